"""Sweep events: the stored transitions of sweeps and their trials (like run_events for runs).

Generated with autogenerate from service.store.models.Base.metadata, then reviewed.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-24 11:16:00.276259
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0002'
down_revision: str | Sequence[str] | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('sweep_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('sweep_id', sa.String(length=40), nullable=False),
    sa.Column('trial_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('time', sa.DateTime(timezone=True), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('from_status', sa.String(length=16), nullable=True),
    sa.Column('to_status', sa.String(length=16), nullable=True),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('actor', sa.String(length=128), nullable=True),
    sa.ForeignKeyConstraint(['sweep_id'], ['sweeps.id'], name=op.f('fk_sweep_events_sweep_id_sweeps'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['trial_id'], ['trials.id'], name=op.f('fk_sweep_events_trial_id_trials'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sweep_events'))
    )
    with op.batch_alter_table('sweep_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_sweep_events_sweep_id'), ['sweep_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_sweep_events_trial_id'), ['trial_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('sweep_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sweep_events_trial_id'))
        batch_op.drop_index(batch_op.f('ix_sweep_events_sweep_id'))

    op.drop_table('sweep_events')
