"""The hang corpus: rankctl against torchrun and NVRx ft_launcher (default and tuned), side by side.

Method. Every system runs the corpus script of ``tests/e2e/hangcorpus.py`` (its real patterns, 2 gloo ranks), on
loopback on this machine: rankctl as a ``kind: python`` job of 1 node x 2 slots on a real coordinator and two 2-slot
daemons (``tests/cluster.py``; the script in ``plain`` mode, a torchrun-style script, and in ``report`` mode, through
``rankctl.context()``); torchrun and ft_launcher ``--standalone`` with 2 ranks, ``--max-restarts=0`` (a rank they end
is a death the bench sees in /proc), the script in ``plain`` mode through ``bench/peers/corpus_rank.py`` (its pid in
a mark; under ft_launcher an NVRx heartbeat after each of the script's all-reduces, one a step; tuned:
``calculate_and_set_hb_timeouts()`` after the 5th, as ``bench/peers.py``'s ranks do). Every time is ``time.time()``
on the one wall clock the marks, the coordinator's events and the launchers' log lines share.
*healthy*: the whole healthy corpus (a 20 s first step, a rank-0 save blocked 8 s, pickling 8 s, torch.save+fsync
5 s, rank-1 loader Event / Queue / worker subprocess 8 s each, an uneven evaluation, a GC pause, a 30 s save), one
job per system and mode, all of them at the same time; at its outside phase the bench throttles rank 1 to 10 % for
3 s, SIGSTOPs every rank 3 s, then holds rank 0 in ptrace 3 s. "false kill": rankctl: the job did not succeed on
attempt 1; a launcher: a rank died before the outside phase ended, or it exited non-zero; the kill is put on the
pause in progress (the latest mark before it). rankctl's rows also give, for each pause of ``HEALTHY_PAUSES``, the
delay from its start mark to the first ``stall`` event after it naming its frame (a pause is named once a peer waits
on it: the uneven evaluation once its 6 s side is done). Healthy ``hang_timeout``: report
600 s, plain the default (as ``tests/e2e/test_e2e_hang_corpus.py``).
*true hangs* (rankctl ``restart: {max_restarts: 0, hang_timeout: 10}``: 10 s is the uncertain bound): *stopped*:
rank 1 SIGSTOPped once both ranks wrote ``stop-me`` (the fault: the bench's stamp); *dead*: the same, SIGKILL;
*mismatch* (rank 0 in all_reduce, rank 1 in barrier), *loop* (an endless Python loop), *lock* (a lock never
released) at step 8 (the fault: the earliest ``pause-8`` mark). "named": the first message naming a culprit (rank 1;
mismatch: either): rankctl: a ``stall``, ``stopped`` or ``transition`` event (``event_time``), by the rank it names
first; launchers: a rank monitor's ``Did not get .. heartbeat`` of rank R or the agent's ``failed (exitcode ..)
local_rank .. (pid P)``. "right rank": every rank so named is a culprit. "acted": rankctl: attempt 1's end
(``finished_at``); launchers: the first death of a rank process (but the one the bench killed; in *dead* the
survivor's own exit on gloo's "Connection closed by peer" counts too). Past ``--cap``
seconds a figure reads "none in N s" (infinite in a median). The two rankctl modes of a case run at the same time;
torchrun and ft_launcher(default) run side by side in stopped, mismatch, loop and lock (neither has a detector that
could fire within the cap: gloo's 30-min timeout, a 45-min heartbeat timeout); every other measurement runs alone.
``--busy K`` runs K ``while True: pass`` processes throughout. torchft: n/a (see ``TORCHFT``).

    python bench/hangs.py [--runs 1] [--busy 0] [--only healthy,stopped,mismatch,loop,lock,dead]
                          [--systems rankctl,torchrun,ftl,ftl-tuned,torchft] [--cap 40] [--venv /tmp/peers-venv]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "peers"), str(HERE.parent / "tests"), str(HERE.parent / "tests" / "e2e"), str(HERE)]

import cluster  # noqa: E402
from corpus_jobs import LauncherCorpus, RankctlCorpus  # noqa: E402
from hangcorpus import HEALTHY_PAUSES  # noqa: E402
from peers import median, secs  # noqa: E402 - bench/peers.py's report helpers
from recovery import leftovers, signal_all, unmount_left  # noqa: E402
from systems import KILL, STOP, ensure_venv, peers, signal_pid  # noqa: E402
from test_e2e_worker_faults import traced  # noqa: E402

CASES = ("healthy", "stopped", "mismatch", "loop", "lock", "dead")
SYSTEMS = ("rankctl", "torchrun", "ftl", "ftl-tuned", "torchft")
CULPRITS = {"stopped": {1}, "dead": {1}, "loop": {1}, "lock": {1}, "mismatch": {0, 1}}
IDLE = ("torchrun", "ftl")   # side by side in the hangs neither can act on within the cap (not dead)
HANG_TIMEOUT, HEALTHY_TIMEOUT = 10.0, {"report": 600.0, "plain": None}
LABELS = {1: "warm_up", 50: "gc_pause", **HEALTHY_PAUSES}
TORCHFT = ("torchft replaces torch.distributed's collectives with its Manager's (quorum, manager.allreduce, "
           "should_commit); the corpus script's own init_process_group and all_reduce would have to be rewritten")
START_S, HEALTHY_S = 300.0, 900.0   # a job's start-up up to its fault; a healthy job in all
LIVE: list = []   # what to stop whatever happens: jobs, the cluster, busy loops


@dataclass
class Row:
    named: float | None = None
    acted: float | None = None
    right: str = ""
    kill: str = ""
    pauses: dict[str, float | None] = field(default_factory=dict)
    note: str = ""


# -- one job ---------------------------------------------------------------------------------------------------------
def wait_marks(job, names: list[str], timeout: float) -> dict[str, float] | None:  # noqa: ANN001
    """The marks' times once all exist; None if the job ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = {n: job.mark(n) for n in names}
        if all(t is not None for t in got.values()):
            return got
        if job.finished():
            return None
        time.sleep(0.02)
    raise RuntimeError(f"no marks {names} in {timeout:g} s")


def fault(job, case: str) -> tuple[float, frozenset[int]]:  # noqa: ANN001
    """Fault the job (or wait for its own fault); (the fault's time, the pid the bench killed if any)."""
    if case in ("stopped", "dead"):
        if wait_marks(job, ["stop-me-0", "stop-me-1"], START_S) is None:
            raise RuntimeError("the job ended before its fault")
        pid = cluster.wait_for(lambda: job.pids().get(1), 30, "rank 1's pid", 0.05)
        t = signal_pid(pid, STOP if case == "stopped" else KILL)
        return t, frozenset({pid} if case == "dead" else ())
    marks = wait_marks(job, ["pause-8-1", *(["pause-8-0"] if case == "mismatch" else [])], START_S)
    if marks is None:
        raise RuntimeError("the job ended before its fault")
    return min(marks.values()), frozenset()


def hang_case(job, case: str, cap: float) -> Row:  # noqa: ANN001
    t_f, spare = fault(job, case)
    until = t_f + cap
    while time.time() < until and not job.finished():
        time.sleep(0.05)
    acted = job.acted(t_f, spare)
    names = job.namings(t_f, until)
    culprits = CULPRITS[case]
    named = next((t for t, ranks in names if set(ranks) & culprits), None)
    blamed = sorted({r for _, ranks in names for r in ranks})
    if not blamed:
        right = "no: none named"
    else:
        right = "yes" if set(blamed) <= culprits else f"no: names rank(s) {', '.join(map(str, blamed))}"
    return Row(named=None if named is None else named - t_f,
               acted=None if acted is None or acted - t_f > cap else acted - t_f, right=right)


def outside(job) -> float | None:  # noqa: ANN001
    """The outside phase (as ``tests/e2e/test_e2e_hang_corpus.py``'s ``outside_faults``): rank 1 throttled to 10 %
    3 s, every rank SIGSTOPped 3 s, rank 0 traced 3 s; then ``external-done``. None if the job ended first."""
    if wait_marks(job, ["external-0", "external-1"], HEALTHY_S) is None:
        return None
    pids = job.pids()
    try:
        throttle = cluster.Throttle(pids[1], 0.09, 0.01)
        time.sleep(3.0)
        throttle.stop()
        signal_all(pids.values(), signal.SIGSTOP)
        time.sleep(3.0)
    finally:
        signal_all(pids.values(), signal.SIGCONT)
    time.sleep(1.0)
    with contextlib.suppress(AssertionError):   # (a rank gone: nothing to trace)
        with traced(pids[0]):
            time.sleep(3.0)
    (job.marks / "external-done").touch()
    return time.time()


def attribute(job, t: float) -> str:  # noqa: ANN001
    """The pause in progress at ``t``: the latest mark before it."""
    marks = [(job.mark(p.name), p.name) for p in job.marks.iterdir() if p.name.startswith(("pause-", "external-"))]
    before = [(m, name) for m, name in marks if m is not None and m <= t]
    if not before:
        return "before the first pause"
    m, name = max(before)
    if name.startswith("external"):
        return f"in the outside phase, {t - m:.1f} s after it began"
    _, step, rank = name.split("-")
    return f"step {step} {LABELS.get(int(step), '?')} (rank {rank}), {t - m:.1f} s into it"


def pause_naming(job: RankctlCorpus) -> dict[str, float | None]:
    """For each pause of ``HEALTHY_PAUSES``: seconds from its start to the first ``stall`` naming its frame."""
    stalls = [(m, t) for k, m, t in job.events() if k == "stall"]
    out: dict[str, float | None] = {}
    for step, frame in HEALTHY_PAUSES.items():
        began = [t for r in (0, 1) if (t := job.mark(f"pause-{step}-{r}")) is not None]
        after = [t for m, t in stalls if began and t >= min(began) and frame in m]
        out[f"{step}:{frame}"] = after[0] - min(began) if after else None
    return out


def healthy_case(job) -> Row:  # noqa: ANN001
    t_done = outside(job)
    ok, t_kill = job.healthy(t_done, HEALTHY_S)
    row = Row(kill="no" if ok else f"yes: {attribute(job, t_kill)}")
    if isinstance(job, RankctlCorpus):
        row.pauses = pause_naming(job)
    return row


# -- the run ---------------------------------------------------------------------------------------------------------
class Bench:
    """The systems, rankctl's cluster (2 daemons x 2 slots: two jobs at a time) and the figures so far."""

    def __init__(self, root: Path, keys: list[str], venv: Path, cap: float) -> None:
        self.root, self.keys, self.cap = root, keys, cap
        self.peers = {k: v for k, v in peers(venv).items() if k in keys and k != "torchft"}
        self.c = None
        if "rankctl" in keys:
            self.c = cluster.ProcCluster(root / "rankctl", ["node-0", "node-1"], 2, heartbeat_timeout=10.0)
            LIVE.append(self.c)
        self.rows: dict[tuple[str, str], list[Row]] = {}
        self.errors: list[BaseException] = []

    def label(self, key: str, mode: str) -> str:
        return f"rankctl ({mode})" if key == "rankctl" else self.peers[key].label

    def launch(self, key: str, mode: str, case: str, where: Path):  # noqa: ANN201
        where.mkdir(parents=True)
        if key == "rankctl":
            timeout = HEALTHY_TIMEOUT[mode] if case == "healthy" else HANG_TIMEOUT
            return RankctlCorpus(self.c, where, mode, "stopped" if case == "dead" else case, timeout)
        return LauncherCorpus(self.peers[key], where, mode, "stopped" if case == "dead" else case)

    def measure(self, key: str, mode: str, case: str, k: int) -> None:
        row, job = Row(), None
        try:
            job = self.launch(key, mode, case, self.root / f"{case}-{key}-{mode}-{k}")
            LIVE.append(job)
            row = healthy_case(job) if case == "healthy" else hang_case(job, case, self.cap)
        except (AssertionError, RuntimeError, OSError) as exc:   # a figure lost, not the bench
            row = Row(right="no: not measured", kill="not measured", note=f"run {k} not measured: {exc}")
        except BaseException as exc:  # noqa: BLE001 - raised again in the main thread
            self.errors.append(exc)
        finally:
            if job is not None and job in LIVE:   # (else stop_all has it)
                LIVE.remove(job)
                job.stop()
        self.rows.setdefault((case, self.label(key, mode)), []).append(row)

    def groups(self, case: str) -> list[list[tuple[str, str]]]:
        """What runs at the same time: healthy, everything; a hang, rankctl's two modes, then the idle pair, then
        each other peer alone."""
        ours = [("rankctl", m) for m in ("report", "plain")] if self.c is not None else []
        theirs = [(key, "plain") for key in self.peers]
        if case == "healthy":
            return [ours + theirs]
        idle = [t for t in theirs if t[0] in IDLE and case != "dead"]
        return [g for g in [ours, idle] if g] + [[t] for t in theirs if t not in idle]

    def run(self, cases: list[str], runs: int, t0: float) -> None:
        for k in range(1, runs + 1):
            for case in cases:
                for group in self.groups(case):
                    names = ", ".join(self.label(key, mode) for key, mode in group)
                    print(f"[{time.monotonic() - t0:5.0f} s] run {k}: {case} on {names}", flush=True)
                    threads = [threading.Thread(target=self.measure, args=(*g, case, k), daemon=True) for g in group]
                    for t in threads:
                        t.start()
                    for t in threads:
                        while t.is_alive():
                            t.join(0.5)
                    if self.errors:
                        raise self.errors[0]


def busy(n: int) -> None:
    for _ in range(n):
        LIVE.append(subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True))


def stop_all(root: Path) -> None:
    """Stop every job, the cluster and the busy loops; kill what of the bench's outlived them."""
    for thing in list(reversed(LIVE)):
        if thing not in LIVE:   # (a job's own thread stopped it meanwhile)
            continue
        try:
            if isinstance(thing, subprocess.Popen):
                thing.kill()
                thing.wait(timeout=30)
            else:
                thing.stop()
        except Exception as exc:  # noqa: BLE001 - keep stopping the rest
            print(f"warning: stopping {thing}: {exc}", flush=True)
        if thing in LIVE:
            LIVE.remove(thing)
    stray = leftovers(root)
    if stray:
        print(f"warning: {len(stray)} processes of this bench outlived it; killing them: {stray}", flush=True)
        signal_all(stray, signal.SIGKILL)
    unmount_left(root)


# -- report ----------------------------------------------------------------------------------------------------------
def verdict(words: list[str], good: str) -> str:
    """``good`` if every run's word is, else the first other word and how many runs said something else."""
    bad = [w for w in words if w != good]
    return good if not bad else bad[0] + (f" ({len(bad)}/{len(words)} runs)" if len(words) > 1 else "")


def cells(case: str, rows: list[Row], cap: float) -> list[str]:
    if case != "healthy":
        return [secs(median([r.named for r in rows]), cap), secs(median([r.acted for r in rows]), cap),
                verdict([r.right for r in rows], "yes"), "-"]
    named = "-"
    if rows[0].pauses:
        delays = [d for r in rows for d in r.pauses.values()]
        hits = [d for d in delays if d is not None]
        named = f"{len(hits)}/{len(delays)} pauses, median {secs(median(hits), cap)}" if hits else "no pause named"
    return [named, "-", "-", verdict([r.kill for r in rows], "no")]


def report(bench: Bench, cases: list[str], keys: list[str], ns: argparse.Namespace, took: float) -> None:
    cap = ns.cap
    print(f"\nhang corpus bench: 2 gloo ranks a job; {ns.runs} run(s) (medians), {ns.busy} busy loop(s), cap {cap:g} s, "
          f"{took:.0f} s in all. rankctl true hangs: restart {{max_restarts: 0, hang_timeout: {HANG_TIMEOUT:g}}} "
          f"(the uncertain bound); healthy: hang_timeout {HEALTHY_TIMEOUT['report']:g} s (report), the default "
          f"(plain). Peers: --standalone, --max-restarts=0.\n")
    print("case | system | named after | acted after | right rank | false kill")
    print("--- | --- | --- | --- | --- | ---")
    order = [bench.label("rankctl", m) for m in ("report", "plain") if "rankctl" in keys]
    order += [bench.label(k, "plain") for k in bench.peers]
    for case in cases:
        for label in order:
            rows = bench.rows.get((case, label), [])
            if rows:
                print(" | ".join([case, label, *cells(case, rows, cap)]))
        if "torchft" in keys:
            print(f"{case} | torchft | n/a | n/a | n/a | n/a")
    print()
    for label in order:
        for r in bench.rows.get(("healthy", label), [])[:1]:
            if r.pauses:
                print(f"{label}, each healthy pause named after: "
                      + ", ".join(f"{p} {secs(d, cap)}" for p, d in r.pauses.items()))
    for (case, label), rows in bench.rows.items():
        for r in rows:
            if r.note:
                print(f"note: {case}, {label}: {r.note}")
    if "torchft" in keys:
        print(f"note: torchft n/a: {TORCHFT}")
    print("\nsummary: " + "; ".join(summary(bench, label, cases, cap) for label in order))


def summary(bench: Bench, label: str, cases: list[str], cap: float) -> str:
    healthy = bench.rows.get(("healthy", label), [])
    kills = sum(r.kill.startswith("yes") for r in healthy)
    hangs = [r for c in cases if c != "healthy" for r in bench.rows.get((c, label), [])]
    out = f"{label}: {kills} false kill(s) in {len(healthy)} healthy job(s)" if healthy else label
    if hangs:
        named = [r.named for r in hangs if r.named is not None]
        acted = [r.acted for r in hangs if r.acted is not None]
        right = sum(r.right == "yes" for r in hangs)
        out += (f", hangs named {len(named)}/{len(hangs)} (right rank {right}), acted on {len(acted)}/{len(hangs)} "
                f"within {cap:g} s")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes beside the bench")
    ap.add_argument("--only", default=",".join(CASES), help="cases, comma-separated: " + ",".join(CASES))
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: " + ",".join(SYSTEMS))
    ap.add_argument("--cap", type=float, default=40.0, help="seconds a system gets after a true hang's fault")
    ap.add_argument("--venv", type=Path, default=Path("/tmp/peers-venv"), help="the peers' virtual environment")
    ns = ap.parse_args()
    cases = [c for c in CASES if c in ns.only.split(",")]
    keys = [s for s in SYSTEMS if s in ns.systems.split(",")]
    if not cases or not keys or set(ns.only.split(",")) - set(CASES) or set(ns.systems.split(",")) - set(SYSTEMS):
        ap.error(f"--only takes {','.join(CASES)}; --systems takes {','.join(SYSTEMS)}")
    if set(keys) - {"rankctl", "torchft"}:
        ensure_venv(ns.venv)
    root = Path(tempfile.mkdtemp(prefix="rankctl-bench-hangs-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0, ok = time.monotonic(), False
    try:
        busy(ns.busy)
        bench = Bench(root, keys, ns.venv, ns.cap)
        bench.run(cases, ns.runs, t0)
        ok = True
    finally:
        stop_all(root)
        if ok:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"(working directory kept: {root})", flush=True)
    report(bench, cases, keys, ns, time.monotonic() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
