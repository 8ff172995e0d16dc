"""Rank logs stay on the nodes: the daemon's answers (``worker.uplink.logship``), the coordinator's
request matching (``LogFetcher``) and GetLogs (``get_logs``) against fake nodes that answer
from real files (no network, no processes, each well under a second); then ``ctl logs`` and ``ctl nodes``
through a real coordinator and daemon, on a job that printed (what it printed, rankctl's records apart)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rankctl.contract.files.logrecords import RECORD_MARK, parse_record
from rankctl.coordinator.model.errors import InvalidRequest, JobNotFound
from rankctl.coordinator.logs.logfetch import LogFetcher, LogsUnavailable, get_logs
from rankctl.coordinator.model.records import JobRecord, RankRecord
from rankctl.coordinator.model.states import JobState
from rankctl.kinds.spec import build_spec
from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.runs import rankio
from rankctl.worker.uplink.logship import MAX_CHUNK_BYTES, MAX_LINE_BYTES, answer_fetch

JOB = "train-0a1b2c"
CUT = f" [rankctl: line cut at {MAX_LINE_BYTES} bytes]"


def log_file(state: Path, rank: int, job: str = JOB, attempt: int = 1) -> Path:
    run_dir = state / "jobs" / job / str(attempt)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir / f"rank-{rank}.log"


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def fetch(state: Path, rank: int = 0, **kw: Any) -> pb.LogChunk:
    kw.setdefault("job_id", JOB)
    kw.setdefault("attempt", 1)
    return answer_fetch(state, pb.FetchLogs(request_id=7, rank=rank, **kw))


def read_all(state: Path, rank: int = 0, offset: int = 0, max_lines: int = 0) -> tuple[list[str], list[int]]:
    """Every line from ``offset`` by chained fetches; also the number of lines of each chunk."""
    lines, sizes = [], []
    while True:
        chunk = fetch(state, rank, offset=offset, max_lines=max_lines)
        assert chunk.error == "" and chunk.request_id == 7
        if chunk.next_offset == offset:
            return lines, sizes
        lines += chunk.lines
        sizes.append(len(chunk.lines))
        offset = chunk.next_offset


# -- answer_fetch ------------------------------------------------------------------------------
def test_complete_lines_from_an_offset_while_a_partial_last_line_waits(tmp_path: Path) -> None:
    path = log_file(tmp_path, 0)
    path.write_bytes(b"alpha\n\nbeta\npart")
    first = fetch(tmp_path, offset=0)
    assert list(first.lines) == ["alpha", "", "beta"] and first.next_offset == 12
    append(path, b"ial\n")
    second = fetch(tmp_path, offset=first.next_offset)
    assert list(second.lines) == ["partial"] and second.next_offset == path.stat().st_size
    assert fetch(tmp_path, offset=second.next_offset).lines == []


def test_tail_gives_the_last_lines_and_the_size_of_the_file(tmp_path: Path) -> None:
    path = log_file(tmp_path, 2)
    path.write_bytes(b"".join(b"line %d\n" % i for i in range(6000)) + b"unfinished")
    chunk = fetch(tmp_path, 2, tail=3)
    assert list(chunk.lines) == ["line 5998", "line 5999", "unfinished"]
    assert chunk.next_offset == path.stat().st_size and chunk.error == ""
    assert len(fetch(tmp_path, 2, tail=10**6).lines) == 5000  # the tail is capped


def test_long_lines_are_cut_and_marked(tmp_path: Path) -> None:
    log_file(tmp_path, 0).write_bytes(b"x" * 10_000 + b"\nshort\n")
    assert list(fetch(tmp_path).lines) == ["x" * MAX_LINE_BYTES + CUT, "short"]
    assert list(fetch(tmp_path, tail=2).lines) == ["x" * MAX_LINE_BYTES + CUT, "short"]


def test_a_long_line_is_cut_before_its_newline_arrives_and_its_rest_skipped(tmp_path: Path) -> None:
    path = log_file(tmp_path, 0)
    path.write_bytes(b"y" * 5000)
    chunk = fetch(tmp_path)
    assert list(chunk.lines) == ["y" * MAX_LINE_BYTES + CUT] and chunk.next_offset == 5000
    append(path, b"y" * 300 + b"\nnext\n")
    assert list(fetch(tmp_path, offset=chunk.next_offset).lines) == ["next"]


def test_a_line_longer_than_a_chunk_is_shown_once(tmp_path: Path) -> None:
    log_file(tmp_path, 0).write_bytes(b"a\n" + b"z" * (3 * MAX_CHUNK_BYTES) + b"\nb\n")
    lines, _ = read_all(tmp_path)
    assert lines == ["a", "z" * MAX_LINE_BYTES + CUT, "b"]


@pytest.mark.parametrize("job_id, attempt, rank, offset", [
    ("../../etc", 1, 0, 0), ("Bad/Id-0a1b2c", 1, 0, 0), (JOB, -1, 0, 0), (JOB, 1, -1, 0), (JOB, 1, 0, -5),
])
def test_unsafe_ids_and_negative_indices_are_answered_with_an_error(tmp_path: Path, job_id: str, attempt: int,
                                                                     rank: int, offset: int) -> None:
    log_file(tmp_path, 0).write_bytes(b"secret\n")
    chunk = fetch(tmp_path, rank, job_id=job_id, attempt=attempt, offset=offset)
    assert chunk.error and list(chunk.lines) == [] and chunk.request_id == 7


def test_a_missing_log_is_no_lines_and_no_error(tmp_path: Path) -> None:
    chunk = fetch(tmp_path, 5, offset=0)
    assert (list(chunk.lines), chunk.next_offset, chunk.error) == ([], 0, "")
    assert fetch(tmp_path, 5, tail=10).error == ""
    assert not (tmp_path / "jobs").exists()


def test_max_lines_bounds_each_chunk_and_next_offset_continues_without_loss(tmp_path: Path) -> None:
    want = [f"step {i}" for i in range(12_000)]
    log_file(tmp_path, 1).write_text("".join(s + "\n" for s in want))
    assert read_all(tmp_path, 1) == (want, [5000, 5000, 2000])
    assert read_all(tmp_path, 1, max_lines=10**6)[1] == [5000, 5000, 2000]
    assert read_all(tmp_path, 1, max_lines=4500) == (want, [4500, 4500, 3000])


def test_a_chunk_holds_about_a_mebibyte_of_text(tmp_path: Path) -> None:
    want = [f"{i:07d}" + "m" * 992 for i in range(3000)]
    log_file(tmp_path, 0).write_text("".join(s + "\n" for s in want))
    first = fetch(tmp_path)
    assert 0 < sum(len(s) for s in first.lines) <= MAX_CHUNK_BYTES and len(first.lines) < 3000
    assert read_all(tmp_path)[0] == want


def test_a_symlinked_or_special_log_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("do not read\n")
    log_file(tmp_path, 0).symlink_to(secret)
    os.mkfifo(log_file(tmp_path, 1))
    for rank in (0, 1):
        chunk = fetch(tmp_path, rank)
        assert chunk.error and list(chunk.lines) == []


# -- rotation as bytes arrive (worker.rankio) ----------------------------------------------------
def _rank_log(path: Path, generation: int) -> tuple["rankio.RankLog", int]:
    r, w = rankio.output_pipe()
    return rankio.RankLog(str(path), r, generation), w


def test_rotation_keeps_one_generation_cut_at_a_line_end(tmp_path: Path) -> None:
    path = log_file(tmp_path, 0)
    log, w = _rank_log(path, 100)
    follower = 0
    try:
        os.write(w, b"old line\n" * 10)  # 90 bytes: no rotation yet
        assert log.pump() and not Path(f"{path}.1").exists()
        follower = fetch(tmp_path).next_offset
        os.write(w, b"new line\n" * 2)  # the second line would pass 100 bytes: it opens a generation
        assert log.pump()
    finally:
        os.close(w)
    assert not log.pump()  # every writer closed the pipe: EOF
    log.close()
    assert Path(f"{path}.1").read_bytes() == b"old line\n" * 10 + b"new line\n"
    assert path.read_bytes() == b"new line\n"
    chunk = fetch(tmp_path, offset=follower)  # the follower's offset is past the new end: it restarts
    assert list(chunk.lines) == ["[rankctl: the log was rotated; older lines are in rank-0.log.1]", "new line"]


def test_a_burst_leaves_at_most_two_generations(tmp_path: Path) -> None:
    path = log_file(tmp_path, 0)
    log, w = _rank_log(path, 1000)
    try:
        for i in range(500):
            os.write(w, b"%07d\n" % i)
            log.pump()
    finally:
        os.close(w)
    log.close()
    assert path.stat().st_size + Path(f"{path}.1").stat().st_size <= 2000
    assert path.read_bytes().endswith(b"0000499\n")


def test_the_per_job_cap_shrinks_each_generation() -> None:
    assert rankio.generation_bytes(1) == rankio.GENERATION_BYTES
    assert rankio.generation_bytes(64) * 2 * 64 <= rankio.JOB_LOG_BYTES
    assert rankio.generation_bytes(1 << 16) == rankio.MIN_GENERATION_BYTES


def test_rotation_follows_no_symlink(tmp_path: Path) -> None:
    victim, other = tmp_path / "victim", tmp_path / "other"
    victim.write_bytes(b"v" * 100)
    other.write_bytes(b"o" * 100)
    path = log_file(tmp_path, 0)
    path.symlink_to(victim)
    log, w = _rank_log(path, 10)
    try:
        Path(f"{path}.1").symlink_to(other)
        os.write(w, b"l" * 30)
        log.pump()
    finally:
        os.close(w)
    log.close()
    assert victim.read_bytes() == b"v" * 100 and other.read_bytes() == b"o" * 100
    assert not path.is_symlink() and not Path(f"{path}.1").is_symlink()


# -- what the program printed, and rankctl's records -------------------------------------------
def record(**fields: Any) -> bytes:
    return (RECORD_MARK + json.dumps(fields)).encode() + b"\n"


def mixed_log(path: Path) -> None:
    """Program lines 'out i' with a record after each, and a record being written (no newline yet)."""
    path.write_bytes(b"".join(b"out %d\n" % i + record(event="step", step=i) for i in range(3))
                     + RECORD_MARK.encode() + b'{"event": "par')


def test_a_fetch_gives_what_the_program_printed_and_records_only_when_asked(tmp_path: Path) -> None:
    mixed_log(log_file(tmp_path, 0))
    plain = fetch(tmp_path)
    assert list(plain.lines) == ["out 0", "out 1", "out 2"]
    with_records = fetch(tmp_path, records=True)
    assert [parse_record(x) or x for x in with_records.lines] == [
        "out 0", {"event": "step", "step": 0}, "out 1", {"event": "step", "step": 1}, "out 2",
        {"event": "step", "step": 2}]
    assert plain.next_offset == with_records.next_offset  # the same bytes read, fewer lines shown


def test_a_tail_counts_only_the_lines_it_shows(tmp_path: Path) -> None:
    mixed_log(log_file(tmp_path, 0))
    assert list(fetch(tmp_path, tail=2).lines) == ["out 1", "out 2"]
    assert [parse_record(x) or x for x in fetch(tmp_path, tail=3, records=True).lines] == [
        "out 2", {"event": "step", "step": 2}, RECORD_MARK + '{"event": "par']


def test_a_tail_past_many_records_reads_back_far_enough_and_no_farther(tmp_path: Path) -> None:
    path = log_file(tmp_path, 0)
    path.write_bytes(b"first\n" + record(event="x" * 50) * 20_000 + b"last\n" + record(event="y"))
    assert list(fetch(tmp_path, tail=2).lines) == ["first", "last"]
    path.write_bytes(b"lost\n" + record(event="x" * 500) * 10_000 + b"last\n")  # ~5 MiB of records
    assert list(fetch(tmp_path, tail=2).lines) == ["last"]  # at most MAX_TAIL_BYTES are read back


def test_chained_fetches_skip_records_over_chunks(tmp_path: Path) -> None:
    path = log_file(tmp_path, 0)
    path.write_bytes(b"".join(record(n=i) + b"out %d\n" % i for i in range(5000)))
    lines, sizes = read_all(tmp_path, max_lines=1000)
    assert lines == [f"out {i}" for i in range(5000)] and max(sizes) <= 1000


def test_get_logs_passes_the_records_flag_to_the_nodes(tmp_path: Path) -> None:
    core, nodes = cluster(tmp_path)
    append(log_file(nodes.dirs["n1"], 3), record(event="done"))
    assert collect(core, rank=3)[-1] == (3, "rank 3 line 2", 1)
    assert collect(core, rank=3, records=True)[-1] == (3, RECORD_MARK + '{"event": "done"}', 1)


# -- LogFetcher --------------------------------------------------------------------------------
@dataclass
class Outboxes:
    """``send`` of the coordinator's node table: messages by node; nodes in ``lost`` are not connected."""

    sent: dict[str, list[pb.CoordinatorMessage]] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)

    def get(self, node: str) -> Any:
        """The node's session as get_logs reads it (``NodeTable.get``): its status."""
        return type("Session", (), {"status": "LOST" if node in self.lost else "READY"})()

    def send(self, node: str, msg: pb.CoordinatorMessage) -> bool:
        if node in self.lost:
            return False
        self.sent.setdefault(node, []).append(msg)
        return True


def test_the_answer_of_the_node_asked_resolves_the_fetch() -> None:
    async def main() -> None:
        boxes = Outboxes()
        fetcher = LogFetcher(boxes.send, timeout=1.0)
        task = asyncio.ensure_future(fetcher.fetch("n1", JOB, 2, 5, offset=10, max_lines=7))
        await asyncio.sleep(0)
        req = boxes.sent["n1"][0].fetch_logs
        assert (req.job_id, req.attempt, req.rank, req.offset, req.tail, req.max_lines) == (JOB, 2, 5, 10, 0, 7)
        fetcher.deliver("n1", pb.LogChunk(request_id=req.request_id, lines=["hi"], next_offset=13))
        chunk = await task
        assert list(chunk.lines) == ["hi"] and chunk.next_offset == 13 and fetcher.outstanding == 0
    asyncio.run(main())


def test_a_node_cannot_answer_another_nodes_request_and_silence_times_out() -> None:
    async def main() -> None:
        boxes = Outboxes()
        fetcher = LogFetcher(boxes.send, timeout=0.1)
        task = asyncio.ensure_future(fetcher.fetch("n1", JOB, 1, 0))
        await asyncio.sleep(0)
        rid = boxes.sent["n1"][0].fetch_logs.request_id
        fetcher.deliver("n2", pb.LogChunk(request_id=rid, lines=["forged"]))
        fetcher.deliver("n1", pb.LogChunk(request_id=rid + 100, lines=["unknown"]))
        with pytest.raises(LogsUnavailable, match="node n1 did not answer within 0.1s"):
            await task
        assert fetcher.outstanding == 0
        fetcher.deliver("n1", pb.LogChunk(request_id=rid, lines=["late"]))  # ignored, no error
    asyncio.run(main())


def test_a_node_that_is_not_connected_or_lost_fails_its_fetches_at_once() -> None:
    async def main() -> None:
        boxes = Outboxes(lost={"n0"})
        fetcher = LogFetcher(boxes.send, timeout=5.0)
        with pytest.raises(LogsUnavailable, match="node n0 is LOST"):
            await fetcher.fetch("n0", JOB, 1, 0)
        on_n1 = [asyncio.ensure_future(fetcher.fetch("n1", JOB, 1, r)) for r in (0, 1)]
        on_n2 = asyncio.ensure_future(fetcher.fetch("n2", JOB, 1, 2))
        await asyncio.sleep(0)
        fetcher.fail_node("n1", "node n1 is LOST (no heartbeat for 10s)")
        for task in on_n1:
            with pytest.raises(LogsUnavailable, match=r"^node n1 is LOST \(no heartbeat for 10s\)$"):
                await task
        assert not on_n2.done() and fetcher.outstanding == 1
        fetcher.deliver("n2", pb.LogChunk(request_id=boxes.sent["n2"][0].fetch_logs.request_id))
        assert (await on_n2).lines == []
    asyncio.run(main())


def test_outstanding_fetches_are_bounded() -> None:
    async def main() -> None:
        fetcher = LogFetcher(Outboxes().send, timeout=5.0, max_outstanding=2)
        held = [asyncio.ensure_future(fetcher.fetch("n1", JOB, 1, r)) for r in (0, 1)]
        await asyncio.sleep(0)
        with pytest.raises(LogsUnavailable, match="in flight"):
            await fetcher.fetch("n1", JOB, 1, 2)
        fetcher.fail_node("n1", "")
        await asyncio.gather(*held, return_exceptions=True)
    asyncio.run(main())


# -- get_logs ----------------------------------------------------------------------------------
class FakeNodes:
    """Nodes whose daemons answer FetchLogs from their own state dirs with ``answer_fetch``."""

    def __init__(self, root: Path, names: list[str], lost: set[str] = frozenset()) -> None:
        self.dirs = {n: root / n for n in names}
        self.lost = set(lost)      # not connected: send fails
        self.silent: set[str] = set()  # connected, never answers
        self.asked: list[str] = []
        self.on_answer = lambda chunk: None  # runs as the daemon answers, before the coordinator has it
        self.fetcher = LogFetcher(self.send, timeout=1.0)

    def get(self, node: str) -> Any:
        """The node's session as get_logs reads it (``NodeTable.get``): its status."""
        return type("Session", (), {"status": "LOST" if node in self.lost else "READY"})()

    def send(self, node: str, msg: pb.CoordinatorMessage) -> bool:
        if node in self.lost:
            return False
        self.asked.append(node)
        if node in self.silent:
            return True
        chunk = answer_fetch(self.dirs[node], msg.fetch_logs)
        self.on_answer(chunk)
        asyncio.get_running_loop().call_soon(self.fetcher.deliver, node, chunk)
        return True


@dataclass
class FakeBook:
    rank_records: dict[int, RankRecord] = field(default_factory=dict)

    def ranks(self, job_id: str) -> dict[int, RankRecord]:
        return self.rank_records


@dataclass
class FakeCore:
    """What get_logs uses of the Coordinator."""

    job: JobRecord
    logfetch: LogFetcher
    book: FakeBook = field(default_factory=FakeBook)
    nodes: Any = None

    def get(self, id_or_name: str) -> JobRecord:
        if id_or_name not in (self.job.id, self.job.name):
            raise JobNotFound(f"no job {id_or_name!r}")
        return self.job


def cluster(tmp_path: Path, lost: set[str] = frozenset(),
            state: JobState = JobState.RUNNING) -> tuple[FakeCore, FakeNodes]:
    """A 4-rank job on nodes n0 (ranks 0, 1) and n1 (ranks 2, 3); each rank wrote 'rank R line i'."""
    nodes = FakeNodes(tmp_path, ["n0", "n1"], lost)
    job = JobRecord(id=JOB, name="train", kind="train", spec=build_spec({"name": "train"}), state=state, reason="", world_size=4,
                    slots_per_node=2, created_at=0.0, nodes=["n0", "n1"])
    for r in range(4):
        log_file(nodes.dirs[job.nodes[r // 2]], r).write_text("".join(f"rank {r} line {i}\n" for i in range(3)))
    return FakeCore(job, nodes.fetcher, nodes=nodes), nodes


def collect(core: FakeCore, **req: Any) -> list[tuple[int, str, int]]:
    async def main() -> list[tuple[int, str, int]]:
        return [(ln.rank, ln.line, ln.attempt) async for ln in get_logs(core, pb.GetLogsRequest(job_id=JOB, **req))]
    return asyncio.run(asyncio.wait_for(main(), 5))


def test_one_rank_is_read_from_the_node_that_ran_it(tmp_path: Path) -> None:
    core, _ = cluster(tmp_path)
    assert collect(core, rank=3) == [(3, f"rank 3 line {i}", 1) for i in range(3)]


def test_all_ranks_come_in_rank_order_each_whole_over_several_chunks(tmp_path: Path) -> None:
    core, nodes = cluster(tmp_path)
    append(log_file(nodes.dirs["n0"], 1), b"".join(b"more %d\n" % i for i in range(6000)))
    got = collect(core, all_ranks=True)
    assert [r for r, _, _ in got] == [0] * 3 + [1] * 6003 + [2] * 3 + [3] * 3
    assert [ln for r, ln, _ in got if r == 1][-1] == "more 5999"
    assert [ln for r, ln, _ in got if r == 3] == [f"rank 3 line {i}" for i in range(3)]


def test_tail_gives_the_last_lines_of_each_rank(tmp_path: Path) -> None:
    core, _ = cluster(tmp_path)
    assert collect(core, all_ranks=True, tail=1) == [(r, f"rank {r} line 2", 1) for r in range(4)]


def test_follow_streams_new_lines_until_the_job_is_terminal(tmp_path: Path) -> None:
    core, nodes = cluster(tmp_path)
    path = log_file(nodes.dirs["n1"], 2)

    async def main() -> list[str]:
        seen: list[str] = []

        async def read() -> None:
            req = pb.GetLogsRequest(job_id=JOB, rank=2, follow=True, tail=1)
            async for ln in get_logs(core, req, poll_s=0.01):
                seen.append(ln.line)

        reader = asyncio.ensure_future(read())
        for shown, new in (("rank 2 line 2", "step 1"), ("step 1", "step 2"), ("step 2", "the end")):
            while shown not in seen:
                await asyncio.sleep(0.01)
            append(path, new.encode() + b"\n")
        core.job.state = JobState.SUCCEEDED  # together with the last line: the round after it reads it
        await asyncio.wait_for(reader, 2)
        return seen
    assert asyncio.run(main()) == ["rank 2 line 2", "step 1", "step 2", "the end"]


def test_a_job_that_ends_during_a_follow_round_gets_one_more_round(tmp_path: Path) -> None:
    core, nodes = cluster(tmp_path)
    path = log_file(nodes.dirs["n0"], 1)

    def the_job_ends_while_a_round_reads(chunk: pb.LogChunk) -> None:
        if not chunk.lines and core.job.state is JobState.RUNNING:  # this round has read everything
            append(path, b"the last words\n")
            core.job.state = JobState.FAILED
    nodes.on_answer = the_job_ends_while_a_round_reads

    async def main() -> list[str]:
        req = pb.GetLogsRequest(job_id=JOB, rank=1, follow=True)
        return [ln.line async for ln in get_logs(core, req, poll_s=0.01)]
    assert asyncio.run(asyncio.wait_for(main(), 2)) == [f"rank 1 line {i}" for i in range(3)] + ["the last words"]


def test_a_lost_nodes_ranks_get_a_marker_and_their_last_error(tmp_path: Path) -> None:
    core, nodes = cluster(tmp_path, lost={"n1"})
    core.book.rank_records[2] = RankRecord(2, "n1", phase="failed", error="ValueError: boom\n  at step 3")
    got = collect(core, all_ranks=True)
    assert [ln for r, ln, _ in got if r < 2] == [f"rank {r} line {i}" for r in (0, 1) for i in range(3)]
    assert [(r, ln) for r, ln, _ in got if r >= 2] == [
        (2, "[rankctl: node n1 is LOST; the log of rank 2 is on that node]"),
        (2, "[rankctl: rank 2 last reported: ValueError: boom]"),
        (2, "[rankctl: rank 2 last reported:   at step 3]"),
        (3, "[rankctl: node n1 is LOST; the log of rank 3 is on that node]"),
    ]
    assert set(nodes.asked) == {"n0"}
    assert collect(core, rank=3) == [(3, "[rankctl: node n1 is LOST; the log of rank 3 is on that node]", 1)]


def test_a_silent_node_costs_one_timeout_and_the_other_ranks_still_come(tmp_path: Path) -> None:
    core, nodes = cluster(tmp_path)
    nodes.silent.add("n0")
    nodes.fetcher.timeout = 0.1
    got = collect(core, all_ranks=True, tail=1)
    assert [(r, ln) for r, ln, _ in got] == [
        (0, "[rankctl: node n0 did not answer within 0.1s; the log of rank 0 is on that node]"),
        (1, "[rankctl: node n0 did not answer within 0.1s; the log of rank 1 is on that node]"),
        (2, "rank 2 line 2"), (3, "rank 3 line 2"),
    ]


def test_a_node_that_cannot_read_a_log_says_why_in_a_marker(tmp_path: Path) -> None:
    core, nodes = cluster(tmp_path)
    path = log_file(nodes.dirs["n0"], 0)
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    got = collect(core, rank=0)
    assert len(got) == 1 and got[0][1].startswith("[rankctl: node n0 cannot read the log of rank 0: ")


def test_a_job_not_placed_yet_has_no_lines(tmp_path: Path) -> None:
    core, nodes = cluster(tmp_path, state=JobState.PENDING)
    core.job.nodes = []
    assert collect(core, all_ranks=True) == [] and nodes.asked == []


@pytest.mark.parametrize("req, error", [
    ({"rank": 4}, InvalidRequest), ({"rank": -1}, InvalidRequest), ({"rank": 0, "tail": -1}, InvalidRequest),
    ({"all_ranks": True, "tail": 5001}, InvalidRequest), ({"job_id": "nope-000000"}, JobNotFound),
])
def test_bad_requests_raise_domain_errors(tmp_path: Path, req: dict[str, Any], error: type[Exception]) -> None:
    core, _ = cluster(tmp_path)
    req.setdefault("job_id", JOB)

    async def main() -> None:
        async for _ in get_logs(core, pb.GetLogsRequest(**req)):
            pass
    with pytest.raises(error):
        asyncio.run(main())


# -- through the real ctl, coordinator and daemon ---------------------------------------------------
PRINTS = """import os, sys
r = os.environ["RANK"]
print(f"hello from rank {r}", flush=True)
print(f"warn from rank {r}", file=sys.stderr, flush=True)
print("L" * 3000 + f" end {r}", flush=True)
"""
PRINTS_JOB = """
name: prints
kind: python
resources: {{nodes: 1, slots_per_node: 2}}
python: {{entrypoint: prints.py, workdir: {workdir}}}
"""


@pytest.fixture(scope="module")
def printed(tmp_path_factory: pytest.TempPathFactory):
    """A real coordinator and one daemon that ran a 2-rank python job which printed, then ended."""
    from cluster import ProcCluster

    root = tmp_path_factory.mktemp("logs-e2e")
    (root / "prints.py").write_text(PRINTS)
    (root / "prints.yaml").write_text(PRINTS_JOB.format(workdir=root))
    cluster = ProcCluster(root / "cluster", ["n0"], slots=2)
    try:
        job = cluster.submit(str(root / "prints.yaml"))
        assert cluster.wait_state(job, {"SUCCEEDED", "FAILED"}, 120)["state"] == "SUCCEEDED"
        yield cluster, job
    finally:
        cluster.stop()


def program_lines(rank: int) -> list[str]:
    return [f"hello from rank {rank}", f"warn from rank {rank}", "L" * 3000 + f" end {rank}"]


def test_ctl_logs_shows_what_the_ranks_printed_whole_and_prefixed(printed) -> None:
    from cluster import ctl

    cluster, job = printed
    out = ctl(cluster.address, "logs", job, "-f")  # a pipe: a long line comes whole
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.split("\n")[:-1] == [f"[rank {r}] {line}" for r in (0, 1) for line in program_lines(r)]
    one = ctl(cluster.address, "logs", job, "--rank", "1", "--tail", "1")
    assert one.stdout == "L" * 3000 + " end 1\n"


def test_ctl_logs_records_shows_rankctls_records_among_the_lines(printed) -> None:
    from cluster import ctl

    cluster, job = printed
    out = ctl(cluster.address, "logs", job, "--rank", "0", "--records")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")[:-1]
    assert [x for x in lines if "[rankctl " not in x] == program_lines(0)
    assert any(x.endswith("[rankctl info] done") for x in lines), lines
    assert RECORD_MARK not in out.stdout and '"event"' not in out.stdout


def test_ctl_logs_json_gives_lines_as_text_and_records_as_objects(printed) -> None:
    from cluster import ctl

    cluster, job = printed
    plain = [json.loads(x) for x in ctl(cluster.address, "--json", "logs", job).stdout.split("\n")[:-1]]
    assert plain == [{"rank": r, "attempt": 1, "line": line} for r in (0, 1) for line in program_lines(r)]
    docs = [json.loads(x) for x in ctl(cluster.address, "logs", job, "--json", "--records").stdout.split("\n")[:-1]]
    records = [d["record"] for d in docs if "record" in d]
    assert [d for d in docs if "record" not in d] == plain
    assert {(r["rank"], r["event"]) for r in records if r["event"] == "done"} == {(0, "done"), (1, "done")}
    assert all(isinstance(r, dict) and r["job"] == job for r in records)


def test_ctl_nodes_shows_each_nodes_use_or_a_dash(printed) -> None:
    from cluster import ctl

    cluster, _ = printed
    node = json.loads(ctl(cluster.address, "nodes", "--json").stdout)[0]
    table = ctl(cluster.address, "nodes").stdout
    header, row = [x for x in table.split("\n") if "cpu" in x or "n0" in x][:2]
    assert "cpu" in header and "memory" in header and "gpu use" in header, table
    # The two calls see different heartbeats, so the live figures may differ; their shape and the total may not.
    if node["usage"] is None:
        assert re.search(r"│ -\s+│", row), row
    else:
        assert re.search(r"│ \d+% │", row), (node["usage"], row)
        total = node["usage"]["memory_total_bytes"] / 2**30
        assert re.search(rf"│ \d+\.\d/{total:.1f} GiB │", row), (node["usage"], row)


def test_follow_reads_on_once_a_node_that_did_not_answer_answers_and_marks_the_outage_once(tmp_path: Path) -> None:
    """One late answer (or a coordinator that stood still 10 s) ended `ctl logs -f` of that rank for good, with a
    marker blaming a healthy node (an outside probe); a connected node is asked again each follow round."""
    core, nodes = cluster(tmp_path)
    nodes.fetcher.timeout = 0.05
    nodes.silent.add("n1")
    path = log_file(nodes.dirs["n1"], 2)

    async def main() -> list[str]:
        seen: list[str] = []

        async def read() -> None:
            async for ln in get_logs(core, pb.GetLogsRequest(job_id=JOB, rank=2, follow=True), poll_s=0.01):
                seen.append(ln.line)
        reader = asyncio.ensure_future(read())
        while nodes.asked.count("n1") < 4:     # the first pass and follow rounds, all unanswered
            await asyncio.sleep(0.01)
        nodes.silent.clear()
        while "rank 2 line 2" not in seen:
            await asyncio.sleep(0.01)
        append(path, b"step 9\n")
        core.job.state = JobState.SUCCEEDED
        await asyncio.wait_for(reader, 2)
        return seen
    assert asyncio.run(asyncio.wait_for(main(), 5)) == [
        "[rankctl: node n1 did not answer within 0.05s; the log of rank 2 is on that node]",
        "rank 2 line 0", "rank 2 line 1", "rank 2 line 2", "step 9"]


def test_a_coordinator_that_stood_still_does_not_take_a_waiting_answer_for_silence(monkeypatch) -> None:
    from rankctl.coordinator.logs import logfetch

    monkeypatch.setattr(logfetch, "SLICE_S", 0.1)

    async def main() -> pb.LogChunk:
        boxes = Outboxes()
        fetcher = LogFetcher(boxes.send, timeout=0.3)
        task = asyncio.ensure_future(fetcher.fetch("n1", JOB, 1, 0))
        await asyncio.sleep(0)
        rid = boxes.sent["n1"][0].fetch_logs.request_id
        loop = asyncio.get_running_loop()
        loop.call_soon(time.sleep, 0.6)             # the loop stands still past the timeout (SIGSTOP, a blocked loop)
        loop.call_later(0.65, fetcher.deliver, "n1", pb.LogChunk(request_id=rid, lines=["waited in the socket"]))
        return await task
    assert list(asyncio.run(main()).lines) == ["waited in the socket"]
