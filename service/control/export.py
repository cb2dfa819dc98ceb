"""Export a run's checkpoint as a Hugging Face model (``POST /v1/runs/{id}/export``).

The service reads the checkpoint where the run's workers wrote it (a filesystem the service shares, as it does
for listing checkpoints) and writes ``config.json`` + ``model.safetensors`` into ``out`` on its own filesystem,
under the same path policy as a spec's paths. The gathering itself (any layout's shards into whole tensors, the
name mapping) is ``workers.export.export_hf``, imported here lazily: the API process loads torch only when an
export is asked for.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy.orm import Session

from api.spec import ExportPublic, ExportRequest
from service import store
from service.errors import Conflict, InvalidRequest
from service.security.paths import decide_path
from service.settings import Settings

log = logging.getLogger(__name__)
_OURS = {"config.json", "model.safetensors"}


def export_run(
    session: Session, *, run_id: str, scope: str | None, request: ExportRequest, settings: Settings, admin: bool
) -> ExportPublic:
    run = store.get_run(session, run_id=run_id, project=scope)  # 404 for another project's run
    model = (run.spec or {}).get("model") or {}
    if model.get("name") != "hf":
        raise InvalidRequest(
            f"format: run {run_id} trained model '{model.get('name')}'; format hf exports runs of "
            "model: {name: hf, path: DIR} (a Hugging Face model meshrun loaded)",
            param="format",
        )
    rows = [c for c in store.list_checkpoints(session, run_id=run_id) if store.checkpoint_exists(c.path)]
    if request.checkpoint is not None:
        rows = [c for c in rows if c.step == request.checkpoint]
    if not rows:
        have = sorted({c.step for c in store.list_checkpoints(session, run_id=run_id)})
        what = f"no checkpoint of step {request.checkpoint}" if request.checkpoint is not None else "no checkpoint"
        raise InvalidRequest(
            f"checkpoint: run {run_id} has {what} on disk (steps recorded: {have[-10:]}); give one of those steps, "
            "or train with checkpoint.every_steps > 0",
            param="checkpoint",
            code="no_checkpoint",
        )
    ck = max(rows, key=lambda c: (c.step, c.attempt))
    if "://" in ck.path:
        raise InvalidRequest(
            f"checkpoint: step {ck.step} is in object storage ({ck.path.split('://')[0]}); export reads local "
            "checkpoints only",
            param="checkpoint",
        )
    out = decide_path(
        request.out,
        param="out",
        settings=settings,
        restricted=settings.auth_enabled,
        walled_to=None if admin else scope,
    )
    out_dir = Path(out).expanduser()
    if not out_dir.is_absolute():
        out_dir = Path(settings.data_dir) / out_dir
    if out_dir.exists() and not out_dir.is_dir():
        raise InvalidRequest(f"out: {request.out} is a file; give a directory", param="out")
    if out_dir.is_dir() and {p.name for p in out_dir.iterdir()} - _OURS:
        raise Conflict(f"out: {request.out} holds other files; give an empty or new directory", param="out")
    from workers.export import ExportError, export_hf

    try:
        info = export_hf(ck.path, out_dir)
    except ExportError as e:
        raise InvalidRequest(f"{e.param}: {e}", param=e.param) from None
    except OSError as e:
        raise InvalidRequest(f"out: cannot write {request.out}: {e.strerror or e}", param="out") from None
    log.info("run %s: exported step %d to %s", run_id, info["step"], out_dir)
    return ExportPublic(
        run_id=run_id,
        format=request.format,
        step=info["step"],
        out=str(out_dir),
        files=info["files"],
        n_params=info["n_params"],
    )
