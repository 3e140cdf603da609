"""Save an SVG screenshot of the dashboard, headless (for the README and bug reports).

Usage::

    python -m edo_monitor.tui.screenshot [DB] [--run RUN] [--view live|runs] [--out FILE]
                                         [--size 140x45]

Opens the database read-only like ``edo-tui``, waits until the view has loaded (or its error
stayed over four reads, about 2 s) and two renders 0.2 s apart agree, and writes the screen as
SVG (Textual's ``export_screenshot``); the path written is logged and printed.

``--out`` is checked before the database is opened and written as ``edo-monitor export --out``
writes (:mod:`edo_monitor.surfaces.cli.output`): never the history database or its ``-wal``,
``-shm`` and ``-journal`` files (by name, link or hard link), not a folder, not in a folder that
does not exist; through a temporary file renamed into place. ``--size`` is at least
:data:`MIN_SIZE` (the dashboard's layout: the classic 80x24 terminal) and at most
:data:`MAX_SIZE`.

It exits with the code ``edo-tui`` would quit with on the view saved (see
:mod:`edo_monitor.tui.app`), so a script sees a failure while the picture of it is still written
for a bug report: 0 a run, the runs table or "waiting for a run"; 1 the view shows that the
database or run cannot be read (no such file, not a database, a newer schema, no run matching
``--run``); 2 a bad option, or a database argument that is neither a path nor a usable URL;
3 the view shows an internal error. With a non-zero code one line on stderr names the file
written, the code and the error shown. A refused ``--out`` or ``--size`` is exit code 2 and an
``--out`` that cannot be written (a read-only folder) exit code 1, one line on stderr each, and
nothing is written.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edo_monitor.errors import ConfigError, EdoMonitorError
from edo_monitor.surfaces import scripting
from edo_monitor.surfaces.cli.output import output_target, write_output
from edo_monitor.tui.app import EdoTui, add_source_arguments, parse_source_args
from edo_monitor.tui.base import EXIT_OK, EXIT_REFUSED
from edo_monitor.tui.widgets import MemoryChart

__all__ = ["MAX_SIZE", "MIN_SIZE", "Shot", "main", "screenshot", "take"]

PROG = "python -m edo_monitor.tui.screenshot"

logger = logging.getLogger(__name__)

#: reads that must all fail before the error is what the screenshot shows
_ERROR_READS = 4

#: the smallest terminal (columns, rows) the dashboard is laid out for: a smaller one cuts its
#: chart, events and tables to nothing
MIN_SIZE = (80, 24)
#: the largest screenshot (columns, rows)
MAX_SIZE = (1000, 500)


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
    ``edo-tui`` would quit with on that view (``EdoTui.exit_code``) and the error it shows.

    Raises:
        ConfigError: ``out`` is refused (the history database or one of its companion files, a
            folder, a folder that does not exist: checked before the database is opened), or
            ``size`` is outside :data:`MIN_SIZE`..:data:`MAX_SIZE`.
        EdoMonitorError: ``out`` cannot be written (one line naming it); nothing is left there.
    """
    check_size(size)
    target = output_target(out, db, "--out")
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
        svg = app.export_screenshot()
        code = app.exit_code  # what edo-tui would quit with on this view
        error = _error_shown(app) if code != EXIT_OK else None
    write_output(target, svg.encode("utf-8"))
    logger.info("saved %s", target.shown)
    return Shot(Path(target.shown), code, error)


def check_size(size: tuple[int, int]) -> None:
    """Refuse a screenshot size outside :data:`MIN_SIZE`..:data:`MAX_SIZE` (``ConfigError``
    naming it and what is allowed)."""
    cols, rows = size
    (low_c, low_r), (high_c, high_r) = MIN_SIZE, MAX_SIZE
    if not (low_c <= cols <= high_c and low_r <= rows <= high_r):
        raise ConfigError(
            f"--size {cols}x{rows} is out of range; allowed: {low_c} to {high_c} columns by "
            f"{low_r} to {high_r} rows (COLUMNSxROWS, e.g. 140x45)"
        )


def parse_size(text: str) -> tuple[int, int]:
    """``--size``: ``"140x45"`` → ``(140, 45)``, within :func:`check_size`'s range.

    Raises:
        argparse.ArgumentTypeError: not ``COLUMNSxROWS``, or out of range (naming the value and
            what is allowed).
    """
    parts = text.strip().lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; expected COLUMNSxROWS, e.g. 140x45 (at least "
            f"{MIN_SIZE[0]}x{MIN_SIZE[1]})"
        )
    size = (int(parts[0]), int(parts[1]))
    try:
        check_size(size)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--size ")) from None
    return size


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
            "but a bad option or an --out that cannot be written): 0 a run, the runs table or "
            "'waiting for a run'; 1 the view shows that the database or run cannot be read (no "
            "such file, not a database, a newer schema, no run matching --run), or --out "
            "cannot be written; 2 usage (bad option, unusable database argument, an --out that "
            "is the history database or one of its -wal/-shm/-journal files, a folder or in a "
            "folder that does not exist); 3 internal error. A non-zero code is also one line "
            "on stderr."
        ),
    )
    add_source_arguments(parser)
    parser.add_argument(
        "--view", choices=("live", "runs"), default="live", help="the view to save (default live)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("edo-tui.svg"),
        help="SVG file (default edo-tui.svg), replaced when there; never the history database "
        "or its -wal/-shm/-journal files",
    )
    low, high = MIN_SIZE, MAX_SIZE
    parser.add_argument(
        "--size",
        type=parse_size,
        default=(140, 45),
        help=f"terminal size, COLUMNSxROWS (default 140x45; {low[0]}x{low[1]} to "
        f"{high[0]}x{high[1]})",
    )
    args = parse_source_args(parser, argv)
    try:
        shot = asyncio.run(take(args.db, args.out, run=args.run, view=args.view, size=args.size))
    except ConfigError as exc:  # a refused --out: before anything is opened
        parser.error(str(exc))
    except EdoMonitorError as exc:  # --out cannot be written
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return EXIT_REFUSED
    sys.stdout.write(f"{shot.path}\n")
    if shot.exit_code != EXIT_OK:
        sys.stderr.write(
            f"{PROG}: wrote {shot.path}, which shows an error; exit code {shot.exit_code} "
            f"(as edo-tui's): {shot.error or 'see the picture'}\n"
        )
    return shot.exit_code


if __name__ == "__main__":
    sys.exit(main())
