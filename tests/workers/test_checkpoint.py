"""Checkpoints (DCP): exact resume, reshard on load, per-rank directories, ZeRO-1, pipeline parts, pruning.

Multi-process cases run the whole engine (``workers.loop.train`` with ``checkpoint_dir`` /
``resume_from``); the no-process-group and per-rank-directory cases use the harness's small engine.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from workers.checkpoint import (
    META_FILE,
    checkpoint_path,
    checkpoint_size_bytes,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    read_checkpoint_meta,
    save_checkpoint,
    usable_checkpoint,
    verify_checkpoint,
)

from .test_pipeline_harness import TINY, loop_world, make_spec, run_world, train_local

TOL = 1e-5


def _keys(path) -> set[str]:
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


# ------------------------------------------------------------------------------------------ fast
def test_single_process_resume_is_exact_without_a_process_group(tmp_path):
    spec = make_spec()
    full = train_local(spec)
    ck = tmp_path / "ck"
    saved = train_local(spec, save_at=2, ckpt=str(ck))
    assert saved["losses"] == full["losses"]

    files = {p.name for p in ck.iterdir()}
    assert {".metadata", META_FILE, "__0_0.distcp"} <= files
    meta = read_checkpoint_meta(ck)
    assert meta["step"] == 2 and meta["world_size"] == 1
    assert meta["plan"]["model"]["n_layers"] == 2 and meta["spec"]["layout"]["dp"] == 1
    keys = _keys(ck)
    assert "model.layers.1.attn.wq.weight" in keys and "model.tok_emb.weight" in keys
    assert any(k.startswith("optim.state.layers.0.") and k.endswith("exp_avg") for k in keys)
    assert checkpoint_size_bytes(ck) == sum(p.stat().st_size for p in ck.iterdir())

    resumed = train_local(spec, resume=str(ck))
    assert resumed["start"] == 2
    assert resumed["losses"] == full["losses"][2:]  # bitwise: model, AdamW moments and LR schedule restored
    assert resumed["extra"] == {"rank": 0, "next_step": 3}
    assert resumed["rng_after_load"] == saved["rng_after_save"]
    assert resumed["plan"]["global_batch_size"] == 8


def test_load_refuses_an_incomplete_checkpoint(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / ".metadata").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="not a complete meshrun checkpoint"):
        load_checkpoint(tmp_path / "half", model_parts=[torch.nn.Linear(2, 2)], optimizers=[], schedulers=[])


def test_a_truncated_or_unpublished_checkpoint_never_counts_and_resume_falls_back(tmp_path):
    model = _tiny_gpt(2)
    for step in (2, 4):
        save_checkpoint(checkpoint_path(tmp_path, step), model_parts=[model], optimizers=[], schedulers=[], step=step)
    good, bad = checkpoint_path(tmp_path, 2), checkpoint_path(tmp_path, 4)
    assert verify_checkpoint(bad) is None and not list(tmp_path.glob("*.partial"))
    assert {"manifest.rank0.json", META_FILE} <= {p.name for p in bad.iterdir()}
    shard = bad / "__0_0.distcp"
    with open(shard, "r+b") as f:  # a full disk: the shard is cut short beside a completion marker
        f.truncate(shard.stat().st_size // 2)
    assert "truncated" in verify_checkpoint(bad)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2] and latest_checkpoint(tmp_path) == good
    with pytest.raises(ValueError, match="cannot be loaded: .*truncated"):
        load_checkpoint(bad, model_parts=[_tiny_gpt(2)], optimizers=[], schedulers=[])
    assert usable_checkpoint(bad) == good  # resume verifies and takes the previous good one
    with open(good / "__0_0.distcp", "r+b") as f:  # same size, other bytes: the checksum catches it
        f.seek(0)
        f.write(b"\xff" * 16)
    assert "checksum" in verify_checkpoint(good) and usable_checkpoint(bad) is None
    partial = tmp_path / "step_00000006.partial"  # a save that crashed before publishing
    shutil.copytree(checkpoint_path(tmp_path, 2), partial)
    assert 6 not in [s for s, _ in list_checkpoints(tmp_path)]


def _tiny_gpt(n_layers: int):
    from api.spec import RunSpec
    from api.spec.validation import build_plan
    from workers.models import build_model, materialize

    plan = build_plan(RunSpec.model_validate(make_spec(model=dict(TINY, n_layers=n_layers))), device="cpu")
    return materialize(build_model(plan.model), device="cpu", seed=3)


def test_weights_only_checkpoint_loads_with_a_fresh_optimizer_and_other_models_are_refused(tmp_path):
    src = _tiny_gpt(2)
    save_checkpoint(tmp_path / "w", model_parts=[src], optimizers=[], schedulers=[], step=5, extra={"a": 1})
    dst = _tiny_gpt(2)
    torch.nn.init.zeros_(dst.output.weight)
    opt = torch.optim.AdamW(dst.parameters(), lr=1e-3)
    info = load_checkpoint(tmp_path / "w", model_parts=[dst], optimizers=[opt], schedulers=[])
    assert info["step"] == 5 and info["extra"] == {"a": 1}
    torch.testing.assert_close(dst.state_dict(), src.state_dict(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="does not hold .* tensors of this model"):
        load_checkpoint(tmp_path / "w", model_parts=[_tiny_gpt(3)], optimizers=[], schedulers=[])


def _adamw(model, lr: float, wd: float) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}], lr=lr)


def _one_step(model, opt) -> None:
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))  # tiny preset: vocab 256
    model(x).float().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "written-before-packing"])
def test_optimizer_hyperparameters_are_one_item_per_parameter_and_old_checkpoints_still_load(
    tmp_path, monkeypatch, packed
):
    """A parameter group's hyperparameters are one DCP item per parameter (``optim.hypers.<fqn>``), not one per
    hyperparameter (they were 3/4 of a save's items); checkpoints of the old layout load the same way."""
    import workers.checkpoint as ck

    src = _tiny_gpt(2)
    opt = _adamw(src, lr=3e-3, wd=0.1)
    _one_step(src, opt)
    opt.param_groups[0]["betas"] = (0.8, 0.9)  # non-default hyperparameters must come back
    if not packed:
        monkeypatch.setattr(ck, "_pack_hypers", lambda flat: flat)
    save_checkpoint(tmp_path / "c", model_parts=[src], optimizers=[opt], schedulers=[], step=1)
    monkeypatch.undo()
    keys = _keys(tmp_path / "c")
    n_params = len(list(src.parameters()))
    groups = [k for k in keys if k.startswith("optim.param_groups.")]
    hypers = [k for k in keys if k.startswith("optim.hypers.")]
    if packed:
        assert not groups and len(hypers) == n_params and "optim.hypers.tok_emb.weight" in hypers
    else:
        assert not hypers and len(groups) >= 10 * n_params
    dst = _tiny_gpt(2)
    opt2 = _adamw(dst, lr=1.0, wd=0.0)
    load_checkpoint(tmp_path / "c", model_parts=[dst], optimizers=[opt2], schedulers=[])
    for g, g2 in zip(opt.param_groups, opt2.param_groups):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in g2.items() if k != "params"}
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        torch.testing.assert_close(s1[k], s2[k], rtol=0, atol=0)
    _one_step(src, opt)
    _one_step(dst, opt2)  # the same update from the restored state
    torch.testing.assert_close(dst.state_dict(), src.state_dict(), rtol=0, atol=0)


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (2, 4, 6, 8):
        d = checkpoint_path(tmp_path, step)
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"\0" * 100)
        (d / META_FILE).write_text(json.dumps({"step": step}))
    (tmp_path / "step_00000010").mkdir()  # a save in progress: no meshrun.json
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4, 6, 8]
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 8)
    assert checkpoint_size_bytes(checkpoint_path(tmp_path, 2)) == 100 + len(json.dumps({"step": 2}))
    deleted = prune_checkpoints(tmp_path, keep=2)
    assert deleted == [checkpoint_path(tmp_path, 2), checkpoint_path(tmp_path, 4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000006", "step_00000008", "step_00000010"]
    assert prune_checkpoints(tmp_path, keep=5) == []
    with pytest.raises(ValueError, match="keep"):
        prune_checkpoints(tmp_path, keep=0)
    assert latest_checkpoint(tmp_path / "nothing") is None


# ------------------------------------------------------------------------------------------ slow
def _resume(spec: dict, ck: Path) -> tuple[dict, dict]:
    return spec, {"resume_from": str(ck)}


@pytest.fixture(scope="module")
def fsdp_dp2(tmp_path_factory):
    """dp=2 FSDP (zero 3), 4 steps, checkpoints at steps 2 and 4 (one shared directory)."""
    root = tmp_path_factory.mktemp("fsdp")
    run = loop_world(2, [(make_spec({"dp": 2, "zero_stage": 3}, every=2), {"checkpoint_dir": str(root)})])[0]
    return run, root


@pytest.mark.slow
def test_fsdp_dp2_resume_is_exact_and_reshards_to_tp2(fsdp_dp2):
    run, root = fsdp_dp2
    ck = checkpoint_path(root, 2)
    assert [s for s, _ in list_checkpoints(root)] == [2, 4]
    assert run["summary"]["last_checkpoint"] == str(checkpoint_path(root, 4))
    assert {p.name for p in ck.glob("*.distcp")} >= {"__0_0.distcp", "__1_0.distcp"}
    same, tp2 = loop_world(2, [_resume(make_spec({"dp": 2, "zero_stage": 3}), ck), _resume(make_spec({"tp": 2}), ck)])
    assert same["steps"] == [3, 4]
    assert same["losses"] == run["losses"][2:]  # the same layout resumes bitwise
    assert tp2["steps"] == [3, 4]
    assert tp2["losses"] == pytest.approx(run["losses"][2:], abs=TOL, rel=0)


@pytest.mark.slow
def test_fsdp_dp2_reshards_to_dp2_tp2_and_to_one_process(fsdp_dp2):
    run, root = fsdp_dp2
    ck = checkpoint_path(root, 2)
    dp_tp = loop_world(4, [_resume(make_spec({"dp": 2, "tp": 2, "zero_stage": 3, "sequence_parallel": True}), ck)])[0]
    one = loop_world(1, [_resume(make_spec(), ck)])[0]
    for got in (dp_tp, one):
        assert got["steps"] == [3, 4]
        assert got["losses"] == pytest.approx(run["losses"][2:], abs=TOL, rel=0)


@pytest.mark.slow
def test_zero1_saves_owned_optimizer_shards_and_reloads_anywhere(tmp_path):
    lay = {"dp": 2, "zero_stage": 1}
    run = loop_world(2, [(make_spec(lay, every=2), {"checkpoint_dir": str(tmp_path)})])[0]
    ck = checkpoint_path(tmp_path, 2)
    keys = _keys(ck)
    # every parameter's AdamW state is in the checkpoint (the union of the two ranks' shards)
    n_params = len([k for k in keys if k.startswith("model.")])
    assert len([k for k in keys if k.startswith("optim.state.") and k.endswith(".exp_avg")]) == n_params
    same = loop_world(2, [_resume(make_spec(lay), ck)])[0]
    assert same["losses"] == pytest.approx(run["losses"][2:], abs=1e-6, rel=0)
    one = loop_world(1, [_resume(make_spec(), ck)])[0]
    assert one["losses"] == pytest.approx(run["losses"][2:], abs=TOL, rel=0)


@pytest.mark.slow
def test_pipeline_checkpoint_loads_under_another_split_and_without_pp(tmp_path):
    m4 = dict(TINY, n_layers=4)
    run = loop_world(2, [(make_spec({"pp": 2}, model=m4, every=2), {"checkpoint_dir": str(tmp_path)})])[0]
    ck = checkpoint_path(tmp_path, 2)
    keys = _keys(ck)
    assert {f"model.layers.{i}.mlp.w1.weight" for i in range(4)} <= keys
    assert not [k for k in keys if "module." in k or "_checkpoint_wrapped" in k or "_orig_mod" in k]
    inter = {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}
    same, looped = loop_world(2, [_resume(make_spec({"pp": 2}, model=m4), ck), _resume(make_spec(inter, model=m4), ck)])
    assert same["losses"] == pytest.approx(run["losses"][2:], abs=1e-6, rel=0)
    assert looped["losses"] == pytest.approx(run["losses"][2:], abs=TOL, rel=0)
    one = loop_world(1, [_resume(make_spec(model=m4), ck)])[0]
    assert one["losses"] == pytest.approx(run["losses"][2:], abs=TOL, rel=0)


@pytest.mark.slow
def test_per_rank_directories_merge_into_one_checkpoint(tmp_path):
    """Ray Train style: each rank saves into its own directory; merged, they are one checkpoint."""
    spec = make_spec({"dp": 2})  # DDP
    run = run_world(train_local, 2, spec, 2, str(tmp_path / "rank{rank}"))
    r0, r1 = tmp_path / "rank0", tmp_path / "rank1"
    names1 = {p.name for p in r1.iterdir()} - {"manifest.rank1.json"}
    assert names1 and all(n.startswith("__1_") and n.endswith(".distcp") for n in names1)
    assert {".metadata", META_FILE} <= {p.name for p in r0.iterdir()}
    assert not any(n.startswith("__1_") for n in os.listdir(r0))

    merged = tmp_path / "merged"
    shutil.copytree(r0, merged)
    for p in r1.iterdir():
        shutil.copy2(p, merged / p.name)
    again = run_world(train_local, 2, spec, None, None, str(merged))
    assert again["losses"] == pytest.approx(run["losses"][2:], abs=1e-6, rel=0)
    assert [e["rank"] for e in again["extras"]] == [0, 1]  # same world size: each rank gets its own extra
    one = train_local(make_spec(), resume=str(merged))  # no process group at all
    assert one["losses"] == pytest.approx(run["losses"][2:], abs=TOL, rel=0)
    assert one["extra"]["rank"] == 0  # other world size: rank 0's
