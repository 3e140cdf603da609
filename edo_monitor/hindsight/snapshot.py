"""What ``explain`` adds from an incident's memory snapshot (:mod:`edo_monitor.measure.snapshots`):
the largest live blocks at that moment by frame, and the fragmentation then — the largest free block
against the request that failed (OOMs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import RenderableType
from rich.text import Text

from edo_monitor.measure.snapshots import SnapshotError, fragmentation, top_by_frame, totals
from edo_monitor.units import format_bytes

if TYPE_CHECKING:
    from edo_monitor.store.history import History

__all__ = ["TOP_FRAMES", "memory_at", "snapshot_renderables"]

#: frames listed per incident
TOP_FRAMES = 5


def memory_at(history: History, run_id: int, event_id: int) -> dict[str, Any] | None:
    """The snapshot facts of event ``event_id`` (``None`` when it has no snapshot).

    Returns:
        ``snapshot_id``, ``source``, ``allocated_bytes``, ``reserved_bytes``, ``top_frames``
        (:meth:`~edo_monitor.measure.snapshots.FrameRow.as_dict`, largest first) and
        ``fragmentation`` (:func:`edo_monitor.measure.snapshots.fragmentation`); or ``{"error":
        why}`` for a damaged blob (explain goes on without it).
    """
    from edo_monitor.store.snapshot_store import find_snapshot, load_snapshot

    try:
        info = find_snapshot(history, run_id, event_id)
    except SnapshotError:
        return None
    try:
        snap = load_snapshot(history, info)
    except SnapshotError as exc:
        return {"snapshot_id": info.id, "error": str(exc)}
    t = totals(snap)
    return {
        "snapshot_id": info.id,
        "source": info.source,
        "allocated_bytes": t.allocated_bytes,
        "reserved_bytes": t.reserved_bytes,
        "top_frames": [r.as_dict() for r in top_by_frame(snap, TOP_FRAMES)],
        "fragmentation": fragmentation(snap),
    }


def snapshot_renderables(facts: dict[str, Any] | None) -> list[RenderableType]:
    """Lines for ``edo-monitor explain``: the largest blocks by frame and the fragmentation."""
    if not facts:
        return []
    if "error" in facts:
        return [Text(f"  memory snapshot: {facts['error']}")]
    lines = [
        f"  memory snapshot {facts['snapshot_id']} ({facts['source']}): allocated "
        f"{format_bytes(facts['allocated_bytes'])} of {format_bytes(facts['reserved_bytes'])} "
        "reserved; largest blocks by frame:"
    ]
    for r in facts["top_frames"]:
        lines.append(f"    {format_bytes(r['bytes']):>12}  {r['frame']} ({r['blocks']} blocks)")
    frag = facts["fragmentation"]
    free = (
        f"  free then {format_bytes(frag['free_bytes'])}, largest free block "
        f"{format_bytes(frag['largest_free_block_bytes'])}"
    )
    if frag["request_bytes"] is not None:
        verdict = (
            "it fits: the allocator had room in one piece"
            if frag["fits_in_largest_free_block"]
            else (
                "it does not fit in any free block"
                + (
                    " though the free bytes add up to more: fragmentation"
                    if frag["free_bytes"] >= frag["request_bytes"]
                    else ""
                )
            )
        )
        free += f"; the failed request {format_bytes(frag['request_bytes'])}: {verdict}"
    lines.append(free)
    return [Text("\n".join(lines))]
