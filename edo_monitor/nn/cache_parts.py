"""What the row cache is built from: its counters (CacheStats), host tensors (pinned, or in the
disk tier's file), copies to the device that do not wait for it and copies back that wait once,
rebinding a Parameter's data, the options of the cached module types, and how optimizer state
dicts leave the batch-row buffers out."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from edo_monitor.checks import whole_number
from edo_monitor.nn.embedding import BAG_MODES, EmbeddingOptions
from edo_monitor.nn.table_checks import check_weight

logger = logging.getLogger(__name__)


CACHE_POLICIES: tuple[str, ...] = ("lfu", "lru")


# ----------------------------------------------------------------------------- the module
@dataclass(frozen=True)
class CacheStats:
    """Counters of a cached table.

    ``*_step`` values cover the forwards since the last optimizer step (or since the last
    :meth:`CachedTable.reset_step_stats`); the others are totals. Hits and misses count unique
    ids (blocks) per forward: a hit is a row found cached that was not loaded ahead of the
    forward; every row loaded is one miss, those loaded ahead by ``prefetch`` or a
    ``LookAhead`` too (their first lookup is no hit), and so is a row a lookup that does not
    fit the cache reads from the host. ``lookups``/``lookup_hits`` count every looked-up id
    (repeats too), a hit being any row in the cache when the forward ran.
    ``h2d_bytes``/``d2h_bytes``: weight and optimizer-state bytes moved
    host→device (loads) and device→host (write-backs).
    """

    cache_rows: int
    num_embeddings: int
    hits: int
    misses: int
    evicted: int
    h2d_bytes: int
    d2h_bytes: int
    hits_step: int
    misses_step: int
    evicted_step: int
    h2d_bytes_step: int
    d2h_bytes_step: int
    peak_unique_ids: int
    lookups: int = 0
    lookup_hits: int = 0
    #: blocks loaded by a forward (on the critical path), not ahead of it by :meth:`prefetch`
    forward_loads: int = 0

    @property
    def hit_rate(self) -> float | None:
        """``hits / (hits + misses)`` over all forwards (``None`` before the first): when every
        row loaded is looked up, ``1 - rows loaded / unique ids looked up``."""
        total = self.hits + self.misses
        return self.hits / total if total else None

    @property
    def lookup_hit_rate(self) -> float | None:
        """Fraction of all looked-up ids (repeats counted) whose row was already cached."""
        return self.lookup_hits / self.lookups if self.lookups else None

    def history_totals(self) -> dict[str, int]:
        """The totals as the history's ``cache_*`` columns name them
        (:data:`edo_monitor.store.schema.CACHE_FIELDS`): rows now, lookups, lookup hits, rows
        loaded (misses), rows evicted, bytes moved either way (``h2d_bytes + d2h_bytes``)."""
        return {
            "cache_rows": self.cache_rows,
            "cache_lookups": self.lookups,
            "cache_lookup_hits": self.lookup_hits,
            "cache_rows_loaded": self.misses,
            "cache_rows_evicted": self.evicted,
            "cache_moved_bytes": self.h2d_bytes + self.d2h_bytes,
        }


def changes_cache(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``method`` (an entry point that changes a cached table's state: loads, evicts,
    resizes, writes back) outside ``torch.inference_mode()``, under ``no_grad``, as
    ``forward`` does: a tensor the cache makes or reorders under inference mode is an inference
    tensor, and the next training forward's in-place update of it raised ``Inplace update to
    inference tensor outside InferenceMode`` (a ``LookAhead`` eval or ``table.prefetch()``
    under inference mode broke the table for good)."""

    @functools.wraps(method)
    def outside(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():
            return method(*args, **kwargs)

    return outside


def rebind_data(param: nn.Parameter, data: torch.Tensor) -> None:
    """``param.data = data`` for a new shape, also when a live graph still holds ``param``.

    Autograd caches a parameter's gradient accumulator (with the shape it had) while any graph
    refers to it, e.g. the previous step's ``loss`` the training loop still holds; reusing it after
    a shape change fails in backward ("invalid gradient ... expected shape"). PyTorch drops that
    cache when ``.data`` changes dtype, so the data is swapped through another dtype first.
    Call with ``param.grad`` set to ``None``.
    """
    other = torch.float32 if data.dtype == torch.float64 else torch.float64
    param.data = torch.empty(0, dtype=other, device=data.device)
    param.data = data


_NUMPY_ROW_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.bool)


def put_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor | int | bool) -> None:
    """``dst[index] = src`` along dim 0, in place: ``dst`` ``(N, ...)``, ``index`` ``(n,)`` int64
    rows of ``dst`` on its device (distinct unless ``src`` is a number), ``src`` ``(n, ...)`` of
    ``dst``'s dtype and device, or one number for every row.

    On the CPU through NumPy's fancy assignment: a row whole at a time (0.7x the time of
    ``index_copy_``, which moves element by element, for the row cache's scatters of a few
    thousand rows, ``docs/benchmarks.md``), and for the cache's ``(C,)`` / ``(N,)`` bookkeeping
    a third of ``dst[index] = src``'s time (torch's indexing costs ~10 us a call more);
    elsewhere, or for a dtype NumPy lacks (bfloat16), torch's ``index_copy_`` / ``index_fill_``.
    """
    number = not isinstance(src, torch.Tensor)
    if (
        dst.is_cpu
        and dst.dtype in _NUMPY_ROW_DTYPES
        and (number or (src.is_cpu and src.dtype == dst.dtype))
        and dst.is_contiguous()
        and not dst.requires_grad
    ):
        value = src if number else (src.detach() if src.requires_grad else src).numpy()
        dst.numpy()[index.numpy()] = value
    elif number:
        dst.index_fill_(0, index, src)
    else:
        dst.index_copy_(0, index, src)


def to_device(
    x: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x`` on ``device`` (as ``dtype``; ``None``: its own), the host not waiting for the device.

    A CUDA copy from pageable host memory makes the driver synchronize the stream before it
    starts (CUDA runtime API, "API synchronization behavior"), and torch's blocking copy waits
    for it to end: the row cache's host index arrays and tables (slot rows, the catch-up's
    coefficients) cost one such wait each, about 20 a step on an H200. Here a host tensor goes
    to a CUDA device through a pinned copy with ``non_blocking=True`` (torch's caching host
    allocator keeps the pinned block until the copy is done, so ``x`` may change at once); a
    dtype change is made on the host first (the same rounding). Elsewhere ``x.to(device,
    dtype)``.
    """
    device = torch.device(device)
    if dtype is not None and x.dtype != dtype and x.is_cpu:
        x = x.to(dtype)
    if device.type != "cuda" or not x.is_cpu or x.requires_grad:  # autograd: torch's own copy
        return x.to(device, dtype) if dtype is not None else x.to(device)
    staged = torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x)  # never x itself
    return staged.to(device, non_blocking=True)


def rows_to_host(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors ``(n, D_i)`` on the host, each as ``part.to("cpu")``; device tensors of one dtype
    and device come back in one copy (concatenated along dim 1, then split as views): a copy to
    the host waits for the device, and the row cache's write-back moves a row's weight and its
    optimizer state together (one wait, not one per tensor)."""
    first = parts[0] if parts else None
    if (
        first is None
        or first.is_cpu
        or len(parts) == 1
        or any(p.dtype != first.dtype or p.device != first.device for p in parts)
    ):
        return [p.to("cpu") for p in parts]
    both = torch.cat(list(parts), 1).to("cpu")
    return list(both.split([p.shape[1] for p in parts], 1))


def _pinned_empty(shape: Sequence[int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Every host tensor of the cache (table copies, optimizer state) is allocated here, so a
    tier below host memory (a memory-mapped file) replaces one function."""
    t = torch.empty(tuple(shape), dtype=dtype)
    if pin:
        try:
            return t.pin_memory()
        except RuntimeError as exc:
            logger.warning("could not pin %d host bytes (%s); using pageable", t.nbytes, exc)
    return t


def _is_row_buffer(p: torch.Tensor) -> bool:
    return bool(getattr(p, "_edo_row_buffer", False))


def row_buffer_name(names: list[Any]) -> str:
    """The row buffer's name in a group's ``param_names`` where it is put right after its
    table's ``weight``, the last of ``names`` (``"emb.weight"`` -> ``"emb.batch_rows"``)."""
    prefix = str(names[-1]).rpartition(".")[0] if names else ""
    return f"{prefix}.batch_rows" if prefix else "batch_rows"


def _strip_row_buffers(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` without the cached tables' row buffers (ids renumbered), as an optimizer over the
    uncached model would save it; unchanged when already stripped."""
    live = [g["params"] for g in optimizer.param_groups]
    groups = sd["param_groups"]
    if [len(g["params"]) for g in groups] != [len(p) for p in live]:
        return sd
    drop = {
        i
        for g, ps in zip(groups, live, strict=True)
        for i, p in zip(g["params"], ps, strict=True)
        if _is_row_buffer(p)
    }
    if not drop:
        return sd
    kept = sorted(i for g in groups for i in g["params"] if i not in drop)
    new_id = {old: new for new, old in enumerate(kept)}
    out = dict(sd)
    out["param_groups"] = []
    for g in groups:
        new_g = {**g, "params": [new_id[i] for i in g["params"] if i not in drop]}
        if "param_names" in g:  # an optimizer over named_parameters(): the names go too
            new_g["param_names"] = [
                name for i, name in zip(g["params"], g["param_names"], strict=True) if i not in drop
            ]
        out["param_groups"].append(new_g)
    out["state"] = {new_id[k]: v for k, v in sd["state"].items() if k not in drop}
    return out


def _insert_row_buffers(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`_strip_row_buffers` for ``optimizer.load_state_dict(sd)``."""
    live = [g["params"] for g in optimizer.param_groups]
    groups = sd["param_groups"]
    stripped = [sum(not _is_row_buffer(p) for p in ps) for ps in live]
    if [len(g["params"]) for g in groups] != stripped or stripped == [len(p) for p in live]:
        return sd
    new_id: dict[Any, int] = {}
    new_groups = []
    n = 0
    for g, live_g in zip(groups, optimizer.param_groups, strict=True):
        old = iter(g["params"])
        names = iter(g.get("param_names", ()))
        ids, new_names = [], []
        for i, p in enumerate(live_g["params"]):
            if _is_row_buffer(p):  # its name as the live group has it (named_parameters())
                live_names = live_g.get("param_names")
                new_names.append(live_names[i] if live_names else row_buffer_name(new_names))
            else:
                new_id[next(old)] = n
                new_names.append(next(names, None))
            ids.append(n)
            n += 1
        new_g = {**g, "params": ids}
        if "param_names" in g:
            new_g["param_names"] = new_names
        new_groups.append(new_g)
    out = dict(sd)
    out["param_groups"] = new_groups
    out["state"] = {new_id[k]: v for k, v in sd["state"].items() if k in new_id}
    return out


class _CacheFullError(Exception):
    """Fewer free or evictable slots (``available``) than an eviction needs; ``needed``: the
    slots it keeps (pinned, the batch's, the look-ahead's) plus those it asked for."""

    def __init__(self, available: int, needed: int) -> None:
        super().__init__(available, needed)
        self.available = available
        self.needed = needed


def _check_bag_mode(mode: str) -> str:
    if mode not in BAG_MODES:
        raise ValueError(f"mode={mode!r}; expected one of {BAG_MODES}")
    return mode


def _options(
    n: int,
    d: int,
    padding_idx: int | None,
    max_norm: float | None,
    norm_type: float,
    scale_grad_by_freq: bool,
    sparse: bool,
    bag_mode: str | None,
    include_last_offset: bool,
) -> EmbeddingOptions:
    n, d = whole_number(n, "num_embeddings", 1), whole_number(d, "embedding_dim", 1)
    is_int = hasattr(padding_idx, "__index__") and not isinstance(padding_idx, bool)
    if is_int and -n <= padding_idx < 0:
        padding_idx += n  # from the end, as nn.Embedding's; EmbeddingOptions checks the rest
    return EmbeddingOptions(
        num_embeddings=int(n),
        embedding_dim=int(d),
        padding_idx=padding_idx,
        max_norm=max_norm,
        norm_type=float(norm_type),
        scale_grad_by_freq=bool(scale_grad_by_freq),
        sparse=bool(sparse),
        bag_mode=bag_mode,
        include_last_offset=bool(include_last_offset),
    )


def _check_table_dtype(dtype: Any) -> None:
    """A cached table trains real floating-point rows (its catch-up is real arithmetic: a complex
    table lost its imaginary part, an integer one failed inside torch)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype}; expected a floating-point dtype")


def _initial_weight(
    options: EmbeddingOptions, weight: torch.Tensor | None, dtype: torch.dtype | None
) -> torch.Tensor:
    n, d = options.num_embeddings, options.embedding_dim
    if weight is not None:
        check_weight(weight, options, "_weight")
        return weight.detach().to("cpu")
    dtype = dtype or torch.get_default_dtype()
    _check_table_dtype(dtype)
    w = torch.empty(n, d, dtype=dtype)
    nn.init.normal_(w)
    if options.padding_idx is not None:
        w[options.padding_idx] = 0
    return w
