"""Recovery at scale (``bench/scale.py --fault``): a node of a big job dies; how soon does the job run again?

For each size, ``--small-nodes`` (64) then ``--nodes`` (8,192), with ``--slots`` ranks a node, one real
``ctl coordinator`` serves the job's simulated daemons (``bench/scale_sim.py``) and ``--spares`` spare ones.
The job (``comm-check``, ``restart.max_restarts: --faults``) is placed on the first nodes in name order; once
its slowest rank stored step ``--fault-step``, the generator process that alone plays the job's last node is
SIGKILLed: its TCP connection closes and its heartbeats stop, as a killed daemon's do. From that moment t0
(unix time; everything runs on this one machine), each on its own clock:

(a) t0 -> the attempt failed: the coordinator's RESTARTING event;
(b) t0 -> every Assign of the next attempt read by the daemons (the dead node's part on a spare);
(c) t0 -> the next attempt's first step stored: the coordinator's ``step`` event (and the first poll of GetJob's
    summary that shows it, an upper bound).

With ``--faults N`` (default 3) the same job loses N nodes, one after another (the last N, each played alone by
its own process), each once the attempt before stored ``FAULT_GAP`` steps; every figure printed is the median
of the N recoveries, and the coordinator's share of (c) is printed for each one (on a shared 2-core machine one
recovery's figure swings by half between runs).

The simulated daemons answer at once: a Cancel with its ranks' exit reports, attempt 2's Assign with its
phases and first step in one batch. What the daemons add to the critical path is the last of them: from the
last Cancel read to the last stop confirmation handed to gRPC, and from the last Assign read to the last
first step handed to gRPC. The coordinator's share of (b) and (c) is the rest: noticing the loss, stopping
the attempt, waiting for and storing the confirmations, the requeue, the placement, the Assigns, storing
attempt 2's reports. Reading a Cancel or an Assign is counted as the coordinator's, though the generators'
loops take part in it. A job of more than ``--relay-width`` nodes gets its Assigns through relay heads
(``coordinator.scheduling.relay``): one Relay a group of 65 nodes, which the head (a generator playing it) hands to the
group's daemons in its own process, checked as the real daemon checks them, and their report batches go up
through it, signed, as many as came in one loop turn in one RelayedBatches; such an Assign counts as read off
the coordinator's stream when its head read the Relay, and the hand-over is the daemons' share (on a cluster it
runs on the heads' machines; the real daemon's PeerService hop is tested end to end). ``--relay-width 0``
sends every Assign direct, for a comparison. On a small machine the generators also take CPU from the coordinator: its CPU seconds
over t0 -> (c), and theirs, are printed beside the wall times. Steps are offered at 0.1/s by default, which
this 2-core machine stores at 65,536 ranks (at 1/s it falls behind and a recovery measures the backlog).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import grpc

from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc
from rankctl.proto import short_name
from scale import (CLIENT_OPTIONS, CLK_TCK, JOB, NAN, Generator, event_s, fmt, proc_cpu_ticks, proc_status_kib,
                   start_coordinator, which_code)

STEPS = 1_000_000          # the job runs until the bench cancels it
COORD_TARGET_S = 2.0       # the bound on the coordinator's share at 65,536 ranks
FAULT_GAP = 2              # steps the attempt after a recovery stores before the next node is killed
TERMINAL = ("FAILED", "CANCELLED", "SUCCEEDED")
ROWS = [  # (key, label): every time from the node's loss, t0
    ("a", "(a) attempt failed (RESTARTING)"),
    ("cancel_handed", "    last Cancel handed to gRPC"),
    ("cancel", "    last Cancel read by a daemon"),
    ("confirm", "    last stop confirmation sent"),
    ("queued", "    next attempt queued (PENDING)"),
    ("placed", "    next attempt placed (Assigns queued)"),
    ("assign_handed", "    last Assign handed to gRPC (a relay: its Relay)"),
    ("read", "    every one read off the coordinator's streams"),
    ("b", "(b) every Assign of the next attempt read"),
    ("step1", "    last first step sent"),
    ("c", "(c) first step of the next attempt stored"),
    ("c_poll", "    GetJob shows it (poll, 0.1 s)"),
    ("sims", "daemons' share of (c)"),
    ("coord_b", "coordinator's share of (b)"),
    ("coord_c", "coordinator's share of (c)"),
    ("coord_own", "  of which its own work"),
    ("coord_cpu", "coordinator CPU s, t0 -> the poll seeing (c)"),
    ("gens_cpu", "generators' CPU s, same window"),
]


def fault_job(nodes: int, slots: int, faults: int) -> str:
    return JOB.format(nodes=nodes, slots=slots) + f"restart: {{max_restarts: {faults}}}\n"


def start_generators(ns: argparse.Namespace, nodes: int, address: str, root: Path
                     ) -> tuple[list[Generator], list[Generator]]:
    """The job's nodes but its last ``--faults``, split over the generator processes; each of those alone (the
    victims, in the order they die: the last node first); the spares."""
    kept, total = nodes - ns.faults, nodes + ns.spares
    procs = ns.procs or min(4, math.ceil(nodes / 1024))
    per = max(1, math.ceil(kept / procs))
    ranges = [(first, min(per, kept - first)) for first in range(0, kept, per)] \
        + [(nodes - 1 - i, 1) for i in range(ns.faults)] + [(nodes, ns.spares)]
    common = ["--address", address, "--total", str(total), "--slots", str(ns.slots), "--steps", str(STEPS),
              "--step-rate", str(ns.step_rate), "--streams-per-channel", str(ns.streams_per_channel)]
    gens = [Generator(common + ["--first", str(first), "--count", str(count)], root / f"gen{i}.log",
                      ns.generators_nice)
            for i, (first, count) in enumerate(ranges) if count > 0]
    first_of = {g.p.args[g.p.args.index("--first") + 1]: g for g in gens}
    return gens, [first_of[str(nodes - 1 - i)] for i in range(ns.faults)]


def sim_attempt(gens: list[Generator], attempt: int, what: str) -> tuple[int, float]:
    """(how many daemons did ``what`` in ``attempt``, the last time one did) over every generator's last line."""
    count, last = 0, NAN
    for g in gens:
        a = (g.final or g.progress).get("attempts", {}).get(str(attempt), {})
        if a.get(what):
            count += a[what]
            last = a[what + "_last"] if math.isnan(last) else max(last, a[what + "_last"])
    return count, last


async def wait_until(check, timeout: float, every: float = 0.2) -> bool:  # noqa: ANN001 - an async predicate
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if await check():
            return True
        await asyncio.sleep(every)
    return False


async def summary(client: rankctl_pb2_grpc.ClientServiceStub, job_id: str) -> tuple[int, str, int]:
    """(attempt, state, slowest rank's stored step) of the job."""
    job = await client.GetJob(pb.GetJobRequest(job_id=job_id, summary_only=True), timeout=60)
    return job.attempt, short_name(pb.JobState, job.state), job.summary.min_step


async def milestones(client: rankctl_pb2_grpc.ClientServiceStub, job_id: str, t0: float, r: dict) -> None:
    """The coordinator's own times after t0, read from the job's stored events once the recovery is over (a watch
    during it would load the coordinator): RESTARTING, attempt 2 PENDING, STARTING, then its first step event."""
    wanted = [("a", "transition", "RESTARTING"), ("queued", "transition", "PENDING"),
              ("placed", "transition", "STARTING"), ("c", "step", "")]

    async def read() -> None:
        async for batch in client.WatchJobBatches(pb.WatchJobRequest(job_id=job_id)):
            for ev in batch.events:
                key, kind, state = wanted[0]
                at = event_s(ev)
                if at >= t0 and ev.kind == kind and state in ("", short_name(pb.JobState, ev.state)):
                    r[key] = at - t0
                    wanted.pop(0)
                    if not wanted:
                        return
    try:
        await asyncio.wait_for(read(), 120 if "c_poll" in r else 5)  # no recovery: the step event never comes
    except (asyncio.TimeoutError, grpc.aio.AioRpcError) as exc:
        r["log"](f"events     : {[w[0] for w in wanted]} not found in the job's events ({type(exc).__name__})")


async def ready_and_running(ns: argparse.Namespace, client, gens: list[Generator], nodes: int,  # noqa: ANN001
                            r: dict) -> str | None:
    """Every node READY, the job submitted, assigned and at step ``--fault-step``; its id (None: it never got there)."""
    total, say = nodes + ns.spares, r["log"]

    async def all_ready() -> bool:
        listed = (await client.ListNodes(pb.ListNodesRequest(), timeout=60)).nodes
        return sum(1 for x in listed if x.state == pb.NODE_STATE_READY) >= total
    if not await wait_until(all_ready, ns.ready_timeout or 60 + 0.02 * total, 0.5):
        say(f"registered : not every one of {total} nodes READY in time")
        return None
    job_id = (await client.SubmitJob(pb.SubmitJobRequest(spec_yaml=fault_job(nodes, ns.slots, ns.faults),
                                                         source="scale-fault.yaml"), timeout=600)).job.id
    r["job_id"] = job_id

    async def assigned() -> bool:
        return sim_attempt(gens, 1, "assign")[0] >= nodes
    if not (await wait_until(assigned, ns.assign_timeout) and await steady(ns, client, job_id, r)):
        say("steps      : attempt 1 never reached its steady steps")
        return None
    _, state, step = await summary(client, job_id)
    say(f"running    : {total} nodes READY ({ns.spares} spare), job {job_id} {state} at stored step {step}; "
        f"steps {ns.fault_step - 2}->{ns.fault_step} stored at {fmt(r['steady_rate'])}/s (offered {ns.step_rate:g}/s)")
    return job_id if state == "RUNNING" else None


async def steady(ns: argparse.Namespace, client, job_id: str, r: dict) -> bool:  # noqa: ANN001
    """Wait for stored step ``--fault-step``; the stored step rate over its last two steps goes in ``r``."""
    seen: dict[int, float] = {}

    async def stepping() -> bool:
        _, state, step = await summary(client, job_id)
        seen.setdefault(step, time.monotonic())
        return step >= ns.fault_step or state in TERMINAL
    if not await wait_until(stepping, 60 + 10 * (ns.fault_step + 3) / ns.step_rate):
        return False
    first = min((k for k in seen if k >= ns.fault_step - 2), default=None)
    top = max(seen)
    r["steady_rate"] = (top - first) / (seen[top] - seen[first]) if first is not None and top > first else NAN
    return True


async def recover(ns: argparse.Namespace, client, job_id: str, coord: subprocess.Popen, nodes: int,  # noqa: ANN001
                  alive: list[Generator], victim: Generator, k: int, r: dict) -> float:
    """SIGKILL the victim of fault ``k`` (attempt k fails; ``alive``: the other generators); wait until attempt k + 1 stored its first step and every
    daemon of it sent one. Returns t0. With ``--profile``, py-spy samples the coordinator from just before the kill
    until then (the first fault only)."""
    spy = start_profile(ns, coord.pid, r["nodes"]) if k == 1 else None
    cpu0, gens0 = proc_cpu_ticks(coord.pid), sum(proc_cpu_ticks(g.p.pid) for g in alive)
    t0 = time.time()
    victim.p.send_signal(signal.SIGKILL)

    async def stepped() -> bool:
        attempt, state, step = await summary(client, job_id)
        if attempt > k and state in ("STARTING", "RUNNING") and step >= 1 and "c_poll" not in r:
            r["c_poll"] = time.time() - t0
            r["coord_cpu"] = (proc_cpu_ticks(coord.pid) - cpu0) / CLK_TCK
            r["gens_cpu"] = (sum(proc_cpu_ticks(g.p.pid) for g in alive) - gens0) / CLK_TCK
        r["final_attempt"], r["final_state"], r["final_step"] = attempt, state, step
        return "c_poll" in r or state in TERMINAL
    await wait_until(stepped, ns.recovery_timeout, 0.1)
    stop_profile(spy, r)

    async def all_sent() -> bool:  # the generators' next progress lines carry their last times
        return sim_attempt(alive, k + 1, "step1")[0] >= nodes
    await wait_until(all_sent, 5.0, 0.1)
    await asyncio.sleep(0.6)
    return t0


def start_profile(ns: argparse.Namespace, pid: int, nodes: int) -> subprocess.Popen | None:
    """py-spy recording the coordinator (100 Hz, ``--profile-format``) into ``--profile``; None without it."""
    if not ns.profile:
        return None
    out = Path(ns.profile) / f"coordinator-{nodes}-nodes.{'txt' if ns.profile_format == 'raw' else 'json'}"
    out.parent.mkdir(parents=True, exist_ok=True)
    spy = subprocess.Popen([ns.py_spy, "record", "--pid", str(pid), "--format", ns.profile_format, "--rate", "100",
                            "--output", str(out)] + (["--native"] if ns.profile_native else []), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # attached before the kill
    return spy


def stop_profile(spy: subprocess.Popen | None, r: dict) -> None:
    if spy is None:
        return
    spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    try:
        _, err = spy.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        spy.kill()
        _, err = spy.communicate()
    r["log"](f"profile    : py-spy exited {spy.returncode}: {err.strip().splitlines()[-1] if err.strip() else ''}")


def handed(root: Path, t0: float, r: dict) -> None:
    """When the coordinator handed its last Cancel and its last Assign to gRPC (its /metrics,
    ``rankctl_coordinator_fanout_end_time_seconds``), from t0."""
    import urllib.request

    try:
        address = (root / "coord" / "http_address").read_text().strip()
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    except OSError as exc:
        r["log"](f"fan-outs   : /metrics not read ({exc})")
        return
    for line in text.splitlines():
        if line.startswith("rankctl_coordinator_fanout_end_time_seconds{"):
            kind = line.split('message="', 1)[1].split('"', 1)[0]
            at = float(line.rsplit(" ", 1)[1]) - t0
            r[f"{kind}_handed"] = at if at >= 0 else NAN   # an earlier fault's fan-out: none in this one


def shares(r: dict, gens: list[Generator], nodes: int, t0: float, k: int = 1) -> None:
    """The daemons' times on the critical path, and what is left of (b) and (c): the coordinator's. Of that, its
    own work: until its last Cancel was handed to gRPC, from the last stop confirmation sent until its last Assign
    was handed to gRPC, and from the last first step sent until (c); the rest is the daemons reading (on this
    machine, generator processes that share its cores). A restart in place (no Cancel, no confirmation) counts
    from t0 to the last Assign handed to gRPC instead of the first two. An Assign that came through a relay head
    (``coordinator.scheduling.relay``) counts as read off the coordinator's stream when its head read the Relay: from there
    to the node's first step sent is the daemons' (the head's hand-over, the node's start)."""
    for key, attempt, what, want in (("cancel", k, "cancel", nodes - 1), ("confirm", k, "confirm", nodes - 1),
                                     ("b", k + 1, "assign", nodes), ("read", k + 1, "read", nodes),
                                     ("step1", k + 1, "step1", nodes)):
        count, last = sim_attempt(gens, attempt, what)
        r[key] = last - t0 if count >= want else NAN
        r[key + "_count"] = count
    r["in_place"] = r["cancel_count"] == 0 and r["confirm_count"] == 0   # no stop confirmed first
    if r["in_place"]:
        stop, own_stop, placing_from = 0.0, 0.0, 0.0
    else:
        stop, own_stop, placing_from = r["confirm"] - r["cancel"], r.get("cancel_handed", NAN), r["confirm"]
    r["sims"] = stop + (r["step1"] - r["read"])   # a relay head's hand-over to its group is the daemons'
    r["coord_b"] = r["read"] - stop
    r["coord_c"] = r.get("c", NAN) - r["sims"]
    r["coord_own"] = own_stop + (r.get("assign_handed", NAN) - placing_from) + (r.get("c", NAN) - r["step1"])


async def drive_fault(ns: argparse.Namespace, address: str, coord: subprocess.Popen, nodes: int,
                      gens: list[Generator], victims: list[Generator], r: dict, root: Path) -> None:
    """The job running, then its faults one by one: each one's figures in ``r["each"]``, their medians in ``r``."""
    channel = grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)
    client = rankctl_pb2_grpc.ClientServiceStub(channel)
    try:
        job_id = await ready_and_running(ns, client, gens, nodes, r)
        if job_id is None:
            return
        alive, r["each"] = list(gens), []
        for k, victim in enumerate(victims, 1):
            one = {"nodes": nodes, "log": r["log"]}
            alive.remove(victim)
            t0 = await recover(ns, client, job_id, coord, nodes, alive, victim, k, one)
            await milestones(client, job_id, t0, one)
            handed(root, t0, one)
            shares(one, alive, nodes, t0, k)
            r["each"].append(one)
            r["log"](f"fault {k}    : node {nodes - k} ({len(alive)} generator processes left): coordinator's share "
                     f"of (c) {fmt(one.get('coord_c', NAN), 3)} s, (c) {fmt(one.get('c', NAN), 3)} s")
            if one.get("final_attempt") != k + 1 or one.get("final_state") in TERMINAL:
                break   # no recovery: the next fault would measure nothing
            if k < len(victims) and not await next_steady(ns, client, job_id, k + 1):
                r["log"](f"steps      : attempt {k + 1} stored no {FAULT_GAP} steps in time; no more faults")
                break
        r.update(medians(r["each"]))
        listed = (await client.ListNodes(pb.ListNodesRequest(), timeout=60)).nodes
        r["lost"] = sorted(x.name for x in listed if x.state == pb.NODE_STATE_LOST)
        await client.CancelJob(pb.CancelJobRequest(job_id=job_id, reason="bench done"), timeout=60)
    finally:
        await channel.close()


async def next_steady(ns: argparse.Namespace, client, job_id: str, attempt: int) -> bool:  # noqa: ANN001
    """Attempt ``attempt`` RUNNING with ``FAULT_GAP`` steps stored: the next fault hits a job in its stride."""
    async def stepped() -> bool:
        now, state, step = await summary(client, job_id)
        return now == attempt and state == "RUNNING" and step >= FAULT_GAP
    return await wait_until(stepped, 60 + 10 * FAULT_GAP / ns.step_rate, 0.5)


def medians(each: list[dict]) -> dict:
    """Per figure, the median over the faults that have it; the last fault's attempt, state and step."""
    out: dict = {k: each[-1][k] for k in ("final_attempt", "final_state", "final_step", "in_place") if k in each[-1]}
    for key, _ in ROWS:
        values = [v for one in each if not math.isnan(v := one.get(key, NAN))]
        if values:
            out[key] = statistics.median(values)
    return out


def lost_nodes(r: dict) -> str:
    lost = r.get("lost")
    if lost is None:
        return "? nodes"
    return f"{len(lost)} node(s)" + (f" ({', '.join(lost[:4])}{' ...' if len(lost) > 4 else ''})" if lost else "")


def fault_once(ns: argparse.Namespace, nodes: int) -> dict:
    """One coordinator, one job of ``nodes`` nodes, one node killed; the figures (also printed as it goes)."""
    root = Path(tempfile.mkdtemp(prefix="rankctl-bench-fault-"))

    def say(text: str) -> None:
        print("  " + text, flush=True)

    r: dict = {"nodes": nodes, "ranks": nodes * ns.slots, "log": say}
    print(f"fault bench: {nodes} nodes x {ns.slots} slots = {nodes * ns.slots} ranks, {ns.spares} spare node(s), "
          f"steps offered at {ns.step_rate:g}/s, node sim-{nodes - 1:05d} SIGKILLed at stored step {ns.fault_step}"
          + (f", then {ns.faults - 1} more node(s) one by one" if ns.faults > 1 else "")
          + (f", simulated daemons at nice {ns.generators_nice}" if ns.generators_nice else ""),
          flush=True)
    coord, address, env = start_coordinator(ns, ns.coordinator_python, ns.coordinator_pythonpath, root)
    say(f"code       : {which_code(ns.coordinator_python, env)}")
    gens: list[Generator] = []
    try:
        gens, victims = start_generators(ns, nodes, address, root)
        asyncio.run(drive_fault(ns, address, coord, nodes, gens, victims, r, root))
        r["rss_mib"] = proc_status_kib(coord.pid, "VmHWM") / 1024
    finally:
        for g in gens:
            g.stop()
        coord.send_signal(signal.SIGTERM)
        try:
            coord.wait(timeout=60)
        except subprocess.TimeoutExpired:
            coord.kill()
            coord.wait()
    say(f"after      : job attempt {r.get('final_attempt', '?')} {r.get('final_state', '?')} at stored step "
        f"{r.get('final_step', '?')}; {lost_nodes(r)} LOST; coordinator peak RSS "
        f"{r.get('rss_mib', NAN):.0f} MiB")
    if not ns.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        say(f"kept       : {root}")
    return r


def table(results: list[dict]) -> list[str]:
    """The side-by-side table: one column per size, then the ratio of the last to the first."""
    head = ["seconds from the node's loss"] + [f"{r['nodes']} nodes ({r['ranks']} ranks)" for r in results]
    if len(results) > 1:
        head.append("ratio")
    rows = [head]
    for key, label in ROWS:
        row = [label] + [fmt(r.get(key, NAN), 3) for r in results]
        if len(results) > 1:
            a, b = results[0].get(key, NAN), results[-1].get(key, NAN)
            row.append(fmt(b / a, 1) + "x" if a and a > 0 and not math.isnan(a + b) else "-")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in rows]


def fault_main(ns: argparse.Namespace) -> None:
    sizes = list(dict.fromkeys([ns.small_nodes, ns.nodes]))
    if ns.faults < 1 or ns.spares < ns.faults or min(sizes) <= ns.faults:
        raise SystemExit(f"--faults={ns.faults}: must be at least 1, at most --spares ({ns.spares}) and fewer than "
                         f"the smaller job's nodes ({min(sizes)})")
    results = [fault_once(ns, n) for n in sizes]
    print()
    print(f"median of {ns.faults} recoveries each" if ns.faults > 1 else "one recovery each")
    for line in table(results):
        print(line)
    for r in results:
        each = ", ".join(fmt(one.get("coord_c", NAN), 3) for one in r.get("each", []))
        print(f"coordinator's share of (c) at {r['ranks']} ranks, each fault: {each or '-'}")
    big = results[-1]
    verdict = "met" if big.get("coord_c", NAN) < COORD_TARGET_S else "NOT met"
    print(f"target: the coordinator's share of (c) under {COORD_TARGET_S:g} s at {big['ranks']} ranks: {verdict} "
          f"(median {fmt(big.get('coord_c', NAN))} s; its own work {fmt(big.get('coord_own', NAN))} s)")
    print("restart: " + ", ".join(f"{r['nodes']} nodes " + ("in place (no Cancel, no stop confirmed)" if
                                 r.get("in_place") else "stop confirmed, then requeued") for r in results))
    for r in results:
        print(f"fault nodes={r['nodes']} ranks={r['ranks']} "
              + " ".join(f"{k}_s={fmt(r.get(k, NAN), 3)}" for k in ("a", "b", "c", "sims", "coord_b", "coord_c", "coord_own"))
              + f" attempt={r.get('final_attempt', 0)} step={r.get('final_step', 0)} "
              f"lost={len(r.get('lost', [])) if 'lost' in r else 'nan'}")
