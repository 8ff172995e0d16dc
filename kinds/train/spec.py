"""The ``train`` kind's spec sections: ``model`` (and ``model.moe``) and ``train``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt

from rankctl.contract import limits as L
from rankctl.contract import model as D
from rankctl.contract.spec import Section

BUILTIN_PYDOC = "builtin:pydoc"


class MoeSpec(Section):
    """Mixture of experts: some layers' MLP is a set of experts, each token routed to the best ``top_k``."""

    experts: StrictInt = Field(ge=1, le=L.MAX_EXPERTS)
    """Experts in each mixture-of-experts layer."""
    top_k: StrictInt = Field(D.MOE_TOP_K, ge=1, le=L.MAX_EXPERTS)
    """Experts each token is routed to."""
    every: StrictInt = Field(D.MOE_EVERY, ge=1, le=L.MAX_LAYERS)
    """Layer i is a mixture-of-experts layer when i % every == 0 (Megatron's moe_layer_freq)."""
    aux_loss: StrictFloat = Field(D.MOE_AUX_LOSS, ge=0)
    """Weight of the load-balancing loss added to the training loss."""
    capacity_factor: StrictFloat | None = Field(D.MOE_CAPACITY_FACTOR, gt=0, le=L.MAX_CAPACITY_FACTOR)
    """Per sequence, an expert takes at most ceil(capacity_factor x top_k x tokens / experts) assignments, in token
    order; later ones are dropped. null: no limit."""


class ModelSpec(Section):
    """The GPT model each rank builds its own shard of."""

    layers: StrictInt = Field(4, ge=1, le=L.MAX_LAYERS)
    """Transformer layers."""
    hidden: StrictInt = Field(128, ge=1, le=L.MAX_HIDDEN)
    """Hidden size."""
    heads: StrictInt = Field(4, ge=1, le=L.MAX_HEADS)
    """Attention heads (divisible by ``parallel.tp``)."""
    ffn_hidden: StrictInt | None = Field(D.FFN_HIDDEN, ge=1, le=L.MAX_FFN_HIDDEN)
    """The MLP's inner size. null: 4 x ``hidden``."""
    seq_len: StrictInt = Field(128, ge=1, le=L.MAX_SEQ_LEN)
    """Tokens in each sample."""
    vocab: StrictInt = Field(256, ge=1, le=L.MAX_VOCAB)
    """Vocabulary size (byte-level by default), padded to a multiple of ``parallel.tp``."""
    position_embedding: Literal["learned", "rope"] = D.POSITION_EMBEDDING
    """Position embedding: learned (absolute) or rope (rotary)."""
    tie_embeddings: StrictBool = D.TIE_EMBEDDINGS
    """The output layer shares the input embedding's weights."""
    moe: MoeSpec | None = None
    """Mixture of experts. null: every layer's MLP is dense."""


class TrainSpec(Section):
    """The training run: steps, batches, optimizer, data, evaluation and checkpoints."""

    steps: StrictInt = Field(20, ge=1, le=L.MAX_STEPS)
    """Optimizer steps of the whole run (the learning-rate schedule's length)."""
    global_batch: StrictInt = Field(16, ge=1, le=L.MAX_BATCH)
    """Samples per step across the data-parallel ranks (gradient accumulation makes up the rest)."""
    micro_batch: StrictInt = Field(2, ge=1, le=L.MAX_BATCH)
    """Samples per forward and backward pass on one rank."""
    lr: StrictFloat = Field(3.0e-4, gt=0)
    """Peak learning rate of AdamW (linear warm-up, then cosine decay)."""
    warmup: StrictInt = Field(2, ge=0, le=L.MAX_STEPS)
    """Steps of linear learning-rate warm-up."""
    grad_clip: StrictFloat = Field(1.0, ge=0)
    """Clip the global gradient norm to this (0: no clipping)."""
    seed: StrictInt = Field(1234, ge=L.MIN_SEED, le=L.MAX_SEED)
    """Seed of the weights and the data order: the same seed gives the same losses under any layout."""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute precision: auto (bf16 on GPUs, fp32 on CPUs), fp32 or bf16."""
    data: str = BUILTIN_PYDOC
    """The training text: builtin:pydoc, a path to UTF-8 text, or a path to a uint16 token file."""
    eval_every: StrictInt = Field(0, ge=0, le=L.MAX_STEPS)
    """Held-out loss (val_loss) every this many steps and at the last (0: none)."""
    checkpoint_every: StrictInt = Field(0, ge=0, le=L.MAX_STEPS)
    """A sharded checkpoint every this many steps (0: none but a drain's or a stop's)."""
    snapshot_every: StrictInt = Field(0, ge=0, le=L.MAX_STEPS)
    """Every this many steps a copy of each rank's state in its node's memory, replicated to a peer node; a
    restart resumes from it (0: off)."""
    resume: StrictBool = False
    """Continue from the newest checkpoint every rank holds intact, saved under any layout of the same run."""
    stop_at: StrictInt | None = Field(None, ge=1, le=L.MAX_STEPS)
    """Stop cleanly after this step with a checkpoint (Megatron's --exit-interval); the schedule stays that of
    ``steps``, so a later run with ``resume: true`` goes on as an uninterrupted one would."""
    checkpoint_dir: str | None = Field(None, min_length=1, max_length=4096)   # Linux PATH_MAX
    """Where checkpoints go: an absolute directory every node reads (a shared filesystem), as {dir}/{job name}.
    null: each node's own state dir (a resume under another layout then needs a shared one)."""
    init_from: str | None = Field(None, min_length=1, max_length=4096)
    """A fresh run's starting weights: a serial state dict (``ctl checkpoint export``) or another job's checkpoints
    (its checkpoint directory, or one step's), under any layout; an absolute path."""
    init_optimizer: StrictBool = False
    """With ``init_from``: start from the checkpoint's AdamW state too (a serial state dict has none)."""
