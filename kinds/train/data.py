"""Byte-level tokens and the deterministic sampler behind every layout's identical batches.

Tokenizer: one token per UTF-8 byte (ids 0..255, ``VOCAB = 256``).

Sources (``train.data``):

* ``builtin:pydoc``: the documentation text that ships with CPython
  (``pydoc_data.topics.topics``, values concatenated in sorted key order, ~470 KB);
* a path ending in ``.bin`` or ``.u16``: a flat file of little-endian uint16 token ids
  (nanoGPT / Megatron style), read through ``numpy.memmap``;
* any other path: a UTF-8 text file, tokenised byte by byte.

The last ``VAL_FRACTION`` of the tokens is held out for validation.

Sampling (the numerical contract): sample ``i`` of step ``s`` is a pure function of
``(seed, s, i)``: a start offset drawn by ``numpy.random.default_rng((seed, s, i, stream))``
in ``[0, N - T - 1]``, inputs ``tokens[off:off+T]``, targets shifted by one. A DP rank
takes its contiguous slice of the global batch and cuts it into micro-batches, so any
(dp, micro_batch) split sees exactly the serial run's samples. No torch in this module
until ``as_tensors``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from rankctl.contract.names import shown
from rankctl.kinds.train.spec import BUILTIN_PYDOC

if TYPE_CHECKING:
    import torch

VOCAB = 256
TOKEN_SUFFIXES = (".bin", ".u16")
MAX_PATH = 4096  # characters of a train.data path (Linux's PATH_MAX)
VAL_FRACTION = 0.05
TRAIN, VAL = 0, 1  # rng stream ids
_U64 = (1 << 64) - 1


class DataError(ValueError):
    """A data source that cannot be read or is too small for the model."""


# -- tokenizer --------------------------------------------------------------------------------

def encode(text: str) -> np.ndarray:
    """UTF-8 bytes as token ids, ``(N,)`` uint16."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def decode(tokens: np.ndarray | list[int]) -> str:
    """Token ids back to text (invalid UTF-8 sequences are replaced)."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


# -- sources ----------------------------------------------------------------------------------

def is_token_file(source: str) -> bool:
    return source.lower().endswith(TOKEN_SUFFIXES)


def data_problem(source: str) -> str | None:
    """Why ``source`` cannot name training data, from its text alone (one line), or None.

    Syntax only: this is what the coordinator and ``ctl`` check at submit. Whether the file exists, and
    its size, are looked at only on the node (``check_data_source``), so that no answer of the coordinator
    tells anything about the files of its host.
    """
    if source.startswith("builtin:"):
        if source != BUILTIN_PYDOC:
            return f"train.data={shown(source)}: unknown builtin data set; the builtin is {BUILTIN_PYDOC!r}"
        return None
    if not source:
        return f"train.data is empty: give {BUILTIN_PYDOC!r} or the path of a text or uint16 token file"
    if "\x00" in source:
        return f"train.data={shown(source)}: a path cannot hold a NUL character"
    if len(source) > MAX_PATH:
        return f"train.data={shown(source)}: longer than the {MAX_PATH} characters a path may have"
    return None


def check_data_source(source: str) -> str | None:
    """Why ``source`` cannot be used on this node (one line, naming ``train.data``), or None.

    Looks at the file: run only where the ranks read it (on the node, after the worker's sandbox check).
    """
    problem = data_problem(source)
    if problem:
        return problem
    if source.startswith("builtin:"):
        return _builtin_problem(source)
    if not os.path.exists(source):
        return f"train.data={source!r}: no such file"
    if not os.path.isfile(source):
        return f"train.data={source!r}: not a regular file"
    size = os.path.getsize(source)
    if size == 0:
        return f"train.data={source!r}: the file is empty"
    if is_token_file(source) and size % 2:
        return f"train.data={source!r}: a uint16 token file must have an even size, got {size} bytes"
    if not os.access(source, os.R_OK):
        return f"train.data={source!r}: not readable"
    return None


def _builtin_problem(source: str) -> str | None:
    if importlib.util.find_spec("pydoc_data") is None:
        return f"train.data={source!r}: this Python has no pydoc_data module"
    return None


@lru_cache(maxsize=1)
def pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))


def load_tokens(source: str) -> np.ndarray:
    """All tokens of ``source``, ``(N,)`` (a read-only memmap for token files)."""
    problem = check_data_source(source)
    if problem:
        raise DataError(problem)
    if source == BUILTIN_PYDOC:
        return encode(pydoc_text())
    if is_token_file(source):
        return np.memmap(source, dtype=np.dtype("<u2"), mode="r")
    with open(source, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8).astype(np.uint16)


# -- deterministic sampling -------------------------------------------------------------------

@dataclass(frozen=True)
class TokenDataset:
    """Train and validation token streams and the sampler (one instance per rank)."""

    train: np.ndarray
    val: np.ndarray
    seq_len: int
    vocab: int = VOCAB

    @classmethod
    def load(cls, source: str, seq_len: int, vocab: int = VOCAB) -> TokenDataset:
        return cls.split(load_tokens(source), seq_len, vocab, source=source)

    @classmethod
    def split(cls, tokens: np.ndarray, seq_len: int, vocab: int = VOCAB, *, source: str = "data") -> TokenDataset:
        n_val = int(len(tokens) * VAL_FRACTION)
        if n_val < seq_len + 1 or len(tokens) - n_val < seq_len + 1:
            raise DataError(
                f"train.data={source!r}: {len(tokens)} tokens is too small for seq_len={seq_len}: "
                f"the held-out {VAL_FRACTION:.0%} and the rest must each hold seq_len+1 tokens"
            )
        if vocab < VOCAB and not is_token_file(source):
            raise DataError(f"model.vocab={vocab} is smaller than the byte vocabulary ({VOCAB})")
        return cls(tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:], seq_len, vocab)

    def sample(self, seed: int, step: int, index: int, split: int = TRAIN) -> np.ndarray:
        """Sample ``index`` of ``step``: ``T + 1`` consecutive tokens (inputs + last target)."""
        data = self.train if split == TRAIN else self.val
        rng = np.random.default_rng((seed & _U64, step, index, split))
        off = int(rng.integers(0, len(data) - self.seq_len, endpoint=False))  # [0, N - T - 1]
        return np.asarray(data[off: off + self.seq_len + 1], dtype=np.int64)

    def samples(self, seed: int, step: int, indices: range, split: int = TRAIN) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each ``(len(indices), T)`` int64."""
        rows = np.stack([self.sample(seed, step, i, split) for i in indices]) if len(indices) else \
            np.zeros((0, self.seq_len + 1), dtype=np.int64)
        if rows.size and int(rows.max()) >= self.vocab:
            raise DataError(f"token id {int(rows.max())} is outside the vocabulary (model.vocab={self.vocab})")
        return rows[:, :-1], rows[:, 1:]


def dp_slice(global_batch: int, dp_size: int, dp_rank: int) -> range:
    """The global-batch sample indices DP rank ``dp_rank`` takes: a contiguous block."""
    if global_batch % dp_size:
        raise ValueError(f"train.global_batch={global_batch} is not divisible by dp={dp_size}")
    per = global_batch // dp_size
    return range(dp_rank * per, (dp_rank + 1) * per)


def micro_batches(indices: range, micro_batch: int) -> list[range]:
    """``indices`` cut into consecutive micro-batches of ``micro_batch`` samples."""
    if len(indices) % micro_batch:
        raise ValueError(f"the per-rank batch {len(indices)} is not divisible by train.micro_batch={micro_batch}")
    return [indices[i: i + micro_batch] for i in range(0, len(indices), micro_batch)]


def as_tensors(inputs: np.ndarray, targets: np.ndarray, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    return torch.from_numpy(np.ascontiguousarray(inputs)).to(device), torch.from_numpy(np.ascontiguousarray(targets)).to(device)
