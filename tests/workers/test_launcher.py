"""The standalone launcher (``python -m workers``) and the loop's callbacks, single process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from api.spec.metrics import METRIC_ROW_FIELDS, PEAK_MEMORY_PER_RANK, MetricRow
from tests.spawn import spawn_ranks
from tests.workers.dist_utils import tiny_spec

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {
    "step",
    "loss",
    "tokens_per_s",
    "step_time_s",
    "mfu",
    "peak_memory_bytes",
    "peak_memory_bytes_per_rank",
    "comm_fraction",
    "grad_norm",
    "lr",
    "time",
}


def _launch(tmp_path: Path, spec: dict, *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "workers", "--spec", str(path), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


SPEC = tiny_spec(steps=4, data={"source": "text"}, checkpoint={"every_steps": 2, "keep": 1})


def test_launcher_writes_metrics_jsonl_and_checkpoints(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    p = _launch(tmp_path, SPEC, "--metrics-out", str(tmp_path / "m.jsonl"), "--checkpoint-dir", str(ck))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _rows(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert ROW_KEYS <= r.keys() and r["loss"] > 0 and r["peak_memory_bytes"] > 0 and r["tokens_per_s"] > 0
        # every key the worker sends is a field of the one metric row definition (or the per-rank peaks)
        assert r.keys() <= set(METRIC_ROW_FIELDS) | {PEAK_MEMORY_PER_RANK}, r.keys()
        assert MetricRow.model_validate(r).step == r["step"]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["steps_done"] == 4 and summary["final_loss"] == rows[-1]["loss"]
    assert sorted(d.name for d in ck.iterdir()) == ["step_00000004"]  # keep=1 pruned step 2


def test_the_process_groups_threads_are_joined_before_the_launcher_exits(tmp_path: Path) -> None:
    """torch's DeviceMesh holds the process group in a reference cycle: unless the loop collects it, the group's gloo
    threads still run when the interpreter exits (seen once as a SIGABRT after the launcher's summary)."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tiny_spec(steps=2)))
    probe = (
        "import os\n"
        "from workers.__main__ import main\n"
        f"rc = main(['--spec', {str(tmp_path / 'run.yaml')!r}, '--log-level', 'WARNING'])\n"
        "names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')]\n"
        "print('THREADS', rc, *sorted(names))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("THREADS"))
    rc, *names = line.split()[1:]
    assert rc == "0" and names and not [n for n in names if "gloo" in n], names


@pytest.mark.slow
def test_launcher_resume_replays_exactly(tmp_path: Path) -> None:
    spec = SPEC
    p = _launch(tmp_path, spec, "--metrics-out", str(tmp_path / "m.jsonl"))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _rows(tmp_path / "m.jsonl")
    # stop after step 2 (with a checkpoint), then resume from it and replay steps 3-4 exactly
    p = _launch(
        tmp_path,
        spec,
        "--metrics-out",
        str(tmp_path / "a.jsonl"),
        "--checkpoint-dir",
        str(tmp_path / "ck2"),
        "--steps",
        "2",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    p = _launch(
        tmp_path,
        spec,
        "--metrics-out",
        str(tmp_path / "b.jsonl"),
        "--resume-from",
        str(tmp_path / "ck2" / "step_00000002"),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    resumed = _rows(tmp_path / "b.jsonl")
    assert [r["step"] for r in resumed] == [3, 4]
    # (tiny_spec uses a constant LR schedule, so --steps 2 does not change the first half's learning rates)
    assert all(abs(a["loss"] - b["loss"]) < 1e-6 for a, b in zip(resumed, rows[2:]))


def test_bad_spec_exits_2_and_names_the_field(tmp_path: Path) -> None:
    p = _launch(tmp_path, tiny_spec(tp=3))
    assert p.returncode == 2 and "layout.tp" in p.stderr and "use tp in" in p.stderr
    p = _launch(tmp_path, {**tiny_spec(), "layuot": {}})
    assert p.returncode == 2 and "layuot" in p.stderr


def test_world_size_mismatch_says_how_to_launch(tmp_path: Path) -> None:
    p = _launch(tmp_path, tiny_spec(dp=2))
    assert p.returncode == 2 and "--nproc-per-node 2" in p.stderr


def _stop_worker(rank: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    from api.spec import RunSpec
    from api.spec.validation import build_plan
    from workers.loop import WorkerJob, train

    spec = RunSpec.model_validate(tiny_spec(steps=10, checkpoint={"every_steps": 2}, metrics={"report_every_s": 0}))
    plan = build_plan(spec, device="cpu")
    rows, ckpts = [], []
    summary = train(
        WorkerJob(spec=spec, plan=plan, checkpoint_dir=os.path.join(out, "ck")),
        sink=rows.append,
        on_checkpoint=lambda s, p: ckpts.append((s, p)),
        stop=lambda: len(rows) >= 2,
    )
    # stop() is polled at each report (here after every step: report_every_s 0), its vote joins the report's
    # gather, before that step's row reaches the sink: with 2 rows seen during step 3, training ends after step 3
    with open(os.path.join(out, "res.json"), "w") as f:
        json.dump({"steps": [r["step"] for r in rows], "ckpts": ckpts, "summary": summary}, f)


def test_stop_callback_and_on_checkpoint(tmp_path: Path) -> None:
    spawn_ranks(_stop_worker, (str(tmp_path),), 1)
    res = json.loads((tmp_path / "res.json").read_text())
    assert res["steps"] == [1, 2, 3] and res["summary"]["stopped"] and res["summary"]["steps_done"] == 3
    assert [s for s, _ in res["ckpts"]] == [2] and res["ckpts"][0][1].endswith("step_00000002")
