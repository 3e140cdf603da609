"""TensorBoard, where ``watch(..., tensorboard=)`` writes: the sink lives in
:mod:`edo_monitor.exporters.tensorboard` (a stage below the agent); this path stays for users."""

from edo_monitor.exporters.tensorboard import (
    EVENT_TAG_PREFIX,
    SCALAR_FIELDS,
    TAG_PREFIX,
    TensorBoardSink,
    summary_writer,
)

__all__ = ["EVENT_TAG_PREFIX", "SCALAR_FIELDS", "TAG_PREFIX", "TensorBoardSink", "summary_writer"]
