"""The ``train`` kind's spec sections: ``model`` (and ``model.moe``) and ``train``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt

from rankctl.contract import limits as L
from rankctl.contract import model as D
from rankctl.contract.spec import Section

BUILTIN_PYDOC = "builtin:pydoc"


class MoeSpec(Section):
    experts: StrictInt = Field(ge=1, le=L.MAX_EXPERTS)
    top_k: StrictInt = Field(D.MOE_TOP_K, ge=1, le=L.MAX_EXPERTS)
    every: StrictInt = Field(D.MOE_EVERY, ge=1, le=L.MAX_LAYERS)
    aux_loss: StrictFloat = Field(D.MOE_AUX_LOSS, ge=0)
    capacity_factor: StrictFloat | None = Field(D.MOE_CAPACITY_FACTOR, gt=0, le=L.MAX_CAPACITY_FACTOR)


class ModelSpec(Section):
    layers: StrictInt = Field(4, ge=1, le=L.MAX_LAYERS)
    hidden: StrictInt = Field(128, ge=1, le=L.MAX_HIDDEN)
    heads: StrictInt = Field(4, ge=1, le=L.MAX_HEADS)
    ffn_hidden: StrictInt | None = Field(D.FFN_HIDDEN, ge=1, le=L.MAX_FFN_HIDDEN)
    seq_len: StrictInt = Field(128, ge=1, le=L.MAX_SEQ_LEN)
    vocab: StrictInt = Field(256, ge=1, le=L.MAX_VOCAB)
    position_embedding: Literal["learned", "rope"] = D.POSITION_EMBEDDING
    tie_embeddings: StrictBool = D.TIE_EMBEDDINGS
    moe: MoeSpec | None = None


class TrainSpec(Section):
    steps: StrictInt = Field(20, ge=1, le=L.MAX_STEPS)
    global_batch: StrictInt = Field(16, ge=1, le=L.MAX_BATCH)
    micro_batch: StrictInt = Field(2, ge=1, le=L.MAX_BATCH)
    lr: StrictFloat = Field(3.0e-4, gt=0)
    warmup: StrictInt = Field(2, ge=0, le=L.MAX_STEPS)
    grad_clip: StrictFloat = Field(1.0, ge=0)
    seed: StrictInt = Field(1234, ge=L.MIN_SEED, le=L.MAX_SEED)
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    data: str = BUILTIN_PYDOC
    eval_every: StrictInt = Field(0, ge=0, le=L.MAX_STEPS)
    checkpoint_every: StrictInt = Field(0, ge=0, le=L.MAX_STEPS)
    # every K steps a copy of the rank's state in the node's memory (tmpfs), replicated to a peer node;
    # a restart resumes from it (0: off)
    snapshot_every: StrictInt = Field(0, ge=0, le=L.MAX_STEPS)
    resume: StrictBool = False
    # stop cleanly after this step with a checkpoint (Megatron's --exit-interval); the schedule (lr) stays that of
    # ``steps``, so a later run with ``resume: true`` goes on exactly as an uninterrupted one
    stop_at: StrictInt | None = Field(None, ge=1, le=L.MAX_STEPS)
    # where checkpoints go: an absolute directory every node reads (a shared filesystem), ``{dir}/{job name}``;
    # unset: each node's own state dir. A resume under another layout needs it (every rank reads old files)
    checkpoint_dir: str | None = Field(None, min_length=1, max_length=4096)   # Linux PATH_MAX
    # a fresh run's start: a serial state dict (``ctl checkpoint export``) or another job's checkpoints (its
    # checkpoint directory, or one step's), under any layout; an absolute path. The optimizer starts fresh
    # unless ``init_optimizer`` asks for the checkpoint's AdamW state (a serial state dict has none)
    init_from: str | None = Field(None, min_length=1, max_length=4096)
    init_optimizer: StrictBool = False
