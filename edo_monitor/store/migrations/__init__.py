"""Alembic migrations of the history database (schema version ``N`` is revision ``"000N"``)."""
