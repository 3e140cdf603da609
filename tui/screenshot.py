"""Save an SVG screenshot of the dashboard, headless (for the README and bug reports).

Usage::

    python -m edo_monitor.tui.screenshot [DB] [--run RUN] [--view live|runs] [--out FILE]
                                         [--size 140x45]

Opens the database read-only like ``edo-tui``, waits until the view has loaded (or its error
stayed over four reads, about 2 s) and two renders 0.2 s apart agree, and writes the screen as
SVG (Textual's ``save_screenshot``); the path written is logged and printed.

It exits with the code ``edo-tui`` would quit with on the view saved (see
:mod:`edo_monitor.tui.app`), so a script sees a failure while the picture of it is still written
for a bug report: 0 a run, the runs table or "waiting for a run"; 1 the view shows that the
database or run cannot be read (no such file, not a database, a newer schema, no run matching
``--run``); 2 a bad option, or a database argument that is neither a path nor a usable URL;
3 the view shows an internal error. With a non-zero code one line on stderr names the file
written, the code and the error shown.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edo_monitor.surfaces import scripting
from edo_monitor.tui.app import EdoTui, add_source_arguments
from edo_monitor.tui.base import EXIT_OK
from edo_monitor.tui.widgets import MemoryChart

__all__ = ["Shot", "main", "screenshot", "take"]

PROG = "python -m edo_monitor.tui.screenshot"

logger = logging.getLogger(__name__)

#: reads that must all fail before the error is what the screenshot shows
_ERROR_READS = 4


@dataclass(frozen=True)
class Shot:
    """A saved screenshot: the file, the exit code ``edo-tui`` would quit with on the view
    saved, and the error line that view shows (``None``: none)."""

    path: Path
    exit_code: int
    error: str | None


async def screenshot(
    db: str | None,
    out: Path,
    *,
    run: str | None = None,
    view: str = "live",
    size: tuple[int, int] = (140, 45),
    timeout_s: float = 30.0,
) -> Path:
    """Render the dashboard headless and save it as SVG at ``out``; returns the path (:func:`take`
    gives the exit code too)."""
    shot = await take(db, out, run=run, view=view, size=size, timeout_s=timeout_s)
    return shot.path


async def take(
    db: str | None,
    out: Path,
    *,
    run: str | None = None,
    view: str = "live",
    size: tuple[int, int] = (140, 45),
    timeout_s: float = 30.0,
) -> Shot:
    """Render the dashboard headless, save it as SVG at ``out``, and return it with the exit code
    ``edo-tui`` would quit with on that view (``EdoTui.exit_code``) and the error it shows."""
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
            runs = app.runs_screen  # an error does not count as a load: it ends the wait too
            while runs.loads == 0 and runs.error_code is None and loop.time() < deadline:
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
        code = app.exit_code  # what edo-tui would quit with on this view
        error = _error_shown(app) if code != EXIT_OK else None
    logger.info("saved %s", path)
    return Shot(Path(path), code, error)


def _error_shown(app: EdoTui) -> str | None:
    """The error line of the view on top that shows one, on one line (``None``: no text)."""
    for screen in reversed(app.screen_stack):
        message = getattr(screen, "error", None)
        if message:
            return " ".join(str(message).split())
    message = app.run_screen.error  # the runs view keeps no text: the run view read the same
    return " ".join(message.split()) if message else None


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point: saves the screenshot, prints its path, and returns the exit code
    ``edo-tui`` would quit with on the view saved (module docstring)."""
    parser = scripting.ArgumentParser(  # one-line errors, exit 2, as edo-tui's
        prog=PROG,
        description=(
            "Save the edo-tui dashboard as an SVG file, headless (for the README and bug "
            "reports): the database is opened read-only as edo-tui opens it, and the view is "
            "saved once it has loaded (or its error stayed) and two renders agree."
        ),
        epilog=(
            "Exit codes, as edo-tui's on the view saved (the SVG is written in every case "
            "but a bad option): 0 a run, the runs table or 'waiting for a run'; 1 the view "
            "shows that the database or run cannot be read (no such file, not a database, a "
            "newer schema, no run matching --run); 2 usage (bad option, unusable database "
            "argument); 3 internal error. A non-zero code is also one line on stderr."
        ),
    )
    add_source_arguments(parser)
    parser.add_argument(
        "--view", choices=("live", "runs"), default="live", help="the view to save (default live)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("edo-tui.svg"), help="SVG file (default edo-tui.svg)"
    )
    parser.add_argument(
        "--size", default="140x45", help="terminal size, COLUMNSxROWS (default 140x45)"
    )
    args = parser.parse_args(argv)
    try:
        cols, rows = (int(x) for x in args.size.lower().split("x"))
    except ValueError:
        parser.error(f"--size {args.size!r}: expected COLUMNSxROWS, e.g. 140x45")
    shot = asyncio.run(take(args.db, args.out, run=args.run, view=args.view, size=(cols, rows)))
    sys.stdout.write(f"{shot.path}\n")
    if shot.exit_code != EXIT_OK:
        sys.stderr.write(
            f"{PROG}: wrote {shot.path}, which shows an error; exit code {shot.exit_code} "
            f"(as edo-tui's): {shot.error or 'see the picture'}\n"
        )
    return shot.exit_code


if __name__ == "__main__":
    sys.exit(main())
