"""Pipeline parallelism: the stage split (fast) and loss parity with single-process training (slow).

Parity runs go through the whole engine (``workers.loop.train``: data, parallelize, pipeline, grad clipping
across pp, optimizer, LR schedule) and compare the per-step global mean loss with a single-process run.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from api.spec import RunSpec
from api.spec.validation import build_plan
from workers.models import build_model
from workers.pipeline import SCHEDULES, split_model_part, stage_ids_for_rank, stage_module_names

from .test_pipeline_harness import TINY, loop_world, make_spec

TOL = 1e-5
TINY4 = dict(TINY, n_layers=4)


def _gpt(n_layers: int = 4):
    spec = RunSpec.model_validate(make_spec(model=dict(TINY, n_layers=n_layers)))
    return build_model(build_plan(spec, device="cpu").model, device="meta")


# ------------------------------------------------------------------------------------------ split (fast)
def test_gpt_stages_hold_embeddings_first_and_head_last():
    names = stage_module_names(_gpt(4), 4)
    assert names == [["tok_emb", "pos_emb", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "output"]]


def test_uneven_layers_go_to_earlier_stages_and_match_the_model_split():
    model = _gpt(5)
    names = stage_module_names(model, 2)
    assert names == [
        ["tok_emb", "pos_emb", "layers.0", "layers.1", "layers.2"],
        ["layers.3", "layers.4", "norm", "output"],
    ]
    # the model's own declaration (workers.models) agrees
    assert [[n.split(".")[1] for n in s if n.startswith("layers.")] for s in names] == model.stage_layer_keys(2)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="exceed the model's 2 layers"):
        stage_module_names(_gpt(2), 3)


def test_split_points_define_stage_starts():
    names = stage_module_names(_gpt(4), 2, split_points=["layers.3"])
    assert names[1] == ["layers.3", "norm", "output"]
    with pytest.raises(ValueError, match="pp_split_points"):
        stage_module_names(_gpt(4), 2, split_points=["layers.9"])
    with pytest.raises(ValueError, match="3 split points make 4 stages"):
        stage_module_names(_gpt(4), 2, split_points=["layers.1", "layers.2", "layers.3"])


def test_parts_keep_full_model_names_and_drop_the_rest():
    model = _gpt(4)
    full = {n for n, _ in model.named_parameters()}
    parts = [split_model_part(model, keep) for keep in stage_module_names(model, 4)]
    names = [{n for n, _ in p.named_parameters()} for p in parts]
    assert set().union(*names) == full  # nothing lost, names unchanged
    assert sum(len(n) for n in names) == len(full)  # nothing duplicated
    assert parts[1].tok_emb is None and parts[1].output is None and list(parts[1].layers.keys()) == ["1"]
    assert parts[0].tok_emb is not None and parts[0].norm is None
    assert parts[3].output is not None and parts[3].pos_emb is None


def test_stage_parts_compose_to_the_full_forward():
    torch.manual_seed(0)
    model = _gpt(4).to_empty(device="cpu")
    for p in model.parameters():
        nn.init.normal_(p, std=0.1)
    x = torch.randint(0, model.vocab_size, (2, 8))
    h = x
    for keep in stage_module_names(model, 4):
        h = split_model_part(model, keep)(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=1e-6)


class _ListNet(nn.Module):  # a user model: ModuleList blocks, a forward that knows nothing of pipelines
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def test_user_models_split_at_split_points_modulelist_and_sequential():
    net = _ListNet()
    names = stage_module_names(net, 2, split_points=["blocks.2"])
    assert names == [["emb", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "head"]]
    a, b = (split_model_part(net, n) for n in names)
    assert {n for n, _ in b.named_parameters()} == {
        "blocks.2.weight",
        "blocks.2.bias",
        "blocks.3.weight",
        "blocks.3.bias",
        "head.weight",
        "head.bias",
    }
    assert isinstance(a.head, nn.Identity) and isinstance(b.emb, nn.Identity)  # dropped, forward unchanged
    x = torch.randn(3, 4)
    torch.testing.assert_close(b(a(x)), net(x))

    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    names = stage_module_names(seq, 2, split_points=["2"])
    a, b = (split_model_part(seq, n) for n in names)
    assert [n for n, _ in b.named_parameters()] == ["2.weight", "2.bias", "4.weight", "4.bias"]
    torch.testing.assert_close(b(a(x)), seq(x))


def test_stage_ids_looped_and_v_shaped():
    assert stage_ids_for_rank(0, 2, 4, schedule="interleaved_1f1b") == [0, 2]
    assert stage_ids_for_rank(1, 2, 4, schedule="interleaved_zero_bubble") == [1, 3]
    assert stage_ids_for_rank(0, 2, 4, schedule="zbv") == [0, 3]
    assert stage_ids_for_rank(1, 2, 4, schedule="zbv") == [1, 2]
    assert stage_ids_for_rank(3, 4, 4, schedule="1f1b") == [3]
    with pytest.raises(ValueError, match="one stage per rank"):
        stage_ids_for_rank(0, 2, 4, schedule="gpipe")
    with pytest.raises(ValueError, match="2 stages per rank"):
        stage_ids_for_rank(0, 2, 6, schedule="zbv")
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv"}


# ------------------------------------------------------------------------------------- parity (slow)
# a user model (entrypoint) whose forward knows nothing of pipelines, split by model.pp_split_points
CUSTOM = {
    "name": "custom",
    "preset": None,
    "entrypoint": "tests.workers.custom_model:build",
    "args": {"d": 32},
    "seq_len": 32,
}
MODELS = {"tiny": TINY, "tiny4": TINY4, "custom": CUSTOM}
PP2_CASES = {  # name: (layout, model key, extra model fields)
    "gpipe": ({"pp": 2, "pp_schedule": "gpipe"}, "tiny", {}),
    "1f1b": ({"pp": 2, "pp_schedule": "1f1b"}, "tiny", {}),
    "interleaved_1f1b": ({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}, "tiny4", {}),
    "interleaved_zero_bubble": (
        {"pp": 2, "pp_schedule": "interleaved_zero_bubble", "pp_virtual_stages": 2},
        "tiny4",
        {},
    ),
    "zbv": ({"pp": 2, "pp_schedule": "zbv", "pp_virtual_stages": 2}, "tiny4", {}),
    "custom_split_points": ({"pp": 2}, "custom", {"pp_split_points": ["blocks.1"]}),
}


@pytest.fixture(scope="module")
def single_process():
    """Reference losses: one process, no parallelism, for every model."""
    r = loop_world(1, [(make_spec(model=m), {}) for m in MODELS.values()])
    return dict(zip(MODELS, r))


@pytest.fixture(scope="module")
def pp2_runs():
    """Every pp=2 schedule, one after another in one 2-process world."""
    runs = loop_world(2, [(make_spec(lay, model={**MODELS[m], **more}), {}) for lay, m, more in PP2_CASES.values()])
    return dict(zip(PP2_CASES, runs))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(PP2_CASES))
def test_pp2_matches_single_process(schedule, single_process, pp2_runs):
    ref = single_process[PP2_CASES[schedule][1]]
    got = pp2_runs[schedule]
    assert got["steps"] == [1, 2, 3, 4]
    # the updates move the loss by far more than the tolerance, so later steps check earlier gradients
    assert max(ref["losses"]) - min(ref["losses"]) > 100 * TOL
    assert got["losses"] == pytest.approx(ref["losses"], abs=TOL, rel=0)
    # grad norm is summed over the pp ranks by the loop: equal to the single-process norm
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4)


@pytest.mark.slow
def test_3d_pp2_dp2_tp2_fsdp_sp_matches_single_process(single_process):
    lay = {"pp": 2, "dp": 2, "tp": 2, "zero_stage": 3, "sequence_parallel": True, "pp_schedule": "1f1b"}
    got = loop_world(8, [(make_spec(lay, model=TINY), {})])[0]
    ref = single_process["tiny"]
    assert got["losses"] == pytest.approx(ref["losses"], abs=TOL, rel=0)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4)
