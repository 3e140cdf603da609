"""Byte counts as the CLI, the dashboard and the examples print them."""

from __future__ import annotations

import pytest

from edo_monitor.errors import ConfigError
from edo_monitor.units import format_bytes, format_percent_beside, parse_bytes


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


@pytest.mark.parametrize("text", ["12 potatoes", "1 tonne", "4 kilos", "12 gigs", "12 megs", "3 x"])
def test_a_unit_that_is_no_unit_is_refused(text: str) -> None:
    """Regression: humanfriendly reads only a unit's first letter, so "12 potatoes" was a budget
    of 12 PB (the monitor never saw pressure) and "4 kilos" 4,000 bytes."""
    with pytest.raises(ConfigError, match=rf"budget='{text}' is not a size"):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("12 bytes", 12),
        ("12 k", 12_000),
        ("12kb", 12_000),
        ("12 kilobytes", 12_000),
        ("1.5 GiB", 3 * 2**29),
        ("2 gibibytes", 2 * 2**30),
        ("12G", 12 * 10**9),
        ("1 PB", 10**15),
    ],
)
def test_units_of_every_form_are_read(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "says"),
    [
        # a fraction of a byte was rounded down: "0.5" became budget=0 ("budget=0 leaves no
        # memory", naming a value the user never gave), "1.5B" a budget of 1 byte
        ("0.5", "is not a whole number of bytes"),
        ("1.5", "is not a whole number of bytes"),
        ("1.9999B", "is not a whole number of bytes"),
        ("1.5 bytes", "is not a whole number of bytes"),
        # a negative string was "not a size", where -5 was "negative"
        ("-1", "is negative"),
        ("-5MiB", "is negative"),
    ],
)
def test_a_fraction_of_a_byte_or_a_negative_string_is_refused_by_name(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_bytes(text)
    assert str(err.value).startswith(f"budget={text!r} {says}; expected ")


@pytest.mark.parametrize(
    ("text", "expected"), [("2.0", 2), ("3.00 bytes", 3), ("0.5KB", 500), ("1.0005KB", 1000)]
)
def test_whole_bytes_and_fractions_of_larger_units_are_read(text: str, expected: int) -> None:
    """A fraction of a larger unit is rounded down to whole bytes, as before."""
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("value", "says"), [(-1, "is negative"), ("-1", "is negative"), (0, "leaves no memory")]
)
def test_a_budget_is_asked_for_as_a_positive_size_whatever_the_fault(
    value: object, says: str
) -> None:
    """``watch(budget=-1)`` asked for "a non-negative int of bytes" and ``budget=0`` for "a
    positive size": one of the two said what is allowed wrong."""
    import edo_monitor

    with pytest.raises(ConfigError) as err:
        edo_monitor.watch(None, budget=value)
    assert str(err.value) == (
        f"budget={value!r} {says}; expected a positive int of bytes or a string such as "
        "'512MiB', '2GB', '1.5 GiB', '4096'"
    )


def test_a_percent_beside_its_threshold_never_reads_as_the_threshold() -> None:
    """Regression: a crossing said "free 20.0% below the floor 20%" (0.19965) and "free 25.0% back
    above the re-arm level 25%" (0.25001): one decimal read as the threshold it differs from."""
    assert format_percent_beside(0.19965, 0.20) == "19.96%"
    assert format_percent_beside(0.2500127, 0.25) == "25.001%"
    assert format_percent_beside(0.169, 0.20) == "16.9%"
    assert format_percent_beside(0.20, 0.20) == "20.0%"
    assert format_percent_beside(0.30000001, 0.30) == "30.0000%"  # at most four decimals
