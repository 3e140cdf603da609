"""The run view at 80 columns: the header takes the rows its text needs (counting the text's
newlines alone kept a header whose text wrapped one row tall, its status, step and follow note
cut off), and a gauge whose label and figures do not fit one line puts them on two (the budget
and the floor were cut off: ``used/budget: 7.0…``)."""

from __future__ import annotations

from pathlib import Path

from textual.pilot import Pilot
from textual.widgets import Static
from tui_helpers import REFRESH_S, db, loaded, run_app, screen_text, wait_for  # noqa: F401

from edo_monitor.tui.app import EdoTui


def test_a_header_that_wraps_is_shown_whole_at_80_columns(db: Path) -> None:  # noqa: F811
    app = EdoTui(db, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        header = app.run_screen.query_one("#run-header", Static)
        await wait_for(pilot, lambda: header.size.height > 1)
        assert header.size.height == 2  # its ~120 characters at 78 columns
        shown = " ".join(screen_text(app).split())
        assert "step: 19" in shown and "following new runs" in shown
        assert "used/budget:" in shown and "119 MiB / 512 MiB" in shown  # on its own line

    run_app(app, body, size=(80, 24))
