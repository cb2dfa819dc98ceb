"""Hang diagnosis, injected faults and profiles (workers.diagnostics, workers.profiling), plus the breakdown
arithmetic of workers.timeline on hand-made steps.

The multi-process cases run real torch processes: ``python -m workers`` under torchrun, or a spawned gloo world.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from api.spec import BREAKDOWN_PARTS
from tests.spawn import spawn_ranks
from tests.workers.dist_utils import run_world, tiny_spec
from workers.diagnostics import describe_hang, read_states
from workers.timeline import LinkModel, breakdown

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    return env


# ------------------------------------------------------------------------------------- arithmetic (fast)
def test_breakdown_splits_a_step_into_parts_that_add_up() -> None:
    step = {  # seconds from the step start; the training thread's waits never overlap
        "total": 1.0,
        "phases": [("data", 0.05, 0.1), ("compute", 0.1, 0.8), ("optimizer", 0.8, 0.95)],
        "waits": [
            ("tp", "coll", 0.2, 0.25, 0),
            ("pp", "recv", 0.3, 0.5, 1_000_000),  # 0.2 s waiting for 1 MB from a neighbour
            ("dp", "ddp", 0.7, 0.8, 0),
            ("pp", "coll", 0.85, 0.9, 0),  # the pipeline-group gradient-norm reduction
        ],
        "inflight": [("tp", 0.15, 0.25), ("tp", 0.2, 0.3), ("dp", 0.6, 0.8)],
        "ddp": [(0.55, 0.8)],
        "p2p_bytes": [1_000_000, 1_000_000],
    }
    link = LinkModel(latency_s=0.001, bandwidth_bytes_per_s=1e8)  # 1 MB: 11 ms
    bd = breakdown(step, link)
    assert bd["tp_comm_exposed"] == pytest.approx(0.05) and bd["tp_comm"] == pytest.approx(0.15)  # union
    assert bd["pp_comm_exposed"] == pytest.approx(0.011 + 0.001)
    assert bd["pp_bubble"] == pytest.approx(0.2 - 0.011 + 0.05 - 0.001)
    assert bd["pp_comm"] == pytest.approx(2 * 0.011)
    assert bd["dp_comm_exposed"] == pytest.approx(0.1) and bd["dp_comm"] == pytest.approx(0.25)
    assert bd["compute"] == pytest.approx(0.7 - 0.05 - 0.2 - 0.1)
    assert bd["optimizer"] == pytest.approx(0.15 - 0.05)
    assert bd["data_wait"] == pytest.approx(0.05)
    assert bd["other"] == pytest.approx(0.05 + 0.05)
    assert sum(bd[t] for t in BREAKDOWN_PARTS) == pytest.approx(bd["total"])


def test_describe_hang_names_the_stuck_rank_and_what_the_others_wait_in() -> None:
    now = 1000.0
    base = {"world_size": 4, "step": 812, "heartbeat": now, "phase": "compute", "pp_stage": None}
    states = [
        {**base, "rank": r, "collective": "pp fwd_recv", "group": "pp (peer rank 3)", "collective_since": now - 90}
        for r in range(3)
    ]
    states.append({**base, "rank": 3, "collective": "all_reduce", "group": "dp_shard", "collective_since": now - 95})
    text = describe_hang(states, now=now)
    assert text.startswith("rank 3 stuck in all_reduce (dp_shard group) at step 812 for 95 s"), text
    assert "ranks 0-2 waiting in pp fwd_recv" in text
    # a rank outside any collective is the one to blame; a silent rank is reported as such
    states[3] = {**base, "rank": 3, "collective": None, "phase_since": now - 100, "fault": "hang_rank"}
    states[2] = {**states[2], "heartbeat": now - 300}
    text = describe_hang(states, now=now)
    assert text.startswith("rank 3 stuck in compute at step 812 (injected hang_rank) for 100 s"), text
    assert "rank 2: no heartbeat" in text and "ranks 0-1 waiting in pp fwd_recv" in text


# --------------------------------------------------------------------------------------- faults (slow)
@pytest.mark.slow
def test_hang_rank_shows_in_the_rank_states_and_stacks_dump_on_signal(tmp_path: Path) -> None:
    spec = tiny_spec(steps=200, dp=2, faults={"hang_rank": {"rank": 1, "at_step": 3}})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(spec))
    sd = tmp_path / "state"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "workers",
        "--spec",
        str(tmp_path / "run.yaml"),
        "--state-dir",
        str(sd),
        "--log-level",
        "WARNING",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_env(MESHRUN_HEARTBEAT_S="0.3", MESHRUN_PG_TIMEOUT_S="300"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        states: list[dict] = []
        deadline = time.time() + 240
        while time.time() < deadline:
            states = read_states(sd)
            if (
                len(states) == 2
                and states[1].get("fault") == "hang_rank"
                and states[0].get("collective")
                and time.time() - states[1]["phase_since"] > 1
            ):
                break
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
            time.sleep(0.3)
        assert len(states) == 2 and states[1]["fault"] == "hang_rank", states
        assert states[1]["step"] == 3 and states[1]["phase"] == "compute" and states[1]["steps_done"] == 2
        assert states[0]["step"] == 3 and states[0]["collective"] == "ddp all_reduce"
        assert states[0]["group"] == "dp_replicate"
        text = describe_hang(states)
        assert text.startswith("rank 1 stuck in compute at step 3 (injected hang_rank)"), text
        assert "rank 0 waiting in ddp all_reduce (dp_replicate)" in text

        os.kill(states[1]["pid"], signal.SIGUSR1)  # faulthandler: every thread's stack, to the state dir
        stacks = sd / "rank1.stacks.txt"
        deadline = time.time() + 30
        while time.time() < deadline and "in_compute" not in (stacks.read_text() if stacks.exists() else ""):
            time.sleep(0.2)
        text = stacks.read_text()
        assert "in_compute" in text and "_run" in text  # the hung training thread and the heartbeat thread
        assert text.lower().count("thread 0x") >= 2
    finally:  # torchrun starts each worker in its own session: kill the workers by pid, then the agent
        for st in read_states(sd):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(st["pid"]), signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def test_kill_rank_kills_the_process_at_the_step(tmp_path: Path) -> None:
    spec = tiny_spec(steps=6, faults={"kill_rank": {"rank": 0, "at_step": 3}}, metrics={"report_every_s": 0})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(spec))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "workers",
            "--spec",
            str(tmp_path / "run.yaml"),
            "--metrics-out",
            str(tmp_path / "m.jsonl"),
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert "injected fault kill_rank at step 3" in p.stderr
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_fault_ranks_must_exist() -> None:
    from api.spec import RunSpec
    from api.spec.validation import check_spec

    chk = check_spec(RunSpec.model_validate(tiny_spec(dp=2, faults={"kill_rank": {"rank": 2, "at_step": 1}})))
    assert not chk.ok and chk.errors[0].param == "faults.kill_rank.rank" and "0..1" in chk.errors[0].message


# ------------------------------------------------------------------------------------------- profiles (slow)
@pytest.mark.slow
def test_profile_window_writes_chrome_traces_and_the_pipeline_timeline(tmp_path: Path) -> None:
    m = 4
    spec = tiny_spec(
        steps=4,
        pp=2,
        gbs=2 * m,
        mbs=2,
        layout={"pp_schedule": "gpipe"},
        profile={"start_step": 2, "steps": 2},
        _job={"profile_dir": str(tmp_path)},
    )
    res = run_world(2, [spec])[0]
    d = tmp_path / "steps_00000002-00000003"
    assert sorted(p.name for p in d.iterdir()) == [
        "rank0.pipeline.json",
        "rank0.trace.json",
        "rank1.pipeline.json",
        "rank1.trace.json",
    ]
    assert res["summary"]["profiles"] == [str(d / "rank0.trace.json"), str(d / "rank0.pipeline.json")]
    for r in range(2):
        trace = json.loads((d / f"rank{r}.trace.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any(n.startswith("aten::") for n in names)  # torch.profiler's op events
        timeline = json.loads((d / f"rank{r}.pipeline.json").read_text())["traceEvents"]
        chunks = [e for e in timeline if e["cat"] == "pipeline"]
        for step in (2, 3):
            got = sorted(e["name"] for e in chunks if e["args"]["step"] == step)
            assert got == sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
        assert {e["tid"] for e in chunks} == {f"stage {r}"} and all(e["dur"] > 0 for e in chunks)
        fwd = sorted((e for e in chunks if e["args"]["step"] == 2), key=lambda e: e["ts"])
        assert [e["name"] for e in fwd[:m]] == [f"F{i}" for i in range(m)]  # gpipe: all forwards first
    # stage 1 cannot start a forward before stage 0 finished it (one host: one clock for both ranks)
    t0 = {
        e["name"]: e
        for e in json.loads((d / "rank0.pipeline.json").read_text())["traceEvents"]
        if e["cat"] == "pipeline" and e["args"]["step"] == 2
    }
    t1 = {
        e["name"]: e
        for e in json.loads((d / "rank1.pipeline.json").read_text())["traceEvents"]
        if e["cat"] == "pipeline" and e["args"]["step"] == 2
    }
    for i in range(m):
        assert t1[f"F{i}"]["ts"] >= t0[f"F{i}"]["ts"] + t0[f"F{i}"]["dur"]


def _control_worker(rank: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    from api.spec import RunSpec
    from api.spec.validation import build_plan
    from workers.loop import WorkerJob, train

    spec = RunSpec.model_validate(tiny_spec(steps=6, metrics={"report_every_s": 0}))
    plan = build_plan(spec, device="cpu")
    asked = {"n": 0}

    def control() -> dict:
        asked["n"] += 1
        return {"profile_steps": 2} if asked["n"] == 2 else {}  # asked at the report after step 2

    got: list = []
    summary = train(
        WorkerJob(spec=spec, plan=plan, profile_dir=out),
        control=control,
        on_profile=lambda a, b, paths: got.append([a, b, paths]),
    )
    with open(os.path.join(out, "res.json"), "w") as f:
        json.dump({"got": got, "profiles": summary["profiles"]}, f)


def test_profile_on_request_profiles_the_next_steps(tmp_path: Path) -> None:
    spawn_ranks(_control_worker, (str(tmp_path),), 1)
    res = json.loads((tmp_path / "res.json").read_text())
    path = str(tmp_path / "steps_00000003-00000004" / "rank0.trace.json")
    assert res["got"] == [[3, 4, [path]]] and res["profiles"] == [path]
    assert json.loads(Path(path).read_text())["traceEvents"]
