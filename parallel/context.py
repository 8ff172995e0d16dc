"""Context parallelism (CP): a load-balanced sequence split and ring attention.

Split. Each sequence of length T is cut into ``2·cp`` equal chunks; CP rank i holds chunks
``i`` and ``2·cp−1−i``, concatenated in that order (:func:`cp_indices`). Under a causal mask
an early chunk is cheap and a late one dear, so pairing them gives every rank the same
number of unmasked (query, key) pairs. Token positions (learned or RoPE) follow each token's
*global* index: the model receives ``positions = cp_indices(...)`` (:func:`cp_shard_batch`).

Ring attention (:func:`ring_attention`). Each rank keeps its queries; the K/V blocks travel
round the CP ring (send to the next rank, receive from the previous one, point-to-point with
global peer ranks taken from the group), the transfer of the next block overlapping the
compute on the current one. A block's contribution is merged into the running result with
its log-sum-exp (online softmax), and masking uses the global positions, which travel with
their block. The local sequence is cut into two tiles (one per chunk): a tile pair whose
every key comes after every query is skipped, one whose every key comes before every query
needs no mask. Backward recomputes each tile pair from the saved LSE; dK/dV accumulate as
they travel with their K/V block and arrive home after ``cp`` transfers.

Loss and gradients. Each CP rank returns the SUM of its local tokens' losses; the sum over
the CP group is the serial loss. Parameter gradients are partial sums too, so the trainer
SUM-reduces them over ``dp_cp`` (after dividing the loss by the global token count), with
no extra averaging over cp.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

KV_TAG, GRAD_TAG = 0, 1  # tags of the K/V (and positions) and dK/dV messages


# -- load-balanced split ---------------------------------------------------------------------

def cp_indices(seq_len: int, cp: int, rank: int, device: torch.device | str | None = None) -> Tensor:
    """Global indices (int64, ``seq_len // cp``) of the tokens CP rank ``rank`` holds."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is outside 0..{cp - 1}")
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp={2 * cp}")
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    idx = torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])
    return idx.to(device) if device is not None else idx


def split_for_cp(x: Tensor, dim: int, cp: int, rank: int) -> Tensor:
    """CP rank ``rank``'s part of ``x`` along the sequence dimension ``dim``."""
    if cp == 1:
        return x
    return x.index_select(dim, cp_indices(x.size(dim), cp, rank, x.device))


def gather_from_cp(parts: list[Tensor], dim: int) -> Tensor:
    """Inverse of :func:`split_for_cp`: the full sequence from every rank's part, in rank order."""
    cp = len(parts)
    seq_len = parts[0].size(dim) * cp
    order = torch.cat([cp_indices(seq_len, cp, r) for r in range(cp)]).to(parts[0].device)
    return torch.cat(parts, dim).index_select(dim, torch.argsort(order))


def cp_shard_batch(tokens: Tensor, targets: Tensor, cp_group_size: int,
                   cp_rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """A micro-batch (B, T) -> this CP rank's (tokens, targets, positions), T/cp tokens each.

    ``positions`` (T/cp,) int64 holds the global indices; pass it to the model.
    """
    positions = cp_indices(tokens.size(1), cp_group_size, cp_rank, tokens.device)
    if cp_group_size == 1:
        return tokens, targets, positions
    return tokens.index_select(1, positions), targets.index_select(1, positions), positions


# -- block math (fp32) ----------------------------------------------------------------------

def _tiles(x: Tensor, n: int, dim: int) -> list[Tensor]:
    return list(x.tensor_split(n, dim)) if x.size(dim) % n == 0 else [x]


def _tile_mask(q_pos: Tensor, k_pos: Tensor) -> tuple[str, Tensor | None]:
    """How a query tile sees a key tile: ``skip`` (every key after every query), ``full``
    (none after), ``causal`` (the same positions: a square causal tile), else ``mask``."""
    if k_pos.min() > q_pos.max():
        return "skip", None
    if k_pos.max() <= q_pos.min():
        return "full", None
    if torch.equal(q_pos, k_pos) and bool((q_pos.diff(dim=-1) > 0).all()):
        return "causal", None
    mask = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)  # (Tq, Tk) or (B, Tq, Tk)
    return "mask", mask.unsqueeze(-3) if mask.dim() == 3 else mask


def _fused(q: Tensor, kind: str) -> bool:
    """Use torch's fused CPU flash kernels (no (Tq, Tk) scores kept) for unmasked or
    square-causal tiles; other devices and masks take the explicit path below."""
    return kind in ("full", "causal") and q.device.type == "cpu" and q.dtype == torch.float32


def _scores(q: Tensor, k: Tensor, kind: str, mask: Tensor | None, scale: float) -> Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, nh, Tq, Tk)
    if kind == "causal":
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _finite(lse: Tensor) -> Tensor:
    return lse.masked_fill(lse == float("-inf"), 0.0)


def block_forward(q: Tensor, k: Tensor, v: Tensor, kind: str, mask: Tensor | None,
                  scale: float) -> tuple[Tensor, Tensor]:
    """Softmax attention of one tile pair: (out (B, nh, Tq, hs), lse (B, nh, Tq)); a row with
    no visible key gives out 0, lse -inf."""
    if _fused(q, kind):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, kind == "causal", scale=scale)
    s = _scores(q, k, kind, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.matmul(p, v), lse


def merge(out: Tensor | None, lse: Tensor | None, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial softmax results over disjoint key sets by their log-sum-exps."""
    if out is None or lse is None:
        return out_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    ref = _finite(new)
    w_a, w_b = torch.exp(lse - ref).unsqueeze(-1), torch.exp(lse_b - ref).unsqueeze(-1)
    return out * w_a + out_b * w_b, new


def block_backward(q: Tensor, k: Tensor, v: Tensor, kind: str, mask: Tensor | None, scale: float,
                   out: Tensor, lse: Tensor, dout: Tensor, delta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one tile pair, recomputing its probabilities from the *final* ``out``
    and ``lse``; ``delta`` = rowsum(dout · out)."""
    if _fused(q, kind):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, kind == "causal", scale=scale)
    p = torch.exp(_scores(q, k, kind, mask, scale) - _finite(lse).unsqueeze(-1))  # (B, nh, Tq, Tk)
    dv = torch.matmul(p.transpose(-2, -1), dout)
    ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - delta.unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv


# -- ring communication -------------------------------------------------------------------

class Ring:
    """Point-to-point neighbours of this rank in its CP group (global ranks)."""

    def __init__(self, group: "dist.ProcessGroup | None") -> None:
        self.group = group
        ranks = dist.get_process_group_ranks(group) if group is not None else [0]
        me = dist.get_rank(group) if group is not None else 0
        self.size = len(ranks)
        self.next, self.prev = ranks[(me + 1) % self.size], ranks[(me - 1) % self.size]

    def shift(self, tensors: list[Tensor], tag: int) -> "InFlight":
        """Start sending ``tensors`` to the next rank and receiving as many (same shapes) from
        the previous one."""
        ops, sent, received = [], [], []
        for i, t in enumerate(tensors):
            sent.append(t.contiguous())
            received.append(torch.empty_like(sent[-1]))
            ops.append(dist.P2POp(dist.isend, sent[-1], self.next, self.group, tag + 4 * i))
            ops.append(dist.P2POp(dist.irecv, received[-1], self.prev, self.group, tag + 4 * i))
        return InFlight(received, dist.batch_isend_irecv(ops), sent)


class InFlight:
    """A started ring transfer; ``wait()`` gives the received tensors. Keeps the sent ones
    alive until then."""

    def __init__(self, received: list[Tensor], works: list[Any], sent: list[Tensor]) -> None:
        self.received, self.works, self.sent = received, works, sent

    def wait(self) -> list[Tensor]:
        for w in self.works:
            w.wait()
        self.sent = []
        return self.received


# -- the autograd function -----------------------------------------------------------------

class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
                group: "dist.ProcessGroup | None", n_tiles: int) -> Tensor:
        ring, scale = Ring(group), 1.0 / math.sqrt(q.size(-1))
        qf, kv, k_pos = q.float(), torch.stack([k, v]), positions
        q_tiles, q_pos = _tiles(qf, n_tiles, 2), _tiles(positions, n_tiles, -1)
        acc: list[tuple[Tensor | None, Tensor | None]] = [(None, None)] * len(q_tiles)
        seen_pos = []
        for step in range(ring.size):
            pending = ring.shift([kv, k_pos], KV_TAG) if step < ring.size - 1 else None
            seen_pos.append(k_pos)
            k_tiles, v_tiles = _tiles(kv[0].float(), n_tiles, 2), _tiles(kv[1].float(), n_tiles, 2)
            for kt, vt, kp in zip(k_tiles, v_tiles, _tiles(k_pos, n_tiles, -1)):
                for i, (qt, qp) in enumerate(zip(q_tiles, q_pos)):
                    kind, mask = _tile_mask(qp, kp)
                    if kind != "skip":
                        acc[i] = merge(*acc[i], *block_forward(qt, kt, vt, kind, mask, scale))
            if pending is not None:
                kv, k_pos = pending.wait()
        B, nh, T, hs = q.shape
        out = q.new_empty(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs) stored as (B, T, nh, hs):
        for ot, (o, _) in zip(_tiles(out, n_tiles, 2), acc):  # the layer's reshape is then a view
            ot.copy_(o)
        lse = torch.cat([s for _, s in acc], 2)  # (B, nh, T) fp32
        ctx.save_for_backward(q, k, v, out, lse, *seen_pos)
        ctx.ring, ctx.n_tiles, ctx.scale = ring, n_tiles, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, *seen_pos = ctx.saved_tensors
        ring, n = ctx.ring, ctx.n_tiles
        dout, out = dout.float(), out.float()
        delta = (dout * out).sum(-1)  # (B, nh, T)
        qf, kv = q.float(), torch.stack([k, v])
        dq = torch.zeros_like(qf)
        rows = list(zip(_tiles(qf, n, 2), _tiles(seen_pos[0], n, -1), _tiles(out, n, 2), _tiles(lse, n, 2),
                        _tiles(dout, n, 2), _tiles(delta, n, 2), _tiles(dq, n, 2)))
        incoming: InFlight | None = None
        for step in range(ring.size):
            pending = ring.shift([kv], KV_TAG) if step < ring.size - 1 else None
            dkv = _block_grads(rows, kv.float(), seen_pos[step], n, ctx.scale)  # fills dq in place
            if incoming is not None:
                dkv.add_(incoming.wait()[0])  # the block's dK/dV from the ranks it visited before
            incoming = ring.shift([dkv], GRAD_TAG) if ring.size > 1 else InFlight([dkv], [], [])
            if pending is not None:
                kv = pending.wait()[0]
        dkv = incoming.wait()[0]  # this rank's own block, home after cp transfers
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _block_grads(rows: list[tuple[Tensor, ...]], kv: Tensor, k_pos: Tensor, n: int, scale: float) -> Tensor:
    """dK/dV (stacked, fp32) of one travelling block; adds its dQ into the ``rows`` views."""
    dkv = torch.zeros_like(kv)
    k_tiles, v_tiles = _tiles(kv[0], n, 2), _tiles(kv[1], n, 2)
    dk_tiles, dv_tiles = _tiles(dkv[0], n, 2), _tiles(dkv[1], n, 2)
    for kt, vt, kp, dkt, dvt in zip(k_tiles, v_tiles, _tiles(k_pos, n, -1), dk_tiles, dv_tiles):
        for qt, qp, ot, lt, dot, dt, dqt in rows:
            kind, mask = _tile_mask(qp, kp)
            if kind == "skip":
                continue
            dq_b, dk_b, dv_b = block_backward(qt, kt, vt, kind, mask, scale, ot, lt, dot, dt)
            dqt.add_(dq_b)
            dkt.add_(dk_b)
            dvt.add_(dv_b)
    return dkv


def ring_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
                   group: "dist.ProcessGroup | None", n_tiles: int = 2) -> Tensor:
    """Causal attention of local q, k, v (B, nh, T/cp, hs) over the whole sequence of the CP
    ``group`` (None: this rank alone). ``positions`` (T/cp,) or (B, T/cp): global token indices.
    Every member must call it with the same shapes. Returns (B, nh, T/cp, hs)."""
    return _RingAttention.apply(q, k, v, positions, group, n_tiles)
