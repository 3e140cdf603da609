"""What the out-of-memory parser's tests share: units and a parse that must succeed."""

from __future__ import annotations

from edo_monitor.measure.oom import OomInfo, parse_oom_message

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4


def parse(message: str, **kwargs: int) -> OomInfo:
    info = parse_oom_message(message, **kwargs)
    assert info is not None, message
    assert info.raw == message
    return info
