"""Cluster scale: one real coordinator against thousands of simulated worker daemons.

A real ``ctl coordinator`` process (this checkout's, or an older one's with
``--coordinator-python``/``--coordinator-pythonpath``) serves ``--nodes`` fake daemons played by
``--procs`` generator processes (``bench/scale_sim.py``: one asyncio loop each, the real
``NodeService.Connect`` protocol, 32 streams per channel). When every node is READY the driver
submits one ``comm-check`` job over all of them (tp=slots, dp=nodes); the daemons play its ranks
through rendezvous, groups, running, ``--steps`` steps at ``--step-rate`` and an exit, their ticks
spread evenly over the step period. Measured:

* submit -> all assigned: from just before ``SubmitJob`` to the last daemon's ``Assign``;
* steps stored: the slowest rank's stored step (``GetJob``, summary only where supported), polled
  every 0.5 s; the stored rate over the steady window against the offered ``--step-rate``;
* watch lag: ``now - event.event_time`` of every live event on ``WatchJobBatches`` (step events;
  ``WatchJob`` and every event on a coordinator without it);
* ``ctl status JOB`` wall time (3 runs during the steps, interpreter start included; the ctl of
  the coordinator's checkout), the max;
* false LOST: nodes not READY after the steps (every fake daemon heartbeats), and stream errors;
* the coordinator's peak RSS (``VmHWM``) and its CPU per rank-step over the steady window.

Each fake daemon sends one ``ReportBatch`` per tick, as the real one does (the one-report-per-message
form that an earlier main was compared in is gone from the protocol, its field numbers reserved).

With ``--store etcd`` the same load runs twice, side by side: on the SQLite store, then on two coordinators
over a local 3-member etcd (``tests/etcdcluster.py``), whose leader is SIGKILLed when the slowest rank's stored
step reaches half the steps; that run adds etcd's write rate and bytes per second (its members' /metrics) and
the failover time: from the kill to the first stored step past the one stored at the kill.

With ``--fault`` it measures recovery instead (``bench/scale_fault.py``): a node of a ``--small-nodes`` job,
then of a ``--nodes`` job (default 8,192), is SIGKILLed once steps flow; from its loss to the attempt failing,
to every Assign of the next attempt read, to that attempt's first step stored, side by side, with the
coordinator's share of each.

    python bench/scale.py --nodes 2048 --slots 8 --steps 30 [--step-rate 1] [--procs P] [--store etcd]
        [--coordinator-python PY] [--coordinator-pythonpath DIR] [--heartbeat-timeout S]
    python bench/scale.py --fault [--nodes 8192] [--small-nodes 64] [--spares 8] [--faults 3] [--fault-step 3]
        [--generators-nice 19] [--profile DIR [--profile-native]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc
from rankctl.proto import short_name

HERE = Path(__file__).resolve().parent
SIM = HERE / "scale_sim.py"
CLK_TCK = os.sysconf("SC_CLK_TCK")
NAN = float("nan")
CLIENT_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]

JOB = """
name: scale-bench
kind: comm-check
resources: {{nodes: {nodes}, slots_per_node: {slots}}}
backend: gloo
parallel: {{tp: {slots}}}
comm_check: {{size_bytes: 1024, iters: 1, warmup: 0}}
"""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return NAN
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def proc_cpu_ticks(pid: int) -> int:
    """utime + stime of a process (all its threads), in clock ticks; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def proc_status_kib(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def fmt(x: float, digits: int = 2) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


class Generator:
    """One generator subprocess and what it last said (read on a thread)."""

    def __init__(self, args: list[str], log: Path, nice: int = 0) -> None:
        self._err = open(log, "wb")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.p = subprocess.Popen([sys.executable, str(SIM), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self._err, env=env, text=True, bufsize=1, start_new_session=True,
                                  preexec_fn=(lambda: os.nice(nice)) if nice else None)
        self.progress: dict = {}
        self.final: dict | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.p.stdout:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if obj.get("ev") == "final":
                self.final = obj
            self.progress = obj

    def stop(self, timeout: float = 30) -> None:
        try:
            self.p.stdin.write("stop\n")
            self.p.stdin.flush()
            self.p.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            pass
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.reader.join(timeout=5)
        self._err.close()


def start_coordinator(ns: argparse.Namespace, python: str, pythonpath: str | None,
                      root: Path, store: str | None = None, name: str = "coord") -> tuple[subprocess.Popen, str, dict]:
    state = root / name
    state.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    args = [python, "-m", "rankctl.cli.main", "coordinator", "--listen", "127.0.0.1:0", "--state-dir", str(state),
            "--log-level", "warning", "--http-listen", "127.0.0.1:0"]   # /metrics: the fault bench's fan-out times
    if ns.heartbeat_timeout is not None:
        args += ["--heartbeat-timeout", str(ns.heartbeat_timeout)]
    if getattr(ns, "relay_width", None) is not None:
        args += ["--relay-width", str(ns.relay_width)]
    if store:
        args += ["--store", store]
    log = open(root / f"{name}.log", "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log.close()
    deadline = time.monotonic() + 60
    addr_file = state / "address"
    while time.monotonic() < deadline:
        if addr_file.exists() and addr_file.read_text().strip():
            return proc, addr_file.read_text().strip(), env
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    tail = (root / f"{name}.log").read_text(errors="replace")[-2000:]
    raise SystemExit(f"the coordinator did not start ({' '.join(args[:4])} ...):\n{tail}")


def which_code(python: str, env: dict) -> str:
    """Where the coordinator's rankctl comes from, and whether it has the issue's node_service module."""
    probe = ("import os, rankctl.coordinator as c; d = os.path.dirname(c.__file__); "
             "print(os.path.dirname(d), os.path.exists(os.path.join(d, 'node_service.py')))")
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    if out.returncode != 0:
        return f"unknown ({out.stderr.strip()[-200:]})"
    where, has = out.stdout.split()
    return f"rankctl from {where} ({'has' if has == 'True' else 'no'} rankctl.coordinator.api.node_service)"


async def job_progress(client: rankctl_pb2_grpc.ClientServiceStub, job_id: str) -> tuple[int, int, str]:
    """(slowest rank's stored step, ranks reported, state): from the summary, else from every rank."""
    job = await client.GetJob(pb.GetJobRequest(job_id=job_id, summary_only=True), timeout=60)
    state = short_name(pb.JobState, job.state)
    if job.HasField("summary"):
        s = job.summary
        reported = job.world_size - s.phases.get("pending", 0) if s.phases else job.world_size
        return s.min_step, reported, state
    ranks = list(job.ranks)
    while job.next_rank_offset and len(ranks) < job.world_size:  # a paged answer without a summary
        job = await client.GetJob(pb.GetJobRequest(job_id=job_id, rank_offset=job.next_rank_offset,
                                                   rank_limit=4096), timeout=60)
        ranks.extend(job.ranks)
    if len(ranks) < job.world_size:
        return 0, len(ranks), state
    return min(r.step for r in ranks), len(ranks), state


def event_s(ev: pb.JobEvent) -> float:
    """When the coordinator recorded the event, in unix seconds."""
    return ev.event_time.seconds + ev.event_time.nanos / 1e9


async def watcher(client: rankctl_pb2_grpc.ClientServiceStub, job_id: str, out: dict) -> None:
    """Lag of every live event: WatchJobBatches (step events), else WatchJob (every event)."""
    start = time.time()
    out.update(api="WatchJobBatches", step_lags=[], all_lags=[], error="")
    try:
        async for batch in client.WatchJobBatches(pb.WatchJobRequest(job_id=job_id)):
            now = time.time()
            for ev in batch.events:
                at = event_s(ev)
                if at >= start:
                    out["all_lags"].append(now - at)
                    if ev.kind == "step":
                        out["step_lags"].append(now - at)
        return
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            out["error"] = f"{exc.code().name}: {exc.details()}"
            return
    out["api"] = "WatchJob"
    try:
        async for ev in client.WatchJob(pb.WatchJobRequest(job_id=job_id)):
            if event_s(ev) >= start:
                lag = time.time() - event_s(ev)
                out["all_lags"].append(lag)
                if ev.kind == "step":
                    out["step_lags"].append(lag)
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            out["error"] = f"{exc.code().name}: {exc.details()}"


def timed_status(ctl: list[str], env: dict, address: str, job_id: str) -> tuple[float, int, float]:
    """(wall seconds, exit code, CPU seconds) of one ``ctl status JOB``; killed after 120 s."""
    t0 = time.perf_counter()
    p = subprocess.Popen(ctl + ["--coordinator", address, "status", job_id], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=env)
    killer = threading.Timer(120, p.kill)
    killer.start()
    _, status, usage = os.wait4(p.pid, 0)
    killer.cancel()
    p.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - t0, p.returncode, usage.ru_utime + usage.ru_stime


class Following:
    """A ClientService stub over the coordinators of one store: a call a standby refuses, or that finds its
    coordinator gone, is tried on the next one (for up to 30 s)."""

    def __init__(self, channels: list[grpc.aio.Channel]) -> None:
        self.stubs = [rankctl_pb2_grpc.ClientServiceStub(ch) for ch in channels]
        self.current = 0

    def __getattr__(self, name: str):  # noqa: ANN204
        if name in ("WatchJob", "WatchJobBatches"):
            return getattr(self.stubs[self.current], name)

        async def call(request, **kw):  # noqa: ANN001, ANN202
            end = time.monotonic() + 30
            while True:
                try:
                    return await getattr(self.stubs[self.current], name)(request, **kw)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or len(self.stubs) == 1 or time.monotonic() > end:
                        raise
                    self.current = (self.current + 1) % len(self.stubs)
                    await asyncio.sleep(0.1)
        return call


def etcd_counters(metrics_urls: list[str]) -> tuple[float, float]:
    """(raft proposals committed: the cluster's writes, max over members; bytes its members received from
    clients, summed) from the members' /metrics."""
    import urllib.request

    committed, received = 0.0, 0.0
    for url in metrics_urls:
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("etcd_server_proposals_committed_total "):
                committed = max(committed, float(line.split()[1]))
            elif line.startswith("etcd_network_client_grpc_received_bytes_total "):
                received += float(line.split()[1])
    return committed, received


async def drive(ns: argparse.Namespace, address: str, coord: subprocess.Popen, env: dict, python: str,
                gens: list[Generator], r: dict, coords: dict | None = None) -> None:
    """``coords`` (a replicated store's run): address -> process of every coordinator; the leader is SIGKILLed
    half-way through the steps and the time until steps are stored again measured."""
    n, slots, steps, rate = ns.nodes, ns.slots, ns.steps, ns.step_rate
    channels = [grpc.aio.insecure_channel(a, options=CLIENT_OPTIONS) for a in address.split(",")]
    client = Following(channels)
    say = r["log"]
    metrics_urls = r.get("etcd_metrics", [])
    killed_at, step_at_kill = 0.0, 0
    try:
        # -- every node READY
        t0 = time.monotonic()
        deadline = t0 + ns.ready_timeout
        ready = 0
        while time.monotonic() < deadline:
            try:
                nodes = (await client.ListNodes(pb.ListNodesRequest(), timeout=30)).nodes
                ready = sum(1 for x in nodes if x.state == pb.NODE_STATE_READY)
            except grpc.aio.AioRpcError:
                ready = 0
            if ready >= n:
                break
            await asyncio.sleep(0.5)
        r["register_s"] = time.monotonic() - t0
        r["ready"] = ready
        say(f"registered : {ready}/{n} nodes READY after {r['register_s']:.1f} s")
        if ready < n:
            say(f"registered : only {ready}/{n} nodes READY after {ns.ready_timeout:.0f} s; submitting anyway")

        # -- submit, then every Assign
        spec = JOB.format(nodes=n, slots=slots)
        t_submit = time.time()
        try:
            job = (await client.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec, source="scale-bench.yaml",
                                                              queue_anyway=True), timeout=600)).job
        except grpc.aio.AioRpcError as exc:
            say(f"submit     : failed: {exc.code().name}: {exc.details()}")
            return
        r["submit_rpc_s"] = time.time() - t_submit
        job_id = r["job_id"] = job.id
        watch_out: dict = {}
        watch = asyncio.create_task(watcher(client, job_id, watch_out))
        r["watch"] = watch_out
        deadline = time.monotonic() + ns.assign_timeout
        while time.monotonic() < deadline:
            if sum(g.progress.get("assigned", 0) for g in gens) >= n:
                break
            await asyncio.sleep(0.1)
        assigned = sum(g.progress.get("assigned", 0) for g in gens)
        last = max((g.progress.get("assign_last", 0.0) for g in gens), default=0.0)
        r["assigned"] = assigned
        if assigned >= n:
            r["assign_s"] = last - t_submit
            say(f"assign     : all {n} nodes ({n * slots} ranks) assigned {r['assign_s']:.2f} s after submit "
                f"(SubmitJob answered in {r['submit_rpc_s']:.2f} s)")
        else:
            say(f"assign     : assigned {assigned}/{n} nodes after {ns.assign_timeout:.0f} s")

        # -- steps: stored progress, CPU, ctl status
        samples: list[tuple[float, int, int, int, int]] = []  # (time, min step, coordinator, generator, driver ticks)
        expected = (steps + 5) / rate
        deadline = time.monotonic() + (steps / rate * 3 + 60 if assigned else 5)
        status_at = [time.monotonic() + expected * f for f in (0.3, 0.5, 0.7)]
        status_tasks: list[asyncio.Task] = []
        state, min_step = "", 0
        ctl = [python, "-m", "rankctl.cli.main"]
        while time.monotonic() < deadline:
            try:
                min_step, reported, state = await job_progress(client, job_id)
            except grpc.aio.AioRpcError as exc:
                say(f"GetJob     : {exc.code().name}: {exc.details()}")
                await asyncio.sleep(0.5)
                continue
            samples.append((time.time(), min_step, proc_cpu_ticks(coord.pid),
                            sum(proc_cpu_ticks(g.p.pid) for g in gens), proc_cpu_ticks(os.getpid()),
                            *(etcd_counters(metrics_urls) if metrics_urls else (0.0, 0.0))))
            if coords and not killed_at and min_step >= steps // 2:
                info = await client.GetInfo(pb.GetInfoRequest(), timeout=10)
                victim = coords[info.leader_address]
                victim.kill()
                killed_at, step_at_kill = time.monotonic(), min_step
                r["killed_wall"] = time.time()
                say(f"failover   : leader {info.leader_address} SIGKILLed at stored step {min_step}")
                coord = next(p for a, p in coords.items() if a != info.leader_address)
            if killed_at and "failover_s" not in r and min_step > step_at_kill:
                r["failover_s"] = time.monotonic() - killed_at
                say(f"failover   : steps stored again {r['failover_s']:.2f} s after the leader was killed "
                    f"(stored step {min_step})")
            if status_at and time.monotonic() >= status_at[0]:
                status_at.pop(0)
                status_tasks.append(asyncio.create_task(asyncio.to_thread(timed_status, ctl, env, address, job_id)))
            if min_step >= steps or state in ("FAILED", "CANCELLED", "SUCCEEDED"):
                break
            await asyncio.sleep(0.5)
        r["min_step"] = min_step
        r["state_after_steps"] = state
        if min_step < steps:
            why = f"the job ended {state}" if state in ("FAILED", "CANCELLED", "SUCCEEDED") else "the deadline passed"
            say(f"steps      : slowest rank stored step {min_step}/{steps} when {why}")
        for t in status_tasks:
            r.setdefault("status_runs", []).append(await t)
        r["samples"] = samples

        # -- steady window: from the first sample with every rank at step >= 1 to the first at the last step seen
        # (before a failover: the CPU figures are the first leader's)
        samples = [s for s in samples if "killed_wall" not in r or s[0] < r["killed_wall"]]
        top = max((s[1] for s in samples), default=0)
        start = next((s for s in samples if s[1] >= 1), None)
        end = next((s for s in samples if s[1] >= top), None)
        if start is not None and end is not None and end[1] > start[1]:
            dsteps, dt = end[1] - start[1], end[0] - start[0]
            r["step_rate"] = dsteps / dt
            r["cpu_us"] = (end[2] - start[2]) / CLK_TCK * 1e6 / (n * slots * dsteps)
            r["coord_cores"] = (end[2] - start[2]) / CLK_TCK / dt
            r["gen_cores"] = (end[3] - start[3]) / CLK_TCK / dt
            r["gen_us_node_step"] = (end[3] - start[3]) / CLK_TCK * 1e6 / (n * dsteps)
            r["driver_cores"] = (end[4] - start[4]) / CLK_TCK / dt
            r["window"] = (start[1], end[1], dt)
            if metrics_urls:
                r["etcd_writes_s"] = (end[5] - start[5]) / dt
                r["etcd_bytes_s"] = (end[6] - start[6]) / dt

        # -- the end of the job, then false LOST
        deadline = time.monotonic() + (60 if assigned else 1)
        while state not in ("FAILED", "CANCELLED", "SUCCEEDED") and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            try:
                _, _, state = await job_progress(client, job_id)
            except grpc.aio.AioRpcError:
                pass
        r["final_state"] = state
        try:
            job = await client.GetJob(pb.GetJobRequest(job_id=job_id, summary_only=True), timeout=60)
            r["reason"] = job.reason
            nodes = (await client.ListNodes(pb.ListNodesRequest(), timeout=60)).nodes
            r["not_ready"] = sum(1 for x in nodes if x.state != pb.NODE_STATE_READY)
            r["lost"] = sum(1 for x in nodes if x.state == pb.NODE_STATE_LOST)
            r["rejected"] = sum(x.rejected_reports for x in nodes)
        except grpc.aio.AioRpcError as exc:
            say(f"after      : GetJob/ListNodes failed: {exc.code().name}: {exc.details()}")
        await asyncio.sleep(1.0)  # the last events reach the watcher
        if not watch.done():
            watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
    finally:
        for ch in channels:
            await ch.close()


def run_once(ns: argparse.Namespace, python: str, pythonpath: str | None, store: str = "sqlite") -> dict:
    """One coordinator (two on an etcd ``store``: a leader and a standby), one load; returns the figures (and
    prints them as it goes)."""
    mode = "batched" if store == "sqlite" else "etcd"
    root = Path(tempfile.mkdtemp(prefix=f"rankctl-bench-scale-{mode}-"))
    lines: list[str] = []

    def say(text: str) -> None:
        print("  " + text, flush=True)
        lines.append(text)

    r: dict = {"mode": mode, "log": say, "root": root}
    who = f"{python}" + (f" PYTHONPATH={pythonpath}" if pythonpath else "")
    print(f"scale bench ({mode}): {ns.nodes} nodes x {ns.slots} slots, {ns.steps} steps at {ns.step_rate:g}/s, "
          f"{ns.procs} generator process(es); coordinator: {who}", flush=True)
    etcd = None
    coords: dict[str, subprocess.Popen] = {}
    if store == "sqlite":
        coord, address, env = start_coordinator(ns, python, pythonpath, root)
    else:
        if store == "etcd":  # a local 3-member cluster, as the tests start it
            sys.path.insert(0, str(HERE.parent / "tests"))
            from etcdcluster import EtcdCluster

            etcd = EtcdCluster(root / "etcd")
            etcd.start_all()
            store = etcd.url
            r["etcd_metrics"] = [f"http://{e}/metrics" for e in etcd.endpoints]
            say(f"etcd       : 3 members on loopback ({store})")
        for i in range(2):
            proc, addr, env = start_coordinator(ns, python, pythonpath, root, store, name=f"coord{i}")
            coords[addr] = proc
        address = ",".join(coords)
        coord = next(iter(coords.values()))
    print(f"  code       : {which_code(python, env)}", flush=True)
    gens: list[Generator] = []
    try:
        per = math.ceil(ns.nodes / ns.procs)
        for i in range(ns.procs):
            first, count = i * per, min(per, ns.nodes - i * per)
            if count <= 0:
                break
            args = ["--address", address, "--first", str(first), "--count", str(count), "--total", str(ns.nodes),
                    "--slots", str(ns.slots), "--steps", str(ns.steps), "--step-rate", str(ns.step_rate),
                    "--streams-per-channel", str(ns.streams_per_channel)]
            gens.append(Generator(args, root / f"gen{i}.log"))
        asyncio.run(drive(ns, address, coord, env, python, gens, r, coords or None))
        alive = [p for p in (coords.values() if coords else [coord]) if p.poll() is None]
        r["rss_mib"] = max((proc_status_kib(p.pid, "VmHWM") / 1024 for p in alive), default=NAN)
        r["coord_alive"] = bool(alive)
    finally:
        for g in gens:
            g.stop()
        for p in (coords.values() if coords else [coord]):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if etcd is not None:
            etcd.close()
    finals = [g.final or g.progress for g in gens]
    r["stream_errors"] = sum(f.get("errors", 0) for f in finals)
    r["reconnects"] = sum(f.get("reconnects", 0) for f in finals)
    r["stream_errors_registered"] = sum(f.get("errors_registered", 0) for f in finals)
    r["gen_cpu_s"] = sum(f.get("cpu_s", 0.0) for f in finals)
    r["late_p99"] = max((f.get("late_p99", NAN) for f in finals), default=NAN)
    r["late_max"] = max((f.get("late_max", 0.0) for f in finals), default=NAN)
    r["assign_bytes_max"] = max((f.get("assign_bytes_max", 0) for f in finals), default=0)
    kinds: dict[str, int] = {}
    counts: dict[str, int] = {}
    for f in finals:
        for k, v in f.get("error_kinds", {}).items():
            kinds[k] = kinds.get(k, 0) + v
        for k, v in f.get("counts", {}).items():
            counts[k] = counts.get(k, 0) + v
    r["counts"] = counts
    for f in finals:
        for idx, at, text in f.get("failed", [])[:3]:
            r["log"](f"stream err : sim-{idx:05d} after {at:.1f} s: {text}")
    report(ns, r, kinds)
    if not ns.keep:
        shutil.rmtree(root, ignore_errors=True)
    return r


def report(ns: argparse.Namespace, r: dict, error_kinds: dict) -> None:
    say = r["log"]
    n, ranks = ns.nodes, ns.nodes * ns.slots
    w = r.get("watch", {})
    lags = w.get("step_lags") or w.get("all_lags") or []
    which = "step events" if w.get("step_lags") else "all events"
    r["watch_p99"] = percentile(lags, 0.99)
    if lags:
        say(f"watch lag  : {w['api']}, {len(lags)} {which}: p50 {percentile(lags, 0.5):.3f} s, "
            f"p99 {r['watch_p99']:.3f} s, max {max(lags):.3f} s" + (f" ({w['error']})" if w.get("error") else ""))
    else:
        say(f"watch lag  : no live events seen{(' (' + w['error'] + ')') if w.get('error') else ''}")
    runs = r.get("status_runs", [])
    r["status_s"] = max((dt for dt, _, _ in runs), default=NAN)
    if runs:
        say(f"ctl status : {', '.join(f'{dt:.2f} s (cpu {cpu:.2f} s)' + ('' if rc == 0 else f' exit {rc}') for dt, rc, cpu in runs)}"
            f"; max {r['status_s']:.2f} s")
    if "step_rate" in r:
        a, b, dt = r["window"]
        say(f"steps      : slowest rank stored step {r.get('min_step', 0)}/{ns.steps}; steps {a}->{b} in {dt:.1f} s "
            f"= {r['step_rate']:.2f} steps/s stored (offered {ns.step_rate:g}/s)")
        say(f"cpu        : coordinator {r['coord_cores']:.2f} cores over that window = {r['cpu_us']:.1f} us per "
            f"rank-step ({ranks} ranks); generators {r['gen_cores']:.2f} cores = {r['gen_us_node_step']:.0f} us "
            f"per node-step; this driver (watch, polls) {r['driver_cores']:.2f} cores")
        need = r["gen_us_node_step"] * n * ns.step_rate / 1e6
        say(f"generators : offering {ns.step_rate:g} steps/s at {n} nodes costs them ~{need:.2f} cores "
            f"({os.cpu_count()} on this machine); tick lateness with idle generator cores is the coordinator's "
            "backpressure (stream flow control), not the generators' CPU")
    else:
        say(f"steps      : slowest rank stored step {r.get('min_step', 0)}/{ns.steps}: no steady window to measure")
    if "etcd_writes_s" in r:
        say(f"etcd       : {r['etcd_writes_s']:.1f} writes/s (raft proposals committed), "
            f"{r['etcd_bytes_s'] / 1024:.1f} KiB/s received from clients, over the steady window")
    say(f"job        : {r.get('final_state', '?')} ({r.get('reason', '')[:160]})")
    say(f"nodes      : {r.get('not_ready', '?')} not READY after the steps ({r.get('lost', '?')} LOST), "
        f"{r.get('rejected', 0)} reports rejected; generator stream errors {r['stream_errors']}, "
        f"{r['stream_errors_registered']} of them after Registered ({r['reconnects']} reconnects)"
        + (f" {error_kinds}" if error_kinds else ""))
    say(f"memory     : coordinator peak RSS {r.get('rss_mib', NAN):.0f} MiB; largest Assign "
        f"{r['assign_bytes_max'] / 1024:.1f} KiB")
    say(f"generators : {r['gen_cpu_s']:.1f} CPU s in all; tick lateness p99 {fmt(r['late_p99'], 3)} s, "
        f"max {fmt(r['late_max'], 3)} s; sent {r['counts'].get('sent_reports', 0)} reports in "
        f"{r['counts'].get('sent_batches', 0)} messages, "
        f"{r['counts'].get('recv_ack', 0)} Acks")
    if not r.get("coord_alive", True):
        say("coordinator: exited during the run (see its log)")
    r["line"] = (f"scale nodes={n} ranks={ranks} assign_s={fmt(r.get('assign_s', NAN), 2)} "
                 f"steps_stored={r.get('min_step', 0)}/{ns.steps} "
                 f"step_rate={fmt(r.get('step_rate', NAN))}/{ns.step_rate:.2f} "
                 f"watch_p99_s={fmt(r['watch_p99'], 3)} status_s={fmt(r['status_s'], 1)} lost={r.get('lost', 'nan')} "
                 f"rss_mib={fmt(r.get('rss_mib', NAN), 0)} cpu_us_per_rank_step={fmt(r.get('cpu_us', NAN), 1)} "
                 f"mode={r['mode']}"
                 + (f" etcd_writes_s={fmt(r['etcd_writes_s'], 1)} etcd_kib_s={fmt(r['etcd_bytes_s'] / 1024, 1)}"
                    if "etcd_writes_s" in r else "")
                 + (f" failover_s={fmt(r.get('failover_s', NAN), 2)}" if r["mode"] == "etcd" else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=None, help="default 2048; 8192 with --fault")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--step-rate", type=float, default=None,
                    help="steps per second each rank offers (default 1; 0.1 with --fault, which this machine sustains "
                         "at 65,536 ranks)")
    ap.add_argument("--procs", type=int, default=0, help="generator processes (default: 1 per 1024 nodes, at most 4)")
    ap.add_argument("--streams-per-channel", type=int, default=32)
    ap.add_argument("--coordinator-python", default=sys.executable)
    ap.add_argument("--coordinator-pythonpath", default=None, help="PYTHONPATH for the coordinator (an older checkout)")
    ap.add_argument("--heartbeat-timeout", type=float, default=None, help="default: the coordinator's (10 s)")
    ap.add_argument("--relay-width", type=int, default=None,
                    help="the coordinator's --relay-width (default: its own, 64; 0: every Assign direct, for a comparison)")
    ap.add_argument("--ready-timeout", type=float, default=0, help="default: 60 s + 20 ms per node")
    ap.add_argument("--assign-timeout", type=float, default=120.0)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, state)")
    ap.add_argument("--store", default="sqlite", metavar="sqlite|etcd|etcd://...",
                    help="etcd: the SQLite run, then the same load on two coordinators over a local 3-member etcd "
                         "(or the etcd:// store given), the leader SIGKILLed half-way; both lines printed")
    ap.add_argument("--fault", action="store_true",
                    help="measure recovery from a SIGKILLed node at --small-nodes and at --nodes, side by side")
    ap.add_argument("--small-nodes", type=int, default=64, help="--fault: the smaller job's nodes")
    ap.add_argument("--spares", type=int, default=8, help="--fault: spare nodes registered beside the job's")
    ap.add_argument("--faults", type=int, default=3,
                    help="--fault: nodes killed one after another in each job (medians printed; at most --spares)")
    ap.add_argument("--fault-step", type=int, default=3, help="--fault: kill a node once this step is stored")
    ap.add_argument("--recovery-timeout", type=float, default=300.0,
                    help="--fault: seconds to wait for the next attempt's first step")
    ap.add_argument("--generators-nice", type=int, default=0, metavar="N",
                    help="--fault: run the simulated daemons at this nice value (19: the coordinator is served first, "
                         "nearer a cluster where they are other machines; the default shares the cores evenly)")
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="--fault: py-spy the coordinator from the loss to the next attempt's first step, into DIR")
    ap.add_argument("--profile-native", action="store_true",
                    help="--profile: with the C frames too (gRPC's core, protobuf, SQLite)")
    ap.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy", help="the py-spy to run with --profile")
    ap.add_argument("--profile-format", default="raw", choices=("raw", "chrometrace", "speedscope"),
                    help="--profile: py-spy's output format (chrometrace has each sample's time)")
    ns = ap.parse_args()
    if ns.fault:
        from scale_fault import fault_main

        ns.nodes, ns.step_rate = ns.nodes or 8192, ns.step_rate or 0.1
        fault_main(ns)
        return
    ns.nodes, ns.step_rate = ns.nodes or 2048, ns.step_rate or 1.0
    ns.procs = ns.procs or min(4, math.ceil(ns.nodes / 1024))
    ns.ready_timeout = ns.ready_timeout or 60 + 0.02 * ns.nodes
    if ns.store == "sqlite":
        r = run_once(ns, ns.coordinator_python, ns.coordinator_pythonpath)
        print(r["line"])
        return
    base = run_once(ns, ns.coordinator_python, ns.coordinator_pythonpath)
    replicated = run_once(ns, ns.coordinator_python, ns.coordinator_pythonpath, ns.store)
    print(base["line"])
    print(replicated["line"])
    ratio = replicated.get("cpu_us", NAN) / base.get("cpu_us", NAN) if base.get("cpu_us") else NAN
    print(f"etcd vs sqlite: assign {fmt(replicated.get('assign_s', NAN))} s vs {fmt(base.get('assign_s', NAN))} s, "
          f"coordinator CPU per rank-step x{fmt(ratio)}, failover (steps stored again) "
          f"{fmt(replicated.get('failover_s', NAN))} s")


if __name__ == "__main__":
    main()
