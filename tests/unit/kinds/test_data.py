"""Tokenizer, sources and the deterministic sampler (pure: no processes)."""

from __future__ import annotations

import numpy as np
import pytest
from rankctl.kinds.train.data import (
    BUILTIN_PYDOC,
    VAL,
    DataError,
    TokenDataset,
    check_data_source,
    decode,
    dp_slice,
    encode,
    load_tokens,
    micro_batches,
)

T = 16


@pytest.fixture(scope="module")
def pydoc() -> TokenDataset:
    return TokenDataset.load(BUILTIN_PYDOC, T)


def test_byte_tokenizer_round_trips_utf8() -> None:
    text = "def f(x):\n    return x ** 2  # ½ → ∞"
    tokens = encode(text)
    assert tokens.max() < 256 and len(tokens) == len(text.encode("utf-8"))
    assert decode(tokens) == text


def test_builtin_pydoc_is_real_text_with_a_held_out_tail(pydoc) -> None:
    assert check_data_source(BUILTIN_PYDOC) is None
    n = len(pydoc.train) + len(pydoc.val)
    assert n > 400_000 and len(pydoc.val) == int(n * 0.05)
    assert "the" in decode(pydoc.train[:2000]).lower()


def test_samples_are_a_pure_function_of_seed_step_index(pydoc) -> None:
    again = TokenDataset.load(BUILTIN_PYDOC, T)
    a = pydoc.sample(7, 3, 5)
    assert a.shape == (T + 1,) and np.array_equal(a, again.sample(7, 3, 5))
    others = [pydoc.sample(8, 3, 5), pydoc.sample(7, 4, 5), pydoc.sample(7, 3, 6), pydoc.sample(7, 3, 5, VAL)]
    assert all(not np.array_equal(a, o) for o in others)
    x, y = pydoc.samples(7, 3, range(4))
    assert x.shape == y.shape == (4, T) and x.dtype == np.int64
    assert np.array_equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one


def test_validation_samples_come_from_the_held_out_tail(pydoc) -> None:
    tail = pydoc.val.tobytes()
    for i in range(5):
        assert pydoc.sample(1, 0, i, VAL).astype(np.uint16).tobytes() in tail


@pytest.mark.parametrize(("dp", "micro"), [(1, 2), (2, 2), (4, 1), (2, 4)])
def test_dp_slices_and_micro_batches_rebuild_the_serial_batch(pydoc, dp: int, micro: int) -> None:
    serial_x, serial_y = pydoc.samples(3, 9, range(8))
    parts = [pydoc.samples(3, 9, mb) for d in range(dp) for mb in micro_batches(dp_slice(8, dp, d), micro)]
    assert np.array_equal(np.concatenate([p[0] for p in parts]), serial_x)
    assert np.array_equal(np.concatenate([p[1] for p in parts]), serial_y)
    assert dp_slice(8, 4, 3) == range(6, 8)


def test_batch_splits_that_do_not_divide_are_errors() -> None:
    with pytest.raises(ValueError, match="global_batch=10 is not divisible by dp=4"):
        dp_slice(10, 4, 0)
    with pytest.raises(ValueError, match="micro_batch=3"):
        micro_batches(range(4), 3)


def test_uint16_token_file_is_memory_mapped(tmp_path) -> None:
    tokens = (np.arange(4000) * 7 % 1000).astype("<u2")
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    loaded = load_tokens(str(path))
    assert isinstance(loaded, np.memmap) and np.array_equal(loaded, tokens)
    ds = TokenDataset.load(str(path), T, vocab=1024)
    x, _ = ds.samples(0, 1, range(3))
    assert x.max() < 1000
    with pytest.raises(DataError, match="outside the vocabulary"):
        TokenDataset.load(str(path), T, vocab=300).samples(0, 1, range(64))


def test_text_file_is_tokenised_by_bytes(tmp_path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("héllo wörld\n" * 200, encoding="utf-8")
    assert np.array_equal(load_tokens(str(path)), encode(path.read_text(encoding="utf-8")))
    assert TokenDataset.load(str(path), T).sample(0, 0, 0).max() < 256


def test_unusable_sources_are_clear_errors(tmp_path) -> None:
    missing = str(tmp_path / "nope.txt")
    assert check_data_source(missing) == f"train.data={missing!r}: no such file"
    with pytest.raises(DataError, match="no such file"):
        load_tokens(missing)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    assert "even size" in check_data_source(str(tmp_path / "odd.bin"))
    (tmp_path / "empty.txt").write_bytes(b"")
    assert "empty" in check_data_source(str(tmp_path / "empty.txt"))
    assert "not a regular file" in check_data_source(str(tmp_path))
    assert "unknown builtin" in check_data_source("builtin:shakespeare")
    (tmp_path / "tiny.txt").write_text("too short for a sequence")
    with pytest.raises(DataError, match="too small for seq_len=16"):
        TokenDataset.load(str(tmp_path / "tiny.txt"), T)
