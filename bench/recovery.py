"""Recovery from a lost node: rankctl vs torchrun (``--max-restarts``, c10d rendezvous), side by side in one run.

The same fault on both sides: a ``train`` job (a small GPT, data parallel over 2 nodes x 1 slot,
gloo) loses the node of rank 1 when every rank has completed step ``--fault-step``; the whole
node goes at once (every process of its tree, whatever their sessions, is stopped, then
SIGKILLed), and a spare node takes its place.

* rankctl: a real ``ctl coordinator`` (heartbeat timeout 10 s, the default) and three worker
  daemons (one slot each: the job's two nodes and an idle spare) as processes on loopback;
  the job has ``restart: {max_restarts: 2}`` and saves every ``--interval`` steps
  (``train.snapshot_every`` when this checkout has it, else ``train.checkpoint_every``; on the
  local disk of each node, replicated to the next node by the daemons).
* torchrun: two agents on this machine (``--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d
  --max-restarts=3 --monitor-interval=0.1``, each in its own session; the first one hosts the
  rendezvous store, ``is_host``), running ``bench/recovery_torchrun.py``: rankctl's own train
  rank built from torchrun's environment, same job file, ``train.resume: true`` and
  ``train.checkpoint_every: --interval`` into a directory every agent shares. The second agent
  is killed and a replacement agent (the spare node) is started at once. The agents run with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torch's opt-out, read in
  ``elastic/rendezvous/dynamic_rendezvous.py``): with the rendezvous store
  shared with the workers (torch's default, ``--torchrun-share-store``) the replacement agent waits
  for a ``MASTER_ADDR`` that the surviving rank-0 agent, whose store info is cached from its first
  round, never writes again; both agents fail after the store's 60 s read timeout.

Both sides run the job with ``restart.collective_timeout: --collective-timeout`` (60 s). Measured
from the kill (``time.time()``), from the ranks' own status lines (``rank-R.status.jsonl``, every
record timestamped by the rank) read every 20 ms:

* fault step: the last step every rank had completed when the node went;
* detected after: rankctl: the attempt's end (``attempts[0].finished_at``, the coordinator's
  clock); torchrun: the surviving agent's ``will restart worker group`` log line (its timestamp);
* next completed step after: when every rank of the new attempt has completed a step;
* steps lost: fault step - the step the new attempt resumed from (``result.resumed_from``).

torchrun is given ``--torchrun-cap`` seconds (180) to complete a step after the fault; past that
it is reported as "did not recover" (pytorch#76287) and the ratio is a lower bound.

Each node runs on its own cores by default (node-0 and torchrun's agent a on the first half of this
machine's, the others on the rest), as separate machines would. ``--no-pin`` puts every node on every core:
both ranks then run as many OpenMP threads as the machine has cores on the same cores (each node's share of
"its" machine), and their spinning makes a first step after a start 5-20x slower on both sides (2 cores:
0.3-1.0 s instead of 0.04-0.08 s; measured with a /proc sampler: the two ranks took 2.4 of the 2.9 CPU s of
such a 1.45 s window, the daemons and coordinator 0.1 s). That is the co-location of two emulated nodes, not
a cost any real node pays.

    python bench/recovery.py [--fault-step 11] [--interval 2] [--steps 30] [--torchrun-cap 180] [--no-pin] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import cluster  # noqa: E402
from cluster import ProcCluster, wait_for  # noqa: E402

RANK_SCRIPT = HERE / "recovery_torchrun.py"
NODES = ["node-0", "node-1", "node-2"]
WORLD = 2
POLL_S = 0.02
JOB = """
name: recovery
kind: train
resources: {{nodes: 2, slots_per_node: 1}}
backend: gloo
restart: {{max_restarts: 2, collective_timeout: {timeout:g}}}
model: {{layers: 2, hidden: 64, heads: 4, seq_len: 32, vocab: 256}}
train: {{steps: {steps}, global_batch: 8, micro_batch: 2, lr: 1.0e-2, warmup: 2, seed: 11,
         {key}: {interval}, data: builtin:pydoc}}
"""
AGENT_RESTART = "will restart worker group"
AGENT_RDZV = "Rendezvous complete for workers"
GLOG = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) ")


# -- the ranks' status lines ----------------------------------------------------------------------
def records(path: Path) -> list[dict]:
    """A status file's complete lines (a line still being written is left for the next read)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines(keepends=True):
        if line.endswith("\n"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def rank_of(path: Path) -> int:
    return int(re.match(r"rank-(\d+)\.status\.jsonl$", path.name).group(1))


def latest_steps(paths: list[Path]) -> dict[int, int]:
    """rank -> the last step it completed (0: none yet)."""
    return {rank_of(p): max((r["step"] or 0 for r in records(p)), default=0) for p in paths}


def all_stepped(paths: list[Path]) -> tuple[float, int] | None:
    """(when every rank had completed a step, the first step) once every rank of the world has one."""
    firsts = {}
    for p in paths:
        stepped = [r for r in records(p) if r["step"]]
        if stepped:
            firsts[rank_of(p)] = (stepped[0]["ts"], stepped[0]["step"])
    if len(firsts) < WORLD:
        return None
    return max(ts for ts, _ in firsts.values()), min(step for _, step in firsts.values())


def result_of(paths: list[Path]) -> dict | None:
    """The result of the lowest rank that finished (``done``) among ``paths``."""
    for p in sorted(paths, key=rank_of):
        done = [r for r in records(p) if r["phase"] == "done"]
        if done:
            return done[-1]["result"]
    return None


def newest_marker(paths) -> int | None:  # noqa: ANN001
    """The newest step among ``.../step-SSSSSSSS/rank-R.done`` markers (None: none)."""
    return max((int(p.parent.name.split("-")[1]) for p in paths), default=None)


def saves_at_fault(root: Path, victim: str, key: str) -> tuple[int | None, int | None]:
    """Rank 1's newest save on the victim node and its newest copy on a peer (snapshots live in each
    node's memory root, checkpoints under its state dir)."""
    if key == "snapshot_every":
        from rankctl.contract.files.checkpoints import snapshot_replica_root, snapshot_root

        own = [Path(snapshot_root(str(root / victim), "recovery"))]
        kept = [Path(snapshot_replica_root(str(root / n), "recovery")) for n in NODES if n != victim]
    else:
        own = [root / victim / "checkpoints" / "recovery"]
        kept = [root / n / "replicas" / "recovery" for n in NODES if n != victim]
    return (newest_marker(p for d in own for p in d.glob("step-*/rank-00001.done")),
            newest_marker(p for d in kept for p in d.glob("step-*/rank-00001.done")))


# -- a node lost at once -------------------------------------------------------------------------
def children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def tree(pid: int) -> list[int]:
    kids, out, todo = children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def signal_all(pids, sig: int) -> None:  # noqa: ANN001
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def kill_node(pid: int) -> float:
    """SIGKILL ``pid`` and every descendant, whatever their session (rankctl's ranks and torchrun's
    workers each have their own): all are stopped first, so none forks, exits or notices the others
    going before the kill. Returns the time of the kill."""
    seen: set[int] = set()
    for _ in range(5):
        new = [p for p in tree(pid) if p not in seen]
        if not new:
            break
        signal_all(new, signal.SIGSTOP)
        seen.update(new)
    t = time.time()
    signal_all(seen, signal.SIGKILL)
    return t


def unmount_left(root: Path) -> list[str]:
    """What the SIGKILLed node's daemon left mounted: its jobs' ``/dev/shm`` tmpfs under its state dir and its
    snapshot memory (``/dev/shm/rankctl-*``). A node whose daemon starts again unmounts them itself
    (``worker.files.shm.unmount_stale``, ``worker.files.snapmem``); the bench's lost node never comes back, so the bench
    does the same for each node's state dir. The mount points undone; the snapshot directories removed."""
    from rankctl.contract.files.checkpoints import memory_base
    from rankctl.worker.files import shm

    states = [p for p in (root / "rankctl").iterdir() if p.is_dir()] if (root / "rankctl").is_dir() else []
    points = [point for state in states for point in shm.unmount_stale(str(state))]
    bases = {memory_base(str(state)) for state in states}
    with open("/proc/self/mounts", encoding="utf-8") as f:
        held = [fields[1] for fields in (line.split() for line in f) if len(fields) > 2 and fields[1] in bases]
    for base in held:
        shm.libc().umount2(base.encode(), shm.MNT_DETACH)
    for base in bases:
        if base.startswith("/dev/shm/"):
            shutil.rmtree(base, ignore_errors=True)
    return points + held


def leftovers(root: Path) -> list[int]:
    """Processes (not this one) whose command line or stdout names the bench's directory."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
            out_fd = os.readlink(f"/proc/{entry}/fd/1")
        except OSError:
            continue
        if str(root) in cmd or out_fd.startswith(str(root)):
            out.append(int(entry))
    return out


# -- one machine as separate nodes ----------------------------------------------------------------
def node_cpus(pin: bool) -> dict[str, set[int]]:
    """Each node's cores when ``pin``: the first half of this process's cores for node-0 (rank 0's node and
    torchrun's agent a), the other half for node-1 and node-2 (the victim and the spare, never both alive
    with ranks). Unpinned, every node takes every core, and 2 ranks x (cores) OpenMP threads on the same
    cores spin against each other: 2 x 2 threads on 2 cores make a first step 0.4-0.5 s instead of 0.05 s."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return {}
    half = len(cpus) // 2
    return {"node-0": set(cpus[:half]), "node-1": set(cpus[half:]), "node-2": set(cpus[half:])}


@contextlib.contextmanager
def on_cpus(cpus: set[int] | None):  # noqa: ANN201
    """Processes started inside inherit ``cpus`` as their affinity (None: unchanged)."""
    old = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


# -- one side's figures --------------------------------------------------------------------------
@dataclass
class Side:
    peer: str
    interval: str
    fault_step: int = 0
    t_fault: float = 0.0
    detected: float | None = None       # seconds after the fault
    next_step: float | None = None      # seconds after the fault; None: no recovery within the cap
    resumed: int | None = None
    losses: list = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cap: float = 0.0

    @property
    def lost(self) -> int | None:
        return None if self.next_step is None else self.fault_step - (self.resumed or 0)


def wait_until_fault_step(paths_now, fault_step: int, timeout: float, what: str) -> list[Path]:  # noqa: ANN001
    """Poll until every rank has completed ``fault_step``; the status files then."""
    def ready():
        paths = paths_now()
        steps = latest_steps(paths)
        return len(steps) == WORLD and min(steps.values()) >= fault_step and paths
    return wait_for(ready, timeout, what, interval=POLL_S)


def job_text(steps: int, key: str, interval: int, timeout: float) -> str:
    return JOB.format(steps=steps, key=key, interval=interval, timeout=timeout)


def run_rankctl(root: Path, ns: argparse.Namespace, key: str) -> Side:
    side = Side("rankctl", f"{key} {ns.interval}", cap=ns.torchrun_cap)
    root.mkdir(parents=True)
    job_file = root / "job.yaml"
    job_file.write_text(job_text(ns.steps, key, ns.interval, ns.collective_timeout))
    cpus = node_cpus(ns.pin)
    start = cluster.start_worker

    def start_worker(address: str, name: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with on_cpus(cpus.get(name)):   # daemons as users run them: the spare's launcher warms when idle
            return start(address, name, *args, idle_warm=True, **kwargs)

    cluster.start_worker = start_worker
    try:
        c = ProcCluster(root, NODES, 1, heartbeat_timeout=10.0)
    finally:
        cluster.start_worker = start
    try:
        job = c.submit(str(job_file))

        def attempt_files(attempts: str) -> list[Path]:
            return sorted(root.glob(f"node-*/jobs/{job}/{attempts}/rank-*.status.jsonl"))

        paths = wait_until_fault_step(lambda: attempt_files("1"), ns.fault_step, 300,
                                      f"rankctl at step {ns.fault_step}")
        victim = next(p for p in paths if rank_of(p) == 1).relative_to(root).parts[0]
        if cpus and cpus[victim] & cpus[next(p for p in paths if rank_of(p) == 0).relative_to(root).parts[0]]:
            side.notes.append("warning: ranks 0 and 1 were placed on nodes that share cores")
        side.t_fault = kill_node(c.workers[victim].pid)
        side.fault_step = min(latest_steps(attempt_files("1")).values())
        side.notes.append(f"SIGKILL of {victim} (daemon, launcher, rank 1); spare "
                          f"{(set(NODES) - {p.relative_to(root).parts[0] for p in paths}).pop()} idle and READY")
        saved, copied = saves_at_fault(root, victim, key)
        side.notes.append(f"at the fault: rank 1's newest save on {victim}: step {saved or 'none'}; its newest copy "
                          f"on a peer: step {copied or 'none'} (daemons push each save to the next node as its rank "
                          f"completes it)")
        try:
            ts, first = wait_for(lambda: all_stepped(attempt_files("[2-9]")), ns.torchrun_cap,
                                 "rankctl's next attempt to complete a step", interval=POLL_S)
            side.next_step = ts - side.t_fault
            side.resumed = first - 1
        except AssertionError:
            side.notes.append(f"no step of a new attempt within {ns.torchrun_cap:.0f} s")
        done = c.wait_state(job, {"SUCCEEDED", "FAILED", "CANCELLED"}, 300)
        attempts = done.get("attempts") or []
        if attempts and attempts[0].get("finished_at"):
            side.detected = attempts[0]["finished_at"] - side.t_fault
            side.notes.append(f"attempt 1 ended {attempts[0]['state']}: {(attempts[0]['reason'] or '')[:120]}")
        result = done.get("result") or {}
        side.resumed = result.get("resumed_from", side.resumed) or 0
        side.losses = result.get("losses") or []
        side.notes.append(f"job {done['state']} on attempt {done['attempt']}, nodes {done['nodes']}, "
                          f"resumed from step {side.resumed}")
    finally:
        c.stop()
    return side


class Agent:
    """One torchrun agent (its own session), output in a log file."""

    def __init__(self, root: Path, name: str, port: int, job_file: Path, shared: Path, is_host: bool,
                 join_timeout: int, env: dict[str, str], cpus: set[int] | None = None) -> None:
        self.name, self.log = name, root / f"agent-{name}.log"
        self._fh = open(self.log, "ab")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=recovery-bench",
               f"--rdzv-conf=is_host={str(is_host).lower()},join_timeout={join_timeout}",
               "--max-restarts=3", "--monitor-interval=0.1", f"--log-dir={root / ('logs-' + name)}",
               str(RANK_SCRIPT), str(job_file), str(shared)]
        with on_cpus(cpus):
            self.p = subprocess.Popen(cmd, stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**os.environ, **env, "LOGLEVEL": "INFO"}, cwd=root)

    def first_line_after(self, text: str, t0: float) -> float | None:
        """The timestamp of the first agent log line holding ``text`` stamped after ``t0``."""
        year = datetime.now().year
        for line in self.log.read_text(errors="replace").splitlines():
            m = GLOG.match(line)
            if m and text in line:
                mon, day, hh, mm, ss = m.groups()
                sec = float(ss)
                t = datetime(year, int(mon), int(day), int(hh), int(mm)).timestamp() + sec  # the agent's local time
                if t >= t0:
                    return t
        return None

    def stop(self) -> None:
        if self.p.poll() is None:
            kill_node(self.p.pid)
        self.p.wait(timeout=30)
        self._fh.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(root: Path, ns: argparse.Namespace) -> Side:
    side = Side("torchrun", f"checkpoint_every {ns.interval}", cap=ns.torchrun_cap)
    shared = root / "shared"
    root.mkdir(parents=True)
    job_file = root / "job.yaml"
    job_file.write_text(job_text(ns.steps, "checkpoint_every", ns.interval, ns.collective_timeout))
    port, join = free_port(), 120
    # torch shares the rendezvous TCPStore with the workers by default; a replacement agent then waits
    # forever for a MASTER_ADDR that the surviving rank-0 agent never writes again (its store info is
    # cached from the first round), so both give up after 60 s. The opt-out gives it a chance.
    env = {} if ns.torchrun_share_store else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    cpus = node_cpus(ns.pin)

    def agent(name: str, is_host: bool) -> Agent:
        return Agent(root, name, port, job_file, shared, is_host, join, env, cpus.get("node-0" if is_host else "node-1"))

    agents = [agent("a", True)]
    try:
        agents.append(agent("b", False))

        def files() -> list[Path]:
            return sorted(shared.glob("jobs/torchrun/*/rank-*.status.jsonl"))

        wait_until_fault_step(files, ns.fault_step, 300, f"torchrun at step {ns.fault_step}")
        before = {p.parent for p in files()}
        side.t_fault = kill_node(agents[1].p.pid)
        agents.append(agent("spare", False))
        side.fault_step = min(latest_steps([p for p in files() if p.parent in before]).values())
        side.notes.append("SIGKILL of agent b (agent and its worker), replacement agent started at once; "
                          f"rendezvous join_timeout {join} s, keep-alive 5 s x 3 (torch defaults), "
                          + ("rendezvous store shared with the workers (torch's default)" if ns.torchrun_share_store
                             else "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"))

        def fresh() -> list[Path]:
            return [p for p in files() if p.parent not in before]

        try:
            ts, first = wait_for(lambda: all_stepped(fresh()), ns.torchrun_cap, "torchrun's restart to complete a step",
                                 interval=POLL_S)
            side.next_step, side.resumed = ts - side.t_fault, first - 1
        except AssertionError:
            side.notes.append(f"did not recover within {ns.torchrun_cap:.0f} s")
        detect = agents[0].first_line_after(AGENT_RESTART, side.t_fault)
        side.detected = None if detect is None else detect - side.t_fault
        rdzv = agents[0].first_line_after(AGENT_RDZV, side.t_fault)
        if rdzv is not None:
            side.notes.append(f"surviving agent's rendezvous complete {rdzv - side.t_fault:.1f} s after the fault")
        if side.next_step is not None:
            try:
                wait_for(lambda: all(a.p.poll() is not None for a in (agents[0], agents[2])), 300,
                         "the agents to finish the job")
                codes = [agents[0].p.returncode, agents[2].p.returncode]
                result = result_of(fresh()) or {}
                side.resumed = result.get("resumed_from", side.resumed) or 0
                side.losses = result.get("losses") or []
                side.notes.append(f"agents a, spare exited {codes}; resumed from step {side.resumed}")
            except AssertionError as exc:
                side.notes.append(str(exc))
    finally:
        for a in agents:
            a.stop()
    return side


# -- report ---------------------------------------------------------------------------------------
def secs(x: float | None, cap: float = 0.0) -> str:
    if x is None:
        return f"did not recover within {cap:.0f} s" if cap else "-"
    return f"{x:.2f} s" if x < 1 else f"{x:.1f} s"


def table(sides: list[Side]) -> str:
    head = ["peer", "fault step", "detected after", "next completed step after", "steps lost", "interval"]
    rows = [[s.peer, str(s.fault_step), secs(s.detected), secs(s.next_step, s.cap),
             "-" if s.lost is None else str(s.lost), s.interval] for s in sides]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def same_losses(a: list, b: list) -> str:
    x = {r["step"]: r["loss"] for r in a if r.get("loss") is not None}
    y = {r["step"]: r["loss"] for r in b if r.get("loss") is not None}
    common = sorted(set(x) & set(y))
    if not common:
        return "losses: no common step to compare"
    worst = max(abs(x[s] - y[s]) / max(abs(y[s]), 1e-12) for s in common)
    return (f"same model and data: losses of steps {common[0]}..{common[-1]} ({len(common)} steps) agree "
            f"on both sides to a relative {worst:.1e}")


def interval_key(choice: str) -> str:
    if choice != "auto":
        return choice
    from rankctl.kinds.train.spec import TrainSpec

    return "snapshot_every" if "snapshot_every" in TrainSpec.model_fields else "checkpoint_every"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fault-step", type=int, default=11)
    ap.add_argument("--interval", type=int, default=2, help="steps between saves, both sides")
    ap.add_argument("--interval-key", choices=["auto", "snapshot_every", "checkpoint_every"], default="auto",
                    help="rankctl's save setting (auto: snapshot_every when the train kind has it)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--collective-timeout", type=float, default=60.0)
    ap.add_argument("--torchrun-cap", type=float, default=180.0, help="seconds torchrun gets to recover")
    ap.add_argument("--torchrun-share-store", action="store_true",
                    help="leave torch's shared rendezvous store on (a replacement agent deadlocks with it)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="each node on its own cores (node-0 / agent a on the first half, the others on the rest), "
                         "as separate machines; --no-pin: every node on every core (default: pinned)")
    ap.add_argument("--only", choices=["rankctl", "torchrun"], help="run one side (no ratio)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (logs, status files)")
    ns = ap.parse_args()
    if not 0 < ns.fault_step < ns.steps:
        ap.error("--fault-step must lie inside the run")
    key = interval_key(ns.interval_key)
    root = Path(tempfile.mkdtemp(prefix="rankctl-bench-recovery-"))
    sides: list[Side] = []
    t0 = time.monotonic()
    ok = False
    try:
        if ns.only != "torchrun":
            sides.append(run_rankctl(root / "rankctl", ns, key))
        if ns.only != "rankctl":
            sides.append(run_torchrun(root / "torchrun", ns))
        ok = True
    finally:
        stray = leftovers(root)
        if stray:
            print(f"warning: {len(stray)} processes of this bench outlived it; killing them: {stray}")
            signal_all(stray, signal.SIGKILL)
        if not ns.keep:
            unmount_left(root)
        if not ok or ns.keep:
            print(f"(working directory kept: {root})")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"recovery bench: train job (GPT 2x64, seq 32, batch 8), 2 nodes x 1 slot (dp 2), gloo, "
          f"SIGKILL of rank 1's node after step {ns.fault_step}, a spare replaces it; "
          f"collective timeout {ns.collective_timeout:g} s; "
          f"{'each node on its own cores' if node_cpus(ns.pin) else 'every node on every core'}; "
          f"{time.monotonic() - t0:.0f} s in all")
    print(table(sides))
    for s in sides:
        for n in s.notes:
            print(f"  {s.peer}: {n}")
    if len(sides) < 2:
        return 0
    ours, theirs = sides
    print(f"  {same_losses(ours.losses, theirs.losses)}")
    if ours.next_step is None:
        print("verdict: FAIL (rankctl did not recover)")
        return 1
    if theirs.next_step is None:
        y, bound = ns.torchrun_cap, ">"
    else:
        y, bound = theirs.next_step, ""
    ratio = y / ours.next_step
    print(f"recovery: rankctl {ours.next_step:.1f} s vs torchrun {bound}{y:.1f} s -> {bound}{ratio:.1f}x faster")
    fast, kept = ratio >= 10, ours.lost is not None and ours.lost <= ns.interval
    print(f"verdict: {'PASS' if fast and kept else 'FAIL'} (recovery {bound}{ratio:.1f}x "
          f"{'>=' if fast else '<'} 10x (issue 28); rankctl lost {ours.lost} steps {'<=' if kept else '>'} its interval "
          f"{ns.interval} ({key}))")
    return 0 if fast and kept else 1


if __name__ == "__main__":
    sys.exit(main())
