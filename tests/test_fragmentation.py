"""Fragmentation arithmetic on hand-made allocator snapshots and memory_stats dicts.

Every expected value is worked out by hand in the comment next to it.
"""

from __future__ import annotations

import pytest

from edo_monitor.measure.fragmentation import (
    FragmentationStats,
    allocator_fields,
    snapshot_fragmentation,
)

KiB = 1024
MiB = 1024**2
BASE = 0x7F00_0000_0000


def block(address: int, size: int, state: str) -> dict[str, object]:
    return {"address": address, "size": size, "requested_size": size, "state": state, "frames": []}


def segment(address: int, blocks: list[tuple[int, str]], *, expandable: bool = False) -> dict:
    """A segment whose blocks are laid out back to back from ``address``."""
    laid_out = []
    cursor = address
    for size, state in blocks:
        laid_out.append(block(cursor, size, state))
        cursor += size
    total = cursor - address
    return {
        "device": 0,
        "address": address,
        "total_size": total,
        "allocated_size": sum(s for s, st in blocks if st == "active_allocated"),
        "active_size": sum(s for s, st in blocks if st.startswith("active")),
        "requested_size": total,
        "stream": 0,
        "segment_type": "large" if total > MiB else "small",
        "segment_pool_id": (0, 0),
        "is_expandable": expandable,
        "frames": [],
        "blocks": laid_out,
    }


def test_no_inactive_memory() -> None:
    snapshot = [
        segment(BASE, [(2 * MiB, "active_allocated"), (2 * MiB, "active_pending_free")]),
        segment(BASE + 64 * MiB, [(20 * MiB, "active_allocated")]),
    ]
    stats = snapshot_fragmentation(snapshot)
    assert stats == FragmentationStats(
        fragmentation=0.0,
        largest_inactive_block_bytes=0,
        total_inactive_bytes=0,
        segment_count=2,
    )


def test_empty_snapshot() -> None:
    assert snapshot_fragmentation([]) == FragmentationStats(0.0, 0, 0, 0)


def test_one_segment() -> None:
    # 20 MiB: used 4 | free 6 | used 2 | free 8  -> holes 6 and 8 MiB, 14 MiB inactive.
    snapshot = [
        segment(
            BASE,
            [
                (4 * MiB, "active_allocated"),
                (6 * MiB, "inactive"),
                (2 * MiB, "active_allocated"),
                (8 * MiB, "inactive"),
            ],
        )
    ]
    stats = snapshot_fragmentation(snapshot)
    assert stats.total_inactive_bytes == 14 * MiB
    assert stats.largest_inactive_block_bytes == 8 * MiB
    assert stats.fragmentation == pytest.approx(3 / 7)  # 1 - 8/14
    assert stats.segment_count == 1


def test_many_small_holes() -> None:
    # 8 segments of 2 MiB with a 512 KiB hole each, one with a 1 MiB hole:
    # 8 * 512 KiB + 1024 KiB = 5120 KiB inactive; largest 1024 KiB -> 1 - 1024/5120 = 0.8.
    snapshot = [
        segment(BASE + i * 2 * MiB, [(1536 * KiB, "active_allocated"), (512 * KiB, "inactive")])
        for i in range(8)
    ]
    snapshot.append(
        segment(BASE + 100 * MiB, [(1 * MiB, "inactive"), (1 * MiB, "active_allocated")])
    )
    stats = snapshot_fragmentation(snapshot)
    assert stats.total_inactive_bytes == 5120 * KiB
    assert stats.largest_inactive_block_bytes == 1024 * KiB
    assert stats.fragmentation == pytest.approx(0.8)
    assert stats.segment_count == 9


def test_expandable_segment() -> None:
    # One expandable segment, reported by PyTorch as two entries (two mapped ranges with
    # unmapped virtual space between them):
    #   range 1: used 2 | free 2 | free 4 | used 2   -> the two free blocks touch: one 6 MiB hole
    #   range 2 (64 MiB further on): free 3 | used 1 -> a 3 MiB hole
    # 9 MiB inactive, largest hole 6 MiB -> 1 - 6/9 = 1/3; two segment entries.
    snapshot = [
        segment(
            BASE,
            [
                (2 * MiB, "active_allocated"),
                (2 * MiB, "inactive"),
                (4 * MiB, "inactive"),
                (2 * MiB, "active_allocated"),
            ],
            expandable=True,
        ),
        segment(
            BASE + 64 * MiB,
            [(3 * MiB, "inactive"), (1 * MiB, "active_allocated")],
            expandable=True,
        ),
    ]
    stats = snapshot_fragmentation(snapshot)
    assert stats.total_inactive_bytes == 9 * MiB
    assert stats.largest_inactive_block_bytes == 6 * MiB
    assert stats.fragmentation == pytest.approx(1 / 3)
    assert stats.segment_count == 2


def test_expandable_ranges_are_not_merged_across_unmapped_space() -> None:
    # range 1: used 2 | free 2 (ends at BASE + 4 MiB); range 2 at BASE + 32 MiB: free 2 | used 2.
    # The free ends face each other across unmapped space: two 2 MiB holes, 1 - 2/4 = 0.5.
    snapshot = [
        segment(BASE, [(2 * MiB, "active_allocated"), (2 * MiB, "inactive")], expandable=True),
        segment(
            BASE + 32 * MiB,
            [(2 * MiB, "inactive"), (2 * MiB, "active_allocated")],
            expandable=True,
        ),
    ]
    stats = snapshot_fragmentation(snapshot)
    assert stats.total_inactive_bytes == 4 * MiB
    assert stats.largest_inactive_block_bytes == 2 * MiB
    assert stats.fragmentation == pytest.approx(0.5)


def test_blocks_sorted_by_address_and_gaps_split_holes() -> None:
    # Blocks listed out of order: free 1 MiB @0, free 1 MiB @1 MiB (touching: one 2 MiB hole),
    # used 1 MiB @2 MiB, free 3 MiB @4 MiB (after a 1 MiB gap: its own hole).
    # 5 MiB inactive, largest 3 MiB -> 1 - 3/5 = 0.4.
    seg = {
        "address": BASE,
        "total_size": 7 * MiB,
        "blocks": [
            block(BASE + 4 * MiB, 3 * MiB, "inactive"),
            block(BASE + 2 * MiB, 1 * MiB, "active_allocated"),
            block(BASE + 1 * MiB, 1 * MiB, "inactive"),
            block(BASE, 1 * MiB, "inactive"),
        ],
    }
    stats = snapshot_fragmentation([seg])
    assert stats.total_inactive_bytes == 5 * MiB
    assert stats.largest_inactive_block_bytes == 3 * MiB
    assert stats.fragmentation == pytest.approx(0.4)


def test_private_snapshot_dict_and_awaiting_free_state() -> None:
    # torch.cuda.memory._snapshot() form; "active_awaiting_free" (the docstring's name) is active.
    # Holes 1 MiB and 3 MiB -> 4 MiB inactive, 1 - 3/4 = 0.25.
    snap = {
        "segments": [
            segment(
                BASE,
                [
                    (1 * MiB, "inactive"),
                    (1 * MiB, "active_awaiting_free"),
                    (3 * MiB, "inactive"),
                ],
            )
        ],
        "device_traces": [],
    }
    stats = snapshot_fragmentation(snap)
    assert stats.total_inactive_bytes == 4 * MiB
    assert stats.largest_inactive_block_bytes == 3 * MiB
    assert stats.fragmentation == pytest.approx(0.25)
    assert stats.as_dict() == {
        "fragmentation": pytest.approx(0.25),
        "largest_inactive_block_bytes": 3 * MiB,
        "total_inactive_bytes": 4 * MiB,
        "segment_count": 1,
    }


def test_malformed_entries_are_skipped() -> None:
    # Only the one well-formed 2 MiB inactive block counts.
    snap = [
        "not a segment",
        {"blocks": "nope"},
        {"blocks": [{"state": "inactive"}, {"size": "big", "state": "inactive"}]},
        {"blocks": [{"size": 2 * MiB, "state": "inactive"}]},
    ]
    stats = snapshot_fragmentation(snap)
    assert stats.total_inactive_bytes == 2 * MiB
    assert stats.fragmentation == 0.0
    assert stats.segment_count == 3
    assert snapshot_fragmentation(None) == FragmentationStats(0.0, 0, 0, 0)


def test_allocator_fields_from_memory_stats() -> None:
    stats = {
        "allocated_bytes.all.current": 3 * MiB,
        "allocated_bytes.all.peak": 7 * MiB,
        "allocated_bytes.large_pool.current": 2 * MiB,
        "reserved_bytes.all.current": 10 * MiB,
        "active_bytes.all.current": 4 * MiB,
        "inactive_split_bytes.all.current": 1536 * KiB,
        "num_alloc_retries": 2,
        "num_ooms": 1,
    }
    assert allocator_fields(stats) == {
        "allocated_bytes": 3 * MiB,
        "reserved_bytes": 10 * MiB,
        "active_bytes": 4 * MiB,
        "inactive_split_bytes": 1536 * KiB,
        "peak_allocated_bytes": 7 * MiB,
        "num_alloc_retries": 2,
        "num_ooms": 1,
        "reserved_unallocated_bytes": 7 * MiB,  # 10 - 3
    }


def test_allocator_fields_missing_keys_are_none() -> None:
    fields = allocator_fields({"reserved_bytes.all.current": 4 * MiB, "num_ooms": 0})
    assert fields["reserved_bytes"] == 4 * MiB
    assert fields["num_ooms"] == 0
    assert fields["allocated_bytes"] is None
    assert fields["reserved_unallocated_bytes"] is None
    assert fields["peak_allocated_bytes"] is None
    assert set(allocator_fields({}).values()) == {None}
