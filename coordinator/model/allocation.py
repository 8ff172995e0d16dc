"""Allocations: a job pinned to nodes a batch scheduler gave it (a Slurm job today).

A job submitted with an ``AllocationRequest`` (``ctl slurm submit``) runs only on the workers its allocation
started, which register with the allocation's *pool* name (``ctl worker --pool``), and no other job runs on
them; its spares stay READY for it. The coordinator asks for the allocation, watches it and releases it through
an ``Allocator`` (``request``, ``state``, ``release``): the scheduler-specific part is an adapter behind that
interface (``coordinator.batch.slurm.SlurmAllocator``), so the core knows pools and states, never ``sbatch``.

Pure data and rules here; ``coordinator.batch.allocations`` keeps them per job, the server's ``AllocationLoop`` calls
the adapter off the event loop.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

SCHEDULERS = ("slurm",)
MAX_SPARES = 1024
# the scheduler's states in which an allocation's workers run no more (Slurm's names; GONE: it forgot the job)
SLURM_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|unlimited|infinite", re.IGNORECASE)   # sbatch --time
REQUESTING = "REQUESTING"   # asked for, no answer from the scheduler yet
UNAVAILABLE = "UNAVAILABLE"  # the scheduler refused it (sbatch failed): the job fails with its words
NOT_SUBMITTED = "NOT_SUBMITTED"  # the job ended before the allocation was asked for
ENDED = frozenset(("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL",
                   "DEADLINE", "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT", "GONE", UNAVAILABLE, NOT_SUBMITTED))


@dataclass(frozen=True, kw_only=True)
class AllocationRequest:
    """What ``ctl slurm submit`` asks for besides the job: spares and the scheduler's options."""

    scheduler: str = "slurm"
    spares: int = 0
    partition: str = ""
    time: str = ""
    account: str = ""
    qos: str = ""
    extra_args: tuple[str, ...] = ()
    worker_state_dir: str = ""      # per node; {node} and {jobid} expand
    ctl: str = ""                   # the ctl executable the workers run ("": the coordinator's own)
    gpus_per_node: int = 0
    worker_args: tuple[str, ...] = ()   # added to each ``ctl worker`` as they are (``--data-root DIR``)
    worker_tls_dir: str = ""        # each worker's identity directory ({node} expands): the coordinator serves TLS

    def problems(self) -> list[str]:
        """Each field that breaks a rule, named with its value and the rule (empty: valid)."""
        out = []
        if self.scheduler not in SCHEDULERS:
            out.append(f"allocation.scheduler (got {self.scheduler!r}): must be one of {', '.join(SCHEDULERS)}")
        if not 0 <= self.spares <= MAX_SPARES:
            out.append(f"--spares (got {self.spares}): must be between 0 and {MAX_SPARES}")
        if not 0 <= self.gpus_per_node <= 64:
            out.append(f"allocation.gpus_per_node (got {self.gpus_per_node}): must be between 0 and 64")
        for name in ("partition", "time", "account", "qos"):
            value = getattr(self, name)
            if len(value) > 200 or any(c in value for c in "\n\r\0"):
                out.append(f"--{name} (got {value[:40]!r}): at most 200 characters on one line")
        for name in ("partition", "account", "qos"):   # a directive's value: a space cuts it (sbatch: "Invalid
            value = getattr(self, name)                  # directive found in batch script")
            if any(c.isspace() for c in value):
                out.append(f"--{name} (got {value[:40]!r}): a Slurm {name} name holds no spaces (several: a,b)")
        if self.time and not SLURM_TIME.fullmatch(self.time):
            out.append(f"--time (got {self.time[:40]!r}): a Slurm time limit: MINUTES, MINUTES:SECONDS, "
                       "HOURS:MINUTES:SECONDS, DAYS-HOURS[:MINUTES[:SECONDS]] or UNLIMITED")
        for option, args in (("--sbatch-arg", self.extra_args), ("--worker-arg", self.worker_args)):
            for arg in args:
                if len(arg) > 1000 or any(c in arg for c in "\n\r\0"):
                    out.append(f"{option} (got {arg[:40]!r}): at most 1000 characters on one line")
                elif option == "--sbatch-arg" and any(c.isspace() for c in arg):   # one #SBATCH line: sbatch
                    out.append(f"{option} (got {arg[:40]!r}): one sbatch option with no spaces, e.g. "  # splits it
                               "--constraint=h100 (each becomes an #SBATCH line, which sbatch splits at spaces)")
            if len(args) > 64:
                out.append(f"{option} (got {len(args)} of them): at most 64")
        for name in ("worker_state_dir", "ctl", "worker_tls_dir"):
            value = getattr(self, name)
            if len(value) > 4096 or any(c in value for c in "\n\r\0"):
                out.append(f"--{name.replace('_', '-')} (got {value[:40]!r}): at most 4096 characters on one line")
        for name in ("worker_state_dir", "worker_tls_dir"):
            value = getattr(self, name)
            if "`" in value or "$(" in value:
                out.append(f"--{name.replace('_', '-')} (got {value[:40]!r}): no command substitution "
                           "(`...` or $(...)); {node}, {jobid} and $VARIABLES expand")
        return out

    def tls_problem(self, coordinator_tls: bool) -> str | None:
        """A coordinator that serves mutual TLS admits a worker only with a node identity of its own name."""
        if coordinator_tls and not self.worker_tls_dir:
            return ("--worker-tls-dir (got none): the coordinator serves mutual TLS, so each worker needs a node "
                    "identity directory; give a path template where {node} expands to the Slurm node name (issue "
                    "one per node: ctl certs issue CA --node NAME --out DIR)")
        return None

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AllocationRequest":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        for name in ("extra_args", "worker_args"):
            if name in known:
                known[name] = tuple(known[name])
        return cls(**known)


@dataclass(kw_only=True)
class Allocation:
    """One allocation of a job: its pool (what its workers register with) and what the scheduler says."""

    request: AllocationRequest
    pool: str                       # "<job id>-a<number>"
    number: int = 1                 # +1 for each new allocation of the same job
    attempt: int = 1                # the job's attempt it was asked for
    id: str = ""                    # the scheduler's id (Slurm job id); "" until it answered
    state: str = REQUESTING
    nodes: list[str] = field(default_factory=list)
    output: str = ""                # where the batch script's own output goes
    detail: str = ""                # the scheduler's words when it refused or ended it
    released: bool = False          # the job ended and its workers were told to exit

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def describe(self) -> str:
        """``slurm job 1234 (RUNNING)``; a pending one with the scheduler's reason: ``(PENDING: PartitionNodeLimit)``
        (a request the partition cannot hold stays pending in Slurm: its reason is what says so), one not yet
        submitted with why (``(REQUESTING: sbatch could not reach the Slurm controller: ...)``)."""
        why = f": {self.detail}" if self.state in ("PENDING", REQUESTING) and self.detail not in ("", "None") else ""
        return f"{self.request.scheduler} job {self.id or '(not yet submitted)'} ({self.state}{why})"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["request"] = self.request.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Allocation":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        known["request"] = AllocationRequest.from_dict(d.get("request") or {})
        return cls(**known)


def pool_name(job_id: str, number: int) -> str:
    return f"{job_id}-a{number}"


@dataclass(frozen=True)
class Ask:
    """Everything an adapter needs to ask for one allocation."""

    job_id: str
    job_name: str
    allocation: Allocation
    nodes: int                      # the job's nodes plus the spares
    slots: int                      # resources.slots_per_node: each worker's --slots
    coordinator: str                # the address the workers dial
    tls: bool = False               # the coordinator serves mutual TLS (the workers pass --tls-dir)
    general: bool = False           # a worker pool for the general queue (``ctl slurm workers``), not one job's


@dataclass(frozen=True)
class Seen:
    """What the scheduler says of an allocation now."""

    state: str
    nodes: tuple[str, ...] = ()
    detail: str = ""


class Allocator(Protocol):
    """A batch scheduler's adapter; every call blocks (the server runs it on a worker thread)."""

    def request(self, ask: Ask) -> tuple[str, str]:
        """Submit the allocation; (its id, where its batch output goes). AllocationRefused: the scheduler said no."""

    def state(self, allocation: Allocation) -> Seen:
        """Its state and nodes now (``GONE`` when the scheduler no longer knows it)."""

    def release(self, allocation: Allocation) -> None:
        """End it now (its workers did not exit by themselves)."""


class AllocationRefused(Exception):
    """The scheduler refused the request: its words, to fail the job with."""
