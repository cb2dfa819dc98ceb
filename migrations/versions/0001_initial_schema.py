"""Initial schema: runs, attempts, metrics, events, checkpoints, sweeps, trials, calibrations, api tokens.

Generated with autogenerate from service.store.models.Base.metadata, then reviewed: timezone-aware timestamps, JSON
columns, named constraints (service.store.models.NAMING), foreign keys with ON DELETE, batch mode for SQLite.

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-22 11:23:44.471678
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0001'
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('api_tokens',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('project', sa.String(length=64), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('admin', sa.Boolean(), nullable=False),
    sa.Column('can_run_code', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_tokens')),
    sa.UniqueConstraint('token_hash', name=op.f('uq_api_tokens_token_hash'))
    )
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_tokens_project'), ['project'], unique=False)

    op.create_table('sweeps',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('project', sa.String(length=64), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('status_reason', sa.Text(), nullable=True),
    sa.Column('objective', sa.String(length=32), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('best_trial_id', sa.Integer(), nullable=True),
    sa.Column('calibration', sa.JSON(), nullable=True),
    sa.Column('ray_job_id', sa.String(length=128), nullable=True),
    sa.Column('created_by', sa.String(length=128), nullable=True),
    sa.Column('idempotency_key', sa.String(length=128), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sweeps')),
    sa.UniqueConstraint('project', 'idempotency_key', name=op.f('uq_sweeps_project_idempotency_key'))
    )
    with op.batch_alter_table('sweeps', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_sweeps_name'), ['name'], unique=False)
        batch_op.create_index(batch_op.f('ix_sweeps_project'), ['project'], unique=False)
        batch_op.create_index(batch_op.f('ix_sweeps_status'), ['status'], unique=False)

    op.create_table('calibrations',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('cluster_key', sa.String(length=256), nullable=False),
    sa.Column('factors', sa.JSON(), nullable=False),
    sa.Column('error_before', sa.Float(), nullable=True),
    sa.Column('error_after', sa.Float(), nullable=True),
    sa.Column('sweep_id', sa.String(length=40), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['sweep_id'], ['sweeps.id'], name=op.f('fk_calibrations_sweep_id_sweeps'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_calibrations'))
    )
    with op.batch_alter_table('calibrations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_calibrations_cluster_key'), ['cluster_key'], unique=False)

    op.create_table('runs',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('project', sa.String(length=64), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('status_reason', sa.Text(), nullable=True),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('plan', sa.JSON(), nullable=True),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('sweep_id', sa.String(length=40), nullable=True),
    sa.Column('ray_job_id', sa.String(length=128), nullable=True),
    sa.Column('dashboard_url', sa.Text(), nullable=True),
    sa.Column('rank_nodes', sa.JSON(), nullable=True),
    sa.Column('summary', sa.JSON(), nullable=True),
    sa.Column('resume_from', sa.Text(), nullable=True),
    sa.Column('created_by', sa.String(length=128), nullable=True),
    sa.Column('idempotency_key', sa.String(length=128), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['sweep_id'], ['sweeps.id'], name=op.f('fk_runs_sweep_id_sweeps'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runs')),
    sa.UniqueConstraint('project', 'idempotency_key', name=op.f('uq_runs_project_idempotency_key'))
    )
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_runs_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_runs_name'), ['name'], unique=False)
        batch_op.create_index(batch_op.f('ix_runs_project'), ['project'], unique=False)
        batch_op.create_index(batch_op.f('ix_runs_status'), ['status'], unique=False)
        batch_op.create_index(batch_op.f('ix_runs_sweep_id'), ['sweep_id'], unique=False)

    op.create_table('checkpoints',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=40), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_checkpoints_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_checkpoints')),
    sa.UniqueConstraint('run_id', 'attempt', 'step', name=op.f('uq_checkpoints_run_id_attempt_step'))
    )
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_checkpoints_run_id'), ['run_id'], unique=False)

    op.create_table('metrics',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=40), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('tokens_per_s', sa.Float(), nullable=True),
    sa.Column('step_time_s', sa.Float(), nullable=True),
    sa.Column('mfu', sa.Float(), nullable=True),
    sa.Column('peak_memory_bytes', sa.BigInteger(), nullable=True),
    sa.Column('comm_fraction', sa.Float(), nullable=True),
    sa.Column('grad_norm', sa.Float(), nullable=True),
    sa.Column('lr', sa.Float(), nullable=True),
    sa.Column('time', sa.DateTime(timezone=True), nullable=False),
    sa.Column('extra', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_metrics_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_metrics')),
    sa.UniqueConstraint('run_id', 'attempt', 'step', name=op.f('uq_metrics_run_id_attempt_step'))
    )
    with op.batch_alter_table('metrics', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_metrics_run_id'), ['run_id'], unique=False)

    op.create_table('run_attempts',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=40), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('cause', sa.Text(), nullable=True),
    sa.Column('train_run_name', sa.String(length=256), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_attempts_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_run_attempts')),
    sa.UniqueConstraint('run_id', 'attempt', name=op.f('uq_run_attempts_run_id_attempt'))
    )
    with op.batch_alter_table('run_attempts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_run_attempts_run_id'), ['run_id'], unique=False)

    op.create_table('run_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=40), nullable=False),
    sa.Column('time', sa.DateTime(timezone=True), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('from_status', sa.String(length=16), nullable=True),
    sa.Column('to_status', sa.String(length=16), nullable=True),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('actor', sa.String(length=128), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_events_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_run_events'))
    )
    with op.batch_alter_table('run_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_run_events_run_id'), ['run_id'], unique=False)

    op.create_table('trials',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('sweep_id', sa.String(length=40), nullable=False),
    sa.Column('run_id', sa.String(length=40), nullable=True),
    sa.Column('layout', sa.JSON(), nullable=False),
    sa.Column('micro_batch_size', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('predicted_tokens_per_s', sa.Float(), nullable=True),
    sa.Column('measured_tokens_per_s', sa.Float(), nullable=True),
    sa.Column('measured_mfu', sa.Float(), nullable=True),
    sa.Column('peak_memory_bytes', sa.BigInteger(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_trials_run_id_runs'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['sweep_id'], ['sweeps.id'], name=op.f('fk_trials_sweep_id_sweeps'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_trials'))
    )
    with op.batch_alter_table('trials', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_trials_run_id'), ['run_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_trials_sweep_id'), ['sweep_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('trials', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_trials_sweep_id'))
        batch_op.drop_index(batch_op.f('ix_trials_run_id'))

    op.drop_table('trials')
    with op.batch_alter_table('run_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_run_events_run_id'))

    op.drop_table('run_events')
    with op.batch_alter_table('run_attempts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_run_attempts_run_id'))

    op.drop_table('run_attempts')
    with op.batch_alter_table('metrics', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_metrics_run_id'))

    op.drop_table('metrics')
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoints_run_id'))

    op.drop_table('checkpoints')
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_runs_sweep_id'))
        batch_op.drop_index(batch_op.f('ix_runs_status'))
        batch_op.drop_index(batch_op.f('ix_runs_project'))
        batch_op.drop_index(batch_op.f('ix_runs_name'))
        batch_op.drop_index(batch_op.f('ix_runs_created_at'))

    op.drop_table('runs')
    with op.batch_alter_table('calibrations', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_calibrations_cluster_key'))

    op.drop_table('calibrations')
    with op.batch_alter_table('sweeps', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sweeps_status'))
        batch_op.drop_index(batch_op.f('ix_sweeps_project'))
        batch_op.drop_index(batch_op.f('ix_sweeps_name'))

    op.drop_table('sweeps')
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_tokens_project'))

    op.drop_table('api_tokens')
