"""Resume under another layout: a checkpoint written under any tp, pp (vpp), cp, dp, ep/etp and world size,
re-sliced for this rank.

A rank file already says where each of its tensors sits in the global one (``models.shard.ParamMeta``:
``full_shape``, ``shard_dim``, ``tp_rank``/``tp_size``, the tensor keyed by its serial name), so no other
format is needed: a TP-sharded tensor is the full tensor zero-padded along ``shard_dim`` to a multiple of
``tp_size``, chunk ``tp_rank`` of ``tp_size``. For each of its own parameters a rank copies, from the old
ranks that hold it (dense ones from ``dp == cp == 0``, experts from ``edp == 0``: ``sources``), only the part
of each old chunk that falls in its own new chunk (``reslice``), and the same for AdamW's ``exp_avg`` and
``exp_avg_sq`` (elementwise per parameter: re-sliced exactly). A parameter the old layout did not hold under
its name (the tied output head that a last pipeline stage keeps, ``init_key`` ``wte.weight``) is taken from
the tensor it is tied to. Old files are opened with ``torch.load(mmap=True)``: a rank reads only the pages of
the slices it copies. The old ranks to open come from the old layout (``parallel.layout.RankLayout``), not
from a scan. RNG state: the old rank of the same number (rank 0's when there is none; no layer draws random
numbers after initialisation), the step and the loss history from the old files. Data are a pure function of
(seed, step, i), so with the same global batch the resumed run sees the same samples: its losses equal the
uninterrupted run's.

Which step: the newest one under the checkpoint root that every old rank finished with one identity that
differs from this run's in the layout only (``world_size``, ``parallel``; the model, seed and data must be
the same) and that every new rank can read (``agree_reshard_step``: one all-gather). Node-local checkpoint
roots hold only their own ranks' files, so resuming under another layout needs ``train.checkpoint_dir`` on
a filesystem every node reads (the refusal says so).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from rankctl.kinds.train import checkpoint as ckpt
from rankctl.kinds.train.intact import first_problem, optimizer_index
from rankctl.parallel.layout import ParallelConfig, RankLayout, layout_words
from rankctl.parallel.tensor import padded

LAYOUT_KEYS = ("world_size", "parallel")


def layout_free(identity: dict[str, Any] | None) -> dict[str, Any]:
    """What must match for a resume under another layout: the identity without its layout."""
    return {k: v for k, v in (identity or {}).items() if k not in LAYOUT_KEYS}


def markers(root: str, step: int) -> dict[int, dict[str, Any]]:
    out = {}
    for path in glob.glob(os.path.join(ckpt.step_dir(root, step), "rank-*.done")):
        try:
            with open(path, "rb") as f:
                m = json.loads(f.read())
            out[int(m["rank"])] = m
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def worlds(root: str, accept: Callable[[dict[str, Any]], bool], newer_than: int | None = None
           ) -> Iterator[tuple[int, str, list[dict[str, Any]], bool]]:
    """(step, fingerprint, markers, complete) of each world that wrote a step under ``root`` (after ``newer_than``
    when given), newest step first: the ``accept``ed markers of one fingerprint, and whether every rank of that
    world finished (all of its markers readable here)."""
    for step in sorted(ckpt.list_steps(root), reverse=True):
        if newer_than is not None and step <= newer_than:
            break
        by_fp: dict[str, list[dict[str, Any]]] = {}
        for m in markers(root, step).values():
            if m.get("fingerprint") and isinstance(m.get("identity"), dict) and accept(m):
                by_fp.setdefault(m["fingerprint"], []).append(m)
        for fp, ms in by_fp.items():
            world = ms[0]["identity"].get("world_size")
            yield step, fp, ms, isinstance(world, int) and {m["rank"] for m in ms} >= set(range(world))


def complete_elsewhere(root: str, identity: dict[str, Any], job_id: str | None = None, newer_than: int | None = None
                       ) -> tuple[list[tuple[int, str]], list[int]]:
    """(step, fingerprint) of the steps under ``root``, newest first, whose every rank of one world finished with
    an identity that is this run's but for its layout (all of that world's markers readable here; only files
    ``job_id`` wrote, when given); and the steps of such an identity of which only some ranks' markers are.
    Steps of this very layout are not another's: ``resume.agree_resume_step`` judged them (a restart whose own
    steps are all damaged or not held by every rank starts over instead of being refused as another layout's).
    ``newer_than``: only steps after it (those of this layout's newest step and before lose to it)."""
    want, own, out, partial = layout_free(identity), ckpt.fingerprint(identity), [], []
    for step, fp, _, complete in worlds(root, lambda m: m["fingerprint"] != own and
                                        layout_free(m["identity"]) == want and
                                        (job_id is None or m.get("job_id") == job_id), newer_than):
        if complete:
            out.append((step, fp))
        else:
            partial.append(step)
    return out, partial


def agree_reshard_step(root: str, identity: dict[str, Any], world_size: int, job_id: str | None = None, *,
                       newer_than: int | None = None, skipped: list[str] | None = None
                       ) -> tuple[int, dict[str, Any]] | None:
    """The newest intact step (after ``newer_than`` when given) that every rank of this world can load under its own
    layout, and the identity it was written with; None when no rank sees one, or every one seen is damaged (one
    line each on ``skipped``). One all-gather, then one a step checked: the old ranks' files are checked against
    their markers' SHA-256 and for tensors of the shapes their metadata says (``kinds.train.intact``), each by one
    rank (rank k: old ranks k, k + world, ...; resharding reads a filesystem every rank shares). RuntimeError when some ranks see a step and others
    cannot (node-local roots). ``job_id``: only that job's files (a restart's)."""
    views: list[Any] = [None] * world_size
    dist.all_gather_object(views, complete_elsewhere(root, identity, job_id, newer_than))
    common = set.intersection(*(set(map(tuple, v[0])) for v in views))
    for step, fp in sorted(common, reverse=True):
        marker = next(m for m in markers(root, step).values() if m.get("fingerprint") == fp)
        old_world, rank = int(marker["identity"]["world_size"]), dist.get_rank()
        mine = first_problem(root, step, range(rank, old_world, world_size))
        found: list[Any] = [None] * world_size
        dist.all_gather_object(found, mine)
        bad = [why for why in found if why]
        if not bad:
            return step, marker["identity"]
        if skipped is not None:
            skipped.append(f"checkpoint step {step} (written by {old_world} rank(s) under another layout) is damaged "
                           f"({bad[0]}); passed over")
    if common:
        return None
    seen = sorted({s for complete, partial in views for s in [*(s for s, _ in complete), *partial]})
    if seen:
        raise RuntimeError(f"checkpoint steps {', '.join(map(str, seen[-5:]))} under {root} were written under "
                           f"another layout, and no rank here can read every old rank's file of one step: resuming "
                           f"under another layout needs them all; set train.checkpoint_dir to a directory on a "
                           f"filesystem all nodes share")
    return None


def old_config(identity: dict[str, Any]) -> ParallelConfig:
    """The layout a checkpoint's ``identity`` was written under."""
    p = identity["parallel"]
    return ParallelConfig(world_size=identity["world_size"], tp=p["tp"], pp=p["pp"], cp=p["cp"], ep=p["ep"],
                          etp=p.get("etp"), vpp=p.get("vpp"), order=p["order"])


def old_layout(identity: dict[str, Any]) -> RankLayout:
    return RankLayout(old_config(identity))


def sources(layout: RankLayout) -> list[int]:
    """The old ranks whose files hold every tensor once: dense ones on ``dp == cp == 0``, experts on ``edp == 0``."""
    out = []
    for r in range(layout.world_size):
        c = layout.coords(r)
        if (c.get("dp", 0) == 0 and c.get("cp", 0) == 0) or c.get("edp", 0) == 0:
            out.append(r)
    return out


def reslice(parts: dict[int, Tensor], old: dict[str, Any], new: Any, shape: torch.Size) -> Tensor:
    """This rank's chunk (``new``: its ParamMeta, ``shape``: its local shape) of a tensor held by the old TP
    ranks as ``parts`` (tp rank -> chunk) with the old ParamMeta ``old`` (a dict); copies only what it needs."""
    d_old, d_new = old["shard_dim"], new.shard_dim
    if d_old is None:
        full = parts[min(parts)]
        if d_new is None:
            return full.clone()
        n, size = full.size(d_new), new.tp_size
        chunk = padded(n, size) // size
        out = torch.zeros(shape, dtype=full.dtype)
        lo, hi = new.tp_rank * chunk, min(n, (new.tp_rank + 1) * chunk)
        if hi > lo:
            out.narrow(d_new, 0, hi - lo).copy_(full.narrow(d_new, lo, hi - lo))
        return out
    n = old["full_shape"][d_old]
    c_old = padded(n, old["tp_size"]) // old["tp_size"]
    if d_new is None:
        out = torch.empty(shape, dtype=parts[0].dtype)
        lo, hi, c_new = 0, n, n
    else:
        c_new = padded(n, new.tp_size) // new.tp_size
        lo, hi = new.tp_rank * c_new, min(n, (new.tp_rank + 1) * c_new)
        out = torch.zeros(shape, dtype=parts[0].dtype)
    d = d_old
    for k, part in parts.items():
        a, b = max(lo, k * c_old), min(hi, (k + 1) * c_old)
        if b > a:
            out.narrow(d, a - lo, b - a).copy_(part.narrow(d, a - k * c_old, b - a))
    return out


class OldStates:
    """The old rank files one rank needs, opened lazily (``mmap``), with where each tensor lives."""

    def __init__(self, root: str, step: int, identity: dict[str, Any], verify: bool = False) -> None:
        """``verify``: check each file against its marker first (ValueError naming the damage)."""
        self.layout = old_layout(identity)
        self.states: dict[int, dict[str, Any]] = {}
        if verify and (why := first_problem(root, step, sources(self.layout))):
            raise ValueError(f"checkpoint step {step} under {root} is damaged: {why}")
        for r in sources(self.layout):
            self.states[r] = torch.load(ckpt.rank_file(root, step, r), map_location="cpu", weights_only=True,
                                        mmap=True)
        self.where: dict[str, dict[int, int]] = {}   # name -> old tp rank -> old rank
        for r, state in self.states.items():
            for name, meta in state["meta"].items():
                self.where.setdefault(name, {}).setdefault(meta["tp_rank"] if meta["shard_dim"] is not None else 0, r)
        self._opt_index = {r: _optimizer_names(s) for r, s in self.states.items()}

    def source_name(self, name: str, init_key: str) -> str:
        if name in self.where:
            return name
        if init_key in self.where:
            return init_key
        raise RuntimeError(f"the checkpoint holds no tensor {name!r} (nor {init_key!r}): another model?")

    def _located(self, name: str, new: Any) -> tuple[str, dict[int, int], dict[str, Any]]:
        """The parameter's name in the old files, its holders (old tp rank -> old rank) and its old meta."""
        src = self.source_name(name, new.init_key)
        holders = self.where[src]
        return src, holders, self.states[next(iter(holders.values()))]["meta"][src]

    def param(self, name: str, new: Any, shape: torch.Size) -> Tensor:
        src, holders, old = self._located(name, new)
        return reslice({k: self.states[r]["model"][src] for k, r in holders.items()}, old, new, shape)

    def adam(self, name: str, new: Any, shape: torch.Size) -> dict[str, Tensor] | None:
        """The parameter's AdamW state re-sliced (None: the old run had taken no step)."""
        src, holders, old = self._located(name, new)
        per: dict[int, dict[str, Any]] = {}
        for k, r in holders.items():
            idx = self._opt_index[r].get(src)
            st = self.states[r]["optimizer"]["state"].get(idx) if idx is not None else None
            if st is None:
                return None
            per[k] = st
        first = per[min(per)]
        out: dict[str, Any] = {"step": first["step"].clone() if isinstance(first["step"], Tensor) else first["step"]}
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = reslice({k: s[key] for k, s in per.items()}, old, new, shape)
        return out

    def history(self) -> dict[str, Any]:
        """The loss history of the old run: from an old rank that holds the losses (a last stage)."""
        for r in sorted(self.states):
            h = self.states[r]["history"]
            if h["losses"] and all(x.get("loss") is not None for x in h["losses"]):
                return h
        return self.states[min(self.states)]["history"]

    def rng(self, rank: int, root: str, step: int) -> dict[str, Tensor]:
        if rank in self.states:
            return self.states[rank]["rng"]
        if rank < self.layout.world_size:
            return torch.load(ckpt.rank_file(root, step, rank), map_location="cpu", weights_only=True, mmap=True)["rng"]
        return self.states[min(self.states)]["rng"]


def _optimizer_names(state: dict[str, Any]) -> dict[str, int]:
    return optimizer_index([(n, t.dim()) for n, t in state["model"].items()])


@torch.no_grad()
def fill(t: Any, old: OldStates, with_optimizer: bool = True) -> None:
    """Trainer ``t``'s parameters re-sliced from ``old``, and with ``with_optimizer`` its AdamW state."""
    metas = t.meta()
    named = list(t.named_parameters())
    index = optimizer_index([(n, p.dim()) for n, p in named])
    new_state: dict[int, Any] = {}
    for name, p in named:
        p.copy_(old.param(name, metas[name], p.shape).to(p.device))
        adam = old.adam(name, metas[name], p.shape) if with_optimizer else None
        if adam is not None:
            new_state[index[name]] = {k: (v.to(p.device) if isinstance(v, Tensor) and v.dim() else v)
                                      for k, v in adam.items()}
    if with_optimizer:
        t.optimizer.load_state_dict({"state": new_state, "param_groups": t.optimizer.state_dict()["param_groups"]})


@torch.no_grad()
def load_resharded(t: Any, root: str, step: int, identity: dict[str, Any]) -> None:
    """Fill trainer ``t``'s parameters, AdamW state, RNG and history from ``step`` written under ``identity``'s
    layout (``agree_reshard_step``)."""
    from rankctl.kinds.train.trainer import TrainState

    old = OldStates(root, step, identity)
    fill(t, old)
    rng = old.rng(t.ctx.assignment.rank, root, step)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and t.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], t.device)
    h = old.history()
    t.state = TrainState(step=step, losses=list(h["losses"]), val_losses=list(h["val_losses"]), resumed_from=step,
                         resumed_layout=layout_words(old_config(identity), identity["world_size"]))
