"""Faults and start-up: rankctl against torchrun, NVRx ft_launcher (default and tuned) and torchft, side by side.

Method. Every system runs the same 4-rank gloo workload (``bench/peers/workload.py``: each step an all-reduce of a
4-float tensor over every rank, 50 ms of sleep, then one JSON status line stamped with the rank's ``time.time()`` in a
file of its own process; no checkpoint on any side: a restarted rank starts again at step 1, a torchft replacement
takes the step count from the survivors), on loopback on this machine, ``--runs`` times (in each run the systems take
turns, case by case). The bench reads the status files every 20 ms; once every rank has completed step 10 it faults
rank 1 (its pid from its own status lines) and stamps the fault with ``time.time()``: every figure is seconds from
that stamp, on the one wall clock that the ranks, the coordinator and the launchers' log lines also stamp with.
*hang*: SIGSTOP of rank 1, never continued. "acted": rankctl: attempt 1's end (``finished_at`` in ``ctl status
--json``); torchft: the Lighthouse's ``Detected quorum change`` line (it drops the silent replica; nobody kills it);
torchrun, ft_launcher: the first death of a rank process of the job, seen in /proc. "named": rankctl: attempt 1's
reason says ``rank 1 stopped``; launchers: the ranks their lines after the fault blame (a rank monitor's ``Did not get
subsequent heartbeat`` of rank R, ``failed (exitcode ..) local_rank .. (pid P)``): yes only if that is rank 1 alone;
torchft: a line naming replica 1 with a timeout or failure word. *crash*: SIGKILL of rank 1 (torchft: a replacement
replica group started at once, the restart torchft leaves to the scheduler). *node*: rankctl: 3 daemons x 2 slots
(the job on 2, one idle spare), the whole process tree of rank 1's daemon SIGSTOPped then SIGKILLed (``kill_node`` of
``bench/recovery.py``); torchrun, ft_launcher: 2 agents x 2 ranks over a c10d rendezvous, the agent that does not host
the store (its ranks named in the notes; losing the store's host ends any such job) killed the same way and a
replacement agent started at once; torchft: rank 1's replica group killed so, a replacement started at once. "next
step": every rank the system needs has completed a step after the fault: a rank process started after it, or
(torchft, whose survivors go on) a step committed in a quorum other than the fault's. "every rank again": every rank
of the world (torchft: the replacement too; elsewhere the next step already needs every rank, and the row is left
out when it says nothing new). Past ``--cap`` seconds (75: just over torchft's default 60 s collective timeout, which
it sometimes waits out) a figure reads "none in 75 s" and counts as infinite in a median. *startup*: 8 ranks, from the
launch (rankctl cold: before its coordinator and an 8-slot daemon start; warm: before ``ctl submit`` to them; peers:
before the launcher starts) to every rank's first completed step. torchrun's and ft_launcher(default)'s hang runs go
side by side at the same time: neither has a detector that could fire within the cap (gloo's 30-min timeout, a 45-min
heartbeat timeout), both only wait it out; every other measurement runs alone.

Systems: rankctl (``kind: python``, ``restart: {max_restarts: 3}``, every other setting its default, coordinator
``--heartbeat-timeout`` its default 10 s); torchrun (``--max-restarts 3 --monitor-interval 0.1``, ``--standalone``,
or c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 as in ``bench/recovery.py``); ft_launcher (the same options; its
ranks heartbeat each step; default: no FT config, its defaults, ``--ignore-missing-fault-tol-cfg``; tuned: a config
with null heartbeat timeouts which the ranks calculate with ``calculate_and_set_hb_timeouts()`` after step 5, as NVRx's
heartbeat guide says, its other settings default: safety factor 5, a check every 5 s); torchft 0.2 (a Lighthouse, one
replica group of 1 rank a rank, ``min_replicas`` = ``min_replica_size`` = world - 1, ``manager.allreduce``, its
defaults: 5 s heartbeat timeout, 60 s join and collective timeouts). The peers run in their own virtual environment
(``--venv``, created when missing) and import only torch and their own library.

    python bench/peers.py [--runs 3] [--only hang,crash,node,startup] [--systems rankctl,torchrun,ftl,ftl-tuned,torchft]
                          [--cap 75] [--venv /tmp/peers-venv] [--keep]
"""

from __future__ import annotations

import argparse
import math
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "peers"), str(HERE.parent / "tests"), str(HERE)]

import cluster  # noqa: E402
from recovery import kill_node, leftovers, signal_all, unmount_left  # noqa: E402
from systems import KILL, STOP, Job, alive, ensure_venv, in_tree, peers, signal_pid  # noqa: E402

VICTIM, FAULT_STEP, POLL_S = 1, 10, 0.02
CASES = ("startup", "hang", "crash", "node")
SYSTEMS = ("rankctl", "torchrun", "ftl", "ftl-tuned", "torchft")
# In the hang case these two only wait out the cap (torchrun: no hang detection, gloo's 30-min timeout; ft_launcher's
# default heartbeat timeout: 45 min): they run at the same time, side by side, to keep a run short.
IDLE_IN_HANG = ("torchrun", "ftl")
JOB = """
name: peers-{name}
kind: python
resources: {{nodes: {nodes}, slots_per_node: {slots}}}
backend: gloo
restart: {{max_restarts: 3}}
python: {{entrypoint: rankctl_rank.py, workdir: {workdir}, args: [{out}]}}
"""
LIVE: list = []   # what to stop whatever happens: jobs and clusters


class RankctlJob(Job):
    """A ``kind: python`` job submitted with ``ctl submit`` to a running cluster."""

    def __init__(self, where: Path, world: int, c: cluster.ProcCluster, nodes: int, workdir: Path) -> None:
        super().__init__(where, world)
        self.c = c
        job_file = where / "job.yaml"
        job_file.write_text(JOB.format(name=where.name, nodes=nodes, slots=world // nodes, workdir=workdir,
                                       out=self.out))
        out = cluster.ctl(c.address, "submit", str(job_file))
        if out.returncode != 0:
            raise RuntimeError(f"ctl submit failed: {out.stderr[-500:]}")
        self.id = out.stdout.strip()

    def lose_node(self, victim_pid: int) -> tuple[float, str]:
        name = next(n for n, w in self.c.workers.items() if in_tree(w.pid, victim_pid))
        t = kill_node(self.c.workers[name].pid)
        return t, f"{name}: its daemon, launcher and 2 ranks; the spare daemon idle and READY"

    def attempt1(self) -> dict:
        attempts = cluster.status(self.c.address, self.id).get("attempts") or []
        return attempts[0] if attempts and attempts[0].get("reason") else {}

    def acted(self, t_fault: float) -> float | None:
        return self.attempt1().get("finished_at")

    def named(self, t_fault: float, victim: int, pids: dict[int, int]) -> str:
        reason = cluster.wait_for(self.attempt1, 30, "attempt 1's reason").get("reason", "")
        return f"yes: rank {victim} stopped" if f"rank {victim} stopped" in reason else f"no: {reason[:90]}"

    def stop(self) -> None:
        cluster.ctl(self.c.address, "cancel", self.id)
        try:
            cluster.wait_for(lambda: not cluster.rank_pids(self.id), 60, f"{self.id}'s ranks to exit", 0.1)
        except AssertionError:
            signal_all(cluster.rank_pids(self.id), signal.SIGKILL)


class Rankctl:
    """rankctl's real coordinator and daemons: one 8-slot node (crash, hang, startup) kept warm; 3 x 2 slots
    for the node case, fresh each time (one of them is killed)."""

    key, label = "rankctl", "rankctl"

    def __init__(self, root: Path) -> None:
        self.root, self.flat, self.n = root, None, 0
        self.workdir = root / "rankctl-workdir"
        self.workdir.mkdir(parents=True)
        for name in ("rankctl_rank.py", "workload.py"):
            shutil.copy(HERE / "peers" / name, self.workdir / name)

    def cluster(self, names: list[str], slots: int) -> cluster.ProcCluster:
        self.n += 1
        # (the layout bench/recovery.py's unmount_left reads: DIR/rankctl/{node}, DIR = cluster-N)
        c = cluster.ProcCluster(self.root / f"cluster-{self.n}" / "rankctl", names, slots, heartbeat_timeout=10.0)
        LIVE.append(c)
        return c

    def cold(self) -> None:
        """A fresh coordinator and 8-slot daemon (the old ones stopped first)."""
        if self.flat is not None:
            stop(self.flat)
        self.flat = self.cluster(["node-0"], 8)

    def launch(self, where: Path, shape: str, world: int) -> Job:
        where.mkdir(parents=True, exist_ok=True)
        if shape == "nodes":
            c = self.cluster(["node-0", "node-1", "node-2"], 2)
            job = RankctlJob(where, world, c, 2, self.workdir)
            job.own = c
            return job
        if self.flat is None:
            self.cold()
        return RankctlJob(where, world, self.flat, 1, self.workdir)


def stop(thing) -> None:  # noqa: ANN001
    """Stop a job or a cluster (and its own cluster), once."""
    if thing in LIVE:
        LIVE.remove(thing)
    try:
        thing.stop()
    finally:
        own = getattr(thing, "own", None)
        if own is not None:
            stop(own)


# -- one fault, one system ------------------------------------------------------------------------------------------
@dataclass
class Result:
    acted: float | None = None
    named: str = ""
    next: float | None = None
    full: float | None = None
    notes: list[str] = field(default_factory=list)


def at_step(job: Job, step: int, timeout: float) -> list[dict]:
    """Wait until every rank has completed ``step`` (torchft: committed); the records then."""
    def ready() -> list[dict] | None:
        recs = job.records.read()
        top: dict[int, int] = {}
        for x in recs:
            if x.get("ok", True):
                top[x["rank"]] = max(top.get(x["rank"], 0), x["step"])
        return recs if len(top) == job.world and min(top.values()) >= step else None
    return cluster.wait_for(ready, timeout, f"every rank at step {step}", POLL_S)


def firsts(recs: list[dict], t_fault: float, quorum) -> dict[int, float]:  # noqa: ANN001
    """rank -> its first step completed after the fault by a process started after it, or (torchft) committed in a
    quorum other than the fault's."""
    out: dict[int, float] = {}
    for x in recs:
        if x["ts"] > t_fault and x.get("ok", True) and (
                x["started"] > t_fault or (x.get("quorum") is not None and x["quorum"] != quorum)):
            out[x["rank"]] = min(out.get(x["rank"], math.inf), x["ts"])
    return out


def fault(system, case: str, where: Path, cap: float) -> Result:  # noqa: ANN001
    res = Result()
    job = system.launch(where, "nodes" if case == "node" else "flat", 4)
    LIVE.append(job)
    try:
        recs = at_step(job, FAULT_STEP, 180)
        pids = {x["rank"]: x["pid"] for x in sorted(recs, key=lambda x: x["ts"])}
        before = len({(x["rank"], x["pid"]) for x in recs}) - job.world
        if before:
            res.notes.append(f"{before} rank process(es) restarted before the fault (a false alarm)")
        quorum = max((x.get("quorum") or 0 for x in recs), default=0)
        if case == "node":
            t_f, note = job.lose_node(pids[VICTIM])
            res.notes.append(note)
        else:
            t_f = signal_pid(pids[VICTIM], STOP if case == "hang" else KILL)
            if case == "crash" and job.survivors_go_on:
                job.respawn(VICTIM)
                res.notes.append("a replacement replica group started at once (torchft leaves it to the scheduler)")
        died, last_status = None, 0.0
        while time.time() - t_f < cap:
            now = time.time()
            if case == "hang" and died is None and not all(alive(p) for p in pids.values()):
                died = now
            if case == "hang" and res.acted is None and now - last_status > 0.25:
                last_status, res.acted = now, job.acted(t_f)
            first = firsts(job.records.read(), t_f, quorum)
            need = [r for r in range(job.world) if r != VICTIM or not job.survivors_go_on]
            if res.next is None and all(r in first for r in need):
                res.next = max(first[r] for r in need) - t_f
            if len(first) == job.world:
                res.full = max(first.values()) - t_f
            if res.full is not None or (res.next is not None and case == "hang"):
                break
            time.sleep(POLL_S)
        if case == "hang":
            acted = job.acted(t_f) if res.acted is None else res.acted
            acted = died if acted is None else acted
            res.acted = None if acted is None or acted - t_f > cap else acted - t_f
            res.named = job.named(t_f, VICTIM, pids) if res.acted is not None else "no: did not act"
        res.notes.append(f"fault at step {max(x['step'] for x in recs if x['rank'] == VICTIM)}")
    finally:
        stop(job)
    return res


def startup(system, where: Path, cold: bool, cap: float) -> float | None:  # noqa: ANN001
    """Seconds from the launch to every one of 8 ranks' first completed step."""
    t0 = time.time()
    if cold:
        system.cold()
    job = system.launch(where, "startup", 8)
    LIVE.append(job)
    try:
        recs = at_step(job, 1, cap)
        first: dict[int, float] = {}
        for x in recs:
            if x.get("ok", True):
                first[x["rank"]] = min(first.get(x["rank"], math.inf), x["ts"])
        return max(first.values()) - t0
    except AssertionError:
        return None
    finally:
        stop(job)


# -- report ---------------------------------------------------------------------------------------------------------
def secs(x: float | None, cap: float) -> str:
    if x is None or math.isinf(x):
        return f"none in {cap:g} s"
    return f"{x:.2f} s" if x < 10 else f"{x:.1f} s"


def median(xs: list[float | None]) -> float:
    return statistics.median([math.inf if x is None else x for x in xs]) if xs else math.inf


def same(a: dict[str, list], b: dict[str, list]) -> bool:
    """Whether two figures agree for every system and run, to 0.1 s."""
    return a.keys() == b.keys() and all(
        (x is None) == (y is None) and (x is None or abs(x - y) < 0.1) for k in a for x, y in zip(a[k], b[k]))


def row(title: str, figures: dict[str, list], labels: dict[str, str], cap: float, named: dict | None = None) -> None:
    print(f"\n{title}")
    order = ["rankctl-cold", "rankctl-warm", *SYSTEMS]
    figures = dict(sorted(figures.items(), key=lambda kv: order.index(kv[0])))
    for key, xs in figures.items():
        extra = f"   named: {'; '.join(named[key])}" if named and named.get(key) else ""
        runs = ", ".join(secs(x, cap) for x in xs)
        print(f"  {labels[key]:22} {secs(median(xs), cap):>14}   runs: {runs}{extra}")
    ours = {k: v for k, v in figures.items() if k.startswith("rankctl")}
    theirs = {k: median(v) for k, v in figures.items() if not k.startswith("rankctl")}
    if not ours or not theirs:
        return
    best = min(theirs, key=theirs.get)
    for key, xs in ours.items():
        mine, other = median(xs), theirs[best]
        if math.isinf(mine):
            ratio = "rankctl did not"
        elif math.isinf(other):
            ratio = f"> {cap / mine:.1f}x (no peer within the cap)"
        else:
            ratio = f"{other / mine:.1f}x"
        print(f"  {labels[key]} {secs(mine, cap)} vs best peer {labels[best]} {secs(other, cap)}: {ratio}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default=",".join(CASES), help="cases, comma-separated: " + ",".join(CASES))
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: " + ",".join(SYSTEMS))
    ap.add_argument("--cap", type=float, default=75.0, help="seconds a system gets after a fault (startup: 2x)")
    ap.add_argument("--venv", type=Path, default=Path("/tmp/peers-venv"), help="the peers' virtual environment")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (logs, status files)")
    ns = ap.parse_args()
    cases = [c for c in CASES if c in ns.only.split(",")]
    keys = [s for s in SYSTEMS if s in ns.systems.split(",")]
    if not cases or not keys or set(ns.only.split(",")) - set(CASES) or set(ns.systems.split(",")) - set(SYSTEMS):
        ap.error(f"--only takes {','.join(CASES)}; --systems takes {','.join(SYSTEMS)}")
    if set(keys) - {"rankctl"}:
        ensure_venv(ns.venv)
    root = Path(tempfile.mkdtemp(prefix="rankctl-bench-peers-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    systems = {**peers(ns.venv), "rankctl": Rankctl(root) if "rankctl" in keys else None}
    labels = {k: systems[k].label for k in keys} | {"rankctl-cold": "rankctl (cold)", "rankctl-warm": "rankctl (warm)"}
    figs: dict[str, dict[str, list]] = {}
    named: dict[str, list[str]] = {}
    notes: list[str] = []

    errors: list[BaseException] = []

    def measure(key: str, case: str, k: int) -> None:
        try:
            measured(key, case, k)
        except BaseException as exc:  # noqa: BLE001 - raised again in the main thread
            errors.append(exc)

    def measured(key: str, case: str, k: int) -> None:
        where = root / key / f"{case}-{k}"
        if case == "startup":
            for mode in (("cold", "warm") if key == "rankctl" else ("",)):
                figs.setdefault("startup", {}).setdefault(f"{key}-{mode}" if mode else key, []).append(
                    startup(systems[key], where / mode, mode == "cold", 2 * ns.cap))
            return
        try:
            res = fault(systems[key], case, where, ns.cap)
        except (AssertionError, RuntimeError, OSError) as exc:   # a figure lost, not the bench
            res = Result(named="no: not measured")
            notes.append(f"{labels[key]}, {case}: run {k} not measured: {exc}")
        figs.setdefault(f"{case}-next", {}).setdefault(key, []).append(res.next)
        figs.setdefault("hang-acted" if case == "hang" else f"{case}-full", {}).setdefault(key, []).append(
            res.acted if case == "hang" else res.full)
        if case == "hang":
            named.setdefault(key, []).append(res.named)
        notes.extend(f"{labels[key]}, {case}, run {k}: {n}" for n in res.notes if k == 1 or "false alarm" in n)

    t0, ok = time.monotonic(), False
    try:
        for k in range(1, ns.runs + 1):
            for case in cases:
                idle = [key for key in keys if case == "hang" and key in IDLE_IN_HANG]
                for group in [[key] for key in keys if key not in idle] + ([idle] if idle else []):
                    print(f"[{time.monotonic() - t0:5.0f} s] run {k}: {case} on {', '.join(labels[g] for g in group)}",
                          file=sys.stderr, flush=True)
                    threads = [threading.Thread(target=measure, args=(key, case, k), daemon=True) for key in group]
                    for t in threads:
                        t.start()
                    for t in threads:
                        while t.is_alive():
                            t.join(0.5)
                    if errors:
                        raise errors[0]
        ok = True
    finally:
        for thing in list(reversed(LIVE)):
            try:
                stop(thing)
            except Exception as exc:  # noqa: BLE001 - keep stopping the rest
                print(f"warning: stopping {thing}: {exc}", file=sys.stderr)
        stray = leftovers(root)
        if stray:
            print(f"warning: {len(stray)} processes of this bench outlived it; killing them: {stray}", file=sys.stderr)
            signal_all(stray, signal.SIGKILL)
        if not ns.keep:
            for d in root.glob("cluster-*"):
                unmount_left(d)   # what a SIGKILLed daemon left mounted, its memory directories
        if not ok or ns.keep:
            print(f"(working directory kept: {root})", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    cap = ns.cap
    print(f"peers bench: 4-rank gloo all-reduce + 50 ms a step, fault on rank 1 after step {FAULT_STEP}, "
          f"{ns.runs} run(s), median then each run; cap {cap:g} s; {time.monotonic() - t0:.0f} s in all")
    titles = [("hang-acted", "hang (SIGSTOP of rank 1, never continued): acted on after"),
              ("hang-next", "hang: next completed step after"),
              ("crash-next", "crash (SIGKILL of rank 1): next completed step after"),
              ("crash-full", "crash: every rank of the world stepping again after"),
              ("node-next", "node loss (whole tree, spare ready): next completed step after"),
              ("node-full", "node loss: every rank of the world stepping again after"),
              ("startup", "start-up, 8 ranks: launch to every rank's first step")]
    for fig, title in titles:
        if fig.endswith("-full") and same(figs.get(fig, {}), figs.get(fig.replace("-full", "-next"), {})):
            continue   # every system's next step already had every rank (torchft's replacement joined with it)
        if fig in figs:
            row(title, figs[fig], labels, 2 * cap if fig == "startup" else cap, named if fig == "hang-acted" else None)
    print()
    for n in notes:
        print(f"  note: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
