"""Alembic migrations of the run database. Run them with ``service.migrate.upgrade(url)`` or ``meshrun db upgrade``."""
