"""A checkpoint save that hits a full disk (ENOSPC) on a real 1 MiB tmpfs: the save fails with the OS error, its
unpublished directory is gone (no space held, nothing listed), the previous checkpoint still verifies and
resumes, and once space returns the next save succeeds. A partial directory left by a crashed save is removed
by the next prune."""

from __future__ import annotations

import errno

import pytest
import torch
from torch import nn

from workers.checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    usable_checkpoint,
)


def _model_and_opt(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(48, 48)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 48)).sum().backward()
    opt.step()
    return model, opt


def _save(root, step, model, opt):
    save_checkpoint(checkpoint_path(root, step), model_parts=model, optimizers=opt, schedulers=[], step=step)


def _fill(mnt, leave_bytes: int):
    """Fill the tmpfs, then free ``leave_bytes``: a save starts (its directory is made) and runs out mid-way."""
    filler = mnt / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    with open(filler, "r+b") as f:
        f.truncate(max(0, filler.stat().st_size - leave_bytes))
    return filler


def test_a_save_on_a_full_disk_leaves_no_partial_directory_and_the_previous_checkpoint_resumes(tiny_tmpfs):
    root = tiny_tmpfs / "ckpt"
    model, opt = _model_and_opt(0)
    _save(root, 1, model, opt)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    filler = _fill(tiny_tmpfs, leave_bytes=8192)
    model(torch.randn(4, 48)).sum().backward()
    opt.step()  # the weights move on; the failed save must not change what step 1 holds
    with pytest.raises(BaseException) as info:  # DCP wraps the OSError in its CheckpointException (a BaseException)
        _save(root, 2, model, opt)
    assert "No space left on device" in str(info.value)

    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]  # no step_00000002.partial left behind
    assert [s for s, _ in list_checkpoints(root)] == [1]
    assert latest_checkpoint(root) == checkpoint_path(root, 1)
    assert usable_checkpoint(checkpoint_path(root, 2)) == checkpoint_path(root, 1)  # a resume falls back to 1

    fresh, fresh_opt = _model_and_opt(7)
    load_checkpoint(checkpoint_path(root, 1), model_parts=fresh, optimizers=fresh_opt, schedulers=[])
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k]), k

    filler.unlink()  # space returns: the same save now succeeds
    _save(root, 2, model, opt)
    assert [s for s, _ in list_checkpoints(root)] == [1, 2]


def test_prune_removes_a_partial_directory_left_by_a_crashed_save(tmp_path):
    model, opt = _model_and_opt(0)
    _save(tmp_path, 1, model, opt)
    crashed = tmp_path / "step_00000002.partial"  # what a save killed mid-way (kill -9) leaves
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"\1" * 1000)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]  # never listed
    assert usable_checkpoint(tmp_path / "step_00000002") == checkpoint_path(tmp_path, 1)  # never resumed from
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
