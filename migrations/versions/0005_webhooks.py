"""Webhooks: per project (or per run) URLs that get signed POSTs of run and sweep events, and the log of every
delivery (attempts, last HTTP status, error, timestamps).

Generated with autogenerate from service.store.models.Base.metadata, then reviewed.

Revision ID: 0005_webhooks
Revises: 0004_artifacts
Create Date: 2026-11-28 18:04:10.188072
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0005_webhooks'
down_revision: str | Sequence[str] | None = '0004_artifacts'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('webhooks',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('project', sa.String(length=64), nullable=False),
    sa.Column('run_id', sa.String(length=40), nullable=True),
    sa.Column('url', sa.Text(), nullable=False),
    sa.Column('events', sa.JSON(), nullable=False),
    sa.Column('states', sa.JSON(), nullable=True),
    sa.Column('payload_format', sa.String(length=16), nullable=False),
    sa.Column('goodput_below', sa.Float(), nullable=True),
    sa.Column('secret_sealed', sa.Text(), nullable=False),
    sa.Column('secret_prefix', sa.String(length=16), nullable=False),
    sa.Column('run_event_cursor', sa.BigInteger(), nullable=False),
    sa.Column('sweep_event_cursor', sa.BigInteger(), nullable=False),
    sa.Column('created_by', sa.String(length=128), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_webhooks_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_webhooks'))
    )
    with op.batch_alter_table('webhooks', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_webhooks_project'), ['project'], unique=False)
        batch_op.create_index(batch_op.f('ix_webhooks_run_id'), ['run_id'], unique=False)

    op.create_table('webhook_deliveries',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('webhook_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('source', sa.String(length=64), nullable=False),
    sa.Column('event', sa.String(length=32), nullable=False),
    sa.Column('run_id', sa.String(length=40), nullable=True),
    sa.Column('sweep_id', sa.String(length=40), nullable=True),
    sa.Column('payload', sa.JSON(), nullable=False),
    sa.Column('outcome', sa.String(length=16), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('http_status', sa.Integer(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_attempt_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['webhook_id'], ['webhooks.id'], name=op.f('fk_webhook_deliveries_webhook_id_webhooks'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_webhook_deliveries')),
    sa.UniqueConstraint('webhook_id', 'source', name=op.f('uq_webhook_deliveries_webhook_id_source'))
    )
    with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        batch_op.create_index('ix_webhook_deliveries_outcome_next_attempt_at', ['outcome', 'next_attempt_at'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        batch_op.drop_index('ix_webhook_deliveries_outcome_next_attempt_at')

    op.drop_table('webhook_deliveries')
    with op.batch_alter_table('webhooks', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_webhooks_run_id'))
        batch_op.drop_index(batch_op.f('ix_webhooks_project'))

    op.drop_table('webhooks')
