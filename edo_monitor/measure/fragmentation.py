"""Allocator fields and fragmentation, as pure functions over what PyTorch's allocator reports.

Inputs are plain data, so these functions run (and are tested) without a GPU:

* ``torch.cuda.memory_stats()`` — a flat ``dict[str, int]`` with keys such as
  ``"allocated_bytes.all.current"``; :func:`allocator_fields` reads the ones edo-monitor shows.
* ``torch.cuda.memory_snapshot()`` — a list of *segments* (memory the allocator obtained from the
  driver), each a dict with ``address``, ``total_size``, ``allocated_size``, ``active_size``,
  ``segment_type`` (``"large"``/``"small"``), ``is_expandable`` and ``blocks``; each block a dict
  with ``address``, ``size``, ``requested_size`` and ``state``: ``"active_allocated"`` (a tensor
  uses it), ``"active_pending_free"`` (freed but still in use by another stream; PyTorch's docstring
  calls it ``"active_awaiting_free"``) or ``"inactive"`` (cached, free for reuse).
  ``torch.cuda.memory._snapshot()``'s ``{"segments": [...], ...}`` dict is accepted too.

**What a hole is.** A request is served from one contiguous free range, so a *hole* is a maximal
run of address-contiguous ``inactive`` blocks inside one segment entry. The allocator coalesces a
freed block with free neighbours, so in a real snapshot each run is a single block; runs are still
merged here so that a snapshot that lists neighbours separately is measured by its usable holes.
Blocks of different segments are never merged (separate driver allocations are not contiguous in
the allocator's eyes).

**Expandable segments** (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``). Such a segment is
one large reserved virtual address range whose pages are mapped to physical memory on demand. The
allocator's ``snapshot()`` reports *one segment entry per contiguous mapped range*
(``is_expandable=True``), listing only mapped blocks; the unmapped virtual space between or after
the ranges is not memory and appears nowhere. So within an expandable entry a hole is, as
elsewhere, a run of contiguous inactive mapped blocks; two entries of the same expandable segment
are separated by unmapped space and their holes are not merged. (Such a segment can also grow by
mapping more pages at its end, so its largest hole understates what it can serve; fragmentation
matters less there, which is why PyTorch suggests the option against it.)

``fragmentation = 1 − largest_hole / total_inactive_bytes`` (0.0 when nothing is inactive):
0 means all free cached memory is one usable hole; near 1 means it is scattered in small pieces.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "ALLOCATOR_STAT_KEYS",
    "EXPANDABLE_PAGE_BYTES",
    "FragmentationStats",
    "allocator_fields",
    "releasable_bytes",
    "snapshot_fragmentation",
]

logger = logging.getLogger(__name__)

#: Reading field -> ``torch.cuda.memory_stats()`` key it is read from.
ALLOCATOR_STAT_KEYS: dict[str, str] = {
    "allocated_bytes": "allocated_bytes.all.current",
    "reserved_bytes": "reserved_bytes.all.current",
    "active_bytes": "active_bytes.all.current",
    "inactive_split_bytes": "inactive_split_bytes.all.current",
    "peak_allocated_bytes": "allocated_bytes.all.peak",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
}


def _int_or_none(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def allocator_fields(stats: Mapping[str, int]) -> dict[str, int | None]:
    """The caching-allocator fields of a reading, from a ``torch.cuda.memory_stats()`` dict.

    Args:
        stats: the dict ``torch.cuda.memory_stats(device)`` returned (or a recorded copy).

    Returns:
        ``allocated_bytes``, ``reserved_bytes``, ``active_bytes``, ``inactive_split_bytes``,
        ``peak_allocated_bytes`` (keys in :data:`ALLOCATOR_STAT_KEYS`, all pools together),
        ``num_alloc_retries`` and ``num_ooms`` (event counts since the process started or the last
        ``reset_accumulated_memory_stats``), and ``reserved_unallocated_bytes`` = reserved −
        allocated. A missing or non-integer key gives ``None`` (an empty dict — CUDA not yet
        initialised — gives all ``None``). Bytes are ints. Never raises for a mapping.
    """
    result: dict[str, int | None] = {
        field: _int_or_none(stats.get(key)) for field, key in ALLOCATOR_STAT_KEYS.items()
    }
    allocated, reserved = result["allocated_bytes"], result["reserved_bytes"]
    result["reserved_unallocated_bytes"] = (
        reserved - allocated if allocated is not None and reserved is not None else None
    )
    return result


@dataclass(frozen=True)
class FragmentationStats:
    """Fragmentation of the allocator's cached memory at one snapshot.

    Attributes:
        fragmentation: ``1 − largest_inactive_block_bytes / total_inactive_bytes`` in [0, 1];
            0.0 when nothing is inactive.
        largest_inactive_block_bytes: the largest hole (contiguous inactive bytes in one segment).
        total_inactive_bytes: all inactive (cached, free) bytes in the snapshot.
        segment_count: segment entries in the snapshot (an expandable segment counts once per
            mapped range, as PyTorch reports it).
    """

    fragmentation: float
    largest_inactive_block_bytes: int
    total_inactive_bytes: int
    segment_count: int

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (the names of the reading's columns)."""
        return asdict(self)


def _segments(snapshot: object, device: int | None = None) -> list[Mapping[str, Any]]:
    """The segment dicts of ``snapshot``; with ``device``, only those of that device index.

    A snapshot covers every device the process has used; each segment names its ``device``
    (an int). A segment without a ``device`` key (a recorded one-device snapshot) is kept.
    """
    if isinstance(snapshot, Mapping):
        snapshot = snapshot.get("segments", [])
    if not isinstance(snapshot, Iterable) or isinstance(snapshot, (str, bytes)):
        return []
    segments = [s for s in snapshot if isinstance(s, Mapping)]
    if device is not None:
        segments = [s for s in segments if s.get("device", device) == device]
    return segments


def _block_address(block: Mapping[str, Any]) -> int | None:
    return _int_or_none(block.get("address", block.get("addr")))


def _holes(segment: Mapping[str, Any]) -> list[int]:
    """Sizes of the maximal runs of contiguous inactive blocks in one segment entry."""
    raw_blocks = segment.get("blocks")
    if not isinstance(raw_blocks, (list, tuple)):
        raw_blocks = ()
    blocks = [b for b in raw_blocks if isinstance(b, Mapping) and _int_or_none(b.get("size"))]
    addresses = [_block_address(b) for b in blocks]
    if blocks and all(a is not None for a in addresses):
        blocks = [b for _, b in sorted(zip(addresses, blocks, strict=True), key=lambda p: p[0])]
        addresses = sorted(addresses)  # type: ignore[type-var]
    else:
        addresses = [None] * len(blocks)
    holes: list[int] = []
    run = 0
    run_end: int | None = None
    for block, address in zip(blocks, addresses, strict=True):
        size = _int_or_none(block.get("size")) or 0
        if block.get("state") != "inactive" or size <= 0:
            if run:
                holes.append(run)
            run, run_end = 0, None
            continue
        contiguous = run_end is None or address is None or address == run_end
        if run and not contiguous:
            holes.append(run)
            run = 0
        run += size
        run_end = address + size if address is not None else None
    if run:
        holes.append(run)
    return holes


def snapshot_fragmentation(snapshot: object, device: int | None = None) -> FragmentationStats:
    """Fragmentation, largest hole, inactive bytes and segment count of an allocator snapshot.

    Args:
        snapshot: ``torch.cuda.memory_snapshot()`` (a list of segment dicts), or the dict of
            ``torch.cuda.memory._snapshot()`` (its ``"segments"`` are used). Malformed entries
            are skipped; anything that is not a snapshot counts as an empty one.
        device: the CUDA device index to measure. A snapshot holds the segments of *every*
            device the process uses; only those whose ``device`` is this index count. ``None``
            counts every segment (a snapshot of one device).

    Returns:
        A :class:`FragmentationStats` (bytes are ints). What a hole is, and how expandable
        segments are treated: see the module docstring.
    """
    segments = _segments(snapshot, device)
    holes = [size for segment in segments for size in _holes(segment)]
    total = sum(holes)
    largest = max(holes, default=0)
    fragmentation = 1.0 - largest / total if total > 0 else 0.0
    return FragmentationStats(
        fragmentation=fragmentation,
        largest_inactive_block_bytes=largest,
        total_inactive_bytes=total,
        segment_count=len(segments),
    )


#: Granularity at which ``empty_cache()`` unmaps the free pages of an expandable segment (the
#: allocator maps expandable segments in 2 MiB pages for its large pool).
EXPANDABLE_PAGE_BYTES = 2 * 1024 * 1024


def releasable_bytes(snapshot: object, device: int | None = None) -> int:
    """Bytes ``torch.cuda.empty_cache()`` would give back to the driver, from a snapshot.

    ``empty_cache()`` releases only memory no block uses: a segment (one ``cudaMalloc``) goes back
    when *all* of it is one inactive block; a segment with any ``active_allocated`` or
    ``active_pending_free`` block stays whole, however much of it is free. In an expandable
    segment entry (``is_expandable``) it unmaps the whole 2 MiB pages inside each inactive block.
    Segments of a private pool (``segment_pool_id`` other than ``(0, 0)``: CUDA graphs) are kept
    by the graph and never released. So this is at most ``reserved - allocated``, and can be far
    less (a half-used segment keeps its free half).

    Args:
        snapshot: as for :func:`snapshot_fragmentation`.
        device: only this device index's segments (a snapshot covers every device); ``None``:
            all.

    Returns:
        Bytes (int, >= 0). Malformed segments count 0.
    """
    total = 0
    for segment in _segments(snapshot, device):
        pool = segment.get("segment_pool_id")
        if isinstance(pool, list):
            pool = tuple(pool)
        if pool not in (None, (0, 0)):
            continue
        raw_blocks = segment.get("blocks")
        blocks = (
            [b for b in raw_blocks if isinstance(b, Mapping)]
            if isinstance(raw_blocks, (list, tuple))
            else []
        )
        if segment.get("is_expandable"):
            for block in blocks:
                size = _int_or_none(block.get("size")) or 0
                address = _block_address(block)
                if block.get("state") != "inactive" or size <= 0:
                    continue
                if address is None:
                    total += size // EXPANDABLE_PAGE_BYTES * EXPANDABLE_PAGE_BYTES
                    continue
                page = EXPANDABLE_PAGE_BYTES
                first = -(-address // page) * page
                last = (address + size) // page * page
                total += max(0, last - first)
            continue
        size = _int_or_none(segment.get("total_size")) or 0
        if size <= 0 or not blocks:
            continue
        if all(b.get("state") == "inactive" for b in blocks):
            total += size
    return total
