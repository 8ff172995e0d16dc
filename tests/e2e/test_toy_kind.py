"""A job kind from a folder outside rankctl (``tests/toykind/``) runs end to end: submit, check,
ranks forked by the launcher, aggregation, ``ctl status --json``; the capabilities it declares take
effect (its node path is sandboxed, a drain waits for its checkpoint); nothing else names it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rankctl.cli.context import Ctx
from rankctl.cli.errors import CtlError
from rankctl.cli.local import LocalCluster
from rankctl.cli.view.render import job_to_dict
from rankctl.kinds import registry

pytestmark = [pytest.mark.timeout(300), pytest.mark.grpc_in_process]
TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
JOB = """
name: toy
kind: toy-kind
resources: {nodes: 2, slots_per_node: 2}
toy: {value: %d}
"""


def wait(ctx: Ctx, job_id: str, timeout: float = 120) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with ctx.client() as c:
            d = job_to_dict(c.get(job_id))
        if d["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
            return d
        time.sleep(0.2)
    raise AssertionError(f"{job_id} did not finish")


def test_a_kind_from_its_own_folder_runs_end_to_end(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    try:
        with LocalCluster(2, 2, tmp_path, imports=["toykind"]) as cluster:
            ctx = Ctx(coordinator=cluster.address)
            with ctx.client() as c:
                job_id = c.submit(JOB % 3, [], "toy.yaml").id
                with pytest.raises(CtlError, match="toy.value=-1 must not be negative"):
                    c.submit(JOB % -1, [], "toy.yaml")
                with pytest.raises(CtlError, match="known kinds: comm-check, python, toy-kind, train"):
                    c.submit((JOB % 1).replace("toy-kind", "no-such-kind"), [], "toy.yaml")
            d = wait(ctx, job_id)
    finally:
        registry.unregister("toy-kind")
    assert d["state"] == "SUCCEEDED", d["reason"]
    assert d["result"] == {"sum": 3.0 * (1 + 2 + 3 + 4), "ranks": 4, "resumed_from": dict.fromkeys("0123")}
    assert d["toy_sum"] == 30.0


STEPS = """
name: toy-steps
kind: toy-kind
resources: {nodes: 2, slots_per_node: 2}
toy: {value: 1, steps: 60, path: %s}
"""


def _progress(ctx: Ctx, job_id: str) -> dict:
    with ctx.client() as c:
        return job_to_dict(c.get(job_id))


def test_its_node_path_is_sandboxed_and_a_drain_waits_for_its_checkpoint(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    data = tmp_path / "data"
    data.mkdir()
    (data / "toy-input").write_text("x")
    try:
        with LocalCluster(3, 2, tmp_path, imports=["toykind"], data_roots=(str(data),)) as cluster:
            ctx = Ctx(coordinator=cluster.address)
            with ctx.client() as c:
                outside = c.submit(STEPS % "/etc/hostname", [], "toy.yaml").id
            refused = wait(ctx, outside)
            assert refused["state"] == "FAILED" and "toy.path" in refused["reason"], refused["reason"]
            with ctx.client() as c:
                job_id = c.submit(STEPS % (data / "toy-input"), [], "toy.yaml").id
            end = time.monotonic() + 120
            while (d := _progress(ctx, job_id))["state"] != "RUNNING" or not d["ranks"] or \
                    min(r["step"] for r in d["ranks"]) < 3:
                assert time.monotonic() < end and d["state"] not in ("FAILED", "SUCCEEDED"), d
                time.sleep(0.1)
            with ctx.client() as c:
                c.drain(d["ranks"][0]["node"], "toy drain")
            done = wait(ctx, job_id, 180)
    finally:
        registry.unregister("toy-kind")
    assert done["state"] == "SUCCEEDED" and done["attempt"] == 2, done["reason"]
    assert done["result"]["sum"] == 1.0 * (1 + 2 + 3 + 4)
    resumed = {s for s in done["result"]["resumed_from"].values() if s is not None}
    assert len(resumed) == 1 and 3 <= resumed.pop() < 60, done["result"]  # the step the drain asked for


def test_nothing_outside_the_kind_folder_names_it() -> None:
    hits = [str(p.relative_to(ROOT)) for folder in ("cli", "contract", "coordinator", "kinds", "models", "parallel",
                                                     "runtime", "worker", "proto", "docs")
            for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".proto")
            and ("toy-kind" in p.read_text() or "toykind" in p.read_text())]
    assert hits == []
