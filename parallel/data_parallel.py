"""Data-parallel gradient reduction: buckets all-reduced asynchronously during backward.

Why a SUM, not a mean. The trainer divides every micro-batch's loss *sum* by the token
count of the whole global batch, so each rank's gradient is its share of the gradient of
the global mean loss, and the global gradient is the plain sum of the shares over the
``dp_cp`` group (CP ranks hold the same parameters and different tokens, so they join the
sum). Averaging here as well would divide by dp twice.

Why some gradients are also summed over TP. Under sequence parallelism the parameters that
TP leaves replicated (LayerNorms, learned positions, row-parallel biases) act on one slice of
the sequence per TP rank, so each TP rank holds a partial gradient; their sum is the full
one. Those parameters carry ``tp_grad_sum`` in their metadata (``models.shard.ParamMeta``).
Without SP every TP rank sees the full sequence and already holds the full gradient.

Mechanics (as in torch DDP / Megatron): parameters are packed, in reverse registration
order (roughly the order backward produces their gradients), into buckets of about
``bucket_bytes``. With ``sync`` on (the last micro-batch of a step), a
``post_accumulate_grad`` hook marks each parameter ready; when a bucket is full of ready
gradients it is flattened and its all-reduce launched with ``async_op=True``, overlapping
the rest of backward. Buckets launch strictly in index order, so every rank issues the same
collectives in the same order. ``finish()`` launches what is left (unused parameters count as
zero), waits, copies the sums back into ``.grad`` and does the TP sums. With ``sync`` off
(earlier micro-batches) gradients simply accumulate locally.

Mixture of experts. Expert parameters (``ParamMeta.expert``) are replicated over a different
group: their gradients are SUMmed over ``expt_dp`` (and, for ``tp_grad_sum`` ones, over
``expt_tp``) instead of ``dp_cp``/``tp``. The trainer builds two reducers, one per kind
(``named_parameters_by_kind``), and drives them together through ``GradReducers``. Every
rank of a group creates the same reducers in the same order and backward fires the hooks
in the same order, so the collectives on a communicator that both kinds share (e.g.
``expt_dp`` == ``dp_cp`` when ep = 1) are still issued identically on every member.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_BUCKET_BYTES = 4 << 20


@dataclass
class Bucket:
    params: list[nn.Parameter]
    numel: int
    ready: int = 0
    handle: Any = None
    buffer: torch.Tensor | None = field(default=None, repr=False)


def plan_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[int]]:
    """Indices into ``params`` per bucket: reverse order, each bucket closed once it reaches
    ``bucket_bytes`` (a parameter larger than that gets a bucket of its own)."""
    buckets: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(params))):
        if buckets[-1] and size >= bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += params[i].numel() * params[i].element_size()
    return [b for b in buckets if b]


class GradReducer:
    """Reduces the gradients of ``params`` (name, parameter) over ``dp_group`` (a SUM) and,
    for parameters whose metadata says ``tp_grad_sum``, over ``tp_group`` too.

    Use: ``set_sync(False)`` before the backward of every micro-batch but the last,
    ``set_sync(True)`` before the last, then ``finish()`` before clipping and the step.
    ``None`` groups (size 1) make the corresponding reduction a no-op.
    """

    def __init__(self, params: Iterable[tuple[str, nn.Parameter]], dp_group: dist.ProcessGroup | None,
                 tp_group: dist.ProcessGroup | None = None, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        named = [(n, p) for n, p in params if p.requires_grad]
        self.params = [p for _, p in named]
        self.dp_group, self.tp_group = dp_group, tp_group
        self.tp_sum = [p for n, p in named if getattr(getattr(p, "_rankctl_meta", None), "tp_grad_sum", False)]
        self.sync = True
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[nn.Parameter, int] = {}
        self._next_launch = 0
        self._hooks: list[Any] = []
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            self._build(bucket_bytes)

    def _build(self, bucket_bytes: int) -> None:
        for b, idx in enumerate(plan_buckets(self.params, bucket_bytes)):
            ps = [self.params[i] for i in idx]
            self.buckets.append(Bucket(params=ps, numel=sum(p.numel() for p in ps)))
            for p in ps:
                self._bucket_of[p] = b
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def set_sync(self, sync: bool) -> None:
        """Whether the next backward is the last of the step (its gradients get reduced)."""
        self.sync = sync

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync:
            return
        bucket = self.buckets[self._bucket_of[p]]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Launch buckets in index order while the next one is complete (or ``force``)."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if not force and bucket.ready < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        p0 = bucket.params[0]
        if bucket.buffer is None:
            bucket.buffer = torch.empty(bucket.numel, dtype=p0.dtype, device=p0.device)
        offset = 0
        for p in bucket.params:
            view = bucket.buffer[offset: offset + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            offset += p.numel()
        bucket.handle = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.dp_group, async_op=True)

    def finish(self) -> None:
        """Wait for every bucket, write the sums into ``.grad``, then the TP sums; reset."""
        self._launch_ready(force=True)
        for bucket in self.buckets:
            bucket.handle.wait()
            offset = 0
            for p in bucket.params:
                flat = bucket.buffer[offset: offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = flat.clone()
                else:
                    p.grad.copy_(flat)
                offset += p.numel()
            bucket.ready, bucket.handle = 0, None
        self._next_launch = 0
        self._sum_over_tp()

    def _sum_over_tp(self) -> None:
        if not self.tp_sum or self.tp_group is None or dist.get_world_size(self.tp_group) == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.tp_sum]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.tp_group)
        offset = 0
        for p in self.tp_sum:
            p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


class GradReducers:
    """Several ``GradReducer`` s (dense and expert) driven as one: the same interface."""

    def __init__(self, reducers: Iterable[GradReducer]) -> None:
        self.reducers = list(reducers)

    def set_sync(self, sync: bool) -> None:
        for r in self.reducers:
            r.set_sync(sync)

    def finish(self) -> None:
        for r in self.reducers:
            r.finish()

    def remove_hooks(self) -> None:
        for r in self.reducers:
            r.remove_hooks()
