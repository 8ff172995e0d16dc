"""The generator side of ``bench/scale.py``: many fake worker daemons in one asyncio loop.

Each fake daemon speaks the real ``NodeService.Connect`` protocol (Register, Heartbeat from
its own task, rank reports) and plays the ranks of an ``Assign`` through rendezvous, groups,
running, ``--steps`` steps at ``--step-rate`` and an exit, without running anything. A restarted
attempt (an Assign of attempt 2 or later) reports its phases and its first step at once, in one batch,
as a daemon whose ranks start faster than it sends would (through its relay head, signed, when a relayed Assign
named one: ``carry``); each rank's first step is marked
``first_step`` as the daemon marks it, so the batch folds as the daemon's does (one ``running``
report for the node's ranks, then one first-step report a rank); a Cancel is answered at once by an exit report
of each of the attempt's ranks, as the real daemon reports the ranks it stopped. Per attempt, the last
time an Assign or a Cancel was read and a stop confirmation or a first step was handed to gRPC are kept
for ``bench/scale_fault.py``. Daemons
share a few channels (``--streams-per-channel`` streams on each, each channel its own TCP
connection). Their ticks are spread evenly over the step period by a per-daemon offset. The process's
survivors go to the permanent generation every ``FREEZE_EVERY_S``: a full collection of thousands of daemons'
state paused the loop up to 0.7 s, where each real daemon collects only its own; the collector's seconds per
generation are in ``final`` (``gc_s``).

Talks to its parent on stdout, one JSON object a line: ``progress`` (every 0.5 s) and, after
``stop`` on stdin (or its end), ``final``. Not meant to be run by hand:

    python bench/scale_sim.py --address HOST:PORT --first 0 --count 1024 --total 2048 ...
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import resource
import sys
import time
from collections import Counter
from typing import Callable

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from rankctl.contract.relaymac import DOWN, UP, relay_mac, relay_mac_ok
from rankctl.coordinator.app.gcpace import Freezer
from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.uplink.reportfold import fold
from rankctl.worker.uplink.reporting import exit_status, stamp_update, step_figures

FREEZE_EVERY_S = 1.0   # survivors into the permanent generation this often (``amain``)
PEERS_AFTER_S = 0.2    # ``Sim.hang``: the peers' evidence after the stopped rank's
MAX_MSG = 16 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MSG),
    ("grpc.max_receive_message_length", MAX_MSG),
    ("grpc.use_local_subchannel_pool", 1),  # one TCP connection per channel, not one for all
]


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class Sim:
    """One generator process: its daemons, their shared counters."""

    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.period = 1.0 / ns.step_rate
        self.stopping = False
        self.registered = 0
        self.assigned = 0
        self.assigned_ranks = 0
        self.assign_first = 0.0
        self.assign_last = 0.0
        self.played = 0            # daemons whose ranks all exited
        self.errors: Counter[str] = Counter()
        self.reconnects = 0
        self.counts: Counter[str] = Counter()  # messages received/sent by kind
        self.lateness: list[float] = []        # seconds a tick was sent after its time
        self.assign_bytes_max = 0
        self._metrics: dict[tuple[int, bool], str] = {}
        self._parsed: dict[str, dict] = {}
        self._figures: dict[str, pb.RankStatus] = {}
        self._stamped, self._stamp = 0.0, Timestamp()
        self.daemons: list[Daemon] = []
        self.by_name: dict[str, Daemon] = {}   # a relay head's group: its nodes are played by this process
        self.failed: list[tuple[int, float, str]] = []  # (daemon index, seconds since start, debug text)
        self.attempts: dict[int, Counter[str]] = {}  # attempt -> counts and last times (unix s) of its events
        self.t0 = time.monotonic()
        self.hung = 0   # attempts up to this one are hung (``hang``): their ranks step no more

    def hang(self, victim: int, world: int) -> None:
        """``bench/scale_hang.py``: every attempt now playing stops stepping, and each daemon sends, in one batch,
        what its real counterpart sends once its ranks' counters stood still (``worker.runs.hangwatch``): one report
        a rank with its evidence (waiting in the job's all-reduce that ``victim`` never entered), ``victim``
        reported stopped. The victim's daemon sends at once (it confirmed the stop); the others ``PEERS_AFTER_S``
        later, as theirs see their ranks' counters stand still for their stall time (0.5 s, the stop's 0.3 s
        confirmation already past)."""
        self.hung = max((a for d in self.daemons for a, _ in d.playing.values()), default=0)
        loop = asyncio.get_running_loop()
        for d in self.daemons:
            for job_id, (attempt, ranks) in list(d.playing.items()):
                delay = 0.0 if victim in ranks else PEERS_AFTER_S
                loop.call_later(delay, lambda d=d, j=job_id, a=attempt, r=ranks: loop.create_task(
                    d.send_evidence(j, a, r, victim, world)))

    def parsed(self, text: str) -> dict:
        """The dict of a metrics text this simulator made (cached: the generator's CPU is the limit)."""
        m = self._parsed.get(text)
        if m is None:
            m = self._parsed[text] = json.loads(text)
        return m

    def stamp(self) -> Timestamp:
        """Now as a report's ``update_time`` (``stamp_update``), made again once a millisecond passed."""
        now = time.time()
        if now - self._stamped >= 1e-3:
            self._stamped, self._stamp = now, Timestamp()
            self._stamp.FromNanoseconds(int(now * 1e9))
        return self._stamp

    def figures(self, text: str) -> pb.RankStatus:
        """A status holding only a metrics text and its typed figures, as ``step_figures`` sets them (cached, and
        merged into each report: the generator's CPU is the limit)."""
        st = self._figures.get(text)
        if st is None:
            st = self._figures[text] = pb.RankStatus(metrics_json=text)
            step_figures(st, self.parsed(text))
        return st

    def metrics(self, step: int, with_loss: bool, slot: int = 0) -> str:
        """A rank's step metrics; the step time differs by the rank's ``slot`` on its node, as real ranks' do, so
        that a daemon never folds a node's step reports into one (``worker.uplink.reportfold``) where a real one could not."""
        key = (step, with_loss, slot)
        text = self._metrics.get(key)
        if text is None:
            m = {"tokens_per_s": 1000.0, "step_time": round(self.period + slot * 1e-5, 6)}
            if with_loss:
                m = {"loss": round(2.0 - step * 0.01, 6), **m}
            text = self._metrics[key] = json.dumps(m, separators=(",", ":"))
        return text

    def note(self, attempt: int, what: str, at: float) -> None:
        """Count one ``what`` (assign, cancel, confirm, step1) of ``attempt`` and keep the last time it happened."""
        a = self.attempts.setdefault(attempt, Counter())
        a[what] += 1
        a[what + "_last"] = max(a[what + "_last"], at)

    def progress(self) -> dict:
        return {"ev": "progress", "registered": self.registered, "assigned": self.assigned,
                "assigned_ranks": self.assigned_ranks, "assign_first": self.assign_first,
                "attempts": {str(k): dict(v) for k, v in self.attempts.items()},
                "assign_last": self.assign_last, "played": self.played, "errors": sum(self.errors.values()),
                "errors_registered": sum(v for k, v in self.errors.items() if not k.startswith("before")),
                "reconnects": self.reconnects}


class Daemon:
    """One fake worker daemon on one Connect stream."""

    def __init__(self, sim: Sim, index: int, channels: list[grpc.aio.Channel]) -> None:
        self.sim, self.index, self.channels = sim, index, channels  # one per coordinator address
        self.target = 0
        self.name = f"sim-{index:05d}"
        self.port = 29500 + index % 1000
        self.ports = [self.port, self.port + 1000]   # a restart in place takes a port the old attempt does not use
        self.offset = (index / sim.ns.total) * sim.period  # spread ticks evenly over the period
        self.seq = 0
        self.session = f"{self.name}-{os.getpid()}-{time.time_ns()}"
        self.lock = asyncio.Lock()
        self.call = None
        self.connected = asyncio.Event()  # set from Registered until the stream breaks
        self.was_registered = False
        self.folds = False
        self.heartbeat: asyncio.Task | None = None
        self.interval = 2.0  # seconds between heartbeats: the coordinator's, from Registered or a retuning Ack
        self.last_batch = 0.0  # when the last ReportBatch went out
        self.tasks: dict[str, asyncio.Task] = {}  # job id -> its player
        self.relay_key, self.relay_seq = b"", 0   # this session's relay key (Registered), the last item taken
        self.via: Daemon | None = None            # the relay head its batches go through (in this process)
        self.up_seq = 0                           # the last batch it handed to its head
        self.carried: list[tuple[pb.NodeBatch, Callable[[], None] | None]] = []   # as a head: batches to send
        self.playing: dict[str, tuple[int, list[int]]] = {}  # job id -> (attempt, ranks), for a re-Register
        self.stepped: dict[str, int] = {}   # job id -> the last step its ranks reported

    async def write(self, msg: pb.NodeMessage, handed: Callable[[], None] | None = None) -> None:
        """Write on the current stream; across a reconnect, on the next one (the seq drops a replay).
        ``handed``: called as the message is handed to gRPC."""
        while True:
            await self.connected.wait()
            call = self.call
            try:
                async with self.lock:  # one write at a time on a stream; the only thing a heartbeat waits for
                    if handed is not None:
                        handed()
                    await call.write(msg)
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the stream broke: the reader sees it and reconnects
                if self.call is call:
                    self.connected.clear()
                await asyncio.sleep(0.05)

    async def run(self) -> None:
        """Connect, Register, serve the coordinator's messages; reconnect (backoff) when the stream breaks."""
        sim = self.sim
        hw = pb.Hardware(hostname=self.name, cpu_count=2, memory_bytes=8 << 30)
        backoff = 0.5
        while not sim.stopping:
            connect = self.channels[self.target].stream_stream(
                "/rankctl.v1.NodeService/Connect",
                request_serializer=pb.NodeMessage.SerializeToString,
                response_deserializer=pb.CoordinatorMessage.FromString)
            try:
                self.call = call = connect(wait_for_ready=len(self.channels) == 1)
                running = [pb.RunningJob(job_id=j, attempt=a, ranks=r) for j, (a, r) in self.playing.items()]
                await call.write(pb.NodeMessage(register=pb.Register(
                    name=self.name, address="127.0.0.1", slots=sim.ns.slots, hardware=hw,
                    free_ports=self.ports, session=self.session, running=running,
                    replaces=True, relays=True, peer_port=1)))   # heads hand items over in this process   # as the daemon: a newer Assign stops the older attempt's player first
                while True:
                    msg = await call.read()
                    if msg is grpc.aio.EOF:
                        if not sim.stopping:
                            sim.errors["closed by coordinator"] += 1
                        break
                    body = msg.WhichOneof("body")
                    sim.counts["recv_" + body] += 1
                    if body == "registered":
                        if not self.was_registered:
                            sim.registered += 1
                            self.was_registered = True
                        backoff = 0.5
                        self.connected.set()
                        if self.heartbeat is not None:
                            self.heartbeat.cancel()
                        self.interval = msg.registered.heartbeat_interval or 2.0
                        self.folds = msg.registered.folds   # an older coordinator (--coordinator-pythonpath): never
                        self.relay_key, self.relay_seq = msg.registered.relay_key, 0
                        self.via, self.up_seq = None, 0
                        self.heartbeat = asyncio.create_task(self.heartbeats())
                    elif body == "ack" and msg.ack.heartbeat_interval > 0:  # retuned, as the daemon is
                        self.interval = msg.ack.heartbeat_interval
                    elif body == "assign":
                        self.on_assign(msg.assign, time.time(), msg.ByteSize())
                    elif body == "cancel":
                        self.on_cancel(msg.cancel, time.time())
                    elif body == "relay":
                        self.on_relay(msg.relay)
                    elif body == "fetch_logs":
                        asyncio.create_task(self.write(pb.NodeMessage(log_chunk=pb.LogChunk(
                            request_id=msg.fetch_logs.request_id, lines=[], next_offset=0))))
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                if not sim.stopping:
                    where = "" if self.was_registered else "before Registered: "
                    sim.errors[f"{where}{exc.code().name}: {(exc.details() or '')[:120]}"] += 1
                    sim.failed.append((self.index, round(time.monotonic() - sim.t0, 2),
                                       str(exc.debug_error_string())[:300]))
            except Exception as exc:  # noqa: BLE001 - counted and shown, never a hang
                if not sim.stopping:
                    where = "" if self.was_registered else "before Registered: "
                    sim.errors[f"{where}{type(exc).__name__}: {str(exc)[:120]}"] += 1
            finally:
                self.connected.clear()
                if self.heartbeat is not None:
                    self.heartbeat.cancel()
                    self.heartbeat = None
            if sim.stopping:
                break
            sim.reconnects += 1
            self.target = (self.target + 1) % len(self.channels)  # several coordinators: try the next (a standby
            if len(self.channels) > 1:                            # refuses; the leader takes the stream)
                backoff = min(backoff, 0.5)
            await asyncio.sleep(backoff)
            backoff = min(5.0, backoff * 2)
        for task in self.tasks.values():
            task.cancel()

    async def heartbeats(self) -> None:
        beat = 0
        await asyncio.sleep(self.interval * ((self.index * 0.618) % 1.0))  # spread beats too
        while True:
            beat += 1
            ports = self.ports if beat % 5 == 0 else []
            # as the real daemon does (worker/daemon/daemon.py): a batch within the interval already showed the
            # node alive, so only every fifth beat (free ports) goes
            if ports or time.time() - self.last_batch >= self.interval:
                await self.write(pb.NodeMessage(heartbeat=pb.Heartbeat(ts=time.time(), free_ports=ports)))
                self.sim.counts["sent_heartbeat"] += 1
            await asyncio.sleep(self.interval)

    def on_assign(self, assign: pb.Assign, t_recv: float, nbytes: int, t_read: float | None = None) -> None:
        """``t_read``: when the message was read off the coordinator's stream (its relay head's read; else
        ``t_recv``)."""
        sim = self.sim
        if assign.rank_count:
            ranks = list(range(assign.first_rank, assign.first_rank + assign.rank_count))
        else:
            ranks = [r.rank for r in assign.ranks]
        sim.assigned += 1
        sim.assigned_ranks += len(ranks)
        sim.assign_first = min(sim.assign_first or t_recv, t_recv)
        sim.assign_last = max(sim.assign_last, t_recv)
        sim.assign_bytes_max = max(sim.assign_bytes_max, nbytes)
        sim.note(assign.attempt, "assign", t_recv)
        sim.note(assign.attempt, "read", t_recv if t_read is None else t_read)
        self.playing[assign.job_id] = (assign.attempt, ranks)  # an older attempt's player sees it and returns
        self.tasks[assign.job_id] = asyncio.create_task(self.play(assign.job_id, assign.attempt, ranks, t_recv))

    def on_relay(self, relay: pb.Relay) -> None:
        """A relay head: each item to its daemon, checked as ``worker.uplink.relay`` checks it. The daemons of a group are
        played by this process (the coordinator groups consecutive job nodes), so the hand-over is a call here where
        the real daemon's is a PeerService.Deliver: on a cluster that hop runs on the heads' machines, not on the
        coordinator's. A node not played here or an item that fails the check goes back in the RelayDone."""
        failed, t_read = [], time.time()
        for item in relay.items:
            d = self.sim.by_name.get(item.node)
            if d is None or not d.take_relayed(item, t_read, self):
                failed.append(item.node)
        self.sim.counts["relayed_items"] += len(relay.items) - len(failed)
        asyncio.create_task(self.write(pb.NodeMessage(relay_done=pb.RelayDone(bundle=relay.bundle, failed=failed))))

    def take_relayed(self, item: pb.Relayed, t_read: float, head: Daemon) -> bool:
        if item.seq <= self.relay_seq or not relay_mac_ok(self.relay_key, DOWN, item.node, item.seq, item.mac,
                                                          item.message, item.report_via.encode()):
            return False
        self.relay_seq = item.seq
        self.via = head if item.report_via else None   # its batches go up through the head, as the daemon's do
        msg = pb.CoordinatorMessage.FromString(item.message)
        if msg.WhichOneof("body") != "assign":
            return False
        self.on_assign(msg.assign, time.time(), len(item.message), t_read)
        return True

    def carry(self, nb: pb.NodeBatch, handed: Callable[[], None] | None) -> None:
        """As a relay head: a group daemon's batch, sent with the others handed over in the same loop turn."""
        if not self.carried:
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self.send_carried()))
        self.carried.append((nb, handed))

    async def send_carried(self) -> None:
        carried, self.carried = self.carried, []
        calls = [h for _, h in carried if h is not None]
        self.sim.counts["sent_relayed"] += 1
        await self.write(pb.NodeMessage(relayed=pb.RelayedBatches(batches=[nb for nb, _ in carried])),
                         (lambda: [h() for h in calls]) if calls else None)

    def on_cancel(self, cancel: pb.Cancel, t_recv: float) -> None:
        """Stop the attempt's player and confirm each of its ranks gone (an exit report), as the real daemon does.

        The player is not cancelled (a task cancelled in ``call.write`` cancels the whole stream): it returns at its
        next report, which it no longer sends."""
        attempt, ranks = self.playing.pop(cancel.job_id, (0, []))
        if not ranks or cancel.attempt not in (0, attempt):
            return
        self.sim.note(attempt, "cancel", t_recv)
        why = "stopped: " + cancel.reason[:80]
        reports = [self.stopped(cancel.job_id, attempt, r, why) for r in ranks]
        asyncio.create_task(self.send(reports, attempt=attempt, note="confirm"))

    def stopped(self, job_id: str, attempt: int, rank: int, why: str) -> pb.RankReport:
        """The exit report of a rank this daemon stopped (SIGTERM)."""
        self.seq += 1
        return pb.RankReport(job_id=job_id, attempt=attempt, seq=self.seq,
                             status=exit_status(rank, self.name, -15, why))

    def report(self, job_id: str, attempt: int, rank: int, phase: str, step: int, metrics: str = "",
               result: str = "", exited: bool = False, first_step: bool = False) -> pb.RankReport:
        self.seq += 1
        status = pb.RankStatus(rank=rank, node=self.name, phase=phase, step=step, exited=exited, exit_code=0,
                               first_step=first_step, update_time=self.sim.stamp())
        if metrics:  # the metrics and their typed step figures, as the real daemon sets them
            status.MergeFrom(self.sim.figures(metrics))
        return pb.RankReport(job_id=job_id, attempt=attempt, seq=self.seq, result_json=result, status=status)

    def restart_batch(self, job_id: str, attempt: int, ranks: list[int]) -> list[pb.RankReport]:
        """What ``fold`` makes of a restarted node's phase reports (``rendezvous``, ``groups``, ``running`` of each
        rank, in that order), built directly: one ``running`` report for the node's ranks with the newest one's
        sequence number. The same wire as the daemon's, without paying the generator's CPU for the fold
        (``tests/unit/worker/test_scale_sim.py`` holds the two equal)."""
        if not self.folds or len(ranks) < 2 or ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            return [self.report(job_id, attempt, r, p, 0) for p in ("rendezvous", "groups", "running") for r in ranks]
        self.seq += 3 * len(ranks)
        status = pb.RankStatus(rank=ranks[0], ranks=len(ranks), node=self.name, phase="running", exit_code=0)
        stamp_update(status, time.time())
        return [pb.RankReport(job_id=job_id, attempt=attempt, seq=self.seq, status=status)]

    async def send(self, reports: list[pb.RankReport], job_id: str = "", attempt: int = 0, note: str = "",
                   folded: bool = False) -> bool:
        """Send one batch; with ``job_id``: only while ``attempt`` is still the one this daemon plays (else False).
        ``note``: what of the attempt to note (``Sim.note``) as the batch is handed to gRPC; ``folded``: the batch
        is already what ``fold`` would make of it."""
        if job_id and self.playing.get(job_id, (0,))[0] != attempt:
            return False
        sim = self.sim
        handed = (lambda: sim.note(attempt, note, time.time())) if note else None
        reports = fold(reports) if self.folds and not folded else reports   # as the daemon does
        if self.via is not None and self.via.connected.is_set():   # signed, to its head: sent with its group's
            self.up_seq += 1
            data = pb.ReportBatch(reports=reports).SerializeToString()
            self.via.carry(pb.NodeBatch(node=self.name, seq=self.up_seq, batch=data,
                                        mac=relay_mac(self.relay_key, UP, self.name, self.up_seq, data)), handed)
        else:
            await self.write(pb.NodeMessage(batch=pb.ReportBatch(reports=reports)), handed)
        self.last_batch = time.time()
        sim.counts["sent_batches"] += 1
        sim.counts["sent_reports"] += len(reports)
        return True

    async def send_evidence(self, job_id: str, attempt: int, ranks: list[int], victim: int, world: int) -> None:
        step = self.stepped.get(job_id, 0)
        low = max(0, min(victim - 32, world - 64))
        members = list(range(low, min(world, low + 64)))   # the members shown: the victim's neighbours

        def evidence(rank: int) -> str:
            group = {"kind": "tp", "members": members, "size": world, "entered": step + (rank != victim),
                     "completed": step, "op": "all_reduce", "since": round(time.time(), 3), "in": rank != victim}
            return json.dumps({"still_s": 0.5, "wait_s": 0.0, "groups": [group]}, separators=(",", ":"))
        reports = []
        for r in ranks:
            self.seq += 1
            reports.append(pb.RankReport(job_id=job_id, attempt=attempt, seq=self.seq, status=pb.RankStatus(
                rank=r, node=self.name, phase="running", step=step, process="stopped" if r == victim else "",
                collectives=evidence(r), update_time=self.sim.stamp())))
        await self.send(reports, job_id, attempt, folded=True)

    async def play(self, job_id: str, attempt: int, ranks: list[int], t_recv: float) -> None:
        """Play the ranks through their phases, steps and exit; return once the attempt is no longer this daemon's."""
        sim, period, steps = self.sim, self.sim.period, self.sim.ns.steps
        t = t_recv + ((self.offset - t_recv) % period)  # this daemon's next tick on the shared grid
        first = ranks[0] if ranks else 0

        async def tick() -> None:
            delay = t - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                sim.lateness.append(-delay)
                return
            sim.lateness.append(max(0.0, time.time() - t))

        def step(k: int) -> list[pb.RankReport]:
            # a rank's first step of the attempt is marked, as the daemon marks it (``worker.runs.runs``): never folded
            # away, and nothing folds across it (the ``running`` phase report before it stays in the batch)
            return [self.report(job_id, attempt, r, "running", k, sim.metrics(k, r == first, r - first),
                                first_step=k == 1) for r in ranks]

        k0 = 1
        if attempt > 1:  # a restart: its phases and first step go out as soon as the Assign is read
            if not await self.send(self.restart_batch(job_id, attempt, ranks) + step(1), job_id, attempt,
                                   note="step1", folded=True):
                return
            k0 = 2
        for phase in ("rendezvous", "groups", "running") if k0 == 1 else ():
            await tick()
            if not await self.send([self.report(job_id, attempt, r, phase, 0) for r in ranks], job_id, attempt):
                return
            t += period
        for k in range(k0, steps + 1):
            await tick()
            while attempt <= sim.hung and self.playing.get(job_id, (0,))[0] == attempt:
                await asyncio.sleep(0.1)   # hung (``Sim.hang``): no more steps, until a Cancel or a newer Assign
            if not await self.send(step(k), job_id, attempt, folded=True):   # one report a rank, each its own
                return                                                      # step time: nothing folds
            self.stepped[job_id] = k
            t += period
        await tick()
        if not await self.send([self.report(job_id, attempt, r, "done", steps, result='{"ok":true}') for r in ranks],
                               job_id, attempt):
            return
        t += period
        await tick()
        if await self.send([self.report(job_id, attempt, r, "exited", steps, exited=True) for r in ranks],
                           job_id, attempt):
            self.playing.pop(job_id, None)
            sim.played += 1


class GcClock:
    """Seconds this process spent in the collector, per generation, and the longest pause."""

    def __init__(self) -> None:
        self.spent, self.longest, self._t = [0.0, 0.0, 0.0], 0.0, 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            dt = time.perf_counter() - self._t
            self.spent[info["generation"]] += dt
            self.longest = max(self.longest, dt)
            if dt > 0.05:
                print(f"gc pause {time.time():.3f} gen {info['generation']} {dt:.3f}", file=sys.stderr)


async def amain(ns: argparse.Namespace) -> None:
    sim = Sim(ns)
    gcc = GcClock()
    n_channels = max(1, math.ceil(ns.count / ns.streams_per_channel))
    addresses = ns.address.split(",")  # several: the coordinators of one replicated store
    channels = [[grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in addresses] for _ in range(n_channels)]
    tasks = []
    for i in range(ns.count):
        d = Daemon(sim, ns.first + i, channels[i // ns.streams_per_channel])
        sim.daemons.append(d)
        sim.by_name[d.name] = d
        tasks.append(asyncio.create_task(d.run()))
        if i % 64 == 63:
            await asyncio.sleep(0.01)  # a connection storm, but a paced one

    async def reporter() -> None:
        while True:
            emit(sim.progress())
            await asyncio.sleep(0.5)

    async def freezer() -> None:
        # this process's heap holds thousands of daemons' state: a full collection of it paused the loop up to
        # 0.7 s (1.7 s in all at 2,048 daemons in a process), inside a recovery too. A real daemon's heap is one
        # daemon's; so survivors leave the collector's sight as the coordinator's do (``coordinator.app.gcpace``)
        pace = Freezer(time.monotonic(), freeze_s=FREEZE_EVERY_S)
        while True:
            await asyncio.sleep(FREEZE_EVERY_S)
            pace.turn(time.monotonic())

    rep = asyncio.create_task(reporter())
    frozen = asyncio.create_task(freezer())
    loop = asyncio.get_running_loop()
    while True:  # until the parent says stop (or goes away)
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line or line.strip() == "stop":
            break
        if line.startswith("hang "):   # "hang VICTIM WORLD" (``bench/scale_hang.py``)
            victim, world = (int(x) for x in line.split()[1:3])
            sim.hang(victim, world)
    sim.stopping = True
    rep.cancel()
    frozen.cancel()
    for d in sim.daemons:
        if d.call is not None:
            d.call.cancel()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for group in channels:
        for ch in group:
            await ch.close()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    lat = sim.lateness
    emit({**sim.progress(), "ev": "final", "cpu_s": ru.ru_utime + ru.ru_stime, "maxrss_kib": ru.ru_maxrss,
          "error_kinds": dict(sim.errors.most_common(5)), "counts": dict(sim.counts),
          "late_p50": percentile(lat, 0.5), "late_p99": percentile(lat, 0.99), "late_max": max(lat, default=0.0),
          "ticks": len(lat), "assign_bytes_max": sim.assign_bytes_max, "failed": sim.failed[:10],
          "gc_s": [round(x, 3) for x in gcc.spent], "gc_longest_s": round(gcc.longest, 3)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--address", required=True)
    ap.add_argument("--first", type=int, default=0, help="index of this process's first daemon")
    ap.add_argument("--count", type=int, required=True, help="daemons in this process")
    ap.add_argument("--total", type=int, required=True, help="daemons in all processes (for tick offsets)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--step-rate", type=float, default=1.0)
    ap.add_argument("--streams-per-channel", type=int, default=32)
    ns = ap.parse_args()
    asyncio.run(amain(ns))


if __name__ == "__main__":
    main()
