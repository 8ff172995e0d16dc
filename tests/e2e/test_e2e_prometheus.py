"""End to end with a real Prometheus (Debian's ``prometheus``; issue 23, items 3 and 4): a ``ctl coordinator
--http-listen`` and two ``ctl worker --metrics-listen`` daemons run a short dp2 train job while Prometheus
scrapes all three every second. Then every query in docs/metrics.md's PromQL block (parsed out of the doc,
so a doc query that breaks fails here) runs through ``/api/v1/query`` and must return data with the labels
its series are documented with; no series is renamed (``exported_job``); and the job's step histogram
counts exactly its steps, read from the coordinator and through Prometheus after the job ended.
Without the binary this is a skip, under ``CI=true`` a failure."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster import ProcCluster, start_worker, wait_for

pytestmark = pytest.mark.timeout(300)
DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
EXAMPLE_JOB = "train-3fa9c1"   # the job id the doc's queries name, replaced by the test job's
STEPS = 40
JOB = f"""
name: prom-train
kind: train
resources: {{nodes: 2, slots_per_node: 1}}
model: {{layers: 1, hidden: 32, heads: 4, seq_len: 16, vocab: 256}}
train: {{steps: {STEPS}, global_batch: 4, micro_batch: 2, lr: 1.0e-2, warmup: 2, seed: 5, data: builtin:pydoc}}
"""
COMPARISON = re.compile(r"\s+(?:>|<|==|!=|>=|<=)\s+[-\d.e]+$")   # an alert's threshold at the end


def prometheus_binary() -> str:
    found = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true and no prometheus binary: install Debian's prometheus package")
        pytest.skip("no prometheus binary (Debian's prometheus package)")
    return found


def doc_queries() -> list[str]:
    """The queries of docs/metrics.md's ```promql block: each line that is not a comment or blank."""
    block = re.search(r"```promql\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/metrics.md has no ```promql block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def documented_labels() -> dict[str, set[str]]:
    """Series name -> its labels, from the doc's series tables (``le`` aside)."""
    out = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 4 and re.fullmatch(r"`rankctl_\w+`", cells[0]):
            out[cells[0].strip("`")] = set(re.findall(r"`(\w+)`", cells[2].split("=")[0])) - {"le"}
    return out


def expected_labels(query: str, documented: dict[str, set[str]]) -> set[str]:
    """The labels a query's result must carry: those of an aggregation's ``by``, else those documented for
    its first series less what ``ignoring`` drops, plus what ``group_left`` adds."""
    by = re.search(r"sum by \(([^)]*)\)", query)
    if by:
        return {x.strip() for x in by.group(1).split(",")} - {"le"}
    first = re.search(r"rankctl_\w+", query).group(0)
    name = re.sub(r"_(bucket|sum|count)$", "", first) if first not in documented else first
    assert name in documented, f"{first} (in {query!r}) is not in docs/metrics.md's series tables"
    labels = set(documented[name])
    for clause, sign in (("ignoring", -1), ("group_left", 1)):
        m = re.search(clause + r" \(([^)]*)\)", query)
        if m:
            names = {x.strip() for x in m.group(1).split(",")}
            labels = labels | names if sign > 0 else labels - names
    return labels


def free_port() -> int:
    with socket.socket() as s:   # Prometheus takes no port 0; the race with another bind is the test's risk
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_metrics_port(log: Path) -> int:
    """The bound /metrics port, from the worker's ``worker started`` record."""
    def port() -> int:
        m = re.search(r'"metrics_port": ?(\d+)|metrics_port=(\d+)', log.read_text(errors="replace"))
        return int(m.group(1) or m.group(2)) if m else 0
    return wait_for(port, 30, f"metrics_port in {log}")


class Prometheus:
    """A Prometheus server of the test's own (config, storage, loopback port), stopped by its PID."""

    def __init__(self, binary: str, root: Path, targets: dict[str, list[str]]) -> None:
        root.mkdir(parents=True, exist_ok=True)
        jobs = [{"job_name": name, "static_configs": [{"targets": hosts}]} for name, hosts in targets.items()]
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": jobs}
        (root / "prometheus.yml").write_text(json.dumps(config))   # JSON is YAML
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(root / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def get(self, path: str, **params: str) -> dict:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, q: str) -> list[dict]:
        return self.get("/api/v1/query", query=q)["result"]

    def targets_up(self) -> bool:
        try:
            active = self.get("/api/v1/targets")["activeTargets"]
        except OSError:
            return False
        return bool(active) and all(t["health"] == "up" for t in active)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()


def scraped(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    """The cluster, Prometheus scraping it, and the train job run to its end: (cluster, prometheus, job)."""
    binary = prometheus_binary()
    root = tmp_path_factory.mktemp("prom")
    cluster = ProcCluster(root, [], 1, http_listen="127.0.0.1:0")
    prom = None
    try:
        for name in ("node-0", "node-1"):
            cluster.workers[name] = start_worker(cluster.address, name, 1, root,
                                                 extra=("--metrics-listen", "127.0.0.1:0"))
        cluster.wait_ready()
        workers = [f"127.0.0.1:{worker_metrics_port(w.log)}" for w in cluster.workers.values()]
        prom = Prometheus(binary, root / "prometheus", {
            "rankctl-coordinator": [cluster.http_url.removeprefix("http://")], "rankctl-worker": workers})
        wait_for(prom.targets_up, 60, "Prometheus' targets up", interval=0.5)
        (root / "job.yaml").write_text(JOB)
        job = cluster.submit(str(root / "job.yaml"))
        cluster.wait_state(job, {"SUCCEEDED"}, 240)
        time.sleep(3)   # a few scrapes after the end
        yield cluster, prom, job
    finally:
        if prom is not None:
            prom.stop()
        cluster.stop()


def test_every_documented_query_returns_data_with_its_documented_labels(run) -> None:  # noqa: ANN001
    _, prom, job = run
    documented, queries = documented_labels(), doc_queries()
    assert len(queries) >= 10 and any(EXAMPLE_JOB in q for q in queries)
    for query in queries:
        q = query.replace(EXAMPLE_JOB, job)
        prom.query(q)   # an alert (with its threshold) must at least parse and evaluate
        data_q = COMPARISON.sub("", q)   # ... its expression must hold data in a healthy cluster
        result = prom.query(data_q)
        assert result, f"no data for {data_q!r} (docs/metrics.md: {query!r})"
        want = expected_labels(query, documented)
        for sample in result:
            labels = set(sample["metric"]) - {"__name__", "job", "instance"}
            assert want <= labels, f"{data_q!r}: {sample['metric']} lacks {want - labels}"
            assert not any(k.startswith("exported_") for k in sample["metric"]), sample
            if "job_id" in labels and "job_id=" in q:
                assert sample["metric"]["job_id"] == job


def test_no_series_is_renamed_and_each_worker_names_its_node(run) -> None:  # noqa: ANN001
    _, prom, job = run
    assert prom.query('{__name__=~"rankctl_.+", exported_job!=""}') == []
    info = prom.query(f'rankctl_job_info{{job_id="{job}"}}')
    assert [(s["metric"]["job_name"], s["metric"]["state"], s["metric"]["job"]) for s in info] == \
        [("prom-train", "SUCCEEDED", "rankctl-coordinator")]
    nodes = {s["metric"]["node"]: s["metric"]["job"] for s in prom.query("rankctl_worker_connected")}
    assert nodes == {"node-0": "rankctl-worker", "node-1": "rankctl-worker"}


def test_the_ended_jobs_step_histogram_counts_each_of_its_steps_once(run) -> None:  # noqa: ANN001
    cluster, prom, job = run
    s = scraped(cluster.http_url)   # the coordinator's own answer, after the job ended
    labels = (("job_id", job),)
    assert s[("rankctl_job_step", labels)] == STEPS
    assert s[("rankctl_job_step_duration_seconds_count", labels)] == STEPS
    assert s[("rankctl_job_step_duration_seconds_sum", labels)] > 0
    (count,) = prom.query(f'rankctl_job_step_duration_seconds_count{{job_id="{job}"}}')
    assert float(count["value"][1]) == STEPS
    (p50,) = prom.query(f'histogram_quantile(0.5, rankctl_job_step_duration_seconds_bucket{{job_id="{job}"}})')
    mean = s[("rankctl_job_step_duration_seconds_sum", labels)] / STEPS
    print(f"\n{STEPS} steps observed {count['value'][1]} times; p50 {float(p50['value'][1]):.4f} s, mean {mean:.4f} s")
