"""The text of ``edo-monitor estimate`` (the typer command in :mod:`edo_monitor.surfaces.cli` calls
this)."""

from __future__ import annotations

import json

from edo_monitor.decide.compress_rules import FROZEN_ONLY_VARIANTS
from edo_monitor.decide.estimate import Estimate, estimate
from edo_monitor.units import format_bytes

__all__ = ["estimate_command", "format_estimate"]

_ROWS = (
    ("params", "params_bytes"),
    ("grads", "grads_bytes"),
    ("optimizer state", "optimizer_state_bytes"),
    ("total", "total_bytes"),
    ("step counters", "step_state_bytes"),
    ("total with step", "total_with_step_bytes"),
)


def format_estimate(result: Estimate, uncompressed: Estimate | None = None) -> str:
    """A small table: one line per category with the exact bytes and binary units; with
    ``uncompressed`` (the same table without its compression), a note when the compressed
    table is not smaller (``compress_embedding`` refuses such a variant)."""
    compression = result.compression or "none"
    master = ", fp32 master weights" if result.master_weights else ""
    lines = [
        f"Embedding table {result.num_embeddings:,} x {result.embedding_dim:,} {result.dtype}, "
        f"optimizer {result.optimizer}, compression {compression}{master}",
    ]
    values = result.as_dict()
    width = max(len(label) for label, _ in _ROWS)
    numbers = {key: f"{values[key]:,}" for _, key in _ROWS}
    num_width = max(len(n) for n in numbers.values())
    for label, key in _ROWS:
        lines.append(
            f"  {label:<{width}}  {numbers[key]:>{num_width}} bytes  {format_bytes(values[key])}"
        )
    lines.append(
        "  (total = device memory; the optimizer's step counters are CPU scalars with PyTorch's "
        "default options)"
    )
    if uncompressed is not None and result.compression:
        variant = result.compression.split(":")[0]
        frozen = variant in FROZEN_ONLY_VARIANTS  # a frozen table: its weight alone
        base = uncompressed.params_bytes if frozen else uncompressed.total_bytes
        if result.total_bytes >= base:
            lines.append(
                f"  ({result.compression} is not smaller than the table uncompressed: "
                f"{base:,} bytes{' frozen' if frozen else ''}; compress_embedding refuses it)"
            )
    return "\n".join(lines)


def estimate_command(
    num_embeddings: int,
    embedding_dim: int,
    dtype: str,
    optimizer: str,
    compression: str | None,
    master_weights: bool,
    as_json: bool,
) -> str:
    """Run :func:`edo_monitor.decide.estimate.estimate` and return what the command prints.

    Args:
        num_embeddings, embedding_dim, dtype, optimizer, compression, master_weights: passed to
            :func:`~edo_monitor.decide.estimate.estimate` (``compression`` as text: ``"int8"``,
            ``"lowrank:64"``, ``"hash:100000"`` …).
        as_json: return ``Estimate.as_dict()`` as indented JSON instead of the table.

    Returns:
        The text to print, without a trailing newline.

    Raises:
        ConfigError: (a ``ValueError``) for a bad argument; its message names the value and what
            is allowed, fit to show the user as is.
    """
    result = estimate(
        num_embeddings,
        embedding_dim,
        dtype=dtype,
        optimizer=optimizer,
        compression=compression,
        master_weights=master_weights,
    )
    if as_json:
        return json.dumps(result.as_dict(), indent=2)
    uncompressed = None
    if compression is not None:
        # master weights belong to a 16-bit table: a float32 one beside fp16 has none (the
        # baseline's refusal failed the command, "compression=None")
        sixteen = result.dtype in ("float16", "bfloat16")
        uncompressed = estimate(
            num_embeddings, embedding_dim, dtype=dtype, optimizer=optimizer,
            master_weights=master_weights and sixteen,
        )  # fmt: skip
    return format_estimate(result, uncompressed)
