"""The dashboard's timers and worker hand-backs against screens that are not there (issue 21).

Every refresh timer, resume/resize handler and worker hand-back of a screen can run while that
screen is being mounted, after it was popped (its widgets being removed) or while the app exits.
They must then do nothing: under load ``RunScreen.tick`` reached ``query_one(MemoryChart)`` on a
screen being torn down and the app crashed with ``NoMatches``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rich.console import Group
from textual.pilot import Pilot
from textual.screen import Screen
from tui_helpers import db, loaded, run_app, wait_for  # noqa: F401 (db: the fixture)

from edo_monitor.hindsight.explain import explain
from edo_monitor.hindsight.view import explain_renderables
from edo_monitor.tui.app import EdoTui
from edo_monitor.tui.base import _call_ui
from edo_monitor.tui.devices_screen import DevicesScreen
from edo_monitor.tui.job_screen import JobScreen
from edo_monitor.tui.modals import ExplainScreen
from edo_monitor.tui.run_screen import RunScreen
from edo_monitor.tui.runs_screen import RunsScreen

#: push/pop rounds of each screen
ROUNDS = 4


def _poke(screen: Screen[Any], reads: dict[str, Any]) -> int:
    """Call every timer target, resume handler and worker hand-back of ``screen`` as Textual
    or a worker thread would; returns how many calls were made."""
    calls: list[tuple[Any, tuple[Any, ...]]] = []
    if isinstance(screen, RunScreen):
        g = screen.generation
        size = (80, 20)
        calls += [
            (screen.tick, ()),
            (screen.on_screen_resume, ()),
            (screen._show_error, (g, "cannot read", 1)),
            (screen._apply_load, (g, *reads["load"], size, None)),
            (screen._apply_poll, (g, reads["poll"], reads["chart"], [], size)),
            (screen._apply_chart, (g, reads["chart"], [], size)),
            (screen._follow_idle, (g,)),
        ]
    elif isinstance(screen, ExplainScreen):
        calls += [(screen._show, reads["explain"])]
        calls += [(screen._show_error, ("cannot read", 1))]
    else:
        calls += [
            (screen.reload, ()),
            (screen.on_screen_resume, ()),
            (screen._show_error, ("cannot read", 1)),
        ]
        if isinstance(screen, RunsScreen):
            calls.append((screen._apply, (None, reads["runs"])))
        elif isinstance(screen, DevicesScreen):
            calls.append((screen._apply, (None, reads["devices"])))
        elif isinstance(screen, JobScreen):
            calls.append((screen._apply, (screen.chosen, reads["jobs"])))
    for call, args in calls:
        call(*args)
    return len(calls)


def test_timers_and_hand_backs_during_push_pop_and_exit_do_nothing(db: Path) -> None:  # noqa: F811
    app = EdoTui(db, refresh_s=0.01)  # the real timers fire all along, too
    counted = {"mounting": 0, "closing": 0, "exiting": 0}

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app) and app.run_screen.run_info is not None)
        live = app.run_screen
        run = live.run_info
        assert run is not None
        source = app.source
        reads = {  # what the workers hand back, read here once
            "load": (run, *live._read_run(run, 100, (80, 20))),
            "poll": source.poll(run.id, 0, 0),
            "chart": live._read_run(run, 100, (80, 20))[4],
            "runs": source.runs(),
            "devices": source.devices(),
            "jobs": source.jobs(None),
            "explain": (
                result := explain(source.open(), run.id),
                Group(*explain_renderables(result)),
            ),
        }
        for _ in range(ROUNDS):
            for make in (
                lambda: RunScreen(str(run.id)),
                RunsScreen,
                DevicesScreen,
                JobScreen,
                lambda: ExplainScreen(run),
            ):
                screen = make()
                screen._id = f"{screen.id}-pushed"  # beside the installed one of that id
                waiter = app.push_screen(screen)
                while not screen.is_mounted:  # being built
                    counted["mounting"] += _poke(screen, reads)
                    await asyncio.sleep(0)
                await waiter
                await pilot.pause(0.02)
                done = app.pop_screen()
                while screen.is_attached:  # popped: its widgets being removed
                    counted["closing"] += _poke(screen, reads)
                    await asyncio.sleep(0)
                await done
                counted["closing"] += _poke(screen, reads)
        installed = (live, app.runs_screen, app.devices_screen, app.job_screen)
        app.exit()
        for _ in range(50):  # the app exiting: the installed screens still get their calls
            for screen in installed:
                counted["exiting"] += _poke(screen, reads)
            await asyncio.sleep(0)

    run_app(app, body)
    assert all(n > 0 for n in counted.values()), counted
    assert app.return_code in (None, 0)  # no crash inside the app


def test_a_worker_hand_back_after_the_app_stopped_is_dropped(db: Path) -> None:  # noqa: F811
    """``call_from_thread`` after the app stopped raises ``RuntimeError`` in the worker; the
    hand-back of a read that outlives the app is dropped instead."""
    app = EdoTui(db)
    seen: list[str] = []
    _call_ui(app, lambda: seen.append("called"))  # never ran: nothing to hand to
    assert seen == []
