"""The dashboard in a real browser: a ``ctl coordinator --http-listen``, two worker daemons of 2 slots and a
4-rank train job (tp2 x pp2), watched by headless Chromium through Selenium; one cluster and one browser
for the module.

The job page shows one grid cell per rank while the job runs, each filled by its phase (never the failed
red unless its rank failed: a python job whose rank 2 raises shows that), and its loss curve, swapped in
live by dashboard.js, ends with one point per step event that carries a loss, counted from the
coordinator's own event stream (WatchJob); the charts' tick labels lie inside their SVG (measured by the
browser, also for a big value like 1.003e+04 tokens/s) and every point plotted names its step on hover.
Meanwhile the coordinator's /metrics holds the job's series. The plan page keeps what was typed when it
shows an error; the nodes page shows CPU, memory and GPU use. Screenshots of the job page and the nodes
page are saved (``RANKCTL_SCREENSHOTS``: a directory to copy them to, e.g. docs/img). Chromium and
chromedriver are required: CI installs them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from cluster import ProcCluster, wait_for

pytestmark = pytest.mark.timeout(600)
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
STATIC = Path(__file__).resolve().parents[2] / "coordinator" / "web" / "static"
TRAIN = """
name: web-train
kind: train
resources: {nodes: 2, slots_per_node: 2}
parallel: {tp: 2, pp: 2}
model: {layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 256}
train: {steps: 150, global_batch: 8, micro_batch: 2, lr: 1.0e-2, warmup: 2, seed: 5, eval_every: 25,
        data: builtin:pydoc}
"""
RAISES = """
name: web-raises
kind: python
resources: {{nodes: 2, slots_per_node: 2}}
python: {{entrypoint: raises.py, workdir: {workdir}}}
"""
# rank 2 fails once the others have exited 0 (so theirs are healthy exits, not ranks stopped for its failure)
RAISES_PY = """import os, time
if os.environ["RANK"] == "2":
    time.sleep(3)
    raise ValueError("boom from rank 2")
"""
HUNG = """
name: web-hung
kind: python
resources: {{nodes: 2, slots_per_node: 2}}
backend: gloo
restart: {{max_restarts: 0, hang_timeout: 10}}
python: {{entrypoint: hung.py, workdir: {workdir}}}
"""
# rank 1 sleeps inside step 10 while the others wait in its all-reduce: named at once, a hang (uncertain: a live
# rank outside collectives) at the job's hang_timeout
HUNG_PY = """import time, torch, torch.distributed as dist, rankctl
ctx = rankctl.context()
for step in range(1, 100):
    if ctx.rank == 1 and step == 10:
        time.sleep(120)
    x = torch.ones(1)
    dist.all_reduce(x, group=ctx.group("world"))
    time.sleep(0.05)
    ctx.report(step, loss=1.0)
"""
# counts the job's step events that carry a loss, from WatchJob (a subprocess: no gRPC in the test process)
COUNT_STEPS = """
import sys
from rankctl.cli.client import Client
with Client(sys.argv[1]) as c:
    print(sum(1 for ev in c.watch(sys.argv[2]) if ev.kind == "step" and "loss" in ev.metrics))
"""


def browser():  # noqa: ANN201 - a selenium WebDriver
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: this test needs Chromium and its driver "
                    "(Debian/Ubuntu: apt-get install chromium chromium-driver; CI installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def data(url: str, job: str) -> dict:
    with urllib.request.urlopen(f"{url}/jobs/{job}/data.json", timeout=10) as r:
        return json.loads(r.read())


VIEW = """
const body = document.getElementById("live-body"), svg = document.getElementById("loss-curve");
const red = body && getComputedStyle(body.querySelector("#rank-grid .key.fill-failed")).backgroundColor;
return body && svg ? {terminal: body.dataset.terminal, points: Number(svg.dataset.points),
  ranks: Array.from(body.querySelectorAll("#rank-grid .rank-cell"), c => Number(c.dataset.rank)),
  groups: body.querySelectorAll("#rank-grid .tp-group").length,
  cells: Array.from(body.querySelectorAll("#rank-grid .rank-cell"), c => ({rank: Number(c.dataset.rank),
    phase: c.dataset.phase, fill: c.dataset.fill, hang: c.classList.contains("hang"),
    red: getComputedStyle(c).backgroundColor === red}))} : null;
"""
# every chart's text as the browser lays it out: what falls outside the SVG's viewBox, the tick labels, the
# hover titles of the points
CHARTS = """
return Array.from(document.querySelectorAll("svg.chart"), svg => {
  const vb = svg.viewBox.baseVal, outside = [];
  for (const t of svg.querySelectorAll("text")) {
    const b = t.getBBox();
    if (b.x < vb.x || b.y < vb.y || b.x + b.width > vb.x + vb.width || b.y + b.height > vb.y + vb.height)
      outside.push(`${t.textContent} at ${b.x},${b.y} ${b.width}x${b.height}`);
  }
  const texts = sel => Array.from(svg.querySelectorAll(sel), t => t.textContent);
  return {id: svg.id, points: Number(svg.dataset.points), outside: outside, y: texts("text.tick.y"),
          x: texts("text.tick.x"), titles: texts("circle.hit > title")};
});
"""


def view(driver) -> dict:  # noqa: ANN001
    """The live fragment as the browser holds it now, read in one script (it is swapped every second)."""
    return driver.execute_script(VIEW) or {"terminal": None, "points": 0, "ranks": [], "groups": 0, "cells": []}


def assert_charts_fit_with_ticks_and_titles(charts: list[dict]) -> None:
    """Each chart's labels inside its viewBox, several ticks per axis, a step on hover per plotted point."""
    assert charts, "no chart on the page"
    for c in charts:
        assert c["outside"] == [], c
        if c["points"]:
            assert len(c["y"]) >= 3 and len(c["x"]) >= 3, c
            assert not any("e+" in t or "e-" in t for t in c["y"]), c["y"]
            assert c["titles"] and all(re.fullmatch(r"step [\d,]+: .+ [-+\de.,]+", t) for t in c["titles"]), c


def scrape(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return r.read().decode()


def assert_metrics_of_a_running_job(text: str, job: str, nodes: list[str]) -> None:
    """The coordinator's /metrics while ``job`` runs: the text format parses (and passes promtool when the
    Debian ``prometheus`` package is installed) and holds the cluster's and the job's series (the job
    labelled ``job_id``, or ``job`` before that rename)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
               for s in family.samples]

    def value(name: str, of: str | None = None, **labels: str) -> float:
        found = [v for n, ls, v in samples if n == name and all(ls.get(k) == x for k, x in labels.items())
                 and (of is None or ls.get("job_id", ls.get("job")) == of)]
        assert len(found) == 1, (name, of, labels, found)
        return found[0]

    assert value("rankctl_jobs", state="RUNNING") == 1 and value("rankctl_job_queue_length") == 0
    assert value("rankctl_nodes", state="READY") == 2
    assert all(0 <= value("rankctl_node_heartbeat_age_seconds", node=n) < 30 for n in nodes)
    assert value("rankctl_rank_reports_total") > 0 and value("rankctl_job_restarts_total", cause="failure") == 0
    assert value("rankctl_job_step", job) >= 3 and value("rankctl_job_ranks", job, phase="running") == 4
    assert value("rankctl_job_loss", job) > 0 and value("rankctl_job_tokens_per_second", job) > 0
    assert value("rankctl_job_step_time_seconds", job, stat="max") > 0
    assert value("rankctl_job_step_duration_seconds_count", job) >= 1
    stragglers = value("rankctl_job_stragglers", job)   # a count of the job's 4 ranks (was ">= 0": never false)
    assert stragglers == int(stragglers) and 0 <= stragglers <= 4, stragglers
    promtool = shutil.which("promtool")
    if promtool:
        check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr


def shot(driver, out: Path, name: str) -> Path:  # noqa: ANN001
    path = out / name
    driver.save_screenshot(str(path))
    keep = os.environ.get("RANKCTL_SCREENSHOTS")
    if keep:
        shutil.copy(path, Path(keep) / name)
    return path


@pytest.fixture(scope="module")
def driver():  # noqa: ANN201
    d = browser()
    yield d
    d.quit()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> ProcCluster:
    c = ProcCluster(tmp_path_factory.mktemp("web"), ["node-0", "node-1"], 2, http_listen="127.0.0.1:0")
    yield c
    c.stop()


def test_chart_labels_of_big_and_small_values_lie_inside_the_svg(driver, tmp_path: Path) -> None:  # noqa: ANN001
    from selenium.webdriver.common.action_chains import ActionChains

    from rankctl.coordinator.web.jobview import charts
    from rankctl.coordinator.web.series import Snapshot
    from rankctl.kinds.common import TRAINING_FIGURES

    steps = range(1, 301)
    series = Snapshot(300, {}, {"loss": [(i, 2e-5 * (1 + i % 5)) for i in steps],
                                "val_loss": [(i, 3.0) for i in steps[::50]],
                                "tokens_per_s": [(i, 10_030.0 - i % 11) for i in steps]}, {}, [])
    html = tmp_path / "charts.html"
    css = (STATIC / "dashboard.css").as_uri()
    html.write_text(f'<!doctype html><html><head><link rel="stylesheet" href="{css}"></head>'
                    f"<body>{charts(series, TRAINING_FIGURES)}</body></html>")
    driver.get(html.as_uri())
    found = driver.execute_script(CHARTS)
    assert [c["id"] for c in found] == ["loss-curve", "throughput"]
    assert_charts_fit_with_ticks_and_titles(found)
    assert "10,030" in found[1]["y"] and found[1]["titles"][-1] == "step 300: tokens/s 10,027"
    dot = driver.find_elements("css selector", "#throughput circle.hit")[-1]
    ActionChains(driver).move_to_element(dot).perform()  # the point a pointer rests on is the one titled
    assert driver.execute_script("return arguments[0].matches(':hover')", dot)


def test_the_job_page_follows_a_running_train_job_in_a_browser(driver, cluster: ProcCluster,  # noqa: ANN001
                                                               tmp_path: Path) -> None:
    (tmp_path / "web-train.yaml").write_text(TRAIN)
    job = cluster.submit(str(tmp_path / "web-train.yaml"))
    url = cluster.http_url
    wait_for(lambda: data(url, job)["min_step"] >= 3, 240, f"{job} past step 3", interval=0.5)
    # on a loaded machine the slowest step can be complete before any rank's figures of a step are folded
    text = wait_for(lambda: (t := scrape(url)) and any(line.startswith("rankctl_job_loss{") and job in line
                                                     for line in t.split("\n")) and t,
                    60, "the job's loss on /metrics", interval=0.5)
    assert_metrics_of_a_running_job(text, job, ["node-0", "node-1"])
    driver.get(f"{url}/jobs/{job}")
    first = wait_for(lambda: (v := view(driver))["points"] > 0 and len(v["ranks"]) == 4 and v, 30,
                     "the grid and the loss curve")
    assert sorted(first["ranks"]) == [0, 1, 2, 3] and first["groups"] == 2  # tp2: ranks 0-1 and 2-3
    assert first["terminal"] == "0", "the job ended before the browser looked"
    assert not any(c["red"] for c in first["cells"]), first["cells"]  # healthy running ranks are not red
    wait_for(lambda: view(driver)["points"] >= 30 or data(url, job)["state"] != "RUNNING", 120, "30 steps")
    assert_charts_fit_with_ticks_and_titles(driver.execute_script(CHARTS))
    shot(driver, tmp_path, "dashboard-job.png")  # the page as dashboard.js swapped it in: no reload
    final = cluster.wait_state(job, {"SUCCEEDED", "FAILED", "CANCELLED"}, 300)
    assert final["state"] == "SUCCEEDED", final
    count = subprocess.run([sys.executable, "-c", COUNT_STEPS, cluster.address, job], capture_output=True,
                           text=True, timeout=60, check=True)
    expected = int(count.stdout)
    assert expected >= 3
    last = wait_for(lambda: (v := view(driver))["terminal"] == "1" and v["points"] == expected and v, 30,
                    f"the loss curve at {expected} points (the coordinator's step events with a loss)")
    assert len(last["ranks"]) == 4 and not any(c["red"] for c in last["cells"]), last["cells"]  # exited 0
    log = driver.find_element("id", "log-lines").text
    assert log and not log.startswith(("reading", "internal error")), log


def test_a_failed_rank_is_the_only_red_cell(driver, cluster: ProcCluster, tmp_path: Path) -> None:  # noqa: ANN001
    (tmp_path / "raises.py").write_text(RAISES_PY)
    (tmp_path / "web-raises.yaml").write_text(RAISES.format(workdir=tmp_path))
    job = cluster.submit(str(tmp_path / "web-raises.yaml"))
    final = cluster.wait_state(job, {"SUCCEEDED", "FAILED", "CANCELLED"}, 120)
    assert final["state"] == "FAILED" and "rank 2" in final["reason"], final
    driver.get(f"{cluster.http_url}/jobs/{job}")
    cells = wait_for(lambda: (v := view(driver))["terminal"] == "1" and len(v["cells"]) == 4 and v["cells"], 30,
                     "the failed job's grid")
    assert [c["rank"] for c in cells if c["red"]] == [2], cells


def test_after_a_hang_no_cell_is_red_and_the_rank_waited_for_is_outlined(driver, cluster: ProcCluster,  # noqa: ANN001
                                                                        tmp_path: Path) -> None:
    """Issue 43: once a hang failed the job, its daemons stop every rank (exit -15): the grid painted them all
    red while its figures counted 0 failed, and the hung rank lost its outline. They fill ``stopped`` now, no
    cell is red, and rank 1, which the others waited for, keeps the hang outline."""
    (tmp_path / "hung.py").write_text(HUNG_PY)
    (tmp_path / "web-hung.yaml").write_text(HUNG.format(workdir=tmp_path))
    job = cluster.submit(str(tmp_path / "web-hung.yaml"))
    final = cluster.wait_state(job, {"SUCCEEDED", "FAILED", "CANCELLED"}, 180)
    assert final["state"] == "FAILED" and final["reason"].startswith("hang:"), final["reason"]
    driver.get(f"{cluster.http_url}/jobs/{job}")
    cells = wait_for(lambda: (v := view(driver))["terminal"] == "1" and len(v["cells"]) == 4
                     and all(c["phase"] == "exited" for c in v["cells"]) and v["cells"], 60, "every rank stopped")
    assert not any(c["red"] for c in cells) and {c["fill"] for c in cells} == {"stopped"}, cells
    assert [c["rank"] for c in cells if c["hang"]] == [1], cells
    assert data(cluster.http_url, job)["failing"] == [], "no rank counts as failed"


def test_the_plan_page_keeps_the_typed_job_file_and_overrides_after_an_error(driver,  # noqa: ANN001
                                                                             cluster: ProcCluster) -> None:
    driver.get(f"{cluster.http_url}/plan")
    spec = driver.find_element("css selector", "textarea[name=spec]")
    driver.execute_script("arguments[0].value = arguments[1]", spec, TRAIN)
    driver.find_element("css selector", "textarea[name=set]").send_keys("parallel.tp=3")
    driver.find_element("css selector", "#plan-form button").click()
    errors = wait_for(lambda: driver.find_elements("id", "plan-errors"), 30, "the plan's errors")
    assert "not divisible by tp*pp*cp=6" in errors[0].text, errors[0].text
    kept = driver.execute_script('return [document.querySelector("textarea[name=spec]").value, '
                                 'document.querySelector("textarea[name=set]").value]')
    assert kept == [TRAIN, "parallel.tp=3"]


USAGE = {"cpu": r"\d+%", "memory": r"[\d.]+ / [\d.]+ GiB", "gpus": r"(?s)none|\d+: .*"}


def test_the_nodes_page_shows_cpu_memory_and_gpu_use(driver, cluster: ProcCluster,  # noqa: ANN001
                                                     tmp_path: Path) -> None:
    driver.set_window_size(1100, 440)

    def table() -> tuple[list[str], list[list[str]]]:
        driver.get(f"{cluster.http_url}/nodes")
        heads = [h.text for h in driver.find_elements("css selector", "#nodes thead th")]
        return heads, [[td.text for td in r.find_elements("css selector", "td")]
                       for r in driver.find_elements("css selector", "#nodes tbody tr")]

    # every daemon's heartbeats carry its usage (worker/daemon/usage.py): wait until both have sent one
    def heard(t: tuple[list[str], list[list[str]]]) -> bool:
        cols = [t[0].index(name) for name in USAGE]
        return len(t[1]) == 2 and all(r[c] != "—" for r in t[1] for c in cols)

    heads, rows = wait_for(lambda: (t := table()) and heard(t) and t, 30, "both nodes' usage on the nodes page")
    assert sorted(r[0] for r in rows) == ["node-0", "node-1"]
    for name, rule in USAGE.items():
        col = heads.index(name)
        assert all(re.fullmatch(rule, r[col]) for r in rows), (name, rows)
    shot(driver, tmp_path, "dashboard-nodes.png")
