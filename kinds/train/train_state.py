"""What a training rank saves and restores: glue between ``kinds.train.loop`` and ``kinds.train.checkpoint``.

A rank file holds the local shard (``model``: every local pipeline chunk's parameters, keyed
by their serial names, which never collide between chunks), its metadata
(``meta``: ``models.shard.ParamMeta`` as dicts), the optimizer state, the RNG state, the step,
the loss history, and the layout (``world_size``, ``coords``, ``parallel``, ``model_config``).
Every rank writes its own file, so a MoE model's experts are saved by the ranks that own them
(each ep rank, every expt_tp slice); ``kinds.train.checkpoint.export_full_state_dict`` reads the
expert parameters from the ranks with ``edp == 0`` and the dense ones from ``dp == cp == 0``.
Data are a pure function of (seed, step, i), so params + optimizer + step (+ RNG) are all a
resumed run needs to reproduce the uninterrupted run's later losses.

Resume (``train.resume: true``, or a restart of the same job: ``restore_or_reset(restart=True)``;
never inferred from attempt numbers, which count from 1 for every job): the newest step every rank
holds intact with the same fingerprint (``identity_of``) is loaded (``kinds.train.resume``: damaged
steps are passed over, each named by an event); checkpoints of a different identity are refused with
the fields that differ. A fresh run with checkpointing
on first deletes this rank's files under the job name, so shards of an earlier run of the same
name can never be mixed with new ones (without checkpointing, this happens before the run's first
checkpoint on request, if any).

Snapshots (``train.snapshot_every: K``, ``Snapshots``): every K steps the same state as a
checkpoint, copied synchronously at the step boundary (tensors cloned to the CPU) and written
by one background thread to the node's tmpfs (``contract.files.checkpoints.snapshot_root``), marker
last; the rank keeps its newest ``KEEP_STEPS`` (2) snapshot steps. One write is outstanding at a
time: the next snapshot *waits* for the previous write rather than skipping a step, so a fault
loses at most K steps plus the newest write, and at most two copies of the state are held. When the
node's snapshot memory is full (its bound: ``ctl worker --snapshot-memory-mb``) the rank keeps only its
newest snapshot step and tries once more; a write that still fails is logged and training goes on.
A fresh run deletes this rank's snapshots under the job name (they only ever serve its restarts).

A resume or restart takes the newest step every rank holds in *either* root (a checkpoint,
preferred when both hold the step, or a snapshot), with the same identity check. A restart
without ``train.resume`` takes only files its own job wrote (the marker's ``job_id``): an earlier
run under the same name with the same identity is never mixed in.

Checkpoints on request (``contract.files.rankfiles.CheckpointRequests``, which any kind may use): the daemon
writes ``{"checkpoint_at": S}`` to the rank's control file; the rank stats it once per step, the ranks agree on
the step they save at (S, or the step they are in when some rank saw S late) and save a full checkpoint at its
end, complete before that step's status record, which reports the saved step (``SAVED_ON_REQUEST``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from rankctl.contract.files import safepath
from rankctl.contract.files.checkpoints import memory_base, state_dir_of
from rankctl.contract.names import job_name_problem
from rankctl.contract.files.rankfiles import CheckpointRequests, notify_saved
from rankctl.kinds.train import checkpoint as ckpt
from rankctl.kinds.train import initfrom, reshard
from rankctl.kinds.train.intact import file_problem
from rankctl.kinds.train.resume import agree_resume_step, intact_root

from rankctl.kinds.train.trainer import Trainer, TrainState


def _layout(t: Trainer) -> tuple[dict[str, Any], dict[str, Any]]:
    par = t.ctx.spec.parallel
    parallel = {k: getattr(par, k) for k in ("tp", "pp", "cp", "ep", "order", "sequence_parallel")}
    if par.vpp is not None:  # which layers a stage holds (absent when unset: older fingerprints hold)
        parallel["vpp"] = par.vpp
    if par.etp is not None:  # how experts are sliced (likewise absent when unset)
        parallel["etp"] = par.etp
    model = dataclasses.asdict(t.model_config)
    if t.moe is not None:
        model["moe"] = dataclasses.asdict(t.moe)
    return parallel, model


def _job_name(t: Trainer) -> str:
    """The directory name of the job's files: its name (one safe path component)."""
    name = t.ctx.spec.name
    problem = job_name_problem(name)
    if problem:
        raise ValueError(f"no checkpoint directory: {problem}")
    return name


def root_of(t: Trainer) -> str:
    """``{train.checkpoint_dir}/{job name}`` (a filesystem every node reads), else the node's own
    ``{state}/checkpoints/{job name}``."""
    if t.cfg.checkpoint_dir:
        return os.path.join(t.cfg.checkpoint_dir, _job_name(t))
    return ckpt.checkpoint_root(t.ctx.assignment.run_dir, _job_name(t))


def snapshot_root_of(t: Trainer) -> str:
    """The node's in-memory ``.../snapshots/{job name}``."""
    return ckpt.snapshot_root_for(t.ctx.assignment.run_dir, _job_name(t))


def base_of(t: Trainer, root: str) -> str:
    """Where the rank's no-link walk to ``root`` (``root_of`` or ``snapshot_root_of``) starts
    (``contract.files.safepath``): the worker root ``train.checkpoint_dir`` lies under (``RankAssignment.roots``;
    the directory itself, made here, when the daemon named none), the node's snapshot memory, or its state dir."""
    state = state_dir_of(t.ctx.assignment.run_dir)
    if root == snapshot_root_of(t):
        base = memory_base(state)
    elif t.cfg.checkpoint_dir:
        base = safepath.base_of(os.path.normpath(t.cfg.checkpoint_dir), t.ctx.assignment.roots) or \
            t.cfg.checkpoint_dir
    else:
        base = state
    os.makedirs(base, exist_ok=True)   # a root, the snapshot memory (made by the daemon) or the named directory
    return base


DIGEST_TOKENS = 1 << 19  # tokens hashed at each end of each split


def data_identity(t: Trainer) -> dict[str, Any]:
    """The corpus: its source, size and a digest of both ends of each split (cheap for any size,
    and a file replaced under the same path shows)."""
    h = hashlib.sha1(usedforsecurity=False)
    for tokens in (t.data.train, t.data.val):
        h.update(tokens[:DIGEST_TOKENS].tobytes())
        h.update(tokens[-DIGEST_TOKENS:].tobytes())
    return {"source": t.cfg.data, "tokens": len(t.data.train) + len(t.data.val), "digest": h.hexdigest()[:16]}


def identity_of(t: Trainer) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: world size, layout and model (what the shards
    hold), the seed and the data (samples are a pure function of (seed, step, i): another seed
    or corpus would continue these weights on another run's samples).

    Left out on purpose: lr, warmup, steps, grad_clip, batch sizes, dtype, eval and checkpoint
    cadence. They steer the optimisation from here on but do not change what the saved tensors
    mean, and changing them on resume is legitimate (train longer, lower the lr)."""
    parallel, model = _layout(t)
    return {"world_size": t.ctx.assignment.world_size, "parallel": parallel, "model": model,
            "train": {"seed": t.cfg.seed, "data": data_identity(t)}}


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    out = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def state_dict(t: Trainer, step: int, *, copy: bool = False) -> dict[str, Any]:
    """Everything a resume needs (data are a pure function of (seed, step, i): the step is the data
    position). ``copy``: every tensor is a CPU copy that later steps leave alone."""
    a = t.ctx.assignment
    parallel, model = _layout(t)
    return {
        "step": step, "rank": a.rank, "world_size": a.world_size, "coords": dict(a.coords),
        "parallel": parallel, "model_config": model,
        "model": {n: p.detach().to("cpu", copy=copy) for n, p in t.named_parameters()},
        "meta": {n: dataclasses.asdict(m) for n, m in t.meta().items()},
        "optimizer": ckpt.copied(t.optimizer.state_dict()) if copy else t.optimizer.state_dict(),
        "rng": _rng_state(t.device),
        "history": {"losses": list(t.state.losses), "val_losses": list(t.state.val_losses)},
    }


def save_checkpoint(t: Trainer, step: int) -> str:
    """A full checkpoint of ``step`` under the checkpoint root, its marker written when this returns."""
    a, root = t.ctx.assignment, root_of(t)
    if t.state.stale_checkpoints:  # a fresh run's first checkpoint: an earlier run's files must not mix in
        t.state.stale_checkpoints = False
        if ckpt.remove_rank_files(root, a.rank, base=base_of(t, root)):
            t.ctx.log.info("removed stale checkpoint files", root=root)
    identity = identity_of(t)
    path = ckpt.save_rank(root, step, a.rank, state_dict(t, step), ckpt.fingerprint(identity), identity, a.job_id,
                          base=base_of(t, root))
    notify_saved(a.run_dir)  # the daemon pushes it to the replica peer now (``worker.replication.savewake``)
    return path


class Snapshots:
    """``train.snapshot_every``: the rank's state every ``every`` steps, copied at the step boundary and
    written to the node's memory by a background thread (one write outstanding; the next waits)."""

    def __init__(self, t: Trainer, every: int) -> None:
        a = t.ctx.assignment
        self.every, self.rank, self.job_id, self.run_dir = every, a.rank, a.job_id, a.run_dir
        self.root = snapshot_root_of(t)
        self.base = base_of(t, self.root) if every > 0 else ""
        self.identity = identity_of(t) if every > 0 else {}
        self.fp = ckpt.fingerprint(self.identity)
        self._thread: threading.Thread | None = None
        self._failure: tuple[int, BaseException] | None = None
        self.waited_s = 0.0  # time the loop spent waiting for an earlier write, over the run
        self.written: list[int] = []  # steps whose write finished, marker included

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def take(self, t: Trainer, step: int) -> None:
        """Copy the state of ``step`` now; write it in the background."""
        self.wait(t)
        state = state_dict(t, step, copy=True)
        self._thread = threading.Thread(target=self._write, args=(step, state), name=f"snapshot-{step}", daemon=True)
        self._thread.start()

    def _write(self, step: int, state: dict[str, Any]) -> None:
        try:
            ckpt.save_snapshot(self.root, step, self.rank, state, self.fp, self.identity, self.job_id,
                               base=self.base)
            notify_saved(self.run_dir)  # the daemon pushes it to the replica peer now (``worker.replication.savewake``)
            ckpt.prune(self.root, [self.rank], base=self.base)
            self.written.append(step)
        except BaseException as exc:  # noqa: BLE001 - reported on the loop's thread (wait)
            self._failure = (step, exc)

    def wait(self, t: Trainer) -> None:
        """Until the outstanding write is done; a failed write is logged and training goes on."""
        if self._thread is not None:
            t0 = time.perf_counter()
            self._thread.join()
            self.waited_s += time.perf_counter() - t0
            self._thread = None
        if self._failure is not None:
            step, exc = self._failure
            self._failure = None
            t.ctx.log.warning("snapshot not written", step=step, root=self.root, error=f"{type(exc).__name__}: {exc}")


def world_max(t: Trainer) -> Callable[[int], int] | None:
    """The max of one int over every rank (a world all-reduce), or None with one rank."""
    if t.ctx.assignment.world_size <= 1:
        return None

    def reduce(value: int) -> int:
        x = torch.tensor([value], dtype=torch.int64, device=t.device)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return int(x.item())
    return reduce


def save_after_step(t: Trainer, step: int, snapshots: Snapshots, requests: CheckpointRequests, *,
                    stop: bool = False) -> None:
    """What the rank keeps at the end of ``step``, before it reports the step: a checkpoint
    (``train.checkpoint_every``, asked for by the daemon, or ``stop``: the run's last step, ``train.stop_at``)
    and a snapshot copy."""
    asked = requests.agreed(step, world_max(t))
    if asked is not None or stop or (t.cfg.checkpoint_every > 0 and step % t.cfg.checkpoint_every == 0):
        with t.ctx.busy("checkpoint"):  # peers may wait for this write: no hang until restart.hang_timeout
            path = save_checkpoint(t, step)
        if asked is not None:
            requests.saved(asked)
            t.ctx.log.info("checkpoint", step=step, path=path, requested_at=asked)
        else:
            t.ctx.log.info("checkpoint", step=step, path=path)
    if snapshots.due(step):
        with t.ctx.busy("snapshot"):
            snapshots.take(t, step)


@torch.no_grad()
def load_state(t: Trainer, state: dict[str, Any]) -> None:
    for name, p in t.named_parameters():
        p.copy_(state["model"][name].to(p.device))
    t.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and t.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], t.device)
    t.state = TrainState(step=state["step"], losses=list(state["history"]["losses"]),
                         val_losses=list(state["history"]["val_losses"]), resumed_from=state["step"])


def _resharded(t: Trainer, root: str, identity: dict[str, Any], job_id: str | None = None, *,
               newer_than: int | None = None, skipped: list[str] | None = None) -> bool:
    """Resume from the newest intact step written under another layout of this run (``kinds.train.reshard``; only
    ``job_id``'s files when given: a restart's; only one after ``newer_than``, this layout's newest, when given);
    False when there is none. Damaged steps passed over go on ``skipped``. A collective: every rank calls it."""
    found = reshard.agree_reshard_step(root, identity, t.ctx.assignment.world_size, job_id, newer_than=newer_than,
                                       skipped=skipped)
    if found is None:
        return False
    step, old = found
    reshard.load_resharded(t, root, step, old)
    t.ctx.log.info("resumed under another layout", step=step, root=root, old_world=old["world_size"],
                   old_parallel=old["parallel"])
    if t.ctx.assignment.rank == 0:
        was = ", ".join(f"{k}={v}" for k, v in old["parallel"].items() if k in ("tp", "pp", "cp", "ep", "vpp", "etp")
                        and v not in (None, 1))
        t.ctx.notice(resumed_note(step, "checkpoint", f", written by {old['world_size']} rank(s) "
                                                    f"({was or 'no model parallelism'}), re-sliced for this layout"))
    return True


def resumed_note(step: int, what: str, how: str = "") -> str:
    """The job event of a resume, in the one step convention (``coordinator.recovery.drains``): the checkpoint at step S
    holds the state after step S, ``resumed_from`` is S, and step S + 1 runs next."""
    return f"resumed from {what} step {step}{how}; step {step + 1} runs next"


def _passed_over(t: Trainer, skipped: list[str]) -> None:
    """One log line and (from rank 0, which knows every rank's findings) one job event per damaged step."""
    for line in skipped:
        t.ctx.log.warning("checkpoint passed over", detail=line)
        if t.ctx.assignment.rank == 0:
            t.ctx.notice(line)
    skipped.clear()


def _restorable(t: Trainer) -> Callable[[str, int, int], str]:
    """A shard's check before a resume takes its step: its checksum, then tensors of this layout's shapes (a shard
    rewritten with its marker passes the checksum: ``kinds.train.intact``)."""
    shapes = {n: tuple(p.shape) for n, p in t.named_parameters()}
    return lambda root, step, rank: file_problem(root, step, rank, shapes)


def _init_from(t: Trainer) -> None:
    """A fresh start from ``train.init_from``'s weights (any layout), if it names any."""
    if not t.cfg.init_from:
        return
    _, model = _layout(t)
    what = initfrom.init_from(t, t.cfg.init_from, t.cfg.init_optimizer, model)
    t.ctx.log.info("initialised from", source=what)
    if t.ctx.assignment.rank == 0:
        t.ctx.notice(f"initialised from {what}")


def _resume_own(t: Trainer, roots: list[str], step: int, root: str | None, restart: bool) -> None:
    """Load this layout's ``step`` from ``root`` (the first of ``roots`` holding it intact), log and record it."""
    a = t.ctx.assignment
    root = root or roots[0]
    load_state(t, ckpt.load_rank(root, step, a.rank))
    t.ctx.log.info("resumed", step=step, root=root, snapshot=root == roots[1], restart=restart)
    if a.rank == 0:
        t.ctx.notice(resumed_note(step, "snapshot" if root == roots[1] else "checkpoint"))


def restore_or_reset(t: Trainer, *, restart: bool = False) -> None:
    """Load the newest step every rank holds (checkpoint or snapshot) when resuming; clear stale
    files on a fresh run.

    ``restart``: this attempt restarts the same job after a failure, so it continues from the job's
    own checkpoints and snapshots even without ``train.resume`` (the one place to pass that in).
    """
    a, cfg = t.ctx.assignment, t.cfg
    roots = [root_of(t), snapshot_root_of(t)]
    if cfg.resume or restart:
        own = restart and not cfg.resume  # the job's own files only
        identity = identity_of(t)
        skipped: list[str] = []
        held_by: list[str] = []
        check = _restorable(t)
        try:
            step = agree_resume_step(roots, a.rank, a.world_size, identity, restart=own,
                                     job_id=a.job_id if own else None, skipped=skipped, held_by=held_by, check=check)
        except RuntimeError:  # every rank raises alike (its views are all-gathered): another layout's steps?
            resharded = not own and _resharded(t, roots[0], identity, skipped=skipped)
            _passed_over(t, skipped)
            if not resharded:
                raise
            return
        # a newer step written under another layout (an elastic job's attempt on another number of nodes, or a run
        # resumed on another layout) wins over this layout's newest
        resharded = _resharded(t, roots[0], identity, a.job_id if own else None, newer_than=step, skipped=skipped)
        _passed_over(t, skipped)
        if resharded:
            return
        if step is not None:
            _resume_own(t, roots, step, intact_root(roots, step, a.rank, ckpt.fingerprint(identity), check), restart)
            return
        if restart:
            t.ctx.log.info("restart without a checkpoint or snapshot every rank has; starting over", roots=roots,
                           held=held_by[0] if held_by else "")
            if a.rank == 0 and held_by:   # why the steps run again, in the job's record
                t.ctx.notice(f"restart starts over: no checkpoint or snapshot step every rank holds ({held_by[0]})")
        _init_from(t)   # nothing to go on from: the run starts as a fresh one does
        return
    _init_from(t)
    if ckpt.remove_rank_files(roots[1], a.rank, base=base_of(t, roots[1])):  # they only serve this run's restarts
        t.ctx.log.info("removed stale snapshot files", root=roots[1])
    if cfg.checkpoint_every > 0:
        if ckpt.remove_rank_files(roots[0], a.rank, base=base_of(t, roots[0])):
            t.ctx.log.info("removed stale checkpoint files", root=roots[0])
    else:  # no checkpoint planned: an earlier run's files stay unless this run saves one (on request)
        t.state.stale_checkpoints = True
