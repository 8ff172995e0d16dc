"""Pre-flight: before an attempt's first step, a few seconds over the job's own groups and links.

``restart.preflight`` (on by default for multi-node jobs; ``contract.spec.RestartSpec.preflight_on``). Right
after the runtime built a rank's groups (``runtime.rank``), every rank:

1. times a few all-reduces (``REPEATS`` of ``PAYLOAD_FLOATS`` floats after one warm-up) on each distinct group
   it belongs to; one all-reduce (MAX) over the world gives the slowest rank's median per group kind: the
   figures ``ctl status`` shows;
2. the first rank of each node (its *leader*) exchanges ``PINGS`` timestamped messages of ``PROBE_FLOATS``
   floats (a latency and a bandwidth both show) with the leaders of the next ``PEERS`` nodes (world
   point-to-point, no new group): the receiver subtracts the sender's clock from its own, so each
   direction's one-way time is known (the minimum over the pings: a late receiver only adds); a node's
   *egress* is the fastest of its messages to any peer. A node that cannot reach a peer fails the attempt
   naming both;
3. the leaders of a job on GPUs add their node's GPU health (``contract.gpuhealth``: NVML; a job on CPUs
   says nothing of GPUs, an NVML error on a GPU job stays in the note);
4. one more all-reduce (SUM) shares every node's egress and GPU verdict with every rank, so each rank
   judges alike (``judge``): a node whose egress exceeds ``SLOW_ABS_S`` and ``SLOW_FACTOR`` times the median
   of the other nodes' is slow (a slow or failing NIC, a congested or mis-negotiated link, a ``tc netem``
   delay); a node whose GPUs report problems is unhealthy.

Rank 0 writes the outcome into its status (``RankStatus.preflight``, JSON: figures and the node indices to
exclude). When a node is to be excluded, the coordinator excludes it for this job and fails the attempt
naming it, and the restart places the job elsewhere; the ranks wait ``EXCLUDE_GRACE_S`` for that and then
raise themselves. Clock skew between nodes shifts the two directions of a pair by the same amount in
opposite signs: a few milliseconds of NTP error are far below ``SLOW_ABS_S``.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rankctl.parallel.layout import GROUP_NAMES, TOKENS

REPEATS = 3              # timed all-reduces per group (after one warm-up)
PAYLOAD_FLOATS = 64 * 1024   # 256 KiB of float32
PINGS = 5                # timestamped messages each way between two leaders
PROBE_FLOATS = 16 * 1024     # float64: 128 KiB each, ~10 us on 100 Gb/s, ~100 ms on a link at 10 Mb/s
PEERS = 2                # leaders of the next nodes each leader exchanges with
SLOW_ABS_S = 0.05        # a node's egress is slow above this ...
SLOW_FACTOR = 10.0       # ... and this many times the median of the other nodes'
EXCLUDE_GRACE_S = 30.0   # ranks wait this long for the coordinator to end an attempt with an excluded node


def preflight_on(spec: Any) -> bool:
    """``restart.preflight``, or (unset) whether the job spans more than one node."""
    chosen = spec.restart.preflight
    return spec.resources.nodes > 1 if chosen is None else bool(chosen)


class PreflightFailed(RuntimeError):
    """The pre-flight found a node to exclude (the coordinator normally ends the attempt first)."""


@dataclass(frozen=True)
class Outcome:
    kinds: dict[str, float]            # group kind -> the slowest rank's median all-reduce, seconds
    egress: list[float]                # per job node: the fastest one-way delay of its messages (0: not probed)
    exclude: dict[int, str]            # node index -> why
    gpu: str                           # rank 0's NVML note ("" when it read its GPUs)

    def to_json(self) -> str:
        probed = [e for e in self.egress if e > 0]
        links = {"median_ms": round(1e3 * statistics.median(probed), 3), "max_ms": round(1e3 * max(probed), 3),
                 "max_node": self.egress.index(max(probed))} if probed else {}
        return json.dumps({"kinds_ms": {k: round(v * 1e3, 3) for k, v in self.kinds.items()}, "links": links,
                           "exclude": {str(k): v for k, v in self.exclude.items()}, "gpu": self.gpu},
                          separators=(",", ":"))


def judge(egress: list[float], gpu_problems: dict[int, str]) -> dict[int, str]:
    """Node index -> why it is excluded: its egress far slower than the other nodes' (``SLOW_ABS_S``,
    ``SLOW_FACTOR``), or its GPUs' problems. Pure."""
    out: dict[int, str] = {}
    probed = {i: e for i, e in enumerate(egress) if e > 0}
    for i, e in probed.items():
        others = [v for j, v in probed.items() if j != i]
        if not others:
            continue
        usual = statistics.median(others)
        if e > SLOW_ABS_S and e > SLOW_FACTOR * usual:
            out[i] = (f"its link is slow: messages from it take {e * 1e3:.0f} ms one way, the other nodes' "
                      f"{usual * 1e3:.1f} ms (pre-flight, {PROBE_FLOATS * 8 >> 10} KiB messages)")
    for i, problem in gpu_problems.items():
        out.setdefault(i, f"its GPUs report problems: {problem} (pre-flight, NVML)")
    return out


def _time_groups(ctx: Any) -> dict[str, float]:
    """Each group kind's median all-reduce time on this rank (seconds; 0 for a kind whose group is this rank
    alone), for every name of ``parallel.layout.GROUP_NAMES`` in that order: the same vector on every rank,
    whatever groups it belongs to (a pipeline's middle stages have no embedding group). A group shared by
    several kinds is timed once."""
    x = torch.ones(PAYLOAD_FLOATS, device=ctx.device)
    by_members: dict[tuple[int, ...], float] = {}
    for members, names in ctx.groups.distinct():   # the same global creation order on every rank
        group = ctx.groups[names[0]]
        dist.all_reduce(x, group=group)   # warm-up: the communicator's first use connects it
        took = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group)
            took.append(time.perf_counter() - t0)
        by_members[tuple(members)] = statistics.median(took)
    return {str(name): by_members.get(tuple(ctx.groups.ranks(name)), 0.0) if name in ctx.groups else 0.0
            for name in GROUP_NAMES}


def _probe(leaders: list[int], node: int) -> list[tuple[int, float]]:
    """(sender's node index, one-way delay) of the messages this leader received from the leaders of the
    ``PEERS`` nodes before and after it (it sends to them as many): the fastest of each tells how fast that
    sender's link is."""
    n = len(leaders)
    received: list[tuple[int, float]] = []
    for k in range(1, min(PEERS, n - 1) + 1):
        to, frm = (node + k) % n, (node - k) % n
        for _ in range(PINGS):
            for dst, src in ((to, frm), (frm, to)):   # ping forward, answer backward
                out, into = torch.zeros(PROBE_FLOATS, dtype=torch.float64), torch.zeros(PROBE_FLOATS, dtype=torch.float64)
                out[0] = time.time()
                try:
                    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, leaders[dst]),
                                                   dist.P2POp(dist.irecv, into, leaders[src])])
                    for r in reqs:
                        r.wait()
                except Exception as exc:  # noqa: BLE001 - any transport error: name the nodes
                    raise RuntimeError(f"pre-flight: no message between job nodes #{node} and #{src} or #{dst}: "
                                       f"{exc}") from exc
                received.append((src, max(0.0, time.time() - float(into[0]))))
    return received


def run(ctx: Any) -> Outcome:
    """The pre-flight of this rank (every rank of the job calls it, in the same order)."""
    from rankctl.contract.gpuhealth import gpu_health

    a = ctx.assignment
    slots = a.spec.resources.slots_per_node
    nodes = a.world_size // slots
    leaders = [i * slots for i in range(nodes)]
    node = a.rank // slots
    kinds = _time_groups(ctx)
    figures = torch.tensor(list(kinds.values()), dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    leader = a.rank == leaders[node]
    on_gpu = torch.device(ctx.device).type == "cuda"   # a CPU job: the nodes' GPUs (or none) are no concern
    health = gpu_health() if on_gpu and (leader or a.rank == 0) else None
    egress = torch.full((nodes,), float("inf"), dtype=torch.float64)   # per sender: its fastest message
    bad = torch.zeros(nodes, dtype=torch.float64)
    if leader:
        for src, delay in _probe(leaders, node):
            egress[src] = min(float(egress[src]), delay)
        bad[node] = 1.0 if health is not None and health.problems else 0.0
    dist.all_reduce(egress, op=dist.ReduceOp.MIN)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    delays = [v if v != float("inf") else 0.0 for v in egress.tolist()]
    problems: dict[int, str] = {}
    if bool(bad.any()):   # rare: the text of each unhealthy node's first problem
        texts: list[Any] = [None] * a.world_size
        dist.all_gather_object(texts, health.problems[0] if health is not None and health.problems else None)
        problems = {i: str(texts[leaders[i]]) for i in range(nodes) if bad[i] and texts[leaders[i]]}
    # shown: the five layout kinds that have a group of more than one rank (their combinations are timed too)
    measured = {k: v for k, v in zip(kinds, figures.tolist()) if v > 0 and k in TOKENS}
    return Outcome(kinds=measured, egress=delays, exclude=judge(delays, problems),
                   gpu=(health.note if health is not None and not health.available else ""))
