"""End to end (issue 13): ``ctl drain`` moves a running train job off a node onto the spare, through a
real coordinator, three real worker daemons and the real ``ctl``; and a cancel while an attempt is
stopping shows the stop in ``ctl status`` and leaves no rank of any attempt behind.

The drained job's losses equal an uninterrupted run's, step for step (it resumes from the drain
checkpoint, or starts over where the ranks cannot save one: the losses are the same function of the
seed either way); ``max_restarts: 0``, since a drain is no failure.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from cluster import ProcCluster, ctl, events, rank_pids, status, stepping, wait_for

pytestmark = pytest.mark.timeout(600)
NODES = ["node-0", "node-1", "node-2"]
STEPS = 60  # long enough that the job still runs when the drain comes, on a loaded 2-core machine
JOB = """
name: {name}
kind: train
resources: {{nodes: 2, slots_per_node: 2}}
parallel: {{tp: 2}}
restart: {{max_restarts: 0}}
model: {{layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 256}}
train: {{steps: {steps}, global_batch: 8, micro_batch: 2, lr: 1.0e-2, warmup: 2, seed: 13, checkpoint_every: 0,
         data: builtin:pydoc}}
"""


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory):
    c = ProcCluster(tmp_path_factory.mktemp("drain"), NODES, 2, 3.0)
    yield c
    c.stop()


def submit(c: ProcCluster, tmp: Path, name: str) -> str:
    path = tmp / f"{name}.yaml"
    path.write_text(JOB.format(name=name, steps=STEPS))
    return c.submit(str(path))


def losses(done: dict) -> list[tuple[int, float]]:
    return [(x["step"], x["loss"]) for x in done["result"]["losses"]]


def nodes_json(c: ProcCluster) -> dict[str, dict]:
    out = ctl(c.address, "nodes", "--json")
    assert out.returncode == 0, out.stderr
    return {n["name"]: n for n in json.loads(out.stdout)}


def test_a_drained_node_hands_its_train_job_to_the_spare_and_the_losses_equal_an_uninterrupted_run(
        three: ProcCluster, tmp_path: Path) -> None:
    ref = three.wait_state(submit(three, tmp_path, "calm"), {"SUCCEEDED", "FAILED"}, 300)
    assert ref["state"] == "SUCCEEDED", ref["reason"]

    job = submit(three, tmp_path, "drained")
    st = stepping(three.root, job, 4, 3)   # the ranks' own files: quick, the job is still running at the drain
    victim = st["nodes"][0]                                          # rank 0's node, the rendezvous
    spare = (set(NODES) - set(st["nodes"])).pop()
    out = ctl(three.address, "drain", victim, "--reason", "maintenance")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"node {victim} is draining: it takes no new work; moving 1 job(s) off it: {job}"
    drained_at = st["summary"]["min_step"]
    listed = nodes_json(three)
    assert listed[victim]["draining"] and listed[victim]["state"] == "READY"   # still connected
    assert not listed[spare]["draining"] and listed[victim]["excluded_for"] == []
    table = ctl(three.address, "nodes")
    assert table.returncode == 0 and "draining" in table.stdout, table.stdout

    done = three.wait_state(job, {"SUCCEEDED", "FAILED", "CANCELLED"}, 300)
    assert done["state"] == "SUCCEEDED" and done["attempt"] == 2, done["reason"]
    assert spare in done["nodes"] and victim not in done["nodes"], done["nodes"]
    first = done["attempts"][0]
    assert first["state"] == "RESTARTING" and f"node {victim} drained (maintenance)" in first["reason"], first
    assert [s for s, _ in losses(done)] == list(range(1, STEPS + 1))
    for (step, ours), (_, theirs) in zip(losses(done), losses(ref)):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs), (step, ours, theirs)
    resumed = done["result"].get("resumed_from") or 0
    saved = re.search(r"every rank passed step (\d+)", first["reason"])
    # the drain checkpoint is the floor: a newer step every rank holds intact (a snapshot taken between the
    # drain's save and the stop, replicated by the save wake) is as good and loses less
    # (with no checkpoint within the drain's wait, the newest step every rank holds, or a start from scratch)
    assert resumed >= (int(saved.group(1)) if saved else 0), (resumed, first["reason"])
    print(f"\ndrain of {victim} at step {drained_at}: {first['reason']}; attempt 2 resumed from step {resumed}")
    wait_for(lambda: not rank_pids(job), 30, "every rank of both attempts to exit")

    out = ctl(three.address, "undrain", victim)
    assert out.returncode == 0 and out.stdout.strip() == f"node {victim} takes work again", (out.stdout, out.stderr)
    assert not nodes_json(three)[victim]["draining"]


def test_drain_of_an_unknown_or_malformed_node_is_a_clear_error(three: ProcCluster) -> None:
    out = ctl(three.address, "drain", "nope")
    assert out.returncode == 2 and out.stderr.startswith("error: no node 'nope' is known"), out.stderr
    bad = ctl(three.address, "undrain", "Bad_Name")
    assert bad.returncode == 2 and "node 'Bad_Name' must be" in bad.stderr, bad.stderr
    assert "Traceback" not in out.stderr + bad.stderr


STUBBORN = """
name: stubborn
kind: python
resources: {nodes: 2, slots_per_node: 2}
backend: gloo
restart: {max_restarts: 3}
python: {entrypoint: main.py, workdir: WORKDIR}
"""
SCRIPT = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)   # stopped only by the SIGKILL after the daemon's grace
print("up", flush=True)
if int(os.environ["RANK"]) == 0:
    time.sleep(2)
    sys.exit("rank 0 gives up")
time.sleep(600)
"""


def test_a_cancel_while_a_restart_waits_for_the_old_ranks_shows_the_stop_and_leaves_no_rank(
        three: ProcCluster, tmp_path: Path) -> None:
    """Rank 0 fails; the others ignore SIGTERM, so attempt 1's ranks go only at the SIGKILL after the grace. The
    restart goes in place: attempt 2 is placed at once and its nodes hold its start until attempt 1's ranks are
    gone. A cancel meanwhile is CANCELLED at once and shows attempt 2's ranks not yet gone; they never start:
    each node reports them exited once attempt 1's are gone, and no rank of either attempt is left."""
    work = tmp_path / "stubborn"
    work.mkdir()
    (work / "main.py").write_text(SCRIPT)
    path = tmp_path / "stubborn.yaml"
    path.write_text(STUBBORN.replace("WORKDIR", str(work)))
    job = three.submit(str(path))
    wait_for(lambda: status(three.address, job)["attempt"] == 2, 120, "attempt 1 failing, attempt 2 placed")
    out = ctl(three.address, "cancel", job)
    assert out.returncode == 0, out.stderr
    st = status(three.address, job)
    assert st["state"] == "CANCELLED" and st["attempt"] == 2, st
    assert "; stopping: " in st["reason"] and "rank(s) not yet confirmed gone" in st["reason"], st["reason"]
    human = ctl(three.address, "status", job)
    assert "not yet confirmed gone" in human.stdout, human.stdout
    t0 = time.monotonic()
    wait_for(lambda: "stopping" not in status(three.address, job)["reason"], 60, "the stop confirmed")
    wait_for(lambda: not rank_pids(job), 30, "every rank of every attempt to exit")
    done = status(three.address, job)
    assert done["state"] == "CANCELLED" and done["attempt"] == 2 and len(done["attempts"]) == 2, done
    assert any("queued as attempt 2, in place" in m for _, m in events(three.address, job))
    errors = [r.get("error", "") for r in done["ranks"]]
    assert errors and all("was cancelled before its ranks started" in e for e in errors), done["ranks"]
    print(f"\ncancel during a restart: the stop was confirmed {time.monotonic() - t0:.1f} s after the cancel")
