"""``RankContext``: one rank's view of its job, for rankctl's kinds and (``rankctl.context()``) for user code.

Identity (``rank``, ``world_size``, ``local_rank``, ``node``, ``job_id``, ``attempt``, ``coords``, ``layout``,
``ranks(name)``) is pure and read from the assignment. Process groups are built once: up front by the
runtime for kinds that want them (``train``, ``comm-check``), or on the first ``group(name)`` for kinds
whose code owns the rendezvous (``python``): the default group is then the one the script created with
``init_process_group``, or, if it created none, one made here at the same address (``MASTER_ADDR:MASTER_PORT``).
All of the rank's groups are built at once, in ``parallel.groups``' global order, so the first ``group()`` call
must happen on every rank (any kind, any time): like Megatron's initialisation, it cannot deadlock then.
Making the context pins gloo and NCCL to the node's advertised address (``runtime.netif``), before any kind runs.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any, ContextManager

import torch
import torch.distributed as dist

from rankctl.contract.files import checkpoints

from rankctl.contract.files import safepath
from rankctl.contract.assignment import RankAssignment
from rankctl.contract.names import job_name_problem
from rankctl.contract.spec import JobSpec
from rankctl.kinds.spec import parallel_config
from rankctl.parallel.groups import WORLD, ProcessGroups, group_name
from rankctl.parallel.layout import RankLayout, shared_layout
from rankctl.parallel.placement import node_of_rank
from rankctl.runtime.netif import pin_interface
from rankctl.runtime.rendezvous import init_distributed, resolve_backend
from rankctl.runtime.status import StatusWriter

_current: "RankContext | None" = None


def current() -> "RankContext | None":
    """The running rank's context (``rankctl.context()``), None while no rank code runs in this process."""
    return _current


def set_current(ctx: "RankContext | None") -> None:
    global _current
    _current = ctx


class RankContext:
    """Everything a rank's code receives; no globals behind it (``rankctl.context()`` hands out this object). The one
    implementation of the protocol kinds code against (``kinds.context.RankContext``)."""

    def __init__(self, *, assignment: RankAssignment, spec: JobSpec, status: StatusWriter, log: Any,
                 groups: ProcessGroups | None = None, device: torch.device | None = None,
                 backend: str | None = None, timeout: timedelta | None = None) -> None:
        self.assignment = assignment
        self.spec = spec  # the typed job spec, validated from the assignment's canonical dict
        self.status = status
        self.log = log  # structlog BoundLogger with job, node, rank bound
        self.timeout = timeout or timedelta(seconds=spec.restart.collective_timeout)
        self._run_dir = os.path.abspath(assignment.run_dir or os.getcwd())  # before user code may chdir
        self._groups = groups
        self._device = device
        self._backend = backend
        self._alone: dist.ProcessGroup | None = None
        self._layout: RankLayout | None = None
        self._losses: list[dict[str, Any]] = []
        self._metrics: dict[str, float] = {}
        self._step: int | None = None
        self.pinning = pin_interface(assignment.node_address, assignment.rendezvous_host, os.environ)
        log.info("collectives", address=self.pinning.address, interface=self.pinning.interface,
                 set=list(self.pinning.set_vars), why=self.pinning.why)

    # -- identity (pure) --------------------------------------------------------------------
    rank = property(lambda self: self.assignment.rank)
    world_size = property(lambda self: self.assignment.world_size)
    local_rank = property(lambda self: self.assignment.local_rank)
    node = property(lambda self: self.assignment.node)
    job_id = property(lambda self: self.assignment.job_id)
    attempt = property(lambda self: self.assignment.attempt)

    @property
    def coords(self) -> dict[str, int]:
        """tp, cp, ep, dp, pp, etp, edp."""
        return dict(self.assignment.coords)

    @property
    def local_world_size(self) -> int:
        return self.spec.resources.slots_per_node

    @property
    def node_index(self) -> int:
        """This rank's node's index in the job (torchrun's ``GROUP_RANK``)."""
        return int(node_of_rank(self.rank, self.local_world_size))

    @property
    def layout(self) -> RankLayout:
        if self._layout is None:
            self._layout = shared_layout(parallel_config(self.spec))
        return self._layout

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's ``name`` group, ascending (``world``: every rank)."""
        if name == WORLD:
            return list(range(self.world_size))
        try:
            return sorted(self.assignment.groups[name])
        except KeyError:
            raise KeyError(f"rank {self.rank} has no {name!r} group; its kinds are "
                           f"{', '.join(self.assignment.groups)}, world") from None

    # -- groups -----------------------------------------------------------------------------
    def init_default_group(self) -> None:
        """The default group at the assignment's rendezvous, unless this process already has one."""
        if dist.is_initialized():
            if self._backend is None:
                self._backend = dist.get_backend()
                self._device = resolve_backend(self.assignment)[1] if self._backend == "nccl" else torch.device("cpu")
            return
        self._backend, self._device = init_distributed(self.assignment, self.timeout)

    @property
    def groups(self) -> ProcessGroups:
        """This rank's ``ProcessGroups``, built (with the default group if needed) on first use."""
        if self._groups is None:
            self.init_default_group()
            self._groups = ProcessGroups.build(self.rank, self.world_size, self.assignment.groups,
                                               timeout=self.timeout)
        return self._groups

    @property
    def backend(self) -> str:
        if self._backend is None:
            self.init_default_group()
        return self._backend

    @property
    def device(self) -> torch.device:
        if self._device is None:
            self._device = resolve_backend(self.assignment)[1]
        return self._device

    def group(self, name: str) -> dist.ProcessGroup:
        """The live process group of ``name`` (``world`` or a ``parallel.layout`` name) for this rank;
        one-member kinds share one group of this rank alone (Megatron asks every group its size)."""
        self.ranks(name)  # a clear KeyError for a name this rank lacks
        pgs = self.groups
        if name == WORLD:
            return dist.group.WORLD
        if pgs.size(name) > 1:
            return pgs[name]
        return self.alone()

    def alone(self) -> dist.ProcessGroup:
        """The one group of this rank alone, shared by every one-member kind (created on first use)."""
        if self._alone is None:
            self._alone = _alone_group(self.rank, self.timeout)
        return self._alone

    # -- reports ----------------------------------------------------------------------------
    def report(self, step: int, loss: float | None = None, **metrics: float) -> None:
        """Step ``step``'s loss and metrics: ``ctl status``/``ctl watch`` and the job result's ``losses``."""
        values = {k: float(v) for k, v in metrics.items()}
        if loss is not None:
            values = {"loss": float(loss), **values}
            self._losses.append({"step": int(step), "loss": float(loss)})
        self._step, self._metrics = int(step), values
        self.status.write("running", step=int(step), metrics=values)

    def notice(self, text: str) -> None:
        """Put ``text`` on the job's record: one job event (``ctl events``), e.g. a damaged checkpoint step."""
        self.status.write("running", notice=text)

    def busy(self, activity: str = "busy") -> ContextManager[None]:
        """``with ctx.busy("checkpoint"):`` marks a stretch in which peers may wait for this rank without
        it being hung (a save, a restore, a long read): the adaptive hang judgement leaves it alone and only
        ``restart.hang_timeout`` applies (``runtime.collectives.CollectiveCounters.busy``)."""
        counters = getattr(self.status, "counters", None)
        return counters.busy(activity) if counters is not None else contextlib.nullcontext()

    def reported(self) -> dict[str, Any]:
        """This rank's result from its reports (``kinds.python.results``)."""
        if self._step is None:
            return {}
        return {"losses": self._losses, "metrics": self._metrics, "final": {"step": self._step, **self._metrics}}

    @property
    def checkpoint_dir(self) -> str:
        """``{state}/checkpoints/{job name}``: the job name's, kept across restarts and resubmissions."""
        problem = job_name_problem(self.spec.name)
        if problem:
            raise ValueError(f"no checkpoint directory: {problem}")
        state = checkpoints.state_dir_of(self._run_dir)
        path = checkpoints.root_in(state, self.spec.name)
        safepath.makedirs(state, path)   # through no link below the state dir
        return path

    def close(self) -> None:
        """Tear down every group this process still has (the script may have destroyed them itself)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self._groups = self._alone = None


def _alone_group(rank: int, timeout: timedelta) -> dist.ProcessGroup:
    """A group of this rank alone, named by its member list (no other rank takes part)."""
    import torch.distributed.distributed_c10d as c10d

    original = getattr(c10d, "_hash_ranks_to_str", None)
    if original is not None:
        c10d._hash_ranks_to_str = lambda ranks: group_name(["alone", *ranks])
    try:
        return dist.new_group([rank], timeout=timeout, use_local_synchronization=True)
    finally:
        if original is not None:
            c10d._hash_ranks_to_str = original
