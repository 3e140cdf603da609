"""The history's multi-rank job queries: jobs, one job by id or prefix, its runs."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select

from edo_monitor.errors import JobNotFoundError
from edo_monitor.store.queries import (
    _count,
    _statuses,
    _to_epoch,
)
from edo_monitor.store.records import (
    JobInfo,
    RunInfo,
)
from edo_monitor.store.schema import (
    jobs_table,
    runs_table,
)


class _JobQueries:
    """The history's multi-rank job queries: jobs, one job by id or prefix, its runs."""

    # -- jobs --------------------------------------------------------------------------------
    def jobs(
        self,
        *,
        status: str | Sequence[str] | None = None,
        since: float | datetime | None = None,
        limit: int | None = None,
    ) -> list[JobInfo]:
        """Multi-rank jobs (``torch.distributed``), newest first (by ``created_at_s``).

        Args:
            status: keep jobs with this summed-up status (or any of these): ``running``,
                ``finished``, ``failed``, ``interrupted``, ``crashed`` (see :class:`JobInfo`).
            since: keep jobs created at or after this time (Unix seconds or datetime).
            limit: at most this many jobs (after filtering).

        Returns:
            One :class:`JobInfo` per job (``[]`` for a database of schema < 6).

        Raises:
            ConfigError: an unknown status, a bad ``since``, ``limit`` not an int >= 0 or None.
        """
        wanted = _statuses(status, "job")
        since_s = _to_epoch(since, "since")
        limit = _count(limit, "limit", 0)
        if self._empty or not self._has_jobs:
            return []
        stmt = select(*jobs_table.columns).order_by(
            jobs_table.c.created_at_s.desc(), jobs_table.c.id.desc()
        )
        if since_s is not None:
            stmt = stmt.where(jobs_table.c.created_at_s >= since_s)
        with self._read() as conn:
            rows = [dict(r._mapping) for r in conn.execute(stmt)]
        infos = self._job_infos(rows)
        if wanted:
            infos = [i for i in infos if i.status in wanted]
        return infos if limit is None else infos[:limit]

    def job(self, ref: str) -> JobInfo:
        """One job by its id, a prefix of it that matches one job, or ``"latest"`` (most
        recently created).

        Raises:
            JobNotFoundError: no job matches, or a prefix matches several.
        """
        return self._job_infos([self._find_job(ref)])[0]

    def job_runs(self, ref: str, *, stats: bool = True) -> list[RunInfo]:
        """The runs of job ``ref`` (as :meth:`job` takes it), one per rank, by rank (then by
        start, for an elastic restart's second run of a rank).

        Args:
            ref: the job reference.
            stats: summarise each run's samples and events as :meth:`run` does (peaks, minimum
                free fraction, action and OOM counts); ``False``: the stored rows only.

        Raises:
            JobNotFoundError: no job matches, or a prefix matches several.
        """
        job_id = self._find_job(ref)["id"]
        stmt = (
            select(*self._run_cols)
            .where(runs_table.c.job_id == job_id)
            .order_by(runs_table.c.rank, runs_table.c.started_at_s, runs_table.c.id)
        )
        with self._read() as conn:
            rows = [dict(r._mapping) for r in conn.execute(stmt)]
        infos = [self._base_info(r) for r in rows]
        return self._with_stats(infos) if stats else infos

    def _find_job(self, ref: str) -> dict[str, Any]:
        if self._empty or not self._has_jobs:
            raise JobNotFoundError(f"no job {ref!r}: the history database has no jobs")
        if not isinstance(ref, str) or not ref.strip():
            raise JobNotFoundError(f"{ref!r} is not a job reference; expected a job id or prefix")
        ref_s = ref.strip()
        cols = jobs_table.columns
        with self._read() as conn:
            row = conn.execute(select(*cols).where(jobs_table.c.id == ref_s)).first()
            if row is not None:
                return dict(row._mapping)
            if ref_s.lower() == "latest":
                row = conn.execute(
                    select(*cols)
                    .order_by(jobs_table.c.created_at_s.desc(), jobs_table.c.id.desc())
                    .limit(1)
                ).first()
                if row is None:
                    raise JobNotFoundError("no job 'latest': the history database has no jobs")
                return dict(row._mapping)
            escaped = ref_s.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            found = conn.execute(
                select(*cols).where(jobs_table.c.id.like(escaped + "%", escape="\\")).limit(6)
            ).all()
        if not found:
            raise JobNotFoundError(f"no job with id or id prefix {ref_s!r}")
        if len(found) > 1:
            shown = ", ".join(str(r.id) for r in found[:5])
            raise JobNotFoundError(
                f"job id prefix {ref_s!r} matches several jobs: {shown}; give more characters"
            )
        return dict(found[0]._mapping)

    def _job_infos(self, rows: list[dict[str, Any]]) -> list[JobInfo]:
        """Each job row with the summary of its runs (one read of their rows)."""
        if not rows:
            return []
        ids = [r["id"] for r in rows]
        with self._read() as conn:
            runs = [
                dict(r._mapping)
                for r in conn.execute(select(*self._run_cols).where(runs_table.c.job_id.in_(ids)))
            ]
        by_job: dict[str, list[RunInfo]] = {}
        for r in runs:
            by_job.setdefault(r["job_id"], []).append(self._base_info(r))
        out = []
        for row in rows:
            members = by_job.get(row["id"], [])
            statuses = {m.status for m in members}
            status = None
            if members:
                status = next(
                    (s for s in ("running", "crashed", "failed", "interrupted") if s in statuses),
                    "finished",
                )
            # where each run ended: its recorded end, else (crashed: nothing wrote one) its
            # last heartbeat, as the run's own duration counts it; a crashed rank's job used to
            # have no end, and its duration grew with the clock
            ends = [
                None
                if m.status == "running"
                else m.ended_at_s
                if m.ended_at_s is not None
                else m.started_at_s + m.duration_s
                for m in members
            ]
            out.append(
                JobInfo(
                    id=row["id"],
                    name=row["name"],
                    world_size=int(row["world_size"]),
                    backend=row["backend"],
                    id_source=row["id_source"],
                    created_at_s=row["created_at_s"],
                    run_count=len(members),
                    ranks=tuple(sorted(m.rank for m in members if m.rank is not None)),
                    hosts=tuple(sorted({m.host for m in members})),
                    status=status,
                    started_at_s=min((m.started_at_s for m in members), default=None),
                    ended_at_s=(
                        None
                        if not members or status == "running" or None in ends
                        else max(e for e in ends if e is not None)
                    ),
                    min_steps=min((m.steps for m in members), default=None),
                )
            )
        return out
