"""The argument checks many modules share: a count, a size or an index, or a duration in seconds,
given by the user."""

from __future__ import annotations

import json
import math
import numbers
import os
import threading
from collections.abc import Mapping
from typing import Any

__all__ = ["int_choice", "mapping_or_none", "seconds", "whole_number", "whole_number_or_none"]


def whole_number(
    value: Any,
    name: str,
    low: int | None,
    high: int | None = None,
    *,
    error: type[Exception] = ValueError,
) -> int:
    """``value`` as a Python ``int``, checked before it is used.

    Allowed: an ``int`` or a NumPy integer (anything registered as ``numbers.Integral``) in
    ``[low, high]`` (``None``: no bound that side). Refused: a bool (``True`` is not a count),
    a float even when whole (``2.0``, ``nan``), a string, a tensor.

    Raises:
        error: (``ValueError`` unless the caller names its own, e.g. ``ConfigError``) naming
            ``name``, the value and what is allowed.
    """
    return _checked(value, name, low, high, error, "")


def whole_number_or_none(
    value: Any,
    name: str,
    low: int | None,
    high: int | None = None,
    *,
    error: type[Exception] = ValueError,
) -> int | None:
    """:func:`whole_number`, or ``None`` as given (the refusal says ``or None`` is allowed)."""
    return None if value is None else _checked(value, name, low, high, error, " or None")


def int_choice(
    value: Any, name: str, allowed: tuple[int, ...], *, error: type[Exception] = ValueError
) -> int:
    """``value`` as a Python ``int``, one of ``allowed`` (a bit width: 4 or 2). Refused as
    :func:`whole_number` refuses, a whole float too: ``4.0 in (2, 4)`` is true, and a float
    width failed deep inside the packing.

    Raises:
        error: naming ``name``, the value and ``allowed``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value not in allowed:
        shown = " or ".join(str(a) for a in allowed)
        raise error(f"{name}={value!r}; expected {shown} (an int)")
    return int(value)


def mapping_or_none(
    value: Any, name: str, *, error: type[Exception] = ValueError
) -> dict[str, Any]:
    """``value`` (a mapping, or ``None``: empty) as a new ``dict``: ``watch(config=)`` and the
    framework callbacks' ``config=``.

    Raises:
        error: (``ValueError`` unless the caller names its own) naming ``name`` and the value.
    """
    if value is not None and not isinstance(value, Mapping):
        raise error(f"{name}={value!r}: expected a mapping of names to values, or None")
    return dict(value or {})


def storable_config(
    value: Any, name: str, *, error: type[Exception] = ValueError
) -> dict[str, Any]:
    """``value`` (:func:`mapping_or_none`) as a run's row stores it: strict JSON, every path
    (``os.PathLike``: ``vars(args)`` of an argparse ``type=Path``) inside mappings, lists and
    tuples as its text.

    Raises:
        error: not a mapping, or a value with no strict JSON form (NaN and infinities, which
            ``show --json`` would print as ``NaN``; objects ``json`` does not know), naming
            ``name`` and the value.
    """
    config = _paths_as_text(mapping_or_none(value, name, error=error))
    try:
        json.dumps(config, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise error(
            f"{name}={value!r} cannot be stored: {exc}; expected JSON-serialisable values "
            "(finite numbers: strict JSON has no NaN or Infinity; paths are stored as text)"
        ) from None
    return config


def _paths_as_text(value: Any) -> Any:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {k: _paths_as_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_paths_as_text(v) for v in value]
    return value


def seconds(
    value: Any, name: str, *, zero: str | None = None, error: type[Exception] = ValueError
) -> float:
    """``value`` as a Python ``float`` number of seconds, checked before it is used.

    Allowed: an ``int`` or a ``float`` (anything registered as ``numbers.Real``: NumPy numbers
    too), finite and above 0, at most ``threading.TIMEOUT_MAX`` (about 292 years: the longest
    wait a thread takes; ``interval_s=1e12`` killed the sampler with ``OverflowError``); with
    ``zero`` (what 0 means, e.g. ``"never"``) 0 as well. Refused: a bool, a string (``"5"``),
    ``None``, a tensor, NaN, infinity, a negative number.

    Raises:
        error: (``ValueError`` unless the caller names its own, e.g. ``ConfigError``) naming
            ``name``, the value and what is allowed.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and zero is None)
    ):
        allowed = "a finite number of seconds > 0"
        if zero is not None:
            allowed = f"a finite number of seconds >= 0 (0: {zero})"
        raise error(f"{name}={value!r}; expected {allowed}")
    if value > threading.TIMEOUT_MAX:
        raise error(
            f"{name}={value!r}; expected at most {threading.TIMEOUT_MAX:.4g} seconds (the "
            "longest wait a thread takes)"
        )
    return float(value)


def _checked(
    value: Any,
    name: str,
    low: int | None,
    high: int | None,
    error: type[Exception],
    also: str,
) -> int:
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
        raise error(f"{name}={value!r}; expected {allowed}{also}")
    return int(value)
