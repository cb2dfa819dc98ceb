"""Run artifacts: files a run produced for diagnosis (``models.Artifact``), gzip-compressed in the database so the
service, the run driver and every API replica see them without a shared filesystem."""

from __future__ import annotations

import gzip

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, load_only

from service.store.models import Artifact
from service.store.runs import NotFound

PROFILE_REQUEST = "profile_request"  # the run event of POST /v1/runs/{id}/profile, which the run's driver forwards
MAX_ARTIFACT_BYTES = 256 * 2**20  # uncompressed; larger files are refused (profile fewer steps)


def artifact_kind(name: str) -> str:
    if name.endswith(".trace.json"):
        return "profile"
    if name.endswith(".pipeline.json"):
        return "pipeline"
    if name.startswith("stacks/"):
        return "stacks"
    return "file"


def add_artifact(
    session: Session, *, run_id: str, attempt: int, rank: int | None, name: str, content: bytes
) -> Artifact | None:
    """Store (or replace) one artifact; None when it is too large to keep."""
    if len(content) > MAX_ARTIFACT_BYTES:
        return None
    session.execute(
        delete(Artifact).where(Artifact.run_id == run_id, Artifact.attempt == attempt, Artifact.name == name)
    )
    art = Artifact(
        run_id=run_id,
        attempt=attempt,
        rank=rank,
        name=name,
        kind=artifact_kind(name),
        size_bytes=len(content),
        content=gzip.compress(content, compresslevel=5),
    )
    session.add(art)
    return art


def list_artifacts(session: Session, *, run_id: str) -> list[Artifact]:
    """Every artifact of the run (without content), newest attempt first, then by name."""
    cols = load_only(
        Artifact.run_id,
        Artifact.attempt,
        Artifact.rank,
        Artifact.name,
        Artifact.kind,
        Artifact.size_bytes,
        Artifact.created_at,
    )
    stmt = (
        select(Artifact).options(cols).where(Artifact.run_id == run_id).order_by(Artifact.attempt.desc(), Artifact.name)
    )
    return list(session.scalars(stmt).all())


def read_artifact(session: Session, *, run_id: str, name: str, attempt: int | None = None) -> tuple[Artifact, bytes]:
    """(the artifact, its uncompressed content): of ``attempt``, else of the newest attempt that has it."""
    stmt = select(Artifact).where(Artifact.run_id == run_id, Artifact.name == name)
    if attempt is not None:
        stmt = stmt.where(Artifact.attempt == attempt)
    art = session.scalars(stmt.order_by(Artifact.attempt.desc()).limit(1)).first()
    if art is None:
        where = f" of attempt {attempt}" if attempt is not None else ""
        raise NotFound(
            f"run '{run_id}' has no artifact '{name}'{where}; list them with GET /v1/runs/{run_id}/artifacts",
            param="name",
        )
    return art, gzip.decompress(art.content)
