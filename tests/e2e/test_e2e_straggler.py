"""End to end: a slowed rank is flagged as a straggler by its compute time (issue 13). A dp4 train job over
2 nodes × 2 slots, through a real coordinator, two worker daemons and ``ctl``; the test slows one rank to
about half speed (SIGSTOP 0.1 s, SIGCONT 0.1 s, over and over). ``ctl status`` (JSON and text) names that
rank and its node, ``ctl watch`` prints its ``straggler`` event, and no other rank is ever flagged, before,
during or after; once it runs freely again it is unflagged. Issue 23 saw a 4-rank job's last rank flagged
in its first steps, printed as ``step 0: rank 3 on local-1 is a straggler``, then flapping: each event
here names a real step, after the slowdown began (the warm-up flags nothing). Prints how compute times
compared."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from cluster import CTL, ProcCluster, Throttle, ctl, rank_pid, status, status_files, status_records, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.alone]   # compares ranks' step times
VICTIM = 3
DUTY_S = 0.1   # stopped this long, then running this long
JOB = """
name: slow-rank
kind: train
resources: {nodes: 2, slots_per_node: 2}
model: {layers: 2, hidden: 256, heads: 4, seq_len: 64, vocab: 256}
train: {steps: 100000, global_batch: 32, micro_batch: 8, lr: 1.0e-3, warmup: 2, seed: 3, checkpoint_every: 100000,
        data: builtin:pydoc}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    c = ProcCluster(tmp_path_factory.mktemp("straggler"), ["node-0", "node-1"], 2)
    yield c
    c.stop()


class Seen:
    """Every status read: the ranks flagged in any of them (``ever``), and the last one."""

    def __init__(self, address: str, job: str) -> None:
        self.address, self.job, self.ever, self.last = address, job, set(), {}

    def read(self) -> dict:
        self.last = status(self.address, self.job)
        self.ever |= {(s["rank"], s["node"]) for s in self.last["summary"]["slow"]}
        return self.last

    def after(self, steps: int) -> None:
        """Read until the slowest rank has finished ``steps`` more steps."""
        start = self.read()["summary"]["min_step"]
        wait_for(lambda: self.read()["summary"]["min_step"] >= start + steps, 120, f"{steps} more steps")


def splits(root: Path, job: str, last: int = 24) -> str:
    """Each attempt's last ``last`` steps as its ranks wrote them (compute/wait seconds per rank): what a failure
    shows, so that a judgement can be checked against the figures it was made on."""
    rows: dict[tuple[int, int], dict[int, str]] = {}
    for _, attempt, rank, path in status_files(root, job):
        for doc in status_records(path):
            if doc.get("compute_s") is not None:
                rows.setdefault((attempt, doc["step"]), {})[rank] = f"{doc['compute_s']:.3f}/{doc['wait_s']:.3f}"
    return "\n".join(f"attempt {a} step {s}: " + " ".join(f"r{k} {r[k]}" for k in sorted(r))
                     for (a, s), r in sorted(rows.items())[-last:])


def test_a_rank_slowed_to_half_speed_is_the_only_straggler_named_with_its_node(cluster: ProcCluster) -> None:
    (cluster.root / "job.yaml").write_text(JOB)
    job = cluster.submit(str(cluster.root / "job.yaml"))
    seen = Seen(cluster.address, job)
    wait_for(lambda: (s := seen.read())["state"] == "RUNNING" and s["summary"]["min_step"] >= 3, 120, "steps")
    node = {r["rank"]: r["node"] for r in seen.last["ranks"]}[VICTIM]
    watch = subprocess.Popen([*CTL, "--coordinator", cluster.address, "watch", job], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    slowdown = None
    try:
        seen.after(8)
        assert seen.ever == set(), "a rank was flagged while all ran freely"
        slowed_at = seen.last["summary"]["min_step"]
        slowdown = Throttle(rank_pid(job, VICTIM), DUTY_S, DUTY_S)
        flagged = wait_for(lambda: seen.read()["summary"]["slow"], 90, f"rank {VICTIM} flagged")
        assert [(s["rank"], s["node"]) for s in flagged] == [(VICTIM, node)], flagged
        slow = flagged[0]
        assert slow["steps"] >= 3, slow   # its figures are those of the latest judgement: while flagged
        # (hysteresis) they may dip; the figures it was flagged on are checked on the event below
        text = ctl(cluster.address, "status", job)
        assert text.returncode == 0, text.stderr
        assert f"straggler: rank {VICTIM} on {node}: compute " in text.stdout, text.stdout
        seen.after(6)   # still slowed: still flagged, and still alone
        assert [(s["rank"], s["node"]) for s in seen.last["summary"]["slow"]] == [(VICTIM, node)], \
            (seen.last["state"], seen.last["attempts"], seen.last["summary"], splits(cluster.root, job))
        slowdown.stop()
        wait_for(lambda: not seen.read()["summary"]["slow"], 90, f"rank {VICTIM} unflagged")
        print(f"\nrank {VICTIM} on {node} at half speed: compute {slow['compute_s']:.3f} s per step vs median "
              f"{slow['median_s']:.3f} s of its peers ({slow['compute_s'] / slow['median_s']:.2f}x)")
    finally:
        if slowdown is not None:
            slowdown.stop()
        ctl(cluster.address, "cancel", job)
        watch_err = watch.communicate(timeout=120)[1]
    assert seen.ever == {(VICTIM, node)}, seen.ever
    events = re.findall(r"step (\d+): rank (\d+) on (\S+) is (a|no longer a) straggler", watch_err)
    assert [e[1:] for e in events] == [(str(VICTIM), node, "a"), (str(VICTIM), node, "no longer a")], \
        watch_err[-3000:]
    assert slowed_at < int(events[0][0]) < int(events[1][0]), (slowed_at, events)
    compute, median = map(float, re.search(r"is a straggler \(compute\): ([\d.]+) s vs median ([\d.]+) s",
                                           watch_err).groups())
    # over both margins (30 % and 10 ms), less the events' rounding to 1 ms
    assert compute >= median * 1.3 - 0.001 and compute - median >= 0.009, (compute, median)
