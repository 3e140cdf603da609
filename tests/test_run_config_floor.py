"""The run's recorded ``config`` and the floor read back from it: a ``watch(config=...)`` key never
replaces a key the agent records (``floor``, ``policy`` …), and every reader (``explain``, the
dashboard's gauges, chart and explain view) takes the policy's floor, also from an older history
whose ``floor`` a user's value had replaced (a string among them); a run without a policy has no
floor (none drawn, nothing coloured by one).

Real ``watch()`` runs on the CPU budget write a real SQLite file; the dashboard runs headless with
``App.run_test`` and a :class:`~textual.pilot.Pilot` (``tui_helpers``)."""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot
from tui_helpers import REFRESH_S, run_app, screen_text, wait_for
from typer.testing import CliRunner
from watch_helpers import PRESSURE_BUDGET, record_pressure_run

import edo_monitor
from edo_monitor.hindsight.explain import explain
from edo_monitor.store.history import History
from edo_monitor.surfaces.cli import app as cli
from edo_monitor.tui.app import EdoTui
from edo_monitor.tui.modals import ExplainScreen
from edo_monitor.tui.widgets import FLOOR_RGB, Gauge, MemoryChart

BUDGET = PRESSURE_BUDGET
FLOOR = 0.3
record = record_pressure_run


def policy() -> edo_monitor.Policy:
    return edo_monitor.Policy(min_free_fraction=FLOOR, rearm_free_fraction=FLOOR + 0.05)


@pytest.fixture(scope="module")
def floors_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run 1: a policy with a 30 % floor and user keys named like the agent's (``floor``: 0.5,
    ``model``); run 2: the same, written as the agent before this fix wrote it (its ``floor``
    replaced by the user's ``"3rd"``: an older history); run 3: the budget without a policy."""
    db = tmp_path_factory.mktemp("floors") / "h.db"
    record(db, "user-keys", policy=policy(), config={"floor": 0.5, "model": "mine", "lr": 0.1})
    old = record(db, "old-history", policy=policy())
    record(db, "no-policy")
    con = sqlite3.connect(db)
    with con:
        con.execute(
            "UPDATE runs SET config = json_set(config, '$.floor', '3rd') WHERE id = ?", (old,)
        )
    con.close()
    return db


def test_a_user_key_named_like_the_agents_is_kept_under_another_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "h.db"
    with caplog.at_level(logging.WARNING):
        record(
            db,
            "clash",
            policy=policy(),
            config={"floor": "3rd", "policy": "mine", "user.policy": 1, "lr": 0.1},
        )
    with History(db) as h:
        config = h.run("latest").config
    assert config["floor"] == FLOOR  # the agent's: the policy's floor
    assert config["policy"].startswith("Policy(min_free_fraction=0.3,")
    assert config["model"] == "Sequential"
    assert config["user.floor"] == "3rd"  # the user's values are all kept
    assert config["user.user.policy"] == "mine" and config["user.policy"] == 1
    assert config["lr"] == 0.1
    warned = [r.getMessage() for r in caplog.records if "config keys" in r.getMessage()]
    assert len(warned) == 1
    assert "'floor' as 'user.floor'" in warned[0]
    assert "'policy' as 'user.user.policy'" in warned[0]


def test_explain_takes_the_policys_floor(floors_db: Path) -> None:
    assert explain(floors_db, 1).floor_fraction == FLOOR  # the user's 0.5 was taken
    result = explain(floors_db, 2)  # "3rd": ValueError before
    assert result.floor_fraction == FLOOR
    assert result.incidents and result.incidents[0].kind == "below_floor"
    res = CliRunner().invoke(cli, ["explain", "2", "--json", "--db", str(floors_db)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["floor_fraction"] == FLOOR


@pytest.mark.parametrize("run", ["1", "2"])
def test_dashboard_shows_the_policys_floor_and_explains(floors_db: Path, run: str) -> None:
    """Run 1's gauges showed the user's 50 %, run 2's 20 % (a string is no number), and ``x``
    on run 2 killed the dashboard (``WorkerFailed: ValueError``)."""
    app = EdoTui(floors_db, run=run, refresh_s=REFRESH_S)
    seen: dict[str, Any] = {}

    async def body(pilot: Pilot[None]) -> None:
        screen = app.run_screen
        await wait_for(pilot, lambda: screen.loaded)
        chart = screen.query_one(MemoryChart)
        await wait_for(pilot, lambda: chart.lines_size == chart.wanted_size)
        seen["free"] = screen.query_one("#gauge-free", Gauge)
        seen["free_text"], seen["free_mark"] = seen["free"].text, seen["free"].mark
        seen["used_mark"] = screen.query_one("#gauge-used", Gauge).mark
        seen["floor_bytes"] = chart.data.floor_bytes
        seen["legend"] = chart.lines[0].text
        await pilot.press("x")
        shown = app.screen
        assert isinstance(shown, ExplainScreen)
        await wait_for(pilot, lambda: shown.result is not None or shown.error is not None)
        seen["result"], seen["error"] = shown.result, shown.error
        await pilot.pause()
        seen["text"] = screen_text(app)

    run_app(app, body)
    assert seen["free_text"].endswith("(floor 30.0 %)"), seen["free_text"]
    assert seen["free_mark"] == FLOOR and seen["used_mark"] == pytest.approx(1 - FLOOR)
    assert seen["floor_bytes"] == int(BUDGET * (1 - FLOOR))
    assert "floor (30% free)" in seen["legend"]
    assert seen["error"] is None
    assert seen["result"] == explain(floors_db, int(run))
    assert "below the floor 30%" in seen["text"]


def test_a_run_without_a_policy_has_no_floor(floors_db: Path) -> None:
    """The dashboard drew a 20 % floor line and turned the gauges red for a budget without a
    policy (its config records ``floor: None``); ``explain --json`` said ``floor_fraction: 0.2``."""
    with History(floors_db) as h:
        run = h.run(3)
        latest_free = h.samples(3, columns=["free_fraction"], max_points=None).min["free_fraction"]
    assert run.config["policy"] is None and run.config["floor"] is None
    assert latest_free[-1] < 0.2  # below the default floor: red there before
    result = explain(floors_db, 3)
    assert result.floor_fraction is None and result.incidents == ()
    res = CliRunner().invoke(cli, ["explain", "3", "--json", "--db", str(floors_db)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["floor_fraction"] is None
    app = EdoTui(floors_db, run="3", refresh_s=REFRESH_S)
    seen: dict[str, Any] = {}

    async def body(pilot: Pilot[None]) -> None:
        screen = app.run_screen
        await wait_for(pilot, lambda: screen.loaded)
        chart = screen.query_one(MemoryChart)
        await wait_for(pilot, lambda: chart.lines_size == chart.wanted_size)
        for name in ("used", "free"):
            gauge = screen.query_one(f"#gauge-{name}", Gauge)
            seen[name] = (gauge.text, gauge.mark, gauge.warn)
        seen["data"] = chart.data
        seen["floor_rows"] = [
            y
            for y, line in enumerate(chart.lines)
            for segment in line
            if segment.style is not None
            and segment.style.color is not None
            and segment.style.color.triplet is not None
            and tuple(segment.style.color.triplet) == FLOOR_RGB
            and segment.text.strip()
        ]
        seen["legend"] = chart.lines[0].text

    run_app(app, body)
    free_text, free_mark, free_warn = seen["free"]
    assert free_text.endswith("% (no policy: no floor)"), free_text
    assert free_mark is None and not free_warn
    _, used_mark, used_warn = seen["used"]
    assert used_mark is None and not used_warn
    assert seen["data"].floor_bytes is None and seen["data"].floor_fraction is None
    assert seen["floor_rows"] == [] and "floor" not in seen["legend"]
