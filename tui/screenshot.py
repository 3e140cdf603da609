"""Save an SVG screenshot of the dashboard, headless (for the README and bug reports).

Usage::

    python -m edo_monitor.tui.screenshot [DB] [--run RUN] [--view live|runs] [--out FILE]
                                         [--size 140x45]

Opens the database read-only like ``edo-tui``, waits until the view has loaded (or its error
stayed over four reads, about 2 s) and two renders 0.2 s apart agree, and writes the screen as
SVG (Textual's ``save_screenshot``); the path written is logged and printed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from edo_monitor.tui.app import EdoTui
from edo_monitor.tui.widgets import MemoryChart

__all__ = ["main", "screenshot"]

logger = logging.getLogger(__name__)

#: reads that must all fail before the error is what the screenshot shows
_ERROR_READS = 4


async def screenshot(
    db: str | None,
    out: Path,
    *,
    run: str | None = None,
    view: str = "live",
    size: tuple[int, int] = (140, 45),
    timeout_s: float = 30.0,
) -> Path:
    """Render the dashboard headless and save it as SVG at ``out``; returns the path."""
    app = EdoTui(db, run=run, refresh_s=0.5)
    async with app.run_test(size=size) as pilot:
        screen = app.run_screen
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # loaded, or an error that stayed over several reads (the screen reads again every
        # refresh: a file not there yet, or a read that failed once, must not end the wait)
        while not (screen.loaded or (screen.error and screen.loads >= _ERROR_READS)):
            if loop.time() >= deadline:
                logger.warning("the view did not load in %.0f s: saving it as it is", timeout_s)
                break
            await pilot.pause(0.05)
        chart = screen.query_one(MemoryChart)
        while chart.lines_size != chart.wanted_size and loop.time() < deadline:
            await pilot.pause(0.05)  # the chart's lines are built for its final size
        if view == "runs":
            await pilot.press("r")
            while app.runs_screen.loads == 0 and loop.time() < deadline:
                await pilot.pause(0.05)
        # settled: two renders 0.2 s apart agree (under load a table's columns were once laid
        # out before its rows; a live run's clock keeps changing: then the deadline decides)
        before = app.export_screenshot()
        for _ in range(50):
            await pilot.pause(0.2)
            now = app.export_screenshot()
            if now == before or loop.time() >= deadline:
                break
            before = now
        out.parent.mkdir(parents=True, exist_ok=True)
        path = app.save_screenshot(filename=out.name, path=str(out.parent))
    logger.info("saved %s", path)
    return Path(path)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog="python -m edo_monitor.tui.screenshot")
    parser.add_argument("db", nargs="?", default=None, help="database path or URL")
    parser.add_argument("--run", default=None, help="run id, uuid prefix or 'latest'")
    parser.add_argument("--view", choices=("live", "runs"), default="live")
    parser.add_argument("--out", type=Path, default=Path("edo-tui.svg"))
    parser.add_argument("--size", default="140x45", help="terminal size, COLUMNSxROWS")
    args = parser.parse_args(argv)
    try:
        cols, rows = (int(x) for x in args.size.lower().split("x"))
    except ValueError:
        parser.error(f"--size {args.size!r}: expected COLUMNSxROWS, e.g. 140x45")
    path = asyncio.run(
        screenshot(args.db, args.out, run=args.run, view=args.view, size=(cols, rows))
    )
    sys.stdout.write(f"{path}\n")


if __name__ == "__main__":
    main()
