"""How the GPT's layers split into pipeline chunks, and one rank's chunks built as shards.

With ``pp`` stages of ``vpp`` chunks each there are ``V = pp*vpp`` model chunks of
``layers / V`` consecutive layers (``kinds.train.checks`` rejects layer counts that do not
divide). Local chunk ``c`` of pipeline stage ``s`` holds model chunk ``v = c*pp + s``
(Megatron's interleaving; ``parallel.schedules`` uses the same numbering):

* model chunk 0 (chunk 0 of stage 0) holds the word embedding and, when learned, the
  position embedding;
* model chunk V-1 (chunk vpp-1 of stage pp-1) holds ``ln_f``, the head and the loss.

Tied word embeddings with pp > 1: the last stage's head gets its own ``head.weight``,
initialised from ``wte.weight``'s seed (``GPT.init_key``), so both copies start equal;
``parallel.embedding_sync`` sums their gradients over the ``embd`` group so they stay equal.
Module and parameter names are the serial model's (``layers.<global index>...``).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from rankctl.models.gpt import GPTConfig, Stage
from rankctl.models.shard import ShardedModel, build_shard


def chunk_stage(layers: int, pp: int, vpp: int, stage: int, chunk: int) -> Stage:
    """The ``Stage`` (layer range, embedding, head) of local ``chunk`` of pipeline ``stage``."""
    chunks = pp * vpp
    if layers % chunks:
        raise ValueError(f"model.layers={layers} is not divisible by pp*vpp={chunks} (pp={pp}, vpp={vpp})")
    if not (0 <= stage < pp and 0 <= chunk < vpp):
        raise ValueError(f"stage={stage}, chunk={chunk} is outside pp={pp}, vpp={vpp}")
    v, per = chunk * pp + stage, layers // chunks
    return Stage(first=v * per, last=(v + 1) * per, has_embedding=v == 0, has_head=v == chunks - 1)


def stage_chunks(layers: int, pp: int, vpp: int, stage: int) -> list[Stage]:
    return [chunk_stage(layers, pp, vpp, stage, c) for c in range(vpp)]


def build_chunks(model_cfg: GPTConfig | Any, *, pp: int, vpp: int | None, stage: int,
                 tp_group: "dist.ProcessGroup | None" = None, sequence_parallel: bool = False,
                 seed: int = 0, **shard_kwargs: Any) -> list[ShardedModel]:
    """This rank's model chunks (``vpp`` of them, or one), in local chunk order.

    ``stage`` is the rank's pp coordinate (``pgs.local_rank("pp")``); other keyword
    arguments go to ``build_shard`` (``device``, ``mlp``, ``tp`` ...).
    """
    cfg = model_cfg if isinstance(model_cfg, GPTConfig) else GPTConfig.from_spec(model_cfg)
    return [build_shard(cfg, tp_group, sequence_parallel, seed, stage=st, **shard_kwargs)
            for st in stage_chunks(cfg.layers, pp, vpp or 1, stage)]
