"""A table's singular spectrum from a random sample of its rows, recorded once per table as a
``table_spectrum`` event, so that ``edo-monitor explain`` (which reads only the database) can
suggest a smaller embedding dimension (:mod:`edo_monitor.hindsight.staged`).

Bounded cost: at most ``SPECTRUM_MAX_ROWS`` rows are read (chosen uniformly without replacement
with a fixed seed), copied to float32 on the CPU and passed to :func:`torch.linalg.svdvals`
(``O(rows · D · min(rows, D))``); never a full pass over a big table. Called at the end of the
run, on the training thread (the model no longer changes).

Which tables (:func:`table_weight`): every ``nn.Embedding`` / ``nn.EmbeddingBag`` of the watched
model, and the tables the agent (or the user) converted, whose full weight can still be read
exactly — these are the tables that caused the pressure:

* a row cache (:class:`~edo_monitor.nn.CachedTable`, after ``cache_embedding`` or
  ``spill_embedding``): the sampled rows as they are at the last step
  (:meth:`~edo_monitor.nn.CachedTable.current_rows`; its ``weight`` is only the ``(C, D)``
  device cache). Nothing is loaded, evicted or counted, and only the sampled rows are caught
  up (a flush caught every host row up: 1.55 s at the end of the pressure demo);
* an :class:`~edo_monitor.nn.OffloadedEmbedding` (``offload_embedding``): its ``weight``, the
  same table on the host;
* a :class:`~edo_monitor.nn.LowPrecisionEmbedding` (fp16/bf16): its ``weight``, the table the
  model now trains, as an ``nn.Embedding`` of that dtype would be read.

Skipped: tables whose rows are computed from a compressed form (int8 / int4 / int2 / 2:8 /
per-row precision, low-rank factors, hashed or shared rows). Their full weight no longer
exists; the spectrum of reconstructed rows would be the compression's (a low-rank table's is
rank K by construction, hashed rows repeat), not the table's, and ``explain`` would suggest a
dimension from the compression's error instead of the data.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from edo_monitor.agent.state import MonitorState

__all__ = [
    "SPECTRUM_MAX_ROWS",
    "SPECTRUM_MAX_VALUES",
    "record_table_spectra",
    "table_spectrum",
    "table_weight",
]

logger = logging.getLogger(__name__)

#: Rows sampled at most from one table.
SPECTRUM_MAX_ROWS = 4096
#: Singular values recorded at most (the largest); the sample's total energy is recorded too.
SPECTRUM_MAX_VALUES = 64


def table_spectrum(
    weight: torch.Tensor | _CachedRows, *, max_rows: int = SPECTRUM_MAX_ROWS, seed: int = 0
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
        elif isinstance(weight, torch.Tensor):
            sample = weight
        else:  # a row cache's rows (_CachedRows): every one
            sample = weight.index_select(0, torch.arange(n))
        sample = sample.detach().to("cpu", torch.float32)
        values = torch.linalg.svdvals(sample)
    return {
        "rows_sampled": int(sample.shape[0]),
        "num_embeddings": int(n),
        "embedding_dim": int(d),
        "singular_values": [float(v) for v in values[:SPECTRUM_MAX_VALUES]],
        "total_energy": float((values.double() ** 2).sum()),
    }


class _CachedRows:
    """A row cache's whole table as :func:`table_spectrum` reads it: its ``(N, D)`` shape, dtype
    and the rows it samples, each as it is at the last step
    (:meth:`~edo_monitor.nn.CachedTable.current_rows`), without a flush."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self.shape = (int(table.num_embeddings), int(table.embedding_dim))
        self.dtype = table.weight.dtype
        self.device = torch.device("cpu")  # ids are host ids

    def dim(self) -> int:
        return 2

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def index_select(self, dim: int, idx: torch.Tensor) -> torch.Tensor:
        return self.table.current_rows(idx)


def table_weight(module: torch.nn.Module) -> torch.Tensor | _CachedRows | None:
    """The full ``(num_embeddings, embedding_dim)`` weight of an embedding table ``module``, read
    exactly (module docstring: plain tables, row caches, offloaded and fp16/bf16 tables), or
    ``None`` for a module that is not such a table or whose weight no longer exists as such (a
    compressed table: its rows are computed). A row cache gives its rows as they are at the last
    step (:class:`_CachedRows`), not flushed."""
    from edo_monitor.nn import CachedTable, LowPrecisionEmbedding, OffloadedEmbedding

    if isinstance(module, CachedTable):  # before the rest: its ``weight`` is the (C, D) cache
        return _CachedRows(module)
    if isinstance(
        module,
        (torch.nn.Embedding, torch.nn.EmbeddingBag, OffloadedEmbedding, LowPrecisionEmbedding),
    ):
        w = getattr(module, "weight", None)
        return w if isinstance(w, torch.Tensor) else None
    return None


def record_table_spectra(m: MonitorState) -> None:
    """One ``table_spectrum`` event per embedding table of the watched model not yet recorded
    (``nn.Embedding`` / ``nn.EmbeddingBag``, and the converted tables whose full weight can be
    read exactly: :func:`table_weight`; a float weight). Never raises: a table that fails is
    counted as an agent error and the others are still recorded."""
    model = getattr(m, "model", None)
    if model is None:
        return
    done: set[str] = m.__dict__.setdefault("_spectra_recorded", set())
    try:
        modules = list(model.named_modules())
    except Exception as exc:
        m._agent_error("table spectrum", exc)
        return
    for name, mod in modules:
        if name in done:
            continue
        try:
            w = table_weight(mod)
            if w is None or w.dim() != 2 or not w.is_floating_point():
                continue
            if w.device.type == "meta" or w.numel() == 0:
                continue
            expected = (getattr(mod, "num_embeddings", None), getattr(mod, "embedding_dim", None))
            if None not in expected and tuple(w.shape) != expected:
                continue  # not the whole table: never a part of it recorded as the table
            done.add(name)
            data = {"table": name, **table_spectrum(w)}
            m._emit(
                "table_spectrum",
                f"{name}: singular spectrum of {data['rows_sampled']:,} sampled rows",
                data,
            )
        except Exception as exc:
            m._agent_error(f"table spectrum of {name}", exc)
