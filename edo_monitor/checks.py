"""The argument check many modules share: a count, a size or an index given by the user."""

from __future__ import annotations

import numbers
from typing import Any, Literal, overload

__all__ = ["whole_number"]


@overload
def whole_number(
    value: Any,
    name: str,
    low: int | None,
    high: int | None = None,
    *,
    none: Literal[False] = False,
    error: type[Exception] = ValueError,
) -> int: ...


@overload
def whole_number(
    value: Any,
    name: str,
    low: int | None,
    high: int | None = None,
    *,
    none: bool,
    error: type[Exception] = ValueError,
) -> int | None: ...


def whole_number(
    value: Any,
    name: str,
    low: int | None,
    high: int | None = None,
    *,
    none: bool = False,
    error: type[Exception] = ValueError,
) -> int | None:
    """``value`` as a Python ``int``, checked before it is used.

    Allowed: an ``int`` or a NumPy integer (anything registered as ``numbers.Integral``) in
    ``[low, high]`` (``None``: no bound that side), and ``None`` when ``none`` (returned as
    is). Refused: a bool (``True`` is not a count), a float even when whole (``2.0``, ``nan``),
    a string, a tensor.

    Raises:
        error: (``ValueError`` unless the caller names its own, e.g. ``ConfigError``) naming
            ``name``, the value and what is allowed.
    """
    if value is None and none:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or (low is not None and value < low)
        or (high is not None and value > high)
    ):
        if high is not None:
            allowed = f"an int in {low}..{high}"
        else:
            allowed = "an int" if low is None else f"an int >= {low}"
        raise error(f"{name}={value!r}; expected {allowed}{' or None' if none else ''}")
    return int(value)
