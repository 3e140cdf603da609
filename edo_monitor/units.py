"""Byte sizes: parsing user input (``"512MiB"``, ``"2GB"``, ``1 << 30``) and formatting for humans;
and times as every view shows them (UTC).

Parsing is done by ``humanfriendly`` (a kept library); this module only adds validation and the
error message edo-monitor promises (the bad value and what is allowed).
"""

from __future__ import annotations

import re
from datetime import datetime, timezone

import humanfriendly

from edo_monitor.errors import ConfigError

__all__ = ["STORABLE_BYTES", "format_bytes", "parse_bytes"]

#: The largest byte count the history stores (a signed 64-bit column): a budget must be below it.
STORABLE_BYTES = 2**63 - 1

_ALLOWED = "a non-negative int of bytes or a string such as '512MiB', '2GB', '1.5 GiB', '4096'"
_ALLOWED_POSITIVE = _ALLOWED.replace("non-negative", "positive")


#: An IEC unit without its "B" ("512Mi", "2Gi"): humanfriendly reads "Mi" as "M", powers of 1000.
_IEC_SHORT = re.compile(r"\d\s*[KMGTPE]i$", re.IGNORECASE)

#: A number and its unit. humanfriendly reads only a unit's first letter ("12 potatoes" was 12
#: PB), so the unit is checked against :data:`_UNITS` first.
_SIZE = re.compile(
    r"^\s*(?P<sign>-?)(?P<number>\d+(?:\.(?P<fraction>\d+))?)\s*(?P<unit>[a-z]*)\s*$",
    re.IGNORECASE,
)
#: The units that are bytes themselves: a fraction of one is not a size ("1.5" was 1 byte).
_BYTE_UNITS = frozenset({"", "b", "byte", "bytes"})
_PREFIXES = (
    ("k", "kilo", "kibi"),
    ("m", "mega", "mebi"),
    ("g", "giga", "gibi"),
    ("t", "tera", "tebi"),
    ("p", "peta", "pebi"),
    ("e", "exa", "exbi"),
)
_UNITS = frozenset(
    {"", "b", "byte", "bytes"}
    | {form for p, _, _ in _PREFIXES for form in (p, p + "b", p + "i", p + "ib")}
    | {name + end for _, si, iec in _PREFIXES for name in (si, iec) for end in ("byte", "bytes")}
)


def parse_bytes(value: int | str, *, name: str = "budget", positive: bool = False) -> int:
    """Return ``value`` as a number of bytes.

    Args:
        value: an ``int`` (bytes) or a string with a unit. IEC units (KiB, MiB, GiB, TiB, also
            written Ki, Mi, Gi, Ti as Kubernetes does) are powers of 1024, SI units (KB, MB, GB,
            TB) powers of 1000, as ``humanfriendly.parse_size`` reads them.
        name: the argument's name, used in the error message.
        positive: 0 is refused too (a budget: it leaves no memory).

    Returns:
        The size in bytes (an ``int``; a fraction of a larger unit rounded down: ``"1.0005KB"``
        is 1,000).

    Raises:
        ConfigError: (a ``ValueError``) when the value is negative (``-5`` or ``"-5MiB"``), a
            bool, a float, a fraction of a byte (``"1.5"``, ``"0.5B"``), or a string
            that is not a size, e.g. ``"12 apples"`` or ``"12 potatoes"`` (a unit is one of
            B, K, M, G, T, P, E with or without ``B``/``iB``/``i``, or written out:
            ``"12 gigabytes"``, ``"12 gibibytes"``; a bare ``"12G"`` is 12 * 1000**3).
    """
    allowed = _ALLOWED_POSITIVE if positive else _ALLOWED
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{name}={value!r} is not a size; expected {allowed}")
    if isinstance(value, int):
        result = value
    else:
        text = value.strip()
        match = _SIZE.match(text)
        if match is None or match["unit"].lower() not in _UNITS:
            raise ConfigError(f"{name}={value!r} is not a size; expected {allowed}")
        if match["sign"]:
            raise ConfigError(f"{name}={value!r} is negative; expected {allowed}")
        if match["unit"].lower() in _BYTE_UNITS and (match["fraction"] or "0").strip("0"):
            raise ConfigError(
                f"{name}={value!r} is not a whole number of bytes; expected {allowed}"
            )
        if _IEC_SHORT.search(text):  # "8Mi" (Kubernetes' form) is 8 MiB, not 8 MB
            text += "B"
        try:
            result = int(humanfriendly.parse_size(text))
        except (humanfriendly.InvalidSize, ValueError):
            raise ConfigError(f"{name}={value!r} is not a size; expected {allowed}") from None
    if result < 0:
        raise ConfigError(f"{name}={value!r} is negative; expected {allowed}")
    if positive and result == 0:
        raise ConfigError(f"{name}={value!r} leaves no memory; expected {allowed}")
    return result


def format_bytes(value: int | float | None) -> str:
    """Format a byte count with binary units (``"87.89 MiB"``, ``"-11.06 MiB"`` for a negative
    one: a saving that costs); ``None`` becomes ``"N/A"``."""
    if value is None:
        return "N/A"
    if value < 0:  # humanfriendly.format_size prints a negative count as raw bytes
        return "-" + humanfriendly.format_size(-value, binary=True)
    return humanfriendly.format_size(value, binary=True)


def format_utc(time_s: float | None, missing: str = "-") -> str:
    """Unix seconds as ``YYYY-MM-DD HH:MM:SS`` in UTC, the one form the CLI and the dashboard
    show times in; ``None`` becomes ``missing``."""
    if time_s is None:
        return missing
    return datetime.fromtimestamp(time_s, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def format_percent_beside(fraction: float, threshold: float) -> str:
    """``fraction`` as a percentage beside ``threshold`` (both fractions of 1): one decimal, more
    (up to four) while it would read as the threshold it differs from: 0.19965 beside 0.20 is
    "19.96%", so a crossing never reads "free 20.0% below the floor 20%"."""
    for decimals in range(1, 5):
        text = f"{fraction:.{decimals}%}"
        if fraction == threshold or text != f"{threshold:.{decimals}%}":
            return text
    return text
