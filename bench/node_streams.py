"""The floor of a recovery's node I/O in one coordinator process: one stream per node, against a relay tree.

What ``bench/scale.py --fault`` cannot separate: how much of the coordinator's CPU in a restart at 65,536 ranks
is gRPC's per-stream work, which no tuning of rankctl's own code removes. One ``grpc.aio`` server process (the
coordinator's runtime, nothing of rankctl's core) holds the streams; for each node it sends one real Assign of
attempt 2 (taken from the core placing a comm-check job) and reads one real restart batch (the daemon's folded
``rendezvous``, ``groups``, ``running`` and first-step reports), parsing it as the coordinator does:

* ``direct``: ``--nodes`` streams, one a node, as rankctl's daemons connect today;
* ``relayed``: ``--nodes / --width`` streams, one a head daemon, each carrying its ``--width`` nodes' Assigns in one
  message out and their reports in one batch in (what a relay tree, as Slurm's ``TreeWidth``, would hand the
  coordinator; the heads' forwarding is theirs, not measured here).

The simulated daemons run in ``--clients`` other processes (32 streams a channel, as ``bench/scale.py``). Prints the
server's CPU seconds and wall time from the moment every stream is open to the last batch parsed, for each mode,
and their ratio.

    python bench/node_streams.py [--nodes 8192] [--width 64] [--clients 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import structlog

from rankctl.proto import rankctl_pb2 as pb

HERE = Path(__file__).resolve().parent
METHOD, SERVICE = "Connect", "bench.NodeStreams"
STREAMS_PER_CHANNEL = 32
OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def real_messages() -> tuple[pb.CoordinatorMessage, pb.NodeMessage]:
    """An Assign of attempt 2 as the core sends it, and the restart batch a daemon answers with (folded)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    from test_core import make_world  # the in-process core the pure tests drive

    with tempfile.TemporaryDirectory(prefix="rankctl-bench-streams-") as root:
        return _place_and_answer(make_world(Path(root)))


def _place_and_answer(world) -> tuple[pb.CoordinatorMessage, pb.NodeMessage]:  # noqa: ANN001 - test_core.World
    from rankctl.worker.uplink.reportfold import fold
    from rankctl.worker.uplink.reporting import stamp_update, step_figures

    for i in range(64):
        world.connect(f"n{i:05d}", slots=8, replaces=True)
    job = world.core.submit("name: big\nkind: comm-check\nresources: {nodes: 64, slots_per_node: 8}\n"
                            "parallel: {tp: 8}\nrestart: {max_restarts: 1}\n")
    node = job.nodes[5]
    assign = next(m for m in world.nodes[node].sent if m is not None and m.WhichOneof("body") == "assign")
    assign.assign.attempt = 2
    ranks = range(assign.assign.first_rank, assign.assign.first_rank + assign.assign.rank_count)
    reports, now = [], time.time()
    for phase in ("rendezvous", "groups", "running"):
        for r in ranks:
            st = pb.RankStatus(rank=r, node=node, phase=phase)
            stamp_update(st, now)
            reports.append(pb.RankReport(job_id=job.id, attempt=2, status=st, seq=len(reports) + 1))
    for r in ranks:
        figures = {"tokens_per_s": 1000.0, "step_time": 10.0, **({"loss": 2.0} if r == ranks[0] else {})}
        st = pb.RankStatus(rank=r, node=node, phase="running", step=1, first_step=True,
                           metrics_json=str(figures).replace("'", '"'))
        stamp_update(st, now)
        step_figures(st, figures)
        reports.append(pb.RankReport(job_id=job.id, attempt=2, status=st, seq=len(reports) + 1))
    return assign, pb.NodeMessage(batch=pb.ReportBatch(reports=fold(reports)))


def bundle(messages: list[bytes]) -> bytes:
    """Length-delimited concatenation: what one head would get for its children."""
    out = bytearray()
    for m in messages:
        out += len(m).to_bytes(4, "little") + m
    return bytes(out)


async def serve(ns: argparse.Namespace, streams: int, width: int, assign: pb.CoordinatorMessage,
                batch: pb.NodeMessage) -> tuple[float, float, int]:
    """One round: the server's CPU and wall seconds from all streams open to the last batch parsed."""
    opened, answered = [0], [0]
    all_open, all_answered, go, finish = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()
    reply = (batch if width == 1 else pb.NodeMessage(batch=pb.ReportBatch(
        reports=list(batch.batch.reports) * width))).SerializeToString()

    async def connect(requests, context):  # noqa: ANN001, ANN202
        requests = requests.__aiter__()
        await requests.__anext__()  # the hello
        opened[0] += 1
        if opened[0] == streams:
            all_open.set()
        await go.wait()
        # what the core does per node: serialize its Assign (one per child for a head)
        yield (assign.SerializeToString() if width == 1
               else bundle([assign.SerializeToString() for _ in range(width)]))
        async for data in requests:
            pb.NodeMessage.FromString(data)
            answered[0] += 1
            if answered[0] == streams:
                all_answered.set()
            break
        await finish.wait()  # streams stay open, as node streams do; they end after the measured window

    server = grpc.aio.server(options=OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {METHOD: grpc.stream_stream_rpc_method_handler(connect)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    with tempfile.NamedTemporaryFile(prefix="rankctl-bench-streams-", suffix=".bin") as f:
        f.write(reply)
        f.flush()
        per = -(-streams // ns.clients)
        clients = [subprocess.Popen([sys.executable, __file__, "--client", str(port), str(min(per, streams - first)),
                                     f.name]) for first in range(0, streams, per)]
        try:
            await asyncio.wait_for(all_open.wait(), 300)
            await asyncio.sleep(1.0)  # the clients' connects settle
            cpu, wall = time.process_time(), time.perf_counter()
            go.set()
            try:
                await asyncio.wait_for(all_answered.wait(), 300)
            except asyncio.TimeoutError:
                pass
            return time.process_time() - cpu, time.perf_counter() - wall, answered[0]
        finally:
            finish.set()
            await server.stop(1.0)
            for c in clients:
                c.kill()
                c.wait()


async def client(port: int, streams: int, reply_path: str) -> None:
    """``streams`` simulated daemons (or heads): hello, read the Assign(s), answer with the batch."""
    reply = Path(reply_path).read_bytes()
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                          options=OPTIONS + [("grpc.use_local_subchannel_pool", 1)])
                for _ in range(-(-streams // STREAMS_PER_CHANNEL))]

    async def one(i: int) -> None:
        for _ in range(50):  # a refused connect under load: again; once the hello is through, no retry
            call = channels[i // STREAMS_PER_CHANNEL].stream_stream(f"/{SERVICE}/{METHOD}")(wait_for_ready=True)
            try:
                await call.write(b"")
                break
            except Exception:  # noqa: BLE001
                await asyncio.sleep(0.2)
        await call.read()
        await call.write(reply)
        await call.done_writing()

    await asyncio.gather(*(one(i) for i in range(streams)), return_exceptions=True)
    await asyncio.sleep(3600)  # killed by the server's side


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        asyncio.run(client(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=8192)
    ap.add_argument("--width", type=int, default=64, help="nodes a head relays for (relayed mode)")
    ap.add_argument("--clients", type=int, default=2, help="processes playing the daemons")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each mode, interleaved; medians printed")
    ns = ap.parse_args()
    assign, batch = real_messages()
    print(f"node streams: {ns.nodes} nodes; an Assign {assign.ByteSize()} B, a restart batch {batch.ByteSize()} B "
          f"({len(batch.batch.reports)} folded reports); relay width {ns.width}", flush=True)
    modes = {"direct": (ns.nodes, 1), "relayed": (-(-ns.nodes // ns.width), ns.width)}
    got: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for rnd in range(ns.rounds):
        for mode, (streams, width) in modes.items():
            cpu, wall, done = asyncio.run(serve(ns, streams, width, assign, batch))
            print(f"  round {rnd + 1} {mode:8s}: {streams:6d} streams, server CPU {cpu:.3f} s, wall {wall:.3f} s"
                  + ("" if done == streams else f"  ({done} of {streams} answered in 300 s)"), flush=True)
            got[mode].append((cpu, wall))
    med = {m: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for m, v in got.items()}
    for mode, (cpu, wall) in med.items():
        print(f"{mode:8s}: {modes[mode][0]:6d} streams   server CPU {cpu:7.3f} s   wall {wall:7.3f} s  (median)")
    ratio = med["direct"][0] / max(med["relayed"][0], 1e-6)
    print(f"one stream a node costs the coordinator {ratio:.1f}x the CPU of a relay tree of width {ns.width} "
          f"({med['direct'][0]:.3f} s vs {med['relayed'][0]:.3f} s) for one Assign out and one batch in a node")


if __name__ == "__main__":
    main()
