"""``POST /v1/runs/{id}/export``: a run's checkpoint as a Hugging Face model directory. Thin: the logic lives in
``service.control.export``."""

from __future__ import annotations

from fastapi import APIRouter

from api.spec import ExportPublic, ExportRequest
from service.app.deps import PrincipalDep, SessionDep, SettingsDep
from service.app.errors import error_responses
from service.app.routes.runs import RunId
from service.control.export import export_run

router = APIRouter(tags=["runs"])


@router.post(
    "/v1/runs/{run_id}/export",
    response_model=ExportPublic,
    summary="Export a checkpoint as a Hugging Face model",
    responses=error_responses(404, 409, 422),
)
def export(
    run_id: RunId, body: ExportRequest, session: SessionDep, principal: PrincipalDep, settings: SettingsDep
) -> ExportPublic:
    """Gather the run's checkpoint (``checkpoint``: its step; the latest by default), whatever layout wrote it,
    into ``out``/config.json + ``out``/model.safetensors on the service's filesystem (under its allowed roots when
    auth is on), which ``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads. Runs of ``model: {name:
    hf}`` only (422 ``format`` otherwise); 409 when ``out`` holds other files."""
    return export_run(
        session, run_id=run_id, scope=principal.scope, request=body, settings=settings, admin=principal.admin
    )
