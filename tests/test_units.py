"""Byte counts as the CLI, the dashboard and the examples print them."""

from __future__ import annotations

from edo_monitor.units import format_bytes


def test_a_negative_byte_count_is_formatted_as_a_positive_one_is() -> None:
    """A saving that costs (grow_cache gives rows back): it printed '-11602176 bytes' beside
    figures in MiB (humanfriendly formats negative counts as raw bytes)."""
    assert format_bytes(11_602_176) == "11.06 MiB"
    assert format_bytes(-11_602_176) == "-11.06 MiB"
    assert format_bytes(-512) == "-512 bytes"
    assert format_bytes(0) == "0 bytes"
    assert format_bytes(None) == "N/A"
