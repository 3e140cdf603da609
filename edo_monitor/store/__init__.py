"""Keeping it: the history database (SQLite or PostgreSQL), its schema and migrations, the writer
threads. Takes readings, events and snapshots; hands runs and series to every reader (History)."""
