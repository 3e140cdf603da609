"""``edo-monitor snapshot``: an incident's memory snapshot for PyTorch's memory viewer.

``--out FILE`` writes the pickle ``torch.cuda.memory._snapshot()`` would (open it at
https://pytorch.org/memory_viz or with ``python -m torch.cuda._memory_viz``); ``--html FILE`` the
viewer's page made by ``torch.cuda._memory_viz.trace_plot`` (or ``segment_plot``), the snapshot
inside it (the page loads PyTorch's ``MemoryViz.js`` when opened, as PyTorch's own page does);
``--top K`` the largest live blocks grouped by frame (the module and category in CPU-budget
mode). Only ``--html`` imports torch.
"""

from __future__ import annotations

import json
import pickle
from typing import TYPE_CHECKING, Any

from rich.text import Text

from edo_monitor.errors import ConfigError
from edo_monitor.list_table import Col, ListTable
from edo_monitor.measure.snapshots import FrameRow, fragmentation, top_by_frame, totals
from edo_monitor.store.snapshot_store import SnapshotInfo, find_snapshot, load_snapshot
from edo_monitor.surfaces.cli.output import OutputFile, write_output
from edo_monitor.units import format_bytes

if TYPE_CHECKING:
    from rich.console import RenderableType

    from edo_monitor.store.history import History

__all__ = ["HTML_KINDS", "describe", "snapshot_command", "top_table"]

#: ``--html-kind``: which page of ``torch.cuda._memory_viz``
HTML_KINDS = ("trace", "segments")


def top_table(rows: list[FrameRow], allocated_bytes: int, title: str = "") -> ListTable:
    """A table (:class:`~edo_monitor.list_table.ListTable`, the frame never cut) of
    :func:`edo_monitor.measure.snapshots.top_by_frame` rows with each frame's share of
    ``allocated_bytes``."""
    table = ListTable(
        Col("frame (module)", key=True),
        Col("blocks", "right"),
        Col("bytes", "right"),
        Col("share", "right"),
        Col("largest block", "right"),
        title=title or None,
        title_justify="left",
    )
    for r in rows:
        share = r.bytes / allocated_bytes if allocated_bytes else 0.0
        table.add_row(
            Text(r.frame), str(r.blocks), format_bytes(r.bytes), f"{share:.1%}",
            format_bytes(r.largest_bytes),
        )  # fmt: skip
    return table


def describe(info: SnapshotInfo, snapshot: dict[str, Any]) -> str:
    """One line: which snapshot, its event, its totals and (at an OOM) its fragmentation."""
    t = totals(snapshot)
    frag = fragmentation(snapshot)
    line = (
        f"snapshot {info.id} of run {info.run_id}, event {info.event_id} "
        f"({info.event_kind or '?'}, {info.phase}), step {info.step}, {info.source}: "
        f"allocated {format_bytes(t.allocated_bytes)} in {t.blocks} blocks, reserved "
        f"{format_bytes(t.reserved_bytes)} in {t.segments} segments, largest free block "
        f"{format_bytes(t.largest_free_block_bytes)}; stored {format_bytes(info.stored_bytes)}"
    )
    if frag["request_bytes"] is not None:
        line += f"; the failed request: {format_bytes(frag['request_bytes'])}"
    return line


def snapshot_command(
    history: History,
    run: Any,
    *,
    event: int | None = None,
    out: OutputFile | None = None,
    html: OutputFile | None = None,
    html_kind: str = "trace",
    top: int | None = None,
    as_json: bool = False,
) -> list[RenderableType]:
    """Do what ``edo-monitor snapshot`` asks and return what it prints.

    Args:
        history: the history (read-only).
        run: the run reference. event: the event id (default: the run's latest snapshot).
        out: write the snapshot's pickle here. html: write the viewer's page here (both checked
            by :func:`~edo_monitor.surfaces.cli.output.output_target` before the history was
            opened: never the database or one of its companion files).
        html_kind: ``"trace"`` (``trace_plot``) or ``"segments"`` (``segment_plot``).
        top: print the ``top`` frames holding the most live bytes (default 10 when neither
            ``out`` nor ``html`` is given).
        as_json: the description, totals, fragmentation and top rows as JSON.

    Raises:
        ConfigError: a bad ``html_kind``, ``top`` below 1.
        EdoMonitorError: ``out`` or ``html`` cannot be written (a read-only folder, a full disk).
        RunNotFoundError, SnapshotError: no such run; no snapshot for it or the event; a damaged
            blob (naming the event).
    """
    if html_kind not in HTML_KINDS:
        raise ConfigError(f"--html-kind {html_kind!r}: expected one of {', '.join(HTML_KINDS)}")
    if top is not None and top < 1:
        raise ConfigError(f"--top {top} must be ≥ 1")
    info = find_snapshot(history, run, event)
    snap = load_snapshot(history, info)
    if top is None and out is None and html is None:
        top = 10
    printed: list[RenderableType] = []
    if out is not None:
        write_output(out, pickle.dumps(snap))
        printed.append(Text(f"wrote {out.shown} (open it at https://pytorch.org/memory_viz)"))
    if html is not None:
        from torch.cuda import _memory_viz  # only here: the page is made by PyTorch's own code

        page = (_memory_viz.trace_plot if html_kind == "trace" else _memory_viz.segment_plot)(snap)
        write_output(html, page.encode("utf-8"))
        printed.append(Text(f"wrote {html.shown} ({html_kind} page of torch.cuda._memory_viz)"))
    rows = top_by_frame(snap, top) if top is not None else []
    t = totals(snap)
    if as_json:
        return [
            Text(
                json.dumps(
                    {
                        "snapshot": info.as_dict(),
                        "totals": t.__dict__,
                        "fragmentation": fragmentation(snap),
                        "top": [r.as_dict() for r in rows],
                    },
                    indent=2,
                )
            )
        ]
    printed.insert(0, Text(describe(info, snap)))
    if top is not None:
        printed.append(
            top_table(rows, t.allocated_bytes, f"largest live blocks by frame (top {top})")
        )
    return printed
