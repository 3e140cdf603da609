"""A table's singular spectrum from a random sample of its rows, recorded once per table as a
``table_spectrum`` event, so that ``edo-monitor explain`` (which reads only the database) can
suggest a smaller embedding dimension (:mod:`edo_monitor.hindsight.staged`).

Bounded cost: at most ``SPECTRUM_MAX_ROWS`` rows are read (chosen uniformly without replacement
with a fixed seed), copied to float32 on the CPU and passed to :func:`torch.linalg.svdvals`
(``O(rows · D · min(rows, D))``); never a full pass over a big table. Called at the end of the
run, on the training thread (the model no longer changes).

Which tables (:func:`_table_rows`): every ``nn.Embedding`` / ``nn.EmbeddingBag`` of the watched
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

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from edo_monitor.measure.module_tree import module_label

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


class NonFiniteTableError(ValueError):
    """A table whose sampled rows hold NaN or inf has no spectrum; logged in one line, without
    a traceback (``one_line``): the table's values, not the agent, are at fault (the SVD's
    ``LinAlgError`` came with its whole traceback)."""

    one_line = True


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
        ValueError: ``weight`` is not 2-D or ``max_rows < 1``; :class:`NonFiniteTableError`
            (a ``ValueError``) when a sampled row holds NaN or inf.
    """
    if weight.dim() != 2 or max_rows < 1:
        raise ValueError(
            f"weight of shape {tuple(weight.shape)} with max_rows={max_rows!r}: expected a 2-D "
            "table and max_rows >= 1"
        )
    n, d = weight.shape
    return _spectrum(n, d, functools.partial(_weight_rows, weight), max_rows, seed)


def _spectrum(
    n: int,
    d: int,
    rows: Callable[[torch.Tensor], torch.Tensor],
    max_rows: int = SPECTRUM_MAX_ROWS,
    seed: int = 0,
) -> dict[str, Any]:
    """:func:`table_spectrum` of an ``(n, d)`` table whose rows ``rows(ids)`` reads (host int64
    ids ``(k,)`` -> ``(k, d)``)."""
    with torch.no_grad():
        if n > max_rows:
            idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:max_rows]
        else:
            idx = torch.arange(n)
        sample = rows(idx).detach().to("cpu", torch.float32)
        if not bool(torch.isfinite(sample).all()):
            raise NonFiniteTableError(
                "the table holds a value that is not finite (or one beyond float32): no "
                "spectrum (an SVD cannot take it)"
            )
        values = torch.linalg.svdvals(sample)
    return {
        "rows_sampled": int(sample.shape[0]),
        "num_embeddings": int(n),
        "embedding_dim": int(d),
        "singular_values": [float(v) for v in values[:SPECTRUM_MAX_VALUES]],
        "total_energy": float((values.double() ** 2).sum()),
    }


def table_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The full ``(num_embeddings, embedding_dim)`` weight of an embedding table ``module``
    (module docstring: plain tables, offloaded and fp16/bf16 tables), or ``None`` for a module
    that is not such a table or whose weight no longer exists as such: a compressed table (its
    rows are computed), a row cache (its ``weight`` is the ``(C, D)`` cache: its rows are read
    by :meth:`~edo_monitor.nn.CachedTable.current_rows`)."""
    from edo_monitor.nn import CachedTable, LowPrecisionEmbedding, OffloadedEmbedding

    if isinstance(module, CachedTable):
        return None
    if isinstance(
        module,
        (torch.nn.Embedding, torch.nn.EmbeddingBag, OffloadedEmbedding, LowPrecisionEmbedding),
    ):
        w = getattr(module, "weight", None)
        return w if isinstance(w, torch.Tensor) else None
    return None


def _table_rows(
    module: torch.nn.Module,
) -> tuple[int, int, Callable[[torch.Tensor], torch.Tensor]] | None:
    """``(N, D, rows)`` of an embedding table ``module`` whose rows can be read exactly, or
    ``None``: a row cache's rows as they are at the last step, nothing loaded, evicted or
    counted; another table's from its whole float weight (:func:`table_weight`)."""
    from edo_monitor.nn import CachedTable

    if isinstance(module, CachedTable):
        return module.num_embeddings, module.embedding_dim, module.current_rows
    w = table_weight(module)
    if w is None or w.dim() != 2 or not w.is_floating_point():
        return None
    if w.device.type == "meta" or w.numel() == 0:
        return None
    expected = (getattr(module, "num_embeddings", None), getattr(module, "embedding_dim", None))
    if None not in expected and tuple(w.shape) != expected:
        return None  # not the whole table: never a part of it recorded as the table
    n, d = w.shape
    return n, d, functools.partial(_weight_rows, w)


def _weight_rows(weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` (host ids) of ``weight``, wherever it is."""
    return weight.index_select(0, idx.to(weight.device))


def record_table_spectra(m: MonitorState) -> None:
    """One ``table_spectrum`` event per embedding table of the watched model not yet recorded
    (``nn.Embedding`` / ``nn.EmbeddingBag``, and the converted tables whose rows can be read
    exactly: :func:`_table_rows`; a float weight). Never raises: a table that fails is
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
            table = _table_rows(mod)
            if table is None:
                continue
            done.add(name)
            data = {"table": module_label(name), **_spectrum(*table)}
            m._emit(
                "table_spectrum",
                f"{module_label(name)}: singular spectrum of {data['rows_sampled']:,} sampled rows",
                data,
            )
        except Exception as exc:
            m._agent_error(f"table spectrum of {module_label(name)}", exc)
