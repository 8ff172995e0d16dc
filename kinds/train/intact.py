"""Whether a checkpoint shard holds what it claims, beyond its checksum.

A shard rewritten together with its marker matches the SHA-256 the marker records, yet may hold a tensor of
another shape; loading it failed deep in a copy or a narrow ("start (0) + length (96) exceeds dimension size
(95)") naming no step, file or tensor. ``file_problem`` checks the checksum (``contract.files.checkpoints.damage``),
then that the file loads (``mmap``: only its metadata is read) and that every tensor, AdamW's moments included,
has the shape its parameter metadata says (or, given ``expected``, this layout's). A step where some rank's
shard fails is passed over like a torn one (``kinds.train.resume``, ``kinds.train.reshard``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from rankctl.contract.files.checkpoints import damage, rank_file
from rankctl.parallel.tensor import padded

Shapes = Mapping[str, tuple[int, ...]]


def optimizer_index(named_dims: list[tuple[str, int]]) -> dict[str, int]:
    """Serial name -> the index AdamW's state_dict gives the parameter (``kinds.train.optim.param_groups``:
    the decayed ones (dim >= 2) first, then the rest, each in the model's order)."""
    order = [n for n, d in named_dims if d >= 2] + [n for n, d in named_dims if d < 2]
    return {n: i for i, n in enumerate(order)}


def local_shape(meta: Mapping[str, Any]) -> tuple[int, ...]:
    """A rank's shape of a parameter from its metadata (``models.shard.ParamMeta`` as a dict): the full shape,
    with the sharded dimension padded to a multiple of ``tp_size`` and cut in ``tp_size`` chunks."""
    shape, dim = [int(n) for n in meta["full_shape"]], meta.get("shard_dim")
    if dim is not None:
        shape[dim] = padded(shape[dim], int(meta["tp_size"])) // int(meta["tp_size"])
    return tuple(shape)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(n) for n in t.shape)


def content_problem(state: Any, expected: Shapes | None = None) -> str:
    """Why a loaded rank file cannot be restored ("" when it can): a tensor missing, or of a shape other than
    its metadata's (``expected``: this layout's, by name), or AdamW moments that do not match it."""
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or not isinstance(state.get("meta"), dict):
        return "it holds no model state (not a rank file)"
    model, meta = state["model"], state["meta"]
    names = list(expected) if expected is not None else list(meta)
    if missing := [n for n in names if n not in model]:
        return f"it holds no tensor {missing[0]!r}"
    for name, tensor in model.items():
        if not isinstance(tensor, torch.Tensor) or name not in meta:
            return f"{name!r} is not a tensor with metadata"
        want, whose = (expected.get(name), "this layout's") if expected is not None else (local_shape(meta[name]),
                                                                                           "its metadata's")
        if want is not None and _shape(tensor) != tuple(want):
            return f"tensor {name!r} has shape {_shape(tensor)}, {whose} is {tuple(want)}"
    return _optimizer_problem(state, model)


def _optimizer_problem(state: dict[str, Any], model: dict[str, torch.Tensor]) -> str:
    moments = ((state.get("optimizer") or {}).get("state") or {}) if isinstance(state.get("optimizer"), dict) else {}
    for name, idx in optimizer_index([(n, t.dim()) for n, t in model.items()]).items():
        for key, value in (moments.get(idx) or {}).items():
            if key != "step" and isinstance(value, torch.Tensor) and _shape(value) != _shape(model[name]):
                return f"AdamW's {key} of tensor {name!r} has shape {_shape(value)}, the tensor {_shape(model[name])}"
    return ""


def file_problem(root: str, step: int, rank: int, expected: Shapes | None = None) -> str:
    """Why ``rank``'s shard of ``step`` under ``root`` cannot be restored ("" when it can), naming the file: its
    checksum (``contract.files.checkpoints.damage``), then whether it loads and holds tensors of the right shapes."""
    if why := damage(root, step, rank):
        return why
    path = rank_file(root, step, rank)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - torch.load's errors name no file
        return f"{path} cannot be loaded: {type(exc).__name__}: {str(exc)[:200]}"
    problem = content_problem(state, expected)
    return f"{path}: {problem}" if problem else ""


def first_problem(root: str, step: int, ranks: Iterable[int]) -> str:
    """``file_problem`` of the first of ``ranks``' shards of ``step`` that cannot be restored ("" when none)."""
    return next((why for rank in ranks if (why := file_problem(root, step, rank))), "")
