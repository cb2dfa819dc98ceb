"""Standalone launcher (no Ray):

    torchrun --standalone --nproc-per-node N -m workers --spec run.yaml --metrics-out metrics.jsonl \
        [--checkpoint-dir D] [--resume-from D] [--code-dir DIR_OF_USER_PACKAGES] \
        [--state-dir D] [--profile-dir D]
    python -m workers --spec run.yaml ...          # one process (a spec with world size 1)

Reads a YAML/JSON RunSpec, resolves the Plan (a bad spec exits with code 2 and names the field), runs
``workers.loop.train``; rank 0 appends one JSON object per step to ``--metrics-out`` (``api.spec.metrics
.MetricRow`` keys, written after each report) and prints a summary. With ``--state-dir`` every rank keeps
``rank<r>.json`` ("where am I", see ``workers.diagnostics``) there and dumps its stacks to ``rank<r>.stacks.txt``
on SIGUSR1; ``--profile-dir`` receives the traces of ``spec.profile``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("workers")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m workers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True, help="RunSpec as YAML or JSON")
    ap.add_argument("--metrics-out", default=None, help="JSON lines, one per step (rank 0)")
    ap.add_argument("--checkpoint-dir", default=None, help="periodic checkpoints go to DIR/step_XXXXXXXX")
    ap.add_argument("--resume-from", default=None, help="checkpoint directory to load before training")
    ap.add_argument("--steps", type=int, default=None, help="override train.steps")
    ap.add_argument("--run-id", default="local")
    ap.add_argument(
        "--code-dir",
        default=None,
        help="directory of user packages for model/data entrypoints, put "
        "on sys.path (default: the spec's code.working_dir)",
    )
    ap.add_argument("--state-dir", default=None, help="per-rank 'where am I' files and stack dumps")
    ap.add_argument("--profile-dir", default=None, help="profiles (spec.profile) go to DIR/steps_<first>-<last>/")
    ap.add_argument("--log-level", default=os.environ.get("MESHRUN_LOG_LEVEL", "INFO"))
    return ap.parse_args(argv)


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=args.log_level.upper() if rank == 0 else "WARNING",
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
    )
    import yaml
    from pydantic import ValidationError

    from api.spec import RunSpec
    from api.spec.validation import SpecError, build_plan
    from api.spec.yamlio import load_yaml

    try:
        raw = load_yaml(Path(args.spec).read_text())
    except (OSError, yaml.YAMLError) as e:
        return _fail(f"cannot read --spec {args.spec}: {e}")
    try:
        spec = RunSpec.model_validate(raw or {})
        if args.steps is not None:
            spec = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": args.steps})})
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(x) for x in first["loc"])
        return _fail(f"{field}: {first['msg']} ({len(e.errors())} issue(s) in {args.spec})")
    code_dir = args.code_dir or (spec.code.working_dir if spec.code is not None else None)
    if code_dir:
        from workers.user_code import UserCodeError, add_code_path

        try:
            add_code_path(code_dir)
        except UserCodeError as e:
            return _fail(str(e))
    import torch

    device = "cuda" if torch.cuda.is_available() and spec.resources.device != "cpu" else "cpu"
    try:
        plan = build_plan(spec, device=device)
    except SpecError as e:
        return _fail(f"{e.param}: {e.issues[0].message}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.world_size:
        return _fail(
            f"the layout needs {plan.world_size} processes (dp {plan.dp} x tp {plan.tp} x pp {plan.pp}) but "
            f"{world} were started; run: torchrun --standalone --nproc-per-node {plan.world_size} "
            f"-m workers --spec {args.spec} ..."
        )

    from workers.loop import WorkerJob, train

    out = None
    if rank == 0 and args.metrics_out:
        Path(args.metrics_out).parent.mkdir(parents=True, exist_ok=True)
        out = open(args.metrics_out, "a")

    def sink(row: dict) -> None:
        if out is not None:
            out.write(json.dumps(row) + "\n")
            out.flush()

    try:
        summary = train(
            WorkerJob(
                spec=spec,
                plan=plan,
                run_id=args.run_id,
                checkpoint_dir=args.checkpoint_dir,
                resume_from=args.resume_from,
                state_dir=args.state_dir,
                profile_dir=args.profile_dir,
            ),
            sink=sink,
        )
    finally:
        if out is not None:
            out.close()
    if rank == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "losses"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
