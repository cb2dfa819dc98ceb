"""The parameter servers' checkpoint files (``workers.ps_checkpoint``): a step is complete only when every shard
wrote it, loading checks what it reads, and pruning never removes the latest complete step for a newer,
incomplete one."""

from __future__ import annotations

import pytest
import torch

from workers.ps_checkpoint import complete_steps, latest_complete, load_shard, prune, save_shard, shard_file


def _state(v: float) -> dict:
    return {"params": [torch.full((2, 3), v)], "optim": {}, "sched": {}}


def test_complete_steps_latest_and_prune(tmp_path) -> None:
    assert latest_complete(tmp_path / "none", 2) == 0 and latest_complete(None, 2) == 0
    for step in (2, 4):
        for k in (0, 1):
            save_shard(tmp_path, step, k, _state(step + k))
    save_shard(tmp_path, 6, 0, _state(6))  # shard 1 has not written step 6 (or died first)
    assert complete_steps(tmp_path, 2) == [2, 4] and latest_complete(tmp_path, 2) == 4
    got = load_shard(tmp_path, 4, 1)
    assert got["step"] == 4 and torch.equal(got["params"][0], torch.full((2, 3), 5.0))
    assert not list(tmp_path.rglob("*.tmp"))  # written under a temporary name, then renamed
    prune(tmp_path, 2, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000006"]
    assert latest_complete(tmp_path, 2) == 4  # the incomplete step 6 did not cost the last complete one
    save_shard(tmp_path, 6, 1, _state(7))
    prune(tmp_path, 2, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006"]


def test_load_refuses_another_shards_file(tmp_path) -> None:
    save_shard(tmp_path, 2, 0, _state(1))
    shard_file(tmp_path, 2, 1).write_bytes(shard_file(tmp_path, 2, 0).read_bytes())
    with pytest.raises(ValueError, match="not shard 1 of step 2"):
        load_shard(tmp_path, 2, 1)
