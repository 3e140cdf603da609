"""edo-monitor: a live GPU memory monitor and auto-tuner for PyTorch training."""

from __future__ import annotations

__version__ = "0.1.0"
