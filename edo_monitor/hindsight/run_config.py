"""What a run's recorded ``config`` says of its policy, read back the same way by every reader
(``explain``, the dashboard's gauges, chart and job view).

The agent records its own keys in the run's ``config`` (``floor``: the policy's
``min_free_fraction``, ``None`` without a policy; ``policy``: the policy's ``repr``) beside the
user's ``watch(config=...)`` keys. Since a user key can no longer replace one of the agent's
(it is kept as ``user.<key>``: ``edo_monitor.agent.lifecycle.AGENT_CONFIG_KEYS``), a current
history's ``floor`` is the policy's; an older history's may be a user's value of any type (a
string such as ``"3rd"`` among them), so a value is taken only when it is a number in ``[0, 1]``,
and the policy's ``repr`` is read first: it names the floor the policy really used.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["DEFAULT_FLOOR", "as_fraction", "recorded_floor"]

#: The policy's default floor (``Policy().min_free_fraction``): a history that records neither a
#: floor nor whether the run had a policy is read with it, as before the floor was recorded.
DEFAULT_FLOOR = 0.20

_POLICY_FLOOR = re.compile(r"^Policy\(.*?\bmin_free_fraction=([0-9.eE+-]+)[,)]")


def as_fraction(value: Any) -> float | None:
    """``value`` when it is a finite number in ``[0, 1]`` (not a bool), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and 0.0 <= value <= 1.0 else None


def recorded_floor(config: Mapping[str, Any] | None) -> float | None:
    """The free-fraction floor of the run's policy, from its recorded ``config``.

    Returns:
        The policy's ``min_free_fraction`` (from its recorded ``repr``, else a numeric
        ``floor``); ``None`` when the run had no policy (``policy`` or ``floor`` recorded as
        ``None``, the agent's record of a run without one: no floor to draw or to judge by);
        :data:`DEFAULT_FLOOR` when the config says neither (an older or hand-written history),
        or has a policy whose floor cannot be read (a non-numeric ``floor``, never a crash).
    """
    config = config if isinstance(config, Mapping) else {}
    policy = config.get("policy")
    if isinstance(policy, str):
        match = _POLICY_FLOOR.match(policy)
        if match is not None:
            try:
                floor = as_fraction(float(match.group(1)))
            except ValueError:
                floor = None
            if floor is not None:
                return floor
    floor = as_fraction(config.get("floor"))
    if floor is not None:
        return floor
    if ("policy" in config and policy is None) or ("floor" in config and config["floor"] is None):
        return None  # the agent's record of a run without a policy
    return DEFAULT_FLOOR
