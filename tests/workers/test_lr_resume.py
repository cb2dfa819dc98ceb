"""Resuming with a longer horizon keeps the LR schedule continuous: the service's resume anchors the schedule at the
checkpoint's step (``service.control.runtime._continued_schedule``) and the workers' LambdaLR, restored from the
checkpoint's state, goes on from the LR it had (no jump), decaying to min_lr_ratio at the new horizon."""

from __future__ import annotations

import pytest
import torch

from api.spec import RunSpec
from api.spec.schedule import lr_factor
from service.control.runtime import _continued_schedule
from workers.optim import build_scheduler


def _spec(steps: int, schedule: str) -> RunSpec:
    return RunSpec.model_validate({"train": {"steps": steps},
                                   "optimizer": {"lr": 3e-4, "warmup_steps": 10, "schedule": schedule}})


def _lrs(spec: RunSpec, steps: int, state: dict | None = None) -> tuple[list[float], dict]:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=spec.optimizer.lr)
    sch = build_scheduler(opt, spec)
    if state is not None:
        opt.load_state_dict(state["opt"])
        sch.load_state_dict(state["sch"])
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])  # the LR this optimizer step uses
        opt.step()
        sch.step()
    return out, {"opt": opt.state_dict(), "sch": sch.state_dict()}


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_longer_horizon_on_resume_has_no_lr_jump(schedule):
    old, k, new_total = _spec(120, schedule), 114, 160  # the issue: 114 steps of 120 done, resumed to 160
    before, state = _lrs(old, k)
    resumed_spec = old.model_copy(update={"train": old.train.model_copy(update={"steps": new_total}),
                                          "optimizer": _continued_schedule(old, k, new_total)})
    after, _ = _lrs(resumed_spec, new_total - k, state)
    uninterrupted, _ = _lrs(old, k + 1)
    # the first resumed step uses exactly the LR the old schedule gave step k: continuous
    assert after[0] == pytest.approx(uninterrupted[k], rel=1e-12)
    # and then it only decays, a step at a time, to min_lr_ratio at the new horizon
    steps = [before[-1], *after]
    assert all(b <= a + 1e-18 for a, b in zip(steps, steps[1:]))
    biggest_drop = max(a - b for a, b in zip(steps, steps[1:]))
    assert biggest_drop < 0.05 * old.optimizer.lr  # no jump (the was 2.15e-4 -> 7.26e-5 at lr 3e-4)
    end = lr_factor(new_total, warmup_steps=10, total_steps=new_total, schedule=schedule, min_lr_ratio=0.1,
                    anchor=(resumed_spec.optimizer.lr_anchor_step, resumed_spec.optimizer.lr_anchor_factor))
    assert end == pytest.approx(0.1)


def test_same_horizon_or_constant_schedule_is_unchanged():
    spec = _spec(120, "cosine")
    assert _continued_schedule(spec, 50, 120) == spec.optimizer
    const = _spec(120, "constant")
    assert _continued_schedule(const, 50, 200).lr_anchor_step is None
