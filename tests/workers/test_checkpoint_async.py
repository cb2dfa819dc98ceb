"""``checkpoint.async: true`` (workers.checkpoint_async) in real gloo worlds: the background writer leaves training
bitwise unchanged, lists the same complete checkpoints as a synchronous save, and a resume from what it wrote is
exact; a save that fails fails the attempt with its cause and lists nothing."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from tests.workers.dist_utils import run_world, tiny_spec
from workers.checkpoint import checkpoint_path, list_checkpoints, read_checkpoint_meta

pytestmark = pytest.mark.slow

STEPS = 6


def _spec(async_save: bool, **over) -> dict:
    return tiny_spec(steps=STEPS, dp=2, zero=3, checkpoint={"every_steps": 2, "keep": 3, "async": async_save}, **over)


def test_async_saves_change_nothing_and_resume_exactly(tmp_path):
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    sync, asyn = run_world(
        2,
        [
            {**_spec(False), "_job": {"checkpoint_dir": str(sync_dir)}},
            {**_spec(True), "_job": {"checkpoint_dir": str(async_dir)}},
        ],
    )
    assert asyn["losses"] == sync["losses"]  # the copy and the writer thread touch nothing of training
    assert sync["summary"]["checkpoint_copy_s"] is None  # saved in the loop
    assert len(asyn["summary"]["checkpoint_copy_s"]) == len(asyn["summary"]["checkpoint_write_s"]) == 3
    assert [s for s, _ in list_checkpoints(async_dir)] == [s for s, _ in list_checkpoints(sync_dir)] == [2, 4, 6]
    assert asyn["summary"]["last_checkpoint"] == str(checkpoint_path(async_dir, 6))
    assert not list(async_dir.glob("*.partial"))
    assert read_checkpoint_meta(checkpoint_path(async_dir, 4))["step"] == 4

    # what the writer wrote at steps 2 and 4 resumes bitwise like the synchronous run's own tail
    from2, from4 = run_world(
        2,
        [
            {**_spec(False), "_job": {"resume_from": str(checkpoint_path(async_dir, 2))}},
            {**_spec(False), "_job": {"resume_from": str(checkpoint_path(async_dir, 4))}},
        ],
    )
    assert from2["losses"] == sync["losses"][2:]
    assert from4["losses"] == sync["losses"][4:]


def test_tensor_and_pipeline_parallel_saves_in_the_background_resume_exactly(tmp_path):
    """DTensor shards (tp2, sequence parallel) and pipeline stages (pp2, 1F1B) through the writer thread."""
    tp = {"layout": {"dp": 1, "tp": 2, "pp": 1, "zero_stage": 0, "sequence_parallel": True}}
    pp = {"layout": {"dp": 1, "tp": 1, "pp": 2, "zero_stage": 0, "pp_schedule": "1f1b"}}
    specs = {"tp": tp, "pp": pp}
    done = run_world(
        2,
        [
            {**_spec(True, **specs[name]), "_job": {"checkpoint_dir": str(tmp_path / name)}}
            for name in ("tp", "pp")
        ],
    )
    resumed = run_world(
        2,
        [
            {**_spec(False, **specs[name]), "_job": {"resume_from": str(checkpoint_path(tmp_path / name, 4))}}
            for name in ("tp", "pp")
        ],
    )
    for name, run, again in zip(("tp", "pp"), done, resumed, strict=True):
        assert [s for s, _ in list_checkpoints(tmp_path / name)] == [2, 4, 6], name
        assert len(run["summary"]["checkpoint_copy_s"]) == 3, name
        assert again["losses"] == run["losses"][4:], name


def test_a_failed_background_save_fails_the_attempt_and_lists_nothing(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoints should go")
    with pytest.raises(mp.ProcessRaisedException) as err:
        run_world(2, [{**_spec(True), "_job": {"checkpoint_dir": str(blocker / "ck")}}])
    assert "NotADirectoryError" in str(err.value) and "checkpoint_async.py" in str(err.value), str(err.value)[-2000:]
    assert list_checkpoints(blocker.parent) == []
