"""Data: the global batch of a step is a pure function of (seed, step), whatever the layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from api.spec import DataSpec
from workers.data import StepBatches, build_batches, builtin_corpus_files


def _batches(data: DataSpec, *, dp_rank=0, dp_size=1, gbs=8, mbs=2, seed=0, seq_len=16, vocab=256) -> StepBatches:
    return build_batches(
        data,
        seq_len=seq_len,
        vocab_size=vocab,
        seed=seed,
        global_batch_size=gbs,
        micro_batch_size=mbs,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )


@pytest.mark.parametrize("data", [DataSpec(source="synthetic"), DataSpec(source="text")])
def test_dp_slices_tile_the_global_batch(data: DataSpec) -> None:
    full_x, full_y = _batches(data).batch(5)
    assert full_x.shape == (8, 16)
    torch.testing.assert_close(full_x[:, 1:], full_y[:, :-1])  # targets are inputs shifted by one
    for dp in (2, 4):
        parts = [_batches(data, dp_rank=r, dp_size=dp).batch(5)[0] for r in range(dp)]
        assert torch.equal(torch.cat(parts), full_x)
    mbs = _batches(data, dp_rank=1, dp_size=2).micro_batches(5)
    assert len(mbs) == 2 and torch.equal(torch.cat([x for x, _ in mbs]), full_x[4:])


def test_steps_differ_and_seed_matters() -> None:
    b = _batches(DataSpec())
    assert not torch.equal(b.batch(0)[0], b.batch(1)[0])
    assert torch.equal(b.batch(3)[0], _batches(DataSpec()).batch(3)[0])
    assert not torch.equal(b.batch(3)[0], _batches(DataSpec(), seed=1).batch(3)[0])


def test_builtin_corpus_is_python_source() -> None:
    files = builtin_corpus_files()
    assert files and files == sorted(files) and all(f.suffix == ".py" for f in files)
    x, _ = _batches(DataSpec(source="text"), seq_len=64).batch(0)
    text = bytes(x.flatten().tolist()).decode("utf-8", errors="replace")
    assert any(w in text for w in ("def ", "import ", "self", "return"))


def test_text_epochs_cover_every_window_once(tmp_path) -> None:
    (tmp_path / "a.txt").write_bytes(np.random.default_rng(0).integers(0, 256, 512, dtype=np.uint8).tobytes())
    b = _batches(DataSpec(source="text", path=str(tmp_path)), gbs=4, mbs=4)
    n = b.num_samples
    assert n == (512 - 1) // 16
    seen = torch.cat([b.batch(s)[0] for s in range(n // 4)])
    assert len({tuple(r.tolist()) for r in seen}) == len(seen)  # a permutation: no repeats within the epoch
    b.step = n  # past one epoch of samples
    assert b.epoch == 4 * n // n
    b.set_epoch(2)
    assert b.step == 2 * n // 4
    assert b.state_dict()["step"] == b.step


def test_tokens_source_memmap(tmp_path) -> None:
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "0.bin")
    (np.arange(1000, dtype=np.uint16) + 5000).tofile(tmp_path / "1.bin")
    b = _batches(DataSpec(source="tokens", path=str(tmp_path)), vocab=50304)
    assert b.num_samples == 2 * ((1000 - 1) // 16)
    x, y = b.batch(0)
    assert torch.all(x[:, 1:] - x[:, :-1] == 1)  # windows are contiguous runs of one file
    with pytest.raises(FileNotFoundError):
        _batches(DataSpec(source="tokens", path=str(tmp_path / "missing")))


def test_bad_batch_split_is_rejected() -> None:
    with pytest.raises(ValueError, match="multiple"):
        _batches(DataSpec(), gbs=6, mbs=4, dp_size=1)
