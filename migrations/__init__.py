"""Alembic migrations of the run database. Run them with ``service.store.migrate.upgrade(url)`` or ``meshrun db upgrade``."""
