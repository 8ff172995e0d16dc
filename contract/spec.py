"""The job file's common sections (version 1): what every job has, whatever its kind.

A kind's own sections (``model``/``train``, ``comm_check``, ...) are declared by the kind
(``kinds/<kind>/``); ``kinds.spec`` composes them with these. Unknown fields are errors,
numbers are strict (``StrictInt`` takes an integer, ``StrictFloat`` an integer or a float;
neither a bool nor a string) and finite, and every size is bounded (``contract.limits``).
The defaults here are the only definition of each default.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from rankctl.contract import limits as L
from rankctl.contract.names import JOB_NAME_RULE, job_name_problem

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
DEFAULT_SCHEDULE = "1f1b"
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
DEFAULT_HANG_TIMEOUT_S = 300.0  # restart.hang_timeout: no rank of a RUNNING job advanced for this long
DEFAULT_SHM_MB = 1024           # resources.shm_mb
MAX_SHM_MB = 1 << 20
MIN_MEMORY_MB, MAX_MEMORY_MB = 64, 1 << 24   # resources.memory_mb: 64 MiB .. 16 TiB per rank
MIN_PIDS, MAX_PIDS = 16, 1 << 22             # resources.pids_max


class Section(BaseModel):
    """Base of every spec section: unknown fields are errors, frozen, finite numbers."""

    # each field's docstring is its description in the served JSON Schema and in docs/job-file.md
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True)


class Resources(Section):
    """Where the job runs: how many nodes, how many ranks on each, and what each rank may use."""

    nodes: StrictInt = Field(1, ge=1, le=L.MAX_NODES)
    """Nodes the job runs on (its full size); the world size is ``nodes`` x ``slots_per_node``."""
    slots_per_node: StrictInt = Field(1, ge=1, le=L.MAX_SLOTS_PER_NODE)
    """Ranks on each node (one per GPU on a GPU node); a tensor-parallel group never spans two nodes."""
    shm_mb: StrictInt = Field(DEFAULT_SHM_MB, ge=1, le=MAX_SHM_MB)
    """MiB of the job's private ``/dev/shm`` on each node (a tmpfs its ranks there share, removed at the end)."""
    memory_mb: StrictInt | None = Field(None, ge=MIN_MEMORY_MB, le=MAX_MEMORY_MB)
    """MiB of memory each rank may use with every process it starts (a cgroup's memory limit; past it the
    kernel's OOM killer ends the rank, and its reason says so). null: no limit of the job's own."""
    pids_max: StrictInt | None = Field(None, ge=MIN_PIDS, le=MAX_PIDS)
    """Processes and threads each rank may have at once, its children's included (a cgroup's pids limit;
    torch's own threads count). null: no limit of the job's own."""

    min_nodes: StrictInt | None = Field(None, ge=1, le=L.MAX_NODES)
    """Elastic: the fewest nodes the job may run on (torchrun's ``--nnodes=MIN:MAX``). When nodes are short (one
    lost and no spare free, or too few free at the start) an attempt runs on as many as there are, down to this,
    with fewer data-parallel replicas and the same global batch through more micro-batches per rank; it grows
    back to ``nodes`` at a checkpoint when nodes are free again. null: always ``nodes``."""

    @model_validator(mode="after")
    def _world(self) -> "Resources":
        if self.nodes * self.slots_per_node > L.MAX_WORLD_SIZE:
            raise ValueError(f"nodes*slots_per_node = {self.nodes * self.slots_per_node} ranks exceeds "
                             f"the maximum world size of {L.MAX_WORLD_SIZE}")
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"min_nodes={self.min_nodes} exceeds nodes={self.nodes} (the job runs on min_nodes .. "
                             f"nodes nodes)")
        return self

    @property
    def fewest_nodes(self) -> int:
        """The fewest nodes an attempt may run on."""
        return self.min_nodes if self.min_nodes is not None else self.nodes


class ParallelSpec(Section):
    """How the ranks split the model, as Megatron-LM's parallel_state does; the data-parallel size is derived:
    world / (tp x pp x cp)."""

    tp: StrictInt = Field(1, ge=1, le=L.MAX_PARALLEL_SIZE)
    """Tensor-parallel size: ranks that split each layer's weights (kept inside one node)."""
    pp: StrictInt = Field(1, ge=1, le=L.MAX_PARALLEL_SIZE)
    """Pipeline-parallel size: stages the layers are cut into."""
    cp: StrictInt = Field(1, ge=1, le=L.MAX_PARALLEL_SIZE)
    """Context-parallel size: ranks that split each sequence."""
    ep: StrictInt = Field(1, ge=1, le=L.MAX_PARALLEL_SIZE)
    """Expert-parallel size: ranks that split a mixture-of-experts layer's experts."""
    etp: StrictInt | None = Field(None, ge=1, le=L.MAX_PARALLEL_SIZE)
    """Expert tensor-parallel size: ranks that split each expert's weights. null: the same as ``tp``."""
    vpp: StrictInt | None = Field(None, ge=1, le=L.MAX_VPP)
    """Virtual pipeline chunks per rank (an interleaved 1F1B schedule). null: one chunk."""
    order: str = DEFAULT_ORDER
    """The order ranks are laid out in, innermost first, as Megatron-LM's ``order`` (tp-cp-ep-dp-pp)."""
    sequence_parallel: StrictBool = False
    """Megatron's sequence parallelism: activations outside the tensor-parallel regions split along the
    sequence across the tensor-parallel group (needs ``tp`` > 1 to change anything)."""
    schedule: Literal["gpipe", "1f1b"] = DEFAULT_SCHEDULE
    """Pipeline schedule: gpipe (all forwards, then all backwards) or 1f1b (interleaved when ``vpp`` is set)."""


class RestartSpec(Section):
    """What happens when an attempt fails or hangs.

    Hangs: a name at once, an action only on certainty. Acted on at once (about a second): a rank stopped for good
    (SIGSTOP held about a second; not a debugger's hold, not the whole job suspended), a deadlock (every rank waits
    inside an operation that cannot complete: a cycle of waits, or mismatched collectives), a cut link (every rank
    waits and a group's data between two nodes goes unacknowledged), and, as always, a dead rank, a lost node or a
    collective library's own timeout. Named within about a second, in a ``stall`` event (``ctl watch``, ``ctl
    events``, the dashboard): a live rank outside collectives while its peers wait - asleep, blocked on I/O or a
    lock, computing, spinning in Python - with its frame and who waits for it; it is acted on only at
    ``hang_timeout``. A long pause needs no declaration: raise ``hang_timeout`` above it, or wrap it in
    ``with ctx.busy("checkpoint"):`` to say what it is."""

    max_restarts: StrictInt = Field(0, ge=0, le=L.MAX_RESTARTS)
    """Failed attempts restarted before the job fails (a drain or an elastic growth uses none). Left out, a job
    on an allocation with spares (``ctl slurm submit --spares N``) gets N: spares are asked for to restart onto."""
    collective_timeout: StrictFloat = Field(DEFAULT_COLLECTIVE_TIMEOUT_S, gt=0, le=L.MAX_COLLECTIVE_TIMEOUT_S)
    """Seconds every rank's process groups wait in one collective before giving up."""
    hang_timeout: StrictFloat = Field(DEFAULT_HANG_TIMEOUT_S, gt=0, le=L.MAX_COLLECTIVE_TIMEOUT_S)
    """Seconds a RUNNING job may stay still (no rank's step, phase or collective counters moving) while a live
    rank is outside collectives - asleep, blocked on I/O or a lock, computing, spinning - before the attempt is
    ended: the bound for uncertain evidence, both ways (raising it raises it; a pause of a kind the job survived
    raises it to twice that pause, and a step where an earlier attempt died so is spared). Certain evidence is
    acted on at once: a rank stopped for good (about a second), a deadlock, a link losing data."""
    preflight: StrictBool | None = None
    """A check of a few seconds over the job's groups and links before each attempt's first step; a node it
    finds bad is excluded and the attempt restarts without it. null: on for multi-node jobs."""


class JobSpec(Section):
    """The sections every job has. ``kinds.spec.spec_model()`` adds each registered kind's
    sections (and checks ``kind`` against the registry); every spec is an instance of this."""

    name: str
    """The job's name: lowercase letters, digits and '-', at most 63 characters; its id adds a suffix."""
    kind: str = "train"
    """The job kind, a registered plug-in: train, comm-check, python, or one a coordinator imports."""
    resources: Resources = Resources()
    """Nodes, ranks per node, and each rank's limits."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """The collectives' backend: auto (nccl on GPUs, gloo on CPUs), nccl or gloo."""
    parallel: ParallelSpec = ParallelSpec()
    """The parallel layout (tensor, pipeline, context, expert, data)."""
    restart: RestartSpec = RestartSpec()
    """Restarts, timeouts and the pre-flight."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if job_name_problem(v):
            raise ValueError(JOB_NAME_RULE)
        return v

    @property
    def world_size(self) -> int:
        return self.resources.nodes * self.resources.slots_per_node

    def on_nodes(self, nodes: int) -> "JobSpec":
        """This spec for an attempt on ``nodes`` nodes (an elastic job's smaller world, ``resources.min_nodes``)."""
        if nodes == self.resources.nodes:
            return self
        return self.model_copy(update={"resources": self.resources.model_copy(update={"nodes": nodes})})

    def with_spares(self, spares: int) -> "JobSpec":
        """This spec on an allocation with ``spares`` spare nodes: ``restart.max_restarts`` as
        ``restarts_for_spares`` says."""
        restarts = restarts_for_spares(self, spares)
        if restarts == self.restart.max_restarts:
            return self
        return self.model_copy(update={"restart": self.restart.model_copy(update={"max_restarts": restarts})})

    def to_dict(self) -> dict[str, Any]:
        """The canonical stored form: every field, but no empty section of another kind."""
        doc = self.model_dump(mode="json")
        return {k: v for k, v in doc.items() if v is not None or k in JobSpec.model_fields}


def restarts_for_spares(spec: JobSpec, spares: int) -> int:
    """The ``restart.max_restarts`` a job runs with on an allocation with ``spares`` spare nodes: the file's when it
    sets one (even 0), else one restart per spare (capped at the limit): spares with no restart stay idle."""
    if "max_restarts" in spec.restart.model_fields_set:
        return spec.restart.max_restarts
    return max(spec.restart.max_restarts, min(spares, L.MAX_RESTARTS))
