"""Run database (SQLAlchemy 2 ORM). Alembic revisions in migrations/ are generated from this metadata."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# BIGINT primary keys autoincrement on PostgreSQL; SQLite needs INTEGER for its rowid alias.
BigId = BigInteger().with_variant(Integer, "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, datetime: DateTime(timezone=True)}


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        UniqueConstraint("project", "idempotency_key"),
        # the list endpoint pages newest first (keyset on created_at, id), per project and per status
        Index("ix_runs_project_created_at_id", "project", "created_at", "id"),
        Index("ix_runs_status_created_at_id", "status", "created_at", "id"),
        Index("ix_runs_created_at_id", "created_at", "id"),
        Index("ix_runs_name_created_at_id", "name", "created_at", "id"),
        Index("ix_runs_sweep_id_created_at_id", "sweep_id", "created_at", "id"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    project: Mapped[str] = mapped_column(String(64), default="default")
    status: Mapped[str] = mapped_column(String(16), default="QUEUED")
    status_reason: Mapped[str | None] = mapped_column(Text)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    sweep_id: Mapped[str | None] = mapped_column(ForeignKey("sweeps.id", ondelete="SET NULL"))
    ray_job_id: Mapped[str | None] = mapped_column(String(128))
    dashboard_url: Mapped[str | None] = mapped_column(Text)
    rank_nodes: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    resume_from: Mapped[str | None] = mapped_column(Text)
    created_by: Mapped[str | None] = mapped_column(String(128))
    idempotency_key: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None] = mapped_column()
    finished_at: Mapped[datetime | None] = mapped_column()

    events: Mapped[list[RunEvent]] = relationship(
        back_populates="run", cascade="all, delete-orphan", passive_deletes=True
    )


class RunAttempt(Base):
    __tablename__ = "run_attempts"
    __table_args__ = (UniqueConstraint("run_id", "attempt"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default="RUNNING")
    cause: Mapped[str | None] = mapped_column(Text)
    train_run_name: Mapped[str | None] = mapped_column(String(256))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column()


class Metric(Base):
    """One row per (run, attempt, step). The run's metric view takes, per step, the latest attempt's row."""

    __tablename__ = "metrics"
    # (run_id, attempt, step) is the unique index every metric query walks: pages, segments, downsampling
    __table_args__ = (UniqueConstraint("run_id", "attempt", "step"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    step: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    step_time_s: Mapped[float | None] = mapped_column(Float)
    mfu: Mapped[float | None] = mapped_column(Float)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    comm_fraction: Mapped[float | None] = mapped_column(Float)
    grad_norm: Mapped[float | None] = mapped_column(Float)
    lr: Mapped[float | None] = mapped_column(Float)
    time: Mapped[datetime] = mapped_column(default=utcnow)
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class RunEvent(Base):
    __tablename__ = "run_events"
    __table_args__ = (
        Index("ix_run_events_run_id_time_id", "run_id", "time", "id"),
        Index("ix_run_events_run_id_kind_time_id", "run_id", "kind", "time", "id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    time: Mapped[datetime] = mapped_column(default=utcnow)
    kind: Mapped[str] = mapped_column(String(32), default="state")
    from_status: Mapped[str | None] = mapped_column(String(16))
    to_status: Mapped[str | None] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    actor: Mapped[str | None] = mapped_column(String(128))

    run: Mapped[Run] = relationship(back_populates="events")


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("run_id", "attempt", "step"),
        Index("ix_checkpoints_run_id_step_attempt", "run_id", "step", "attempt"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Sweep(Base):
    __tablename__ = "sweeps"
    __table_args__ = (
        UniqueConstraint("project", "idempotency_key"),
        Index("ix_sweeps_project_created_at_id", "project", "created_at", "id"),
        Index("ix_sweeps_created_at_id", "created_at", "id"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), index=True)
    project: Mapped[str] = mapped_column(String(64), default="default")
    status: Mapped[str] = mapped_column(String(16), index=True, default="QUEUED")
    status_reason: Mapped[str | None] = mapped_column(Text)
    objective: Mapped[str] = mapped_column(String(32), default="tokens_per_s")
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    best_trial_id: Mapped[int | None] = mapped_column(Integer)
    calibration: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    ray_job_id: Mapped[str | None] = mapped_column(String(128))
    created_by: Mapped[str | None] = mapped_column(String(128))
    idempotency_key: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column()


class RunStats(Base):
    """The run's metric summary, maintained on every metrics write (``service.store.metrics``): reading a run never
    scans its metric rows. Sums and counts over the run's continuous series (see ``list_metrics``)."""

    __tablename__ = "run_stats"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rows: Mapped[int] = mapped_column(BigInteger, default=0)
    steps_done: Mapped[int] = mapped_column(Integer, default=0)
    final_loss: Mapped[float | None] = mapped_column(Float)
    tokens_per_s_sum: Mapped[float] = mapped_column(Float, default=0.0)
    tokens_per_s_count: Mapped[int] = mapped_column(BigInteger, default=0)
    mfu_sum: Mapped[float] = mapped_column(Float, default=0.0)
    mfu_count: Mapped[int] = mapped_column(BigInteger, default=0)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    first_steps: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class ConsoleSession(Base):
    """A signed-in browser of the web console: the cookie holds a random secret, only its SHA-256 is stored.
    It lives as long as the API token it was opened with (revoking the token ends it) and until ``expires_at``."""

    __tablename__ = "console_sessions"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    session_hash: Mapped[str] = mapped_column(String(64), unique=True)
    token_id: Mapped[int] = mapped_column(ForeignKey("api_tokens.id", ondelete="CASCADE"), index=True)
    csrf_token: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column()


class Trial(Base):
    __tablename__ = "trials"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    sweep_id: Mapped[str] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"), index=True)
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"), index=True)
    layout: Mapped[dict[str, Any]] = mapped_column(JSON)
    micro_batch_size: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default="PENDING")
    reason: Mapped[str | None] = mapped_column(Text)
    predicted_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    measured_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    measured_mfu: Mapped[float | None] = mapped_column(Float)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class SweepEvent(Base):
    """A state change of a sweep (``trial_id`` None) or of one of its trials, or an event without a state change
    (``kind`` other than "state"), like ``RunEvent`` for runs."""

    __tablename__ = "sweep_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    sweep_id: Mapped[str] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"), index=True)
    trial_id: Mapped[int | None] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"), index=True)
    time: Mapped[datetime] = mapped_column(default=utcnow)
    kind: Mapped[str] = mapped_column(String(32), default="state")
    from_status: Mapped[str | None] = mapped_column(String(16))
    to_status: Mapped[str | None] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    actor: Mapped[str | None] = mapped_column(String(128))


class Calibration(Base):
    """Planner efficiency factors fitted to a sweep's measurements, per cluster."""

    __tablename__ = "calibrations"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    cluster_key: Mapped[str] = mapped_column(String(256), index=True)
    factors: Mapped[dict[str, Any]] = mapped_column(JSON)
    error_before: Mapped[float | None] = mapped_column(Float)
    error_after: Mapped[float | None] = mapped_column(Float)
    sweep_id: Mapped[str | None] = mapped_column(ForeignKey("sweeps.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiToken(Base):
    """API tokens. Only a SHA-256 hash of the secret is stored."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    project: Mapped[str] = mapped_column(String(64), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    can_run_code: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column()


class Artifact(Base):
    """A file a run produced for diagnosis: a profile's Chrome trace, a pipeline timeline, a hang's stack dump.
    Stored gzip-compressed (``content``); ``size_bytes`` is the uncompressed size."""

    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("run_id", "attempt", "name"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    rank: Mapped[int | None] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(512))
    kind: Mapped[str] = mapped_column(String(32), default="file")
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    content: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Webhook(Base):
    """Where a project (or one run: ``run_id``) wants its events POSTed. The signing secret is kept sealed
    (``secret_sealed``: encrypted and authenticated with the service's webhook key, ``service.store.webhooks``),
    only ``secret_prefix`` is ever shown. ``run_event_cursor``/``sweep_event_cursor``: the last ``run_events`` and
    ``sweep_events`` ids the dispatcher has turned into deliveries."""

    __tablename__ = "webhooks"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    project: Mapped[str] = mapped_column(String(64), index=True)
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(Text)
    events: Mapped[list[str]] = mapped_column(JSON)
    states: Mapped[list[str] | None] = mapped_column(JSON)
    payload_format: Mapped[str] = mapped_column(String(16), default="json")
    goodput_below: Mapped[float | None] = mapped_column(Float)
    secret_sealed: Mapped[str] = mapped_column(Text)
    secret_prefix: Mapped[str] = mapped_column(String(16))
    run_event_cursor: Mapped[int] = mapped_column(BigInteger, default=0)
    sweep_event_cursor: Mapped[int] = mapped_column(BigInteger, default=0)
    created_by: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WebhookDelivery(Base):
    """One event for one webhook and every attempt to deliver it: ``outcome`` pending / delivered / failed (gave
    up after the last attempt), the last attempt's ``http_status`` and ``error``. ``source`` makes an event's
    delivery unique per webhook (several service replicas may scan the same events)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("webhook_id", "source"),
        Index("ix_webhook_deliveries_outcome_next_attempt_at", "outcome", "next_attempt_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    webhook_id: Mapped[int] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"))
    source: Mapped[str] = mapped_column(String(64))
    event: Mapped[str] = mapped_column(String(32))
    run_id: Mapped[str | None] = mapped_column(String(40))
    sweep_id: Mapped[str | None] = mapped_column(String(40))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    outcome: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    http_status: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_attempt_at: Mapped[datetime | None] = mapped_column()
    delivered_at: Mapped[datetime | None] = mapped_column()
