"""Byte counts as the CLI, the dashboard and the examples print them."""

from __future__ import annotations

import pytest

from edo_monitor.units import format_bytes, parse_bytes


def test_a_negative_byte_count_is_formatted_as_a_positive_one_is() -> None:
    """A saving that costs (grow_cache gives rows back): it printed '-11602176 bytes' beside
    figures in MiB (humanfriendly formats negative counts as raw bytes)."""
    assert format_bytes(11_602_176) == "11.06 MiB"
    assert format_bytes(-11_602_176) == "-11.06 MiB"
    assert format_bytes(-512) == "-512 bytes"
    assert format_bytes(0) == "0 bytes"
    assert format_bytes(None) == "N/A"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8Mi", 8 * 2**20), ("8 mi", 8 * 2**20), ("1.5Gi", 3 * 2**29), ("512Ki", 2**19)],
)
def test_an_iec_unit_without_its_b_is_binary(text: str, expected: int) -> None:
    """Regression: "8Mi" (Kubernetes' quantity) was read as 8,000,000 bytes: 5 % less than meant."""
    assert parse_bytes(text) == expected
