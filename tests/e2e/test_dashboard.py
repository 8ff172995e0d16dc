"""The coordinator's web dashboard (``coordinator.web``) over a real in-process coordinator: pages, bounds,
plan errors, rank logs and client-certificate auth."""

from __future__ import annotations

import asyncio
import re
import ssl
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
import pytest

from rankctl.coordinator.app.server import CoordinatorServer, start_coordinator
from rankctl.coordinator.web.grid import MAX_CELLS
from rankctl.coordinator.web.series import MAX_POINTS
from rankctl.proto import rankctl_pb2 as pb
from rankctl.security.certs import init_ca, issue

pytestmark = pytest.mark.grpc_in_process
SMALL = """
name: small
kind: train
resources: {nodes: 2, slots_per_node: 2}
parallel: {tp: 2}
model: {layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 256}
train: {steps: 50, global_batch: 8, micro_batch: 2, lr: 1.0e-2, data: builtin:pydoc}
"""
BIG = """
name: big
kind: train
resources: {nodes: 8192, slots_per_node: 8}
parallel: {tp: 8, pp: 4}
model: {layers: 8, hidden: 64, heads: 8, seq_len: 16, vocab: 256}
train: {steps: 100, global_batch: 2048, micro_batch: 1, lr: 1.0e-2, data: builtin:pydoc}
"""
CC = "name: cc\nkind: comm-check\nresources: {nodes: 1, slots_per_node: 2}\n"


def serve(test: Callable[[CoordinatorServer, aiohttp.ClientSession], Awaitable[Any]], state_dir: Path,
          tls_dir: Path | None = None, ssl_ctx: ssl.SSLContext | None = None) -> Any:
    """A coordinator with its dashboard on 127.0.0.1:0, a client session, ``test``; everything stopped after."""
    async def main() -> Any:
        coord = await start_coordinator("127.0.0.1:0", state_dir, http_listen="127.0.0.1:0", tls_dir=tls_dir)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl_ctx) if ssl_ctx else None) as s:
                return await asyncio.wait_for(test(coord, s), 30)
        finally:
            await coord.stop(grace=0.1)
    return asyncio.run(main())


async def get(s: aiohttp.ClientSession, coord: CoordinatorServer, path: str) -> tuple[int, str]:
    async with s.get(coord.http_url + path) as r:
        return r.status, await r.text()


def steps(coord: CoordinatorServer, job: Any, n: int, val_every: int = 0) -> None:
    with coord.core.store.transaction("test steps"):
        for i in range(1, n + 1):
            m = {"loss": 6.0 - i / max(n, 1), "tokens_per_s": 1000.0 + i, "step_time_min": 0.1, "step_time_max": 0.2}
            if val_every and i % val_every == 0:
                m["val_loss"] = 6.5 - i / max(n, 1)
            coord.core.book.event(job, "step", f"step {i}", step=i, metrics=m)


def polyline_points(svg: str, cls: str) -> int:
    m = re.search(rf'<polyline class="line {cls}" data-points="(\d+)" points="([^"]*)"', svg)
    if m is None:
        return 0
    assert int(m.group(1)) == len(m.group(2).split())
    return int(m.group(1))


def loss_svg(html: str) -> str:
    return re.search(r'<svg id="loss-curve".*?</svg>', html, re.S).group(0)


def test_pages_render_and_the_loss_curve_has_one_point_per_step_event(tmp_path: Path) -> None:
    async def test(coord: CoordinatorServer, s: aiohttp.ClientSession) -> None:
        job = coord.core.submit(SMALL, queue_anyway=True)
        steps(coord, job, 37, val_every=10)
        status, jobs = await get(s, coord, "/")
        assert status == 200 and job.id in jobs and "tp2 cp1 ep1 dp2 pp1" in jobs and "PENDING" in jobs
        status, page = await get(s, coord, f"/jobs/{job.id}")
        assert status == 200 and 'id="live"' in page and "/static/dashboard.js" in page
        svg = loss_svg(page)
        assert re.search(r'data-points="(\d+)"', svg).group(1) == "37"
        assert polyline_points(svg, "train") == 37 and polyline_points(svg, "val") == 3
        assert len(re.findall(r'class="rank-cell', page)) == 4
        assert len(re.findall(r'class="tp-group"', page)) == 2  # ranks 0-1 and 2-3
        status, data = await get(s, coord, f"/jobs/{job.id}/data.json")
        assert '"step_events": 37' in data and '"plotted": 37' in data
        steps(coord, job, 5)  # the cache reads only what is new
        _, live = await get(s, coord, f"/jobs/{job.id}/live")
        assert 'data-step-events="42"' in live and polyline_points(loss_svg(live), "train") == 42
        assert (await get(s, coord, "/jobs/no-such-job"))[0] == 404
        status, js = await get(s, coord, "/static/dashboard.js")
        assert status == 200 and "live-body" in js
    serve(test, tmp_path)


def test_hostile_text_is_escaped_and_only_our_script_may_run(tmp_path: Path) -> None:
    async def test(coord: CoordinatorServer, s: aiohttp.ClientSession) -> None:
        job = coord.core.submit(SMALL, queue_anyway=True)
        coord.core.cancel(job.id, reason='<script>alert(1)</script><img src=x onerror="alert(2)">')
        for path in ("/", f"/jobs/{job.id}", f"/jobs/{job.id}/live"):
            async with s.get(coord.http_url + path) as r:
                text = await r.text()
                assert r.status == 200 and "script-src 'self'" in r.headers["Content-Security-Policy"]
                assert r.headers["X-Content-Type-Options"] == "nosniff"
            assert "<script>alert" not in text and "<img src=x" not in text, path
        _, page = await get(s, coord, f"/jobs/{job.id}")
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    serve(test, tmp_path)


def test_a_large_job_is_bounded(tmp_path: Path) -> None:
    async def test(coord: CoordinatorServer, s: aiohttp.ClientSession) -> None:
        job = coord.core.submit(BIG, queue_anyway=True)
        steps(coord, job, 5000)
        _, live = await get(s, coord, f"/jobs/{job.id}/live")
        assert len(live) < 200_000
        cells = [int(r) for r in re.findall(r'class="rank-cell[^"]*" data-rank="(\d+)"', live)]
        assert cells == list(range(MAX_CELLS))
        plotted = polyline_points(loss_svg(live), "train")
        assert MAX_POINTS // 2 <= plotted <= MAX_POINTS
        _, page3 = await get(s, coord, f"/jobs/{job.id}/live?page=3")
        assert re.search(r'data-rank="(\d+)"', page3).group(1) == str(3 * MAX_CELLS)
        _, last = await get(s, coord, f"/jobs/{job.id}/live?page=999999")
        assert re.findall(r'data-rank="(\d+)"', last)[-1] == str(65535)
    serve(test, tmp_path)


def test_plan_shows_the_layout_or_the_rule_broken_and_creates_nothing(tmp_path: Path) -> None:
    async def test(coord: CoordinatorServer, s: aiohttp.ClientSession) -> None:
        async with s.post(coord.http_url + "/plan", data={"spec": SMALL, "set": "parallel.tp=3"}) as r:
            text = await r.text()
            assert r.status == 400 and "world_size=4 is not divisible by tp*pp*cp=3" in text
            assert '<textarea name="set" rows="2" cols="60">\nparallel.tp=3</textarea>' in text  # kept
        async with s.post(coord.http_url + "/plan", data={"spec": SMALL, "set": "parallel.tp=4"}) as r:
            text = await r.text()
            assert r.status == 200 and 'id="plan-kinds"' in text and "dense: tp=4 cp=1 dp=1 pp=1" in text
            assert "cross a node boundary" in text  # tp=4 over nodes of 2 slots
        async with s.post(coord.http_url + "/plan", data={"spec": "kind: [oops"}) as r:
            assert r.status == 400 and 'id="plan-errors"' in await r.text()
        assert coord.core.list() == []
    serve(test, tmp_path)


def test_nodes_page_and_a_rank_log_read_from_its_node(tmp_path: Path) -> None:
    import grpc

    from test_servicer import FakeDaemon

    async def test(coord: CoordinatorServer, s: aiohttp.ClientSession) -> None:
        async with grpc.aio.insecure_channel(coord.address) as channel:
            daemon = FakeDaemon(channel, "n0", slots=2)
            await daemon.expect("registered")
            job = coord.core.submit(CC)
            await daemon.expect("assign")
            status, nodes = await get(s, coord, "/nodes")
            assert status == 200 and "n0" in nodes and "READY" in nodes
            reading = asyncio.ensure_future(get(s, coord, f"/jobs/{job.id}/logs?rank=1"))
            ask = await daemon.expect("fetch_logs")
            assert (ask.rank, ask.tail) == (1, 50)
            daemon.send(log_chunk=pb.LogChunk(request_id=ask.request_id, lines=["hello from rank 1"], next_offset=18))
            assert await reading == (200, "hello from rank 1")
            status, text = await get(s, coord, f"/jobs/{job.id}/logs?rank=7")
            assert status == 400 and "rank 7 is not a rank of job" in text
            daemon.close()
    serve(test, tmp_path)


def test_metrics_answer_503_until_the_module_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rankctl.coordinator.web.metrics", None)  # import fails

    async def test(coord: CoordinatorServer, s: aiohttp.ClientSession) -> None:
        assert await get(s, coord, "/metrics") == (503, "metrics not available")
    serve(test, tmp_path)


def test_head_is_answered_wherever_get_is(tmp_path: Path) -> None:
    """`curl -I /metrics` got 405 Method Not Allowed (an outside probe; HTTP requires HEAD where GET is served)."""
    async def test(coord: CoordinatorServer, s: aiohttp.ClientSession) -> None:
        for path in ("/metrics", "/", "/nodes"):
            async with s.head(coord.http_url + path) as r:
                assert r.status == 200 and await r.read() == b"", path
    serve(test, tmp_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    init_ca(root / "ca", sans=[])
    issue(root / "ca", root / "val", user="val", role="viewer")
    issue(root / "ca", root / "node-0", node="node-0")
    init_ca(root / "other", sans=[])
    issue(root / "other", root / "mallory", user="mallory", role="admin")
    return root


def client_ctx(pki: Path, who: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca" / "ca.pem"))
    if who is not None:
        ctx.load_cert_chain(pki / who / "cert.pem", pki / who / "key.pem")
    return ctx


@pytest.mark.parametrize("who, page, metrics", [("val", 200, 200), ("node-0", 403, 200),
                                                (None, None, None), ("mallory", None, None)])
def test_with_tls_every_request_needs_a_certificate_of_the_ca_and_pages_a_user_role(
        tmp_path: Path, pki: Path, who: str | None, page: int | None, metrics: int | None) -> None:
    async def test(coord: CoordinatorServer, s: aiohttp.ClientSession) -> None:
        assert coord.http_url.startswith("https://127.0.0.1:")
        out = []
        for path in ("/", "/metrics"):
            try:
                async with s.get(coord.http_url + path) as r:
                    out.append((r.status, await r.text()))
            except aiohttp.ClientError:
                out.append((None, "refused in the handshake"))
        assert (out[0][0], out[1][0]) == (page, metrics), out
        if page == 403:
            assert "node node-0 may not read /: it needs the viewer role" in out[0][1]
        if page == 200:
            assert "user val (viewer)" in out[0][1]
    serve(test, tmp_path / "state", tls_dir=pki / "ca" / "coordinator", ssl_ctx=client_ctx(pki, who))


def test_the_bound_address_is_written_to_the_state_dir(tmp_path: Path) -> None:
    async def test(coord: CoordinatorServer, s: aiohttp.ClientSession) -> None:
        assert (tmp_path / "http_address").read_text().strip() == coord.http_address == f"127.0.0.1:{coord.http_port}"
        assert coord.http_port != coord.port
    serve(test, tmp_path)


def test_a_taken_dashboard_address_stops_the_coordinator_and_frees_its_state_dir(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"

        async def main() -> None:
            with pytest.raises(OSError, match=f"cannot serve the dashboard on {listen}"):
                await start_coordinator("127.0.0.1:0", tmp_path, http_listen=listen)
            coord = await start_coordinator("127.0.0.1:0", tmp_path)  # the state dir is free again
            await coord.stop(grace=0.1)
        asyncio.run(main())


def test_the_grid_marks_stragglers_failed_ranks_and_the_ranks_a_hang_points_at() -> None:
    from rankctl.coordinator.diagnosis.progress import JobSummary, SlowRank
    from rankctl.coordinator.model.records import RankRecord
    from rankctl.coordinator.web.grid import marks

    failed = RankRecord(rank=5, node="n1", phase="failed", exited=True, exit_code=1)
    summary = JobSummary(phases={}, running=6, exited=1, failed=1, min_step=3, max_step=4, stragglers=[1],
                         failing=[failed], metrics={}, reports=9, slow=[SlowRank(2, "n0", 0.5, 0.1, 3)])
    records = [RankRecord(rank=3, node="n1", phase="running", process="stopped"),
               RankRecord(rank=4, node="n1", phase="running", collectives='{"groups":[{"in":true}]}'),
               RankRecord(rank=6, node="n1", phase="running"), failed]
    assert marks(summary, records) == {1: "straggler", 2: "straggler", 3: "hang", 4: "hang", 5: "failed"}


# --- rendering, pure: chart ticks and labels, hover titles, cell fills, node usage, the plan form ---

CHAR_W = 0.62 * 11  # a generous width of one character of the charts' 11px labels


def tick_texts(svg: str, axis: str) -> list[tuple[float, str, str]]:
    return [(float(x), anchor, text) for x, anchor, text in
            re.findall(rf'<text class="tick {axis}" x="([\d.]+)" y="[\d.]+" text-anchor="(\w+)">([^<]*)</text>', svg)]


@pytest.mark.parametrize("values", [[10_020.0 + i / 10 for i in range(100)], [1.0e6 + 3e3 * i for i in range(100)],
                                    [3e-5 * (1 + i % 7) for i in range(100)], [-40.0 + i for i in range(100)],
                                    [10_030.0] * 100])
def test_chart_ticks_are_round_short_and_inside_the_viewbox(values: list[float]) -> None:
    from rankctl.coordinator.web.charts import LEFT, W, Series, line_chart

    svg = line_chart("tps", [Series("tps", list(zip(range(1, 101), values)), "tokens/s")])
    ys, xs = tick_texts(svg, "y"), tick_texts(svg, "x")
    assert len(ys) >= 3 and len(xs) >= 3, (ys, xs)
    for x, anchor, text in ys:
        assert anchor == "end" and x - len(text) * CHAR_W >= 0 and x < LEFT, text
        assert "e+" not in text and "e-" not in text and len(text) <= 8, text
    for x, _, text in xs:
        assert 0 <= x - len(text) * CHAR_W / 2 and x + len(text) * CHAR_W / 2 <= W, text
    assert len({t for _, _, t in ys}) == len(ys)  # distinct labels: enough decimals for the step


def test_tick_labels_read_like_numbers() -> None:
    from rankctl.coordinator.web.charts import nice_step, tick_labels, tick_values

    assert tick_labels(tick_values(10_020, 10_031, 2), 2) == ["10,020", "10,022", "10,024", "10,026", "10,028",
                                                               "10,030"]
    assert tick_labels([80_000, 100_000, 120_000], 20_000) == ["80k", "100k", "120k"]  # one scale per axis
    assert tick_labels([1.2e6, 1.4e6], 2e5) == ["1.2M", "1.4M"]
    assert tick_labels([0.0, 0.05, 0.1], 0.05) == ["0", "0.05", "0.10"]
    # the round step nearest span/5 ticks with at least 3 (11 with a step of 5 could show 2 ticks)
    assert [nice_step(s) for s in (11, 0.37, 1, 7000)] == [2, 0.1, 0.2, 1000]


def test_points_carry_their_step_and_value_on_hover_bounded_per_line() -> None:
    from rankctl.coordinator.web.charts import HOVER_POINTS, Series, line_chart

    short = line_chart("loss", [Series("train", [(i, 6.0 - i / 100) for i in range(1, 38)], "train loss")])
    titles = re.findall(r'<circle class="hit"[^>]*><title>([^<]*)</title>', short)
    assert len(titles) == 37 and titles[11] == "step 12: train loss 5.88"
    long = line_chart("tps", [Series("tps", [(i, 10_030.0 + i) for i in range(1, 5001)], "tokens/s")])
    titles = re.findall(r"<title>([^<]*)</title>", long)
    assert 2 < len(titles) <= HOVER_POINTS and titles[-1] == "step 5,000: tokens/s 15,030"


def test_a_cell_is_filled_by_its_phase_and_red_only_when_its_rank_failed() -> None:
    from rankctl.coordinator.diagnosis.progress import JobSummary
    from rankctl.coordinator.model.records import RankRecord
    from rankctl.coordinator.web.grid import fill, rank_grid, window
    from rankctl.parallel.layout import ParallelConfig

    recs = [RankRecord(rank=0, node="n0", phase="running"), RankRecord(rank=1, node="n0", phase="exited", exited=True),
            RankRecord(rank=2, node="n1", phase="rendezvous"),
            RankRecord(rank=3, node="n1", phase="exited", exited=True, exit_code=1)]
    assert [fill(r) for r in recs] == ["running", "done", "waiting", "failed"]
    assert fill(RankRecord(rank=4, node="n2", phase="done", exited=True, exit_code=0)) == "done"
    assert fill(RankRecord(rank=5, node="n2", phase="failed")) == "failed"
    stopped = RankRecord(rank=6, node="n2", phase="exited", exited=True, exit_code=-15, error="stopped: attempt 1 ended")
    assert fill(stopped) == "stopped"                   # its daemon stopped it: no failure of its own, not red
    summary = JobSummary(phases={}, running=1, exited=2, failed=1, min_step=0, max_step=0, stragglers=[],
                         failing=[recs[3]], metrics={}, reports=4, slow=[])
    job = type("Job", (), {"nodes": ["n0", "n1"]})()
    html = rank_grid(job, ParallelConfig(world_size=4, tp=1, pp=2), recs, summary, window(4, 2, 0))
    cells = re.findall(r'class="rank-cell fill-(\w+)[^"]*" data-rank="(\d+)"[^>]*style="--hue:(\d+)"', html)
    assert [(f, int(r)) for f, r, _ in cells] == [("running", 0), ("done", 1), ("waiting", 2), ("failed", 3)]
    assert all(170 <= int(h) <= 260 for _, _, h in cells) and len({h for *_, h in cells}) == 2  # a hue per stage


def node(usage: Any = None, name: str = "n0") -> Any:
    from types import SimpleNamespace

    status = SimpleNamespace(value="READY")
    record = SimpleNamespace(address="127.0.0.1:1", slots=2, last_seen=0.0)
    ns = SimpleNamespace(name=name, record=record, status=status, last_heartbeat=99.0, detail="")
    if usage is not None:
        ns.usage = usage
    return ns


def test_the_nodes_page_shows_cpu_memory_and_gpu_use_or_a_dash() -> None:
    from rankctl.coordinator.web.views import nodes_table

    gib = 1 << 30
    usage = pb.NodeUsage(cpu_percent=37.4, memory_used_bytes=3 * gib, memory_total_bytes=16 * gib,
                         gpus=[pb.GpuUsage(index=i, utilization=90 - i, memory_used_bytes=gib,
                                           memory_total_bytes=80 * gib) for i in range(20)])
    from rankctl.coordinator.jobs.shown import NodeShown

    html = nodes_table([NodeShown(s, free, None, [], [], 0) for s, free in
                        [(node(), 2), (node(usage, "g0"), 0), (node(pb.NodeUsage(cpu_percent=5), "c0"), 2)]], 0, 100.0)
    rows = re.findall(r"<tr>(.*?)</tr>", html)
    assert re.findall(r"<th>(\w+)</th>", rows[0])[6:9] == ["cpu", "memory", "gpus"]
    cells = [re.findall(r"<td>(.*?)</td>", r) for r in rows[1:]]
    assert cells[0][6:9] == ["—", "—", "—"]  # no usage heard yet
    cpu, mem, gpus = (re.sub(r"<[^>]+>", " ", c).strip() for c in cells[1][6:9])
    assert (cpu, mem) == ("37%", "3.0 / 16.0 GiB")
    assert gpus.startswith("0: 90% · 1.0 / 80.0 GiB") and "15: 75%" in gpus and "16:" not in gpus
    assert gpus.endswith("… 4 more")
    assert [re.sub(r"<[^>]+>", "", c) for c in cells[2][6:9]] == ["5%", "—", "none"]


def test_the_plan_form_holds_what_was_typed() -> None:
    from rankctl.coordinator.web.views import plan_form

    form = plan_form("name: x\nkind: train", 'parallel.tp=3\nname=<b>"')
    assert '<textarea name="spec" rows="16" cols="90">\nname: x\nkind: train</textarea>' in form
    assert '<textarea name="set" rows="2" cols="60">\nparallel.tp=3\nname=&lt;b&gt;&quot;</textarea>' in form


def test_every_axis_gets_between_three_and_a_dozen_round_ticks() -> None:
    """CI saw steps 1..55 labelled 20 and 40 only: the smallest round step above span/5 left 2 ticks."""
    from rankctl.coordinator.web.charts import MIN_TICKS, nice_step, tick_values

    for lo, hi in [(1, 55), (1, 41), (1, 34), (0, 7), (3.2, 5.5), (1000, 10030), (1e-5, 2e-5), (2.5, 2.61), (1, 999)]:
        for shift in (0.0, 0.37, 0.71):
            a, b = lo + shift * (hi - lo) / 10, hi + shift * (hi - lo) / 10
            step = nice_step(b - a)
            ticks = tick_values(a, b, step)
            assert MIN_TICKS <= len(ticks) <= 12, (a, b, step, ticks)
            assert f"{step:.1e}"[0] in "125", step


def test_after_a_hang_its_victims_are_not_red_and_the_rank_it_waited_for_is_outlined(tmp_path: Path) -> None:
    """Issue 43: after a hang every rank was painted red (the daemons stopped them, exit -15) while the figures
    counted 0 failed, and the hung rank lost its outline once it exited. Through the core: a comm-check job
    whose rank 2 is stopped is judged hung and fails; its ranks' stop exits fill ``stopped`` (no cell red,
    as no rank counts failed) and rank 2, named by the reason, keeps the hang outline."""
    from test_core import make_world

    from rankctl.contract.files.rankstatus import STOPPED
    from rankctl.coordinator.model.records import RankRecord, RankUpdate
    from rankctl.coordinator.web.grid import rank_grid, window

    world = make_world(tmp_path)
    try:
        for n in ("n0", "n1"):
            world.connect(n)
        job = world.core.submit("name: hung\nkind: comm-check\nresources: {nodes: 2, slots_per_node: 2}\n"
                                "parallel: {tp: 2}\nrestart: {max_restarts: 0, hang_timeout: 20}\n")
        for r in range(4):
            world.deliver(world.nodes[job.nodes[r // 2]].session, RankUpdate(
                job.id, 1, RankRecord(r, job.nodes[r // 2], "running", 1 if r != 2 else 0), "", 100 + r))
        world.deliver(world.nodes[job.nodes[1]].session,
                      RankUpdate(job.id, 1, RankRecord(2, job.nodes[1], "", 0, process="stopped"), "", 200))
        world.clock.t += 21
        for n in ("n0", "n1"):
            world.core.heartbeat(world.nodes[n].session)
        world.core.tick()
        assert job.state.value == "FAILED" and "rank 2 stopped" in job.reason, job.reason
        for r in range(4):
            world.report(job.id, r, "exited", code=-15, error=f"{STOPPED}attempt 1 ended", seq=300 + r)
        summary = world.core.summary(job.id)
        assert summary.exited == 4 and summary.failed == 0 and summary.hang == [2]
        html = rank_grid(job, None, world.core.rank_page(job.id, 0, 4), summary, window(4, 2, 0))
    finally:
        world.store.close()
    cells = dict((int(r), (fill, flags.split())) for fill, flags, r in
                 re.findall(r'class="rank-cell fill-(\w+) ph-\w+ ?([^"]*)" data-rank="(\d+)"', html))
    assert {r: fill for r, (fill, _) in cells.items()} == {0: "stopped", 1: "stopped", 2: "stopped", 3: "stopped"}
    assert [r for r, (_, flags) in cells.items() if "hang" in flags] == [2], cells
    assert not any("failed" in flags for _, flags in cells.values()), cells
