"""The dashboard in a real browser: a ``ctl coordinator --http-listen``, two worker daemons of 2 slots and a
4-rank train job (tp2 x pp2), watched by headless Chromium through Selenium.

The job page shows one grid cell per rank while the job runs, and its loss curve, swapped in live by
dashboard.js, ends with one point per step event that carries a loss, counted from the coordinator's own
event stream (WatchJob); meanwhile the coordinator's /metrics holds the job's series. Screenshots of the job page and the nodes page are saved (``RANKCTL_SCREENSHOTS``:
a directory to copy them to, e.g. docs/img). Chromium and chromedriver are required: CI installs them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from cluster import ProcCluster, wait_for

pytestmark = pytest.mark.timeout(600)
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
TRAIN = """
name: web-train
kind: train
resources: {nodes: 2, slots_per_node: 2}
parallel: {tp: 2, pp: 2}
model: {layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 256}
train: {steps: 150, global_batch: 8, micro_batch: 2, lr: 1.0e-2, warmup: 2, seed: 5, eval_every: 25,
        data: builtin:pydoc}
"""
# counts the job's step events that carry a loss, from WatchJob (a subprocess: no gRPC in the test process)
COUNT_STEPS = """
import json, sys
from rankctl.cli.client import Client
with Client(sys.argv[1]) as c:
    print(sum(1 for ev in c.watch(sys.argv[2])
              if ev.kind == "step" and json.loads(ev.metrics_json or "{}").get("loss") is not None))
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
return body && svg ? {terminal: body.dataset.terminal, points: Number(svg.dataset.points),
  ranks: Array.from(body.querySelectorAll("#rank-grid .rank-cell"), c => Number(c.dataset.rank)),
  groups: body.querySelectorAll("#rank-grid .tp-group").length} : null;
"""


def view(driver) -> dict:  # noqa: ANN001
    """The live fragment as the browser holds it now, read in one script (it is swapped every second)."""
    return driver.execute_script(VIEW) or {"terminal": None, "points": 0, "ranks": [], "groups": 0}


def scrape(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return r.read().decode()


def assert_metrics_of_a_running_job(text: str, job: str, nodes: list[str]) -> None:
    """The coordinator's /metrics while ``job`` runs: the text format parses (and passes promtool when the
    Debian ``prometheus`` package is installed) and holds the cluster's and the job's series."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("rankctl_jobs", state="RUNNING") == 1 and value("rankctl_job_queue_length") == 0
    assert value("rankctl_nodes", state="READY") == 2
    assert all(0 <= value("rankctl_node_heartbeat_age_seconds", node=n) < 30 for n in nodes)
    assert value("rankctl_rank_reports_total") > 0 and value("rankctl_job_restarts_total", cause="failure") == 0
    assert value("rankctl_job_step", job=job) >= 3 and value("rankctl_job_ranks", job=job, phase="running") == 4
    assert value("rankctl_job_loss", job=job) > 0 and value("rankctl_job_tokens_per_second", job=job) > 0
    assert value("rankctl_job_step_time_seconds", job=job, stat="max") > 0
    assert value("rankctl_job_step_duration_seconds_count", job=job) >= 1
    assert value("rankctl_job_stragglers", job=job) >= 0
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


def test_the_job_page_follows_a_running_train_job_in_a_browser(tmp_path: Path) -> None:
    driver = browser()
    cluster = ProcCluster(tmp_path, ["node-0", "node-1"], 2, http_listen="127.0.0.1:0")
    try:
        (tmp_path / "web-train.yaml").write_text(TRAIN)
        job = cluster.submit(str(tmp_path / "web-train.yaml"))
        url = cluster.http_url
        wait_for(lambda: data(url, job)["min_step"] >= 3, 240, f"{job} past step 3", interval=0.5)
        assert_metrics_of_a_running_job(scrape(url), job, ["node-0", "node-1"])
        driver.get(f"{url}/jobs/{job}")
        first = wait_for(lambda: (v := view(driver))["points"] > 0 and len(v["ranks"]) == 4 and v, 30,
                         "the grid and the loss curve")
        assert sorted(first["ranks"]) == [0, 1, 2, 3] and first["groups"] == 2  # tp2: ranks 0-1 and 2-3
        assert first["terminal"] == "0", "the job ended before the browser looked"
        wait_for(lambda: view(driver)["points"] >= 30 or data(url, job)["state"] != "RUNNING", 120, "30 steps")
        shot(driver, tmp_path, "dashboard-job.png")  # the page as dashboard.js swapped it in: no reload
        final = cluster.wait_state(job, {"SUCCEEDED", "FAILED", "CANCELLED"}, 300)
        assert final["state"] == "SUCCEEDED", final
        count = subprocess.run([sys.executable, "-c", COUNT_STEPS, cluster.address, job], capture_output=True,
                               text=True, timeout=60, check=True)
        expected = int(count.stdout)
        assert expected >= 3
        last = wait_for(lambda: (v := view(driver))["terminal"] == "1" and v["points"] == expected and v, 30,
                        f"the loss curve at {expected} points (the coordinator's step events with a loss)")
        assert len(last["ranks"]) == 4
        log = driver.find_element("id", "log-lines").text
        assert log and not log.startswith(("reading", "internal error")), log
        driver.set_window_size(900, 440)
        driver.get(f"{url}/nodes")
        rows = driver.find_elements("css selector", "#nodes tbody tr")
        assert sorted(r.find_element("css selector", "td").text for r in rows) == ["node-0", "node-1"]
        shot(driver, tmp_path, "dashboard-nodes.png")
    finally:
        driver.quit()
        cluster.stop()
