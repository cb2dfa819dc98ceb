"""``meshrun plan`` (rank layouts) and ``meshrun validate`` (check a spec offline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from api.cli._common import (
    EXIT_INVALID,
    EXIT_USAGE,
    _escape,
    _fail,
    _gib,
    _load_or_usage,
    _pct,
    _rate,
    _state,
    _usage,
    _usd,
    app,
    command,
    emit_json,
    err,
    out,
)
from api.sdk import (
    parse_layout,
)
from api.sdk._specs import apply_overrides
from api.spec import layout_label

# ------------------------------------------------------------------------------------------------ plans
BREAKDOWN_TERMS = (
    ("compute", "comp"),
    ("tp_comm", "tp"),
    ("pp_comm", "pp"),
    ("pp_bubble", "bubble"),
    ("dp_comm", "dp"),
    ("optimizer", "opt"),
    ("other", "other"),
)


def breakdown_str(step: Any) -> str:
    """Where a predicted step goes, largest first: 'comp 71% tp 14% bubble 9% dp 3%' (terms of 1 % or more)."""
    total = getattr(step, "total", 0.0) or 0.0
    if total <= 0:
        return "-"
    parts = [(short, (getattr(step, name, 0.0) or 0.0) / total) for name, short in BREAKDOWN_TERMS]
    return " ".join(f"{short} {share:.0%}" for short, share in sorted(parts, key=lambda p: -p[1]) if share >= 0.01)


def step_cell(c: Any) -> str:
    """'0.412 -5%/+21%': the predicted step time and the extent of its interval each way."""
    iv = getattr(c, "step_time_interval", None)
    cell = f"{c.step_time_s.total:.3f}"
    return cell + (f" -{iv.below:.0%}/+{iv.above:.0%}" if iv is not None and iv.above > 0 else "")


def _model_note(resp: Any) -> str:
    """Attention, kernel profile, what the intervals rest on, and the candidates they cannot tell apart."""
    cl = resp.cluster
    first = resp.candidates[0] if resp.candidates else None
    iv = getattr(first, "step_time_interval", None)
    note = f"attention: {getattr(resp.model, 'attention', 'flash')}; kernels: {cl.get('kernels', 'megatron')}"
    if iv is not None:
        note += f"; step s -x%/+y%: the 80% interval ({iv.basis})"
    ties = list(getattr(resp, "within_uncertainty", None) or [])
    if ties:
        note += "\nwithin uncertainty of #1 (measure them: meshrun sweep --layouts auto): " + ", ".join(
            f"#{i + 1}" for i in ties
        )
    return note


def _calibration_note(resp: Any) -> str:
    cal = getattr(resp, "calibration", None)
    if cal is None or getattr(cal, "source", "default") != "measured":
        return "planner factors: defaults (no measured runs of this cluster yet)"
    when = cal.measured_at.strftime("%Y-%m-%d %H:%M") if getattr(cal, "measured_at", None) else "?"
    names = ", ".join(cal.measured or []) or "none moved"
    return f"planner factors measured {when} (calibration {cal.calibration_id}): {names}"


def plan_table(resp: Any, *, show_rejected: bool = False) -> Table:
    cl = resp.cluster
    title = (
        f"{resp.model.name} {resp.model.n_params / 1e9:.2f}B params on "
        f"{cl.get('nodes', '?')} x {cl.get('gpus_per_node', '?')} {cl.get('device', '?')}  "
        f"({resp.evaluated} layouts evaluated in {resp.elapsed_s:.2f}s)"
    )
    t = Table(title=title)
    t.caption = (
        "mb: micro-batch size; ckpt: activation checkpointing; GiB: predicted peak memory per GPU; "
        "breakdown: predicted share of the step (comp compute, tp/pp/dp communication, bubble pipeline idle, "
        "opt optimizer; dp counts only what the backward pass does not hide)\n"
        + _model_note(resp)
        + "\n"
        + _calibration_note(resp)
    )
    costs = [c.cost for c in resp.candidates if c.cost is not None]
    priced = any(k.usd_per_step is not None for k in costs)
    cost_cols: tuple[str, ...] = ("$/step", "$/1B tok") if priced else ("dev-h/step",)
    if len({k.devices for k in costs}) > 1:  # a cost ranking: parts of the cluster too
        cost_cols = ("GPUs", *cost_cols)
    if any(k.steps for k in costs):
        cost_cols += ("$ run",) if priced else ("dev-h run",)
    first = costs[0] if costs else None
    if first is not None:
        t.caption += (
            "\n"
            + (
                f"cost: {_usd(first.price_per_device_hour)} per device-hour ({first.price_source})"
                if priced
                else "cost: no price known for this device (give cluster.price_per_device_hour or --price)"
            )
            + (f"; run = {first.steps} steps" if first.steps else "")
        )
    right = ("#", "mb", "GiB", "step s", "tokens/s", "MFU", *cost_cols)
    for col in ("#", "layout", "mb", "ckpt", "GiB", "step s", "tokens/s", "MFU", *cost_cols, "breakdown", "feasible"):
        t.add_column(col, justify="right" if col in right else "left", no_wrap=col in ("layout", "tokens/s"))
    if show_rejected:
        t.add_column("reason")
    rows = list(resp.candidates) + (list(resp.rejected) if show_rejected else [])
    for i, c in enumerate(rows, 1):
        t.add_row(
            str(i),
            layout_label(c.layout),
            str(c.micro_batch_size),
            c.activation_checkpointing,
            _gib(c.memory_bytes.total),
            step_cell(c),
            _rate(c.tokens_per_s),
            _pct(c.mfu),
            *_cost_cells(c.cost, cost_cols),
            breakdown_str(c.step_time_s),
            "[green]yes[/]" if c.feasible else "[red]no[/]",
            *([_escape(c.reason or "")] if show_rejected else []),
        )
    return t


def _cost_cells(cost: Any, cols: tuple[str, ...]) -> list[str]:
    values = {
        "GPUs": lambda k: str(k.devices),
        "$/step": lambda k: _usd(k.usd_per_step),
        "$/1B tok": lambda k: _usd(k.usd_per_billion_tokens),
        "$ run": lambda k: _usd(k.usd_for_steps),
        "dev-h/step": lambda k: f"{k.device_hours_per_step:.3g}",
        "dev-h run": lambda k: "-" if k.device_hours_for_steps is None else f"{k.device_hours_for_steps:.3g}",
    }
    return [values[col](cost) if cost is not None else "-" for col in cols]


@command(app, "plan")
def plan(
    ctx: typer.Context,
    file: Optional[Path] = typer.Argument(None, help="A plan request or a run spec (YAML/JSON)."),
    model: Optional[str] = typer.Option(None, help="Model family: gpt | mlp."),
    preset: Optional[str] = typer.Option(None, help="Preset, e.g. 125m, 7b, 70b."),
    device: Optional[str] = typer.Option(None, help="H100, A100-80GB, H200, L4, cpu, or 'live' (the service's Ray)."),
    gpus_per_node: Optional[int] = typer.Option(None, min=1),
    nodes: Optional[int] = typer.Option(None, min=1),
    global_batch_size: Optional[int] = typer.Option(None, min=1),
    seq_len: Optional[int] = typer.Option(None, min=1),
    precision: Optional[str] = typer.Option(None, help="fp32 | bf16 | fp16 (default bf16)."),
    layout: Optional[str] = typer.Option(None, help='Score only this layout, e.g. "dp=4,tp=8,pp=4".'),
    keep_layout: bool = typer.Option(False, "--keep-layout", help="With a run spec FILE: score its layout only."),
    micro_batch_size: Optional[int] = typer.Option(None, min=1),
    top_k: Optional[int] = typer.Option(None, "--top-k", min=1, help="How many candidates (default 10)."),
    show_rejected: bool = typer.Option(False, "--rejected", help="Also list layouts that do not fit."),
    rank_by: Optional[str] = typer.Option(
        None, "--rank-by", help="time (fastest on the whole cluster, default) | cost (cheapest per token, parts too)."
    ),
    price: Optional[float] = typer.Option(None, "--price", min=0, help="US dollars per device-hour."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="The run's steps: cost of all of them."),
    attention: Optional[str] = typer.Option(None, help="flash (default) | eager: unfused softmax(QK^T)V attention."),
    kernels: Optional[str] = typer.Option(
        None, help="megatron (fused kernels, the default) | eager (meshrun's own PyTorch loop)."
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Predict memory, step time, tokens/s and MFU of layouts before running anything."""
    body: dict[str, Any] = {}
    if file is not None:
        data = _load_or_usage(file)
        run_cluster = {"price_per_device_hour"}  # a run spec's cluster section; a plan request's has the device
        if "global_batch_size" in data or set(data.get("cluster") or {}) - run_cluster:
            body = data
        else:  # a run spec
            body = {
                "model": data.get("model", {}),
                "global_batch_size": (data.get("batch") or {}).get("global_batch_size", 16),
            }
            if data.get("precision"):
                body["precision"] = data["precision"]
            if (data.get("train") or {}).get("steps"):
                body["steps"] = data["train"]["steps"]
            if (data.get("cluster") or {}).get("price_per_device_hour") is not None:
                body["cluster"] = {"price_per_device_hour": data["cluster"]["price_per_device_hour"]}
            # a meshrun run: its own eager loop, fused-kernel figures when compiled (service/planner/profiles.py)
            body.setdefault("cluster", {})["kernels"] = "megatron" if data.get("compile") else "eager"
            if keep_layout:
                body["layout"] = data.get("layout", {})
                if (data.get("batch") or {}).get("micro_batch_size"):
                    body["micro_batch_size"] = data["batch"]["micro_batch_size"]
    elif model is None and preset is None:
        _fail("give a FILE or --model/--preset with --global-batch-size (see meshrun plan --help)", EXIT_USAGE)
    if model is not None or preset is not None or attention is not None:
        m = dict(body.get("model") or {})
        for key, val in (("name", model), ("preset", preset), ("attention", attention)):
            if val is not None:
                m[key] = val
        body["model"] = m
    cluster = dict(body.get("cluster") or {})
    for k, v in (
        ("device", device),
        ("gpus_per_node", gpus_per_node),
        ("nodes", nodes),
        ("price_per_device_hour", price),
        ("kernels", kernels),
    ):
        if v is not None:
            cluster[k] = v
    if cluster:
        body["cluster"] = cluster
    if "global_batch_size" not in body and global_batch_size is None:
        _fail("--global-batch-size is required (sequences per optimizer step)", EXIT_USAGE, param="global_batch_size")
    for k, v in (
        ("global_batch_size", global_batch_size),
        ("seq_len", seq_len),
        ("precision", precision),
        ("micro_batch_size", micro_batch_size),
        ("top_k", top_k),
        ("rank_by", rank_by),
        ("steps", steps),
    ):
        if v is not None:
            body[k] = v
    if layout is not None:
        body["layout"] = _usage(lambda: parse_layout(layout))
    resp = _state(ctx).client().plans.create(body)
    if as_json:
        emit_json(resp)
        return
    out().print(plan_table(resp, show_rejected=show_rejected))
    if not resp.candidates:
        err().print("[yellow]no feasible layout; see --rejected for why[/]")


# ------------------------------------------------------------------------------------------ local tools
OFFLINE_NOT_CHECKED = (
    "memory fit on the cluster's devices (the planner with the service's cluster)",
    "the cluster's capacity (enough nodes, CPUs and GPUs)",
    "the service's policy (project permissions, paths, user code)",
)


@command(app, "validate")
def validate(
    ctx: typer.Context,
    file: Path = typer.Argument(..., help="Run spec (YAML/JSON)."),
    set_: list[str] = typer.Option([], "--set", help="Override a field: key=value."),
    cluster: Optional[str] = typer.Option(
        None,
        "--cluster",
        help='"live": also run every check of a submission on the service (--url): memory fit on its cluster, '
        "capacity, policy. Without it: the spec alone, offline.",
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Check a run spec and print the resolved plan: offline (the spec alone, no service needed), or with
    --cluster live the same checks as `meshrun submit` on the service, nothing submitted."""
    import pydantic

    from api.sdk._base import tolerant_validate
    from api.spec import RunSpec
    from api.spec.checks import RunValidation
    from api.spec.messages import describe_errors
    from api.spec.validation import SpecError, build_plan
    from api.spec.yamlio import parse_run_spec

    if cluster not in (None, "live"):
        _fail(f'--cluster {cluster!r}: give "live" (the service\'s cluster), or omit it to check offline', EXIT_USAGE)
    body = _usage(lambda: apply_overrides(_load_or_usage(file), set_))
    try:
        # the server's parse of a JSON body (what `meshrun submit` sends): valid here means accepted there
        spec = parse_run_spec(body)
    except pydantic.ValidationError as e:
        # the same words as the service's 422 (api.spec.messages)
        _code, message, param = describe_errors(e.errors(include_url=False), model=RunSpec)
        _fail(message, EXIT_INVALID, param=param)
    except (TypeError, ValueError) as e:  # data JSON cannot carry (a YAML date, NaN)
        _fail(f"{file}: {e}; quote such values", EXIT_INVALID)
    try:
        p = build_plan(spec)
    except SpecError as e:
        for issue in e.issues[1:]:
            err().print(f"[red]error: {_escape(issue.message)}  (field: {issue.param})[/]", soft_wrap=True)
        _fail(e.issues[0].message, EXIT_INVALID, param=e.issues[0].param)
    not_checked = list(OFFLINE_NOT_CHECKED)
    where = "offline"
    if cluster == "live":
        client = _state(ctx).client()
        # the submission's own checks on the service (its 422 -> exit 4 with the field and the fix)
        res = tolerant_validate(RunValidation, client.request("POST", "/v1/runs/validate", json=body))
        p, not_checked, where = res.plan, res.not_checked, f"on {client.base_url}"
    if as_json:
        emit_json(p)
        return
    pred = p.predicted
    fits = f", predicted {_gib(pred.memory_bytes.total)} GiB/rank" if pred is not None else ""
    out().print(
        f"[green]valid[/] ({where}) {spec.name}: {layout_label(spec.layout)}  world {p.world_size}, "
        f"{p.model.n_params:,} params, {p.microbatches_per_step} micro-batches/step, "
        f"{p.tokens_per_step:,} tokens/step{fits}",
        soft_wrap=True,
    )
    for w in p.warnings:
        err().print(f"[yellow]warning:[/] {_escape(w)}", soft_wrap=True)
    if not_checked:
        hint = "; meshrun validate FILE --cluster live runs them on the service" if cluster is None else ""
        err().print(f"[yellow]not checked:[/] {_escape('; '.join(not_checked))}{hint}", soft_wrap=True)
