"""ORM classes mapped onto the tables of :mod:`edo_monitor.store.schema`, for the agent's writer.

Each class's columns are its table's (same names and types); readers use the tables themselves
and never import this module (or ``sqlalchemy.orm``).
"""

from __future__ import annotations

from sqlalchemy.orm import DeclarativeBase

from edo_monitor.store import schema

__all__ = [
    "Base",
    "DeviceEvent",
    "DeviceSample",
    "Event",
    "Meta",
    "ModuleStat",
    "ProcessSample",
    "Run",
    "Sample",
    "Snapshot",
]


class Base(DeclarativeBase):
    """Declarative base of every edo-monitor table; its metadata is :data:`schema.metadata`."""

    metadata = schema.metadata


class Meta(Base):
    """A row of ``meta``: key/value facts about the database itself (``schema_version``)."""

    __table__ = schema.meta_table


class Run(Base):
    """A row of ``runs``: one ``watch()`` block, its device, settings and how it ended."""

    __table__ = schema.runs_table


class Sample(Base):
    """A row of ``samples``: one :class:`edo_monitor.probes.readings.Reading` (same field names)."""

    __table__ = schema.samples_table


class Event(Base):
    """A row of ``events``: a threshold crossing, decision, action, refusal, OOM … (``data``)."""

    __table__ = schema.events_table


class ModuleStat(Base):
    """A row of ``module_stats``: the bytes of one module at one moment."""

    __table__ = schema.module_stats_table


class DeviceSample(Base):
    """A row of ``device_samples``: one GPU at one daemon sample."""

    __table__ = schema.device_samples_table


class ProcessSample(Base):
    """A row of ``process_samples``: one process on one GPU at one daemon sample."""

    __table__ = schema.process_samples_table


class DeviceEvent(Base):
    """A row of ``device_events``: a GPU appeared or was lost, NVML stopped, the daemon …"""

    __table__ = schema.device_events_table


class Snapshot(Base):
    """A row of ``snapshots``: one incident's memory snapshot (compressed pickle)."""

    __table__ = schema.snapshots_table
