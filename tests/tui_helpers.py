"""What the dashboard's tests share: history databases seeded in ``tmp_path`` (written through
the ORM, as the agent's writer does), the ``db`` fixture, and running the app headless with
``App.run_test``, a :class:`~textual.pilot.Pilot` pressing keys and clicking."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session
from textual.pilot import Pilot
from textual.widgets import DataTable, Static

from edo_monitor.store.engine import open_engine
from edo_monitor.store.models import Event, ModuleStat, Run, Sample
from edo_monitor.tui.app import EdoTui
from edo_monitor.tui.run_screen import RunScreen

GIB = 1 << 30
REFRESH_S = 0.2
SIZE = (140, 45)


# -- seeding ---------------------------------------------------------------------------------


#: Fixed run uuids (no chance in tests): prefixes a0000001, a0000002, … each unique, never digits
_UUIDS = (uuid.UUID(int=(0xA0000000 + n) << 96 | n) for n in itertools.count(1))


def make_run(
    session: Session,
    name: str,
    *,
    status: str = "finished",
    started: float | None = None,
    duration: float = 60.0,
    pid: int | None = None,
    device_kind: str = "cuda",
    device_name: str | None = "NVIDIA H100 80GB HBM3",
    budget: int = 8 * GIB,
    tags: list[str] | None = None,
) -> Run:
    """Add a run row (flushed, so it has an id)."""
    started = time.time() - 3600 if started is None else started
    run = Run(
        uuid=str(next(_UUIDS)),
        name=name,
        host=os.uname().nodename if pid is None else __import__("socket").gethostname(),
        pid=os.getpid() if pid is None else pid,
        started_at_s=started,
        ended_at_s=None if status == "running" else started + duration,
        heartbeat_at_s=time.time() if status == "running" else started + duration,
        status=status,
        error=None,
        device_kind=device_kind,
        device_name=device_name,
        device_uuid=None,
        device_total_bytes=80 * GIB,
        budget_bytes=budget,
        interval_s=0.5,
        torch_version="2.4.0",
        config={"floor": 0.2},
        tags=tags or [],
        steps=0,
        samples_dropped=0,
    )
    session.add(run)
    session.flush()
    return run


def sample(run: Run, t: float, step: int, in_use: int, **extra: Any) -> Sample:
    """A sample row with consistent derived fields."""
    budget = run.budget_bytes or 8 * GIB
    fields: dict[str, Any] = {
        "run_id": run.id,
        "time_s": t,
        "step": step,
        "device_kind": run.device_kind,
        "allocated_bytes": int(in_use * 0.9),
        "reserved_bytes": int(in_use * 1.1),
        "budget_bytes": budget,
        "in_use_bytes": in_use,
        "free_fraction": (budget - in_use) / budget,
        "fragmentation": 0.125,
    }
    fields.update(extra)
    return Sample(**fields)


def add_samples(session: Session, run: Run, n: int, *, start: float | None = None) -> None:
    """``n`` samples, one per second, rising from 1 GiB to about 7 GiB."""
    t0 = run.started_at_s if start is None else start
    for i in range(n):
        session.add(sample(run, t0 + i, i, GIB + (6 * GIB * i) // max(1, n)))


def add_event(session: Session, run: Run, t: float, kind: str, message: str, **data: Any) -> None:
    """An event row."""
    session.add(Event(run_id=run.id, time_s=t, step=1, kind=kind, message=message, data=data))


def add_table(session: Session, run: Run, module: str, rows: int, dim: int, **kw: Any) -> None:
    """An embedding table's module_stats row."""
    fields: dict[str, Any] = {
        "run_id": run.id,
        "time_s": run.started_at_s,
        "step": 0,
        "module": module,
        "kind": "Embedding",
        "num_embeddings": rows,
        "embedding_dim": dim,
        "dtype": "torch.float32",
        "device": "cuda:0",
        "placement": "device",
        "params_bytes": rows * dim * 4,
        "grads_bytes": rows * dim * 4,
        "optimizer_state_bytes": 2 * rows * dim * 4,
        "activations_bytes": 0,
    }
    fields.update(kw)
    session.add(ModuleStat(**fields))


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """A database with two runs: ``old-finished`` (finished) and ``live-run`` (running)."""
    path = tmp_path / "history.db"
    engine = open_engine(path)
    with Session(engine) as session, session.begin():
        old = make_run(session, "old-finished", started=time.time() - 7200, tags=["baseline"])
        add_samples(session, old, 50)
        add_event(
            session,
            old,
            old.started_at_s + 20,
            "threshold_crossed",
            "free below floor",
            direction="down",
            free_fraction=0.15,
            floor=0.2,
        )
        add_event(
            session,
            old,
            old.started_at_s + 21,
            "action",
            "offloaded table",
            action="offload",
            target="emb.big",
            saved_bytes=2 * GIB,
            bytes_before=7 * GIB,
            bytes_after=5 * GIB,
            duration_s=0.05,
        )
        add_event(session, old, old.started_at_s + 30, "oom", "CUDA out of memory")
        add_table(session, old, "emb.big", 1_000_000, 128, placement="host", device="cpu")
        live = make_run(
            session,
            "live-run",
            status="running",
            started=time.time() - 30,
            device_kind="cpu-budget",
            device_name=None,
            budget=512 << 20,
        )
        for i in range(20):
            session.add(sample(live, live.started_at_s + i, i, (100 + i) << 20))
        add_table(session, live, "encoder.tok_emb", 30522, 384)
        add_table(session, live, "encoder.ln", 0, 0, kind="LayerNorm", num_embeddings=None)
    engine.dispose()
    return path


def run_app(
    app: EdoTui,
    body: Callable[[Pilot[None]], Coroutine[Any, Any, None]],
    size: tuple[int, int] = SIZE,
) -> None:
    """Run ``body(pilot)`` against the app headless, in a terminal of ``size`` (columns, rows)."""

    async def go() -> None:
        async with app.run_test(size=size) as pilot:
            await body(pilot)

    asyncio.run(go())


async def wait_for(pilot: Pilot[None], cond: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Let the app run until ``cond()`` holds (fails after ``timeout_s``: a hang guard, not a
    speed bound; bound what the app does in refresh ticks with :func:`within_refreshes`)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.02)


async def within_refreshes(
    pilot: Pilot[None], screen: RunScreen, cond: Callable[[], bool], refreshes: int
) -> None:
    """Let the app run until ``cond()`` holds; fail if the run view completes more than
    ``refreshes`` reads first (the app's own clock, not the machine's speed)."""
    start = screen.refreshes + screen.loads
    await wait_for(pilot, lambda: cond() or screen.refreshes + screen.loads - start > refreshes)
    assert cond(), f"not reached within {refreshes} refreshes"


def text_of(widget: Static) -> str:
    """The plain text a Static shows."""
    content = widget.render()
    return str(getattr(content, "plain", content))


def run_view(app: EdoTui) -> RunScreen:
    """The run view (loaded)."""
    return app.run_screen


def loaded(app: EdoTui) -> bool:
    """True once the run view has shown a run or a message."""
    screen = app.run_screen
    return screen.loaded or screen.error is not None


def table_column(table: DataTable[Any], index: int) -> list[str]:
    """One column of a DataTable as plain strings."""
    return [
        str(getattr(c, "plain", c))
        for c in (table.get_row_at(r)[index] for r in range(table.row_count))
    ]


def screen_text(app: EdoTui) -> str:
    """What the terminal shows now: the screenshot's text, its tags and entities removed."""
    import html
    import re

    svg = app.export_screenshot()
    return html.unescape(re.sub(r"<[^>]+>", "", svg)).replace("\xa0", " ")
