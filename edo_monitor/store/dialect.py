"""The SQL dialect a history speaks: SQLite or PostgreSQL, and the statements that differ."""

from __future__ import annotations

from sqlalchemy import Connection, Engine


def is_postgres(conn: Connection | Engine) -> bool:
    """Whether ``conn`` talks to PostgreSQL (rather than SQLite)."""
    return conn.dialect.name == "postgresql"


class SqlDialect:
    """The few SQL idioms that differ between SQLite and PostgreSQL, as text to format in.

    SQLite's ``total()`` (a float sum, ``0.0`` over no values) is ``coalesce(sum()::float8, 0)``
    on PostgreSQL (whose ``sum`` of integers is ``numeric``); SQLite's ``CAST(x AS INTEGER)``
    truncates toward zero, PostgreSQL's rounds, hence ``trunc()``; SQLite's two-argument
    ``min``/``max`` are ``least``/``greatest``; SQLite's planner hints (``NOT INDEXED``, a unary
    ``+`` on a column) are dropped on PostgreSQL.
    """

    def __init__(self, postgres: bool) -> None:
        self.postgres = postgres
        self.not_indexed = "" if postgres else " NOT INDEXED"
        self.plus = "" if postgres else "+"

    def samples_above(self, param: str) -> str:
        """``FROM`` source and ``WHERE`` start for the samples with ``id > :param``, walked by
        id (the samples newer than a rollup mark): SQLite's ``NOT INDEXED``; on PostgreSQL a
        subquery fenced by ``OFFSET 0``, planned alone, so its only predicate picks the primary
        key range (never the ``(run_id, time_s)`` index over a whole run). Follow it with
        ``self.plus + "run_id = …"``."""
        if self.postgres:
            return f"(SELECT * FROM samples WHERE id > :{param} OFFSET 0) AS samples WHERE "
        return f"samples NOT INDEXED WHERE id > :{param} AND "

    def total(self, expr: str) -> str:
        """Float sum of the non-NULL values of ``expr`` (``0.0`` when there are none)."""
        return f"coalesce(sum({expr})::float8, 0)" if self.postgres else f"total({expr})"

    def trunc(self, expr: str) -> str:
        """``expr`` truncated toward zero, as an integer."""
        return f"trunc({expr})::bigint" if self.postgres else f"CAST({expr} AS INTEGER)"

    def least(self, a: str, b: str) -> str:
        """The smaller of two values."""
        return f"least({a}, {b})" if self.postgres else f"min({a}, {b})"


def sql_dialect(conn: Connection | Engine) -> SqlDialect:
    """The :class:`SqlDialect` of ``conn``'s database."""
    return SqlDialect(is_postgres(conn))


#: First key of the advisory locks that serialise one run's inserts on PostgreSQL ("edo1").
_LOCK_CLASS = 0x65646F31
