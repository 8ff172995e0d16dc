"""``train.init_from``: a fresh run that starts from given weights instead of the seed's, under any layout.

The source is a serial state dict (``ctl checkpoint export``: full tensors keyed by the serial model's names)
or another job's checkpoints (its checkpoint directory, whose newest complete step is taken, or one step's
directory), written under any layout. Each rank takes only its own slices: from a state dict
``models.shard.shard_slice`` of the full tensor (opened with ``mmap``), from checkpoints the re-slicing of
``kinds.train.reshard``. The model must be the same (every tensor's name and full shape; a checkpoint's
``model`` section); the seed and the data may differ (a new run). The run starts at step 1 with the lr
schedule from its start; the optimizer starts fresh unless ``train.init_optimizer`` asks for the checkpoint's
AdamW state (a state dict has none, which is refused at the rank's start).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from rankctl.kinds.train import checkpoint as ckpt
from rankctl.kinds.train import reshard
from rankctl.kinds.train.intact import first_problem
from rankctl.models.shard import shard_slice

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _newest_complete(root: str) -> tuple[int, dict[str, Any]]:
    """The newest step under ``root`` that every rank of one world finished and whose files that a load reads match
    their markers and hold tensors of the shapes their metadata says (``kinds.train.intact``), and its identity."""
    damaged = []
    for step, _, ms, complete in reshard.worlds(root, lambda m: True):
        if complete:
            identity = ms[0]["identity"]
            why = first_problem(root, step, reshard.sources(reshard.old_layout(identity)))
            if not why:
                return step, identity
            damaged.append(f"step {step} is damaged ({why})")
    raise ValueError(f"train.init_from: {root} holds no intact checkpoint step that every rank of one run finished"
                     + (f": {'; '.join(damaged[:3])}" if damaged else ""))


def _from_state_dict(t: Any, path: str) -> None:
    full = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(full, dict):
        raise ValueError(f"train.init_from: {path} is not a state dict (ctl checkpoint export writes one)")
    metas = t.meta()
    for name, p in t.named_parameters():
        m = metas[name]
        src = name if name in full else m.init_key
        if src not in full:
            raise ValueError(f"train.init_from: {path} holds no tensor {name!r}: another model?")
        tensor = full[src]
        if tuple(tensor.shape) != tuple(m.full_shape):
            raise ValueError(f"train.init_from: {path}'s {src} has shape {tuple(tensor.shape)}, this model's "
                             f"{tuple(m.full_shape)}: another model?")
        p.copy_(shard_slice(tensor, m.shard_dim, m.tp_rank, m.tp_size).to(p.device))


def _from_checkpoint(t: Any, path: str, with_optimizer: bool, model: dict[str, Any]) -> int:
    base = os.path.basename(os.path.normpath(path))
    named = (match := _STEP_DIR.match(base)) is not None   # one step named: checked as it loads (a root's newest
    if named:                                              # intact step was checked as it was chosen)
        root, step = os.path.dirname(os.path.normpath(path)), int(match.group(1))
        identity = next((m["identity"] for m in reshard.markers(root, step).values()
                         if isinstance(m.get("identity"), dict)), None)
        if identity is None:
            raise ValueError(f"train.init_from: {path} holds no finished rank file")
    else:
        root = path
        step, identity = _newest_complete(root)
    if identity.get("model") != model:
        diffs = ckpt.differences({"model": identity.get("model")}, {"model": model})
        raise ValueError(f"train.init_from: {path} was written by another model ({'; '.join(diffs)})")
    try:
        old = reshard.OldStates(root, step, identity, verify=named)
    except ValueError as exc:
        raise ValueError(f"train.init_from: {exc}") from None
    reshard.fill(t, old, with_optimizer)
    return step


@torch.no_grad()
def init_from(t: Any, path: str, with_optimizer: bool, model: dict[str, Any]) -> str:
    """Fill trainer ``t``'s parameters (and with ``with_optimizer`` its AdamW state) from ``path``; what was
    taken, for the log. ``model``: this run's model section as its checkpoint identity holds it."""
    if os.path.isfile(path):
        if with_optimizer:
            raise ValueError(f"train.init_optimizer: {path} is a state dict, which holds no optimizer state")
        _from_state_dict(t, path)
        return f"the state dict {path}"
    if os.path.isdir(path):
        step = _from_checkpoint(t, path, with_optimizer, model)
        return f"checkpoint step {step} under {path}" + (" with its AdamW state" if with_optimizer else "")
    raise ValueError(f"train.init_from: {path} is neither a file nor a directory on this node")
