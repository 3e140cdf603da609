"""A table's singular spectrum from a random sample of its rows, recorded once per table as a
``table_spectrum`` event, so that ``edo-monitor explain`` (which reads only the database) can
suggest a smaller embedding dimension (:mod:`edo_monitor.hindsight.staged`).

Bounded cost: at most ``SPECTRUM_MAX_ROWS`` rows are read (chosen uniformly without replacement
with a fixed seed), copied to float32 on the CPU and passed to :func:`torch.linalg.svdvals`
(``O(rows · D · min(rows, D))``); never a full pass over a big table. Called at the end of the
run, on the training thread (the model no longer changes).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from edo_monitor.agent.state import MonitorState

__all__ = ["SPECTRUM_MAX_ROWS", "SPECTRUM_MAX_VALUES", "record_table_spectra", "table_spectrum"]

logger = logging.getLogger(__name__)

#: Rows sampled at most from one table.
SPECTRUM_MAX_ROWS = 4096
#: Singular values recorded at most (the largest); the sample's total energy is recorded too.
SPECTRUM_MAX_VALUES = 64


def table_spectrum(
    weight: torch.Tensor, *, max_rows: int = SPECTRUM_MAX_ROWS, seed: int = 0
) -> dict[str, Any]:
    """The singular spectrum of a random sample of the rows of ``weight``.

    Args:
        weight: the table, shape ``(num_embeddings, embedding_dim)``, any float dtype and device.
        max_rows: rows sampled at most (all rows when the table has fewer).
        seed: the sample's seed (the same rows each call).

    Returns:
        ``{"rows_sampled", "num_embeddings", "embedding_dim", "singular_values"`` (the largest
        ``SPECTRUM_MAX_VALUES``, descending), ``"total_energy"`` (the sum of all squared singular
        values of the sample: its squared Frobenius norm)``}``.

    Raises:
        ValueError: ``weight`` is not 2-D or ``max_rows < 1``.
    """
    if weight.dim() != 2 or max_rows < 1:
        raise ValueError(
            f"weight of shape {tuple(weight.shape)} with max_rows={max_rows!r}: expected a 2-D "
            "table and max_rows >= 1"
        )
    n, d = weight.shape
    with torch.no_grad():
        if n > max_rows:
            g = torch.Generator().manual_seed(seed)
            idx = torch.randperm(n, generator=g)[:max_rows].to(weight.device)
            sample = weight.index_select(0, idx)
        else:
            sample = weight
        sample = sample.detach().to("cpu", torch.float32)
        values = torch.linalg.svdvals(sample)
    return {
        "rows_sampled": int(sample.shape[0]),
        "num_embeddings": int(n),
        "embedding_dim": int(d),
        "singular_values": [float(v) for v in values[:SPECTRUM_MAX_VALUES]],
        "total_energy": float((values.double() ** 2).sum()),
    }


def record_table_spectra(m: MonitorState) -> None:
    """One ``table_spectrum`` event per embedding table of the watched model not yet recorded
    (``nn.Embedding`` / ``nn.EmbeddingBag`` with a float weight). Never raises: a failure is
    counted as an agent error."""
    model = getattr(m, "model", None)
    if model is None:
        return
    done: set[str] = m.__dict__.setdefault("_spectra_recorded", set())
    try:
        for name, mod in model.named_modules():
            if name in done or not isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
                continue
            w = getattr(mod, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
                continue
            if w.device.type == "meta" or w.numel() == 0:
                continue
            done.add(name)
            data = {"table": name, **table_spectrum(w)}
            m._emit(
                "table_spectrum",
                f"{name}: singular spectrum of {data['rows_sampled']:,} sampled rows",
                data,
            )
    except Exception as exc:
        m._agent_error("table spectrum", exc)
