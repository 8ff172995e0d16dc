"""The pipeline interpreter: runs one stage's action list (``parallel.schedules``) with p2p.

``pipeline_step(chunks, actions, micro_batches, pgs, loss_scale=...)`` runs one training
step's forwards and backwards on this rank and returns the loss sums of the micro-batches
(on the stage with the head; ``[]`` elsewhere):

* FORWARD of (micro-batch i, local chunk c): the chunk with the embedding reads the tokens,
  any other reads the activation received for (i, c); the chunk with the head computes the
  fp32 loss *sum* of the micro-batch (``models.gpt`` loss contract) and keeps
  ``loss_sum * loss_scale`` as its output, so with ``loss_scale = 1 / global tokens`` the
  gradients are this rank's share of the gradient of the global mean loss;
* BACKWARD: ``torch.autograd.backward(output, grad)`` with the gradient received for the
  output (none for the loss); the input's ``.grad`` is what SEND_BWD sends upstream;
* a maximal run of send/recv actions is one ``batch_isend_irecv`` to the neighbours in the
  ``pp`` group (global ranks ``pgs.ranks("pp")[peer]``), waited on as a whole.

Activations are ``(micro_batch, T, hidden)`` in the chunks' parameter dtype, with ``T`` the
micro-batch's sequence length divided by tp under sequence parallelism (each TP rank sends
its own sequence slice to the TP rank with the same index on the next stage; without SP
all TP ranks send the same full activation).

Gradient accumulation hook: ``before_backward(chunk, last)`` is called before every BACKWARD;
``last`` is True for the chunk's final backward of the step (turn DP gradient sync on then).

Evaluation: ``forward_only=True`` runs only the forwards and their sends/receives (the
schedule's forward prefix: ``forward_actions``) without autograd, dropping each activation
once it is sent; use the ``gpipe`` actions (every forward first).

Trainer use (one rank; ``p`` = spec.parallel, ``m`` = global_batch / (micro_batch * dp))::

    stage = pgs.local_rank("pp")
    chunks = build_chunks(spec.model, pp=p.pp, vpp=p.vpp, stage=stage, tp_group=pgs.get("tp"),
                          sequence_parallel=p.sequence_parallel, seed=t.seed, device=device)
    actions = stage_actions(p.schedule, PipelineShape(pp=p.pp, vpp=p.vpp or 1, microbatches=m),
                            stage)  # 1f1b with vpp > 1 is the interleaved schedule
    reducer = GradReducer([np for c in chunks for np in c.named_parameters()],
                          pgs.get("dp_cp"), pgs.get("tp"))
    init_p2p(pgs, device)                        # once
    for each step:                               # zero grads first
        sums = pipeline_step(chunks, actions, micro_batches, pgs,
                             loss_scale=1 / (global_batch * seq_len),
                             before_backward=lambda c, last: reducer.set_sync(last))
        reducer.finish()
        sync_embedding_grads(chunks, pgs)        # models.embedding_sync
        clip (norm over tp and pp, without embedding_sync.duplicate_params), optimizer step
        loss = sum(sums) / (global_batch * seq_len) on the last stage, summed over dp_cp
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from rankctl.parallel.groups import ProcessGroups
from rankctl.parallel.schedules import Action, Kind, batches, last_backward

MicroBatch = tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor | None]  # tokens, targets[, positions]
BackwardHook = Callable[[int, bool], None]
Key = tuple[int, int]  # (micro-batch, local chunk)


class ShardedModel(Protocol):
    """What the interpreter needs of a model chunk (``models.shard.ShardedModel`` is one);
    a protocol, so that ``parallel`` does not import ``models``."""

    module: Any  # has_embedding, has_head, parameters()
    tp: Any      # sequence_parallel, size
    config: Any  # hidden

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor: ...


def activation_shape(chunk: ShardedModel, tokens: Tensor) -> tuple[int, int, int]:
    """The shape of the activation a chunk receives or sends for this micro-batch's tokens."""
    b, t = tokens.shape
    if chunk.tp.sequence_parallel and chunk.tp.size > 1:
        t //= chunk.tp.size
    return b, t, chunk.config.hidden


@dataclass
class _Step:
    """State of one step on one rank: what is in flight between actions."""

    chunks: Sequence[ShardedModel]
    micro_batches: Sequence[MicroBatch]
    loss_scale: float
    dtype: torch.dtype | None = None  # of activations; None: the chunk's parameter dtype
    keep_graph: bool = True  # False (forward only): drop activations once used or sent
    inputs: dict[Key, Tensor] = field(default_factory=dict)  # received activations (leaves)
    outputs: dict[Key, Tensor] = field(default_factory=dict)  # forward outputs, until backward
    out_grads: dict[Key, Tensor] = field(default_factory=dict)  # received gradients of outputs
    losses: dict[int, Tensor] = field(default_factory=dict)  # loss sums (no sync per micro-batch)

    def forward(self, a: Action) -> None:
        key, chunk = (a.microbatch, a.chunk), self.chunks[a.chunk]
        tokens, targets, *rest = self.micro_batches[a.microbatch]
        positions = rest[0] if rest else None
        x = tokens if chunk.module.has_embedding else self.inputs[key]
        if not self.keep_graph:
            self.inputs.pop(key, None)
        if not chunk.module.has_head:
            self.outputs[key] = chunk(x, positions=positions)
            return
        loss_sum = chunk(x, targets, positions=positions)
        self.losses[a.microbatch] = loss_sum.detach()
        if self.keep_graph:
            self.outputs[key] = loss_sum * self.loss_scale

    def backward(self, a: Action) -> None:
        key = (a.microbatch, a.chunk)
        out = self.outputs.pop(key)
        grad = self.out_grads.pop(key, None)
        if grad is None and out.dim() != 0:
            raise RuntimeError(f"no gradient was received for the output of {a}")
        torch.autograd.backward(out, grad)

    def p2p_op(self, a: Action, peers: list[int], group: "dist.ProcessGroup | None") -> dist.P2POp:
        key, chunk = (a.microbatch, a.chunk), self.chunks[a.chunk]
        if a.kind is Kind.SEND_FWD:
            return dist.P2POp(dist.isend, self.outputs[key].detach().contiguous(), peers[a.peer], group)
        if a.kind is Kind.SEND_BWD:
            x = self.inputs.pop(key)
            grad = x.grad if x.grad is not None else torch.zeros_like(x)
            return dist.P2POp(dist.isend, grad.contiguous(), peers[a.peer], group)
        tokens = self.micro_batches[a.microbatch][0]
        dtype = self.dtype or next(chunk.module.parameters()).dtype
        buf = torch.empty(activation_shape(chunk, tokens), dtype=dtype, device=tokens.device)
        if a.kind is Kind.RECV_FWD:
            self.inputs[key] = buf.requires_grad_()
        else:
            self.out_grads[key] = buf
        return dist.P2POp(dist.irecv, buf, peers[a.peer], group)


def forward_actions(actions: Sequence[Action]) -> list[Action]:
    """The forwards of ``actions`` and the sends/receives of activations, in order."""
    return [a for a in actions if a.kind in (Kind.FORWARD, Kind.SEND_FWD, Kind.RECV_FWD)]


def exchange(ops: list[dist.P2POp]) -> None:
    """Post a batch of sends and receives together and wait for all of them."""
    for req in dist.batch_isend_irecv(ops):
        req.wait()


def init_p2p(pgs: ProcessGroups, device: torch.device | str = "cpu") -> None:
    """Once per process before the first step: one collective over the ``pp`` group.
    NCCL creates communicators lazily, and a group's first communication must involve all
    of its ranks, which a stage's first p2p batch does not (harmless, and cheap, on gloo)."""
    group = pgs.get("pp") if "pp" in pgs else None
    if group is not None:
        dist.all_reduce(torch.zeros(1, device=device), group=group)


def pipeline_step(chunks: Sequence[ShardedModel], actions: Sequence[Action],
                  micro_batches: Sequence[MicroBatch], pgs: ProcessGroups, *, loss_scale: float,
                  before_backward: BackwardHook | None = None,
                  dtype: torch.dtype | None = None, forward_only: bool = False) -> list[float]:
    """Run this rank's ``actions`` (from ``schedules.stage_actions(name, shape,
    pgs.local_rank("pp"))``) over ``micro_batches`` (every rank passes the full list;
    only the first stage reads the tokens and only the last the targets).

    Returns the micro-batches' loss sums (unscaled) on the rank holding the head, else [].
    Gradients accumulate into the chunks' ``.grad``; reducing them is the caller's job.
    ``dtype``: of the activations exchanged (default: the chunks' parameter dtype).
    ``forward_only``: run only ``forward_actions(actions)``, without autograd (evaluation).
    """
    if forward_only:
        with torch.no_grad():
            return _run(chunks, forward_actions(actions), micro_batches, pgs,
                        _Step(chunks, micro_batches, loss_scale, dtype, keep_graph=False), None)
    return _run(chunks, actions, micro_batches, pgs, _Step(chunks, micro_batches, loss_scale, dtype),
                before_backward)


def _run(chunks: Sequence[ShardedModel], actions: Sequence[Action], micro_batches: Sequence[MicroBatch],
         pgs: ProcessGroups, step: _Step, before_backward: BackwardHook | None) -> list[float]:
    if any(a.chunk >= len(chunks) or a.microbatch >= len(micro_batches) for a in actions):
        raise ValueError(f"the actions name chunks or micro-batches beyond the {len(chunks)} chunks "
                         f"and {len(micro_batches)} micro-batches given")
    peers = pgs.ranks("pp") if "pp" in pgs else [pgs.rank]
    group = pgs.get("pp") if "pp" in pgs else None
    last = {i: c for c, i in last_backward(list(actions)).items()}
    index = 0
    for batch in batches(list(actions)):
        first = batch[0]
        if first.kind is Kind.FORWARD:
            step.forward(first)
        elif first.kind is Kind.BACKWARD:
            if before_backward is not None:
                before_backward(first.chunk, index in last)
            step.backward(first)
        else:
            exchange([step.p2p_op(a, peers, group) for a in batch])
            if not step.keep_graph:
                for a in batch:
                    if a.kind is Kind.SEND_FWD:
                        step.outputs.pop((a.microbatch, a.chunk))
        index += len(batch)
    if step.outputs or step.inputs or step.out_grads:
        raise RuntimeError(f"actions left state behind: outputs {sorted(step.outputs)}, "
                           f"inputs {sorted(step.inputs)}, gradients {sorted(step.out_grads)}")
    return [step.losses[i].item() for i in sorted(step.losses)]
