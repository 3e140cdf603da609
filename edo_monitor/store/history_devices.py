"""The history's queries over the daemon's tables: GPUs, their processes, devices lost and found."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select

from edo_monitor.errors import ConfigError
from edo_monitor.store.queries import _count
from edo_monitor.store.records import (
    DeviceEventInfo,
    DeviceInfo,
    ProcessInfo,
)
from edo_monitor.store.schema import (
    device_events_table,
    device_samples_table,
    process_samples_table,
    runs_table,
)


class _DeviceQueries:
    """The history's queries over the daemon's tables: GPUs, their processes, devices lost and
    found."""

    # -- the daemon's rows (edo-monitor daemon) -----------------------------------------------
    def devices(self, *, within_s: float = 300.0, host: str | None = None) -> list[DeviceInfo]:
        """Every GPU at the latest daemon sample of each host, with its processes.

        Args:
            within_s: hosts whose latest sample is at most this many seconds older than the
                newest sample of any host (a daemon stopped long ago is not shown).
            host: only this host.

        Returns:
            By host, then NVML index; each device's processes largest first. ``[]`` when no
            daemon has written (or the file predates schema 7).

        Raises:
            ConfigError: ``within_s`` not a number >= 0.
        """
        if (
            isinstance(within_s, bool)
            or not isinstance(within_s, (int, float))
            or not within_s >= 0
        ):
            raise ConfigError(f"within_s={within_s!r}: expected a number of seconds >= 0")
        if not self._has_devices:
            return []
        ds, ps, runs = device_samples_table, process_samples_table, runs_table
        with self._read() as conn:
            newest = conn.execute(select(func.max(ds.c.time_s))).scalar()
            if newest is None:
                return []
            stmt = (
                select(ds.c.host, func.max(ds.c.time_s))
                .where(ds.c.time_s >= newest - within_s)
                .group_by(ds.c.host)
                .order_by(ds.c.host)
            )
            if host is not None:
                stmt = stmt.where(ds.c.host == host)
            out: list[DeviceInfo] = []
            for h, t in conn.execute(stmt).all():
                procs: dict[str, list[ProcessInfo]] = {}
                rows = conn.execute(
                    select(
                        ps.c.device_uuid,
                        ps.c.pid,
                        ps.c.process_name,
                        ps.c.kind,
                        ps.c.process_device_bytes,
                        ps.c.run_id,
                        runs.c.name,
                    )
                    .select_from(ps.outerjoin(runs, runs.c.id == ps.c.run_id))
                    .where(ps.c.time_s == t, ps.c.host == h)
                    .order_by(ps.c.id)
                )
                for r in rows:
                    procs.setdefault(r[0], []).append(ProcessInfo(*r[1:]))
                devs = conn.execute(
                    select(*ds.columns)
                    .where(ds.c.time_s == t, ds.c.host == h)
                    .order_by(ds.c.device_index, ds.c.id)
                )
                for d in devs:
                    mine = sorted(
                        procs.get(d.device_uuid, ()),
                        key=lambda p: -(p.process_device_bytes or 0),
                    )
                    out.append(
                        DeviceInfo(
                            d.time_s,
                            d.host,
                            d.device_index,
                            d.device_uuid,
                            d.device_name,
                            d.device_total_bytes,
                            d.device_used_bytes,
                            d.device_free_bytes,
                            d.utilization_gpu_fraction,
                            d.utilization_memory_fraction,
                            d.process_count,
                            tuple(mine),
                        )
                    )
        return out

    def device_events(
        self, *, limit: int | None = 100, kind: str | Sequence[str] | None = None
    ) -> list[DeviceEventInfo]:
        """The daemon's events (GPUs appearing or lost, NVML faults, starts and stops), the
        newest ``limit`` in time order; ``[]`` before schema 7.

        Raises:
            ConfigError: ``limit`` not an int >= 0 or None.
        """
        limit = _count(limit, "limit", 0)
        if not self._has_devices:
            return []
        de = device_events_table
        stmt = select(*de.columns).order_by(de.c.time_s.desc(), de.c.id.desc())
        if kind is not None:
            stmt = stmt.where(de.c.kind.in_([kind] if isinstance(kind, str) else list(kind)))
        if limit is not None:
            stmt = stmt.limit(limit)
        with self._read() as conn:
            found = [
                DeviceEventInfo(
                    r.id,
                    r.time_s,
                    r.host,
                    r.device_index,
                    r.device_uuid,
                    r.kind,
                    r.message,
                    dict(r.data or {}),
                )
                for r in conn.execute(stmt)
            ]
        return found[::-1]
