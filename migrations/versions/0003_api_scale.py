"""The API at scale and the console: ``run_stats`` (each run's metric summary, maintained on write), keyset indexes
for the paged lists (runs and sweeps newest first per project/status/name/sweep, events by time and kind, checkpoints
by step), the metrics' run_id-only index dropped (the unique (run_id, attempt, step) index serves every query), and
``console_sessions`` (signed-in browsers of the web console; only a hash of the cookie is stored).

Runs from before this revision get their ``run_stats`` row the first time they are read.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24 11:15:50.679492
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0003'
down_revision: str | Sequence[str] | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('console_sessions',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('session_hash', sa.String(length=64), nullable=False),
    sa.Column('token_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('csrf_token', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['token_id'], ['api_tokens.id'], name=op.f('fk_console_sessions_token_id_api_tokens'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_console_sessions')),
    sa.UniqueConstraint('session_hash', name=op.f('uq_console_sessions_session_hash'))
    )
    with op.batch_alter_table('console_sessions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_console_sessions_token_id'), ['token_id'], unique=False)

    op.create_table('run_stats',
    sa.Column('run_id', sa.String(length=40), nullable=False),
    sa.Column('rows', sa.BigInteger(), nullable=False),
    sa.Column('steps_done', sa.Integer(), nullable=False),
    sa.Column('final_loss', sa.Float(), nullable=True),
    sa.Column('tokens_per_s_sum', sa.Float(), nullable=False),
    sa.Column('tokens_per_s_count', sa.BigInteger(), nullable=False),
    sa.Column('mfu_sum', sa.Float(), nullable=False),
    sa.Column('mfu_count', sa.BigInteger(), nullable=False),
    sa.Column('peak_memory_bytes', sa.BigInteger(), nullable=True),
    sa.Column('first_steps', sa.JSON(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_stats_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', name=op.f('pk_run_stats'))
    )
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoints_run_id'))
        batch_op.create_index('ix_checkpoints_run_id_step_attempt', ['run_id', 'step', 'attempt'], unique=False)

    with op.batch_alter_table('metrics', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_metrics_run_id'))

    with op.batch_alter_table('run_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_run_events_run_id'))
        batch_op.create_index('ix_run_events_run_id_kind_time_id', ['run_id', 'kind', 'time', 'id'], unique=False)
        batch_op.create_index('ix_run_events_run_id_time_id', ['run_id', 'time', 'id'], unique=False)

    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_runs_created_at'))
        batch_op.drop_index(batch_op.f('ix_runs_name'))
        batch_op.drop_index(batch_op.f('ix_runs_project'))
        batch_op.drop_index(batch_op.f('ix_runs_status'))
        batch_op.drop_index(batch_op.f('ix_runs_sweep_id'))
        batch_op.create_index('ix_runs_created_at_id', ['created_at', 'id'], unique=False)
        batch_op.create_index('ix_runs_name_created_at_id', ['name', 'created_at', 'id'], unique=False)
        batch_op.create_index('ix_runs_project_created_at_id', ['project', 'created_at', 'id'], unique=False)
        batch_op.create_index('ix_runs_status_created_at_id', ['status', 'created_at', 'id'], unique=False)
        batch_op.create_index('ix_runs_sweep_id_created_at_id', ['sweep_id', 'created_at', 'id'], unique=False)

    with op.batch_alter_table('sweeps', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sweeps_project'))
        batch_op.create_index('ix_sweeps_created_at_id', ['created_at', 'id'], unique=False)
        batch_op.create_index('ix_sweeps_project_created_at_id', ['project', 'created_at', 'id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('sweeps', schema=None) as batch_op:
        batch_op.drop_index('ix_sweeps_project_created_at_id')
        batch_op.drop_index('ix_sweeps_created_at_id')
        batch_op.create_index(batch_op.f('ix_sweeps_project'), ['project'], unique=False)

    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index('ix_runs_sweep_id_created_at_id')
        batch_op.drop_index('ix_runs_status_created_at_id')
        batch_op.drop_index('ix_runs_project_created_at_id')
        batch_op.drop_index('ix_runs_name_created_at_id')
        batch_op.drop_index('ix_runs_created_at_id')
        batch_op.create_index(batch_op.f('ix_runs_sweep_id'), ['sweep_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_runs_status'), ['status'], unique=False)
        batch_op.create_index(batch_op.f('ix_runs_project'), ['project'], unique=False)
        batch_op.create_index(batch_op.f('ix_runs_name'), ['name'], unique=False)
        batch_op.create_index(batch_op.f('ix_runs_created_at'), ['created_at'], unique=False)

    with op.batch_alter_table('run_events', schema=None) as batch_op:
        batch_op.drop_index('ix_run_events_run_id_time_id')
        batch_op.drop_index('ix_run_events_run_id_kind_time_id')
        batch_op.create_index(batch_op.f('ix_run_events_run_id'), ['run_id'], unique=False)

    with op.batch_alter_table('metrics', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_metrics_run_id'), ['run_id'], unique=False)

    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index('ix_checkpoints_run_id_step_attempt')
        batch_op.create_index(batch_op.f('ix_checkpoints_run_id'), ['run_id'], unique=False)

    op.drop_table('run_stats')
    with op.batch_alter_table('console_sessions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_console_sessions_token_id'))

    op.drop_table('console_sessions')
