"""Steady growth of one memory category over many steps: a suspected leak (issue 14, item 2).

Pure arithmetic, fed once per step (one value per step:
:class:`edo_monitor.decide.trend.StepSeries`, the window the policy's forecast uses too). A category
is suspected when, over the last ``window_steps`` steps, its bytes never fell and rose in at least
``min_rising_fraction`` of the steps, by at least ``min_growth_bytes_per_step`` on average. Each
category is reported once per run.

The agent feeds it the saved-for-backward bytes still alive at each step boundary (category
``activations``): after ``backward()`` they are normally back to what they were, so growth there
means tensors kept alive across steps (a list of losses with their graphs, a
``retain_graph=True`` graph kept).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from edo_monitor.checks import whole_number
from edo_monitor.decide.trend import StepSeries
from edo_monitor.errors import ConfigError

__all__ = ["GrowthDetector", "LeakSuspicion"]


@dataclass(frozen=True)
class LeakSuspicion:
    """One category's steady growth.

    Attributes:
        category: the memory category (``activations``: saved tensors alive at a step boundary).
        growth_bytes_per_step: (bytes at ``last_step`` - bytes at ``first_step``) / the steps
            between them.
        first_step, last_step: the window's first and last step.
        bytes_now: the category's bytes at ``last_step``.
    """

    category: str
    growth_bytes_per_step: float
    first_step: int
    last_step: int
    bytes_now: int


class GrowthDetector:
    """See the module docstring.

    Raises:
        ConfigError: ``window_steps`` < 2, ``min_rising_fraction`` outside (0, 1],
            ``min_growth_bytes_per_step`` <= 0.
    """

    def __init__(
        self,
        window_steps: int = 20,
        *,
        min_rising_fraction: float = 0.9,
        min_growth_bytes_per_step: float = 1.0,
    ) -> None:
        window_steps = whole_number(window_steps, "window_steps", 2, error=ConfigError)
        if not 0 < min_rising_fraction <= 1:
            raise ConfigError(f"min_rising_fraction={min_rising_fraction!r} must be in (0, 1]")
        if not min_growth_bytes_per_step > 0:
            raise ConfigError(
                f"min_growth_bytes_per_step={min_growth_bytes_per_step!r} must be > 0"
            )
        self.window_steps = window_steps
        self.min_rising_fraction = min_rising_fraction
        self.min_growth_bytes_per_step = min_growth_bytes_per_step
        self._values: dict[str, StepSeries] = {}
        self._reported: set[str] = set()

    def add(self, step: int, category: str, nbytes: int) -> LeakSuspicion | None:
        """Record ``category``'s bytes at ``step``; returns a suspicion the first time the last
        ``window_steps`` steps show steady growth, else ``None``."""
        series = self._values.get(category)
        if series is None:
            series = self._values[category] = StepSeries(self.window_steps)
        series.add(step, int(nbytes))
        if category in self._reported or len(series) <= self.window_steps:
            return None
        values = series.points()
        diffs = [b - a for (_, a), (_, b) in itertools.pairwise(values)]
        if min(diffs) < 0:
            return None
        rising = sum(d > 0 for d in diffs) / len(diffs)
        (first_step, first), (last_step, last) = values[0], values[-1]
        growth = (last - first) / max(1, last_step - first_step)
        if rising < self.min_rising_fraction or growth < self.min_growth_bytes_per_step:
            return None
        self._reported.add(category)
        return LeakSuspicion(category, growth, first_step, last_step, int(last))
