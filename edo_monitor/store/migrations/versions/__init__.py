"""Alembic revisions of the history database."""
