"""Parameter sharing: tables whose rows are shared between ids (seed EDO §3, §5.1).

Three drop-in replacements for ``nn.Embedding`` / ``nn.EmbeddingBag`` lookups (same ``forward``
signature and output shapes as the module they replace; see :mod:`edo_monitor.nn.embedding`):

* :class:`HashedEmbedding` — the hashing trick: id ``i`` reads bucket ``h(i)`` of a ``(B, D)``
  table. With ``num_hashes=2`` it reads two buckets and mixes them with learned per-id weights
  ``(N, 2)`` (Svenstrup et al., "Hash embeddings", 2017), so two ids rarely share both buckets.
* :class:`QREmbedding` — quotient–remainder compositional rows (Shi et al., 2020): id ``i`` reads
  ``Q[i // R]`` and ``Rt[i % R]`` from two small tables ``(ceil(N / R), D)`` and ``(R, D)`` and
  combines them by sum or element-wise product. Every id gets a distinct pair.
* :class:`HybridEmbedding` — the ``K`` most frequent ("hot") ids keep unique rows ``(K, D)``; the
  rest share ``B`` hashed buckets ``(B, D)`` (the hot/cold split of CAFE and of frequency-aware
  TorchRec sharding). :meth:`HybridEmbedding.from_weight` converts a trained table: hot rows are
  copied, each bucket starts as the mean of its members' rows.

**The hash** (:func:`hash_ids`) is deterministic across processes, runs and machines (Python's
``hash()`` is salted per process and is never used): a Carter–Wegman universal hash over the
Mersenne prime ``p = 2^31 - 1``::

    h(i) = ((a * (i mod p) + c * (i div p) + b) mod p) mod B

with ``a in [1, p)``, ``b, c in [0, p)`` drawn from ``seed`` by splitmix64 (integer arithmetic
only). Every product stays below ``2^62``, so int64 tensors never overflow for ids below ``2^62``.

Options: ``padding_idx`` is kept (its row exact, in a ``padding_row`` buffer, no gradient;
EmbeddingBag entries equal to it are left out of their bag), bag modes, ``offsets``,
``per_sample_weights`` and ``include_last_offset`` behave as in ``nn.EmbeddingBag``, and
``sparse=True`` gives sparse gradients on the shared tables. ``max_norm`` (it renormalises a
looked-up row in place, which would rewrite a row shared by other ids) and
``scale_grad_by_freq`` (frequencies are per id, gradients per shared row) are refused with a
``ValueError`` naming them.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from edo_monitor.checks import whole_number
from edo_monitor.nn.embedding import EmbeddingOptions, _RowComputedEmbedding
from edo_monitor.nn.table_checks import exact_padding_row, id_list

__all__ = [
    "HashedEmbedding",
    "HybridEmbedding",
    "QREmbedding",
    "hash_ids",
    "hash_params",
]

logger = logging.getLogger(__name__)

_P = (1 << 31) - 1  # the Mersenne prime of the universal hash
_MASK64 = (1 << 64) - 1
_MAX_ID = 1 << 62


def _splitmix64(state: int) -> tuple[int, int]:
    """One splitmix64 step: ``(new_state, output)``, both unsigned 64-bit Python ints."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def hash_params(seed: int) -> tuple[int, int, int]:
    """The ``(a, b, c)`` of :func:`hash_ids` for ``seed``: ``1 <= a < p``, ``0 <= b, c < p``.

    Raises:
        ValueError: when ``seed`` is not a non-negative int.
    """
    seed = whole_number(seed, "seed", 0)
    state, a = _splitmix64(seed)
    state, b = _splitmix64(state)
    _, c = _splitmix64(state)
    return 1 + a % (_P - 1), b % _P, c % _P


def hash_ids(ids: torch.Tensor, num_buckets: int, seed: int = 0) -> torch.Tensor:
    """Bucket of each id: ``h(i)`` of the module docstring.

    Args:
        ids: integer tensor of any shape, values in ``[0, 2^62)``.
        num_buckets: ``B >= 1``.
        seed: selects the hash function; the same seed gives the same buckets everywhere.

    Returns:
        int64 tensor of ``ids``' shape, values in ``[0, num_buckets)``, on ``ids``' device.

    Raises:
        ValueError: for ``num_buckets < 1`` or a bad seed.
    """
    num_buckets = whole_number(num_buckets, "num_buckets", 1)
    a, b, c = hash_params(seed)
    x = ids.long()
    lo = torch.remainder(x, _P)
    hi = torch.div(x, _P, rounding_mode="floor")
    h = torch.remainder(a * lo + c * hi + b, _P)
    return torch.remainder(h, num_buckets)


class _SharedEmbedding(_RowComputedEmbedding):
    """Common parts: option checks, the exact padding row, and the shared-table lookup."""

    _refused_options = ("scale_grad_by_freq",)

    def __init__(self, options: EmbeddingOptions, padding_row: torch.Tensor | None) -> None:
        super().__init__(options)
        self.register_buffer("padding_row", exact_padding_row(options, padding_row, None))

    def _gather(self, idx: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, table, sparse=self.options.sparse)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``(*ids.shape, D)`` a lookup of ``ids`` returns (padding row exact)."""
        w = self._rows(ids)
        if self.padding_row is not None:
            mask = (ids == self.options.padding_idx).unsqueeze(-1)
            w = torch.where(mask, self.padding_row.to(w.dtype), w)
        return w

    def reconstructed(self) -> torch.Tensor:
        """Every id's row ``(N, D)`` as a lookup returns it (no gradient)."""
        with torch.no_grad():
            return self.rows(
                torch.arange(self.options.num_embeddings, device=self.padding_device())
            )

    def padding_device(self) -> torch.device:
        """The device of the module's tensors (where lookups run)."""
        return next(self.parameters()).device


class HashedEmbedding(_SharedEmbedding):
    """Ids hashed into ``num_buckets`` shared rows (optionally two hashes, learned mixing).

    Args:
        options: the replaced table's options (``num_embeddings`` N, ``embedding_dim`` D, …).
        num_buckets: ``B``, rows of the shared table ``weight`` ``(B, D)``.
        num_hashes: 1 (row = ``weight[h0(i)]``) or 2 (row = ``importance[i, 0] * weight[h0(i)] +
            importance[i, 1] * weight[h1(i)]``, ``importance`` a ``(N, 2)`` parameter).
        seed: hash ``k`` uses seed ``seed + k``.
        weight: initial ``(B, D)`` table; default ``N(0, 1)`` like ``nn.Embedding``.
        dtype, device: of a default-initialised table.
        padding_row: the exact ``(D,)`` padding row, required when ``padding_idx`` is set
            (default for a new table: zeros, as ``nn.Embedding`` initialises it).

    Bytes: ``B * D`` elements, plus ``N * 2`` with two hashes.
    """

    def __init__(
        self,
        options: EmbeddingOptions,
        num_buckets: int,
        *,
        num_hashes: int = 1,
        seed: int = 0,
        weight: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        padding_row: torch.Tensor | None = None,
    ) -> None:
        num_buckets = whole_number(num_buckets, "num_buckets", 1)
        if isinstance(num_hashes, bool) or num_hashes not in (1, 2):
            raise ValueError(f"num_hashes={num_hashes!r}; expected 1 or 2")
        hash_params(seed)  # validates the seed
        d = options.embedding_dim
        if weight is None:
            weight = torch.randn(num_buckets, d, dtype=dtype, device=device)
        elif tuple(weight.shape) != (num_buckets, d):
            raise ValueError(
                f"weight has shape {tuple(weight.shape)}; expected ({num_buckets}, {d})"
            )
        if options.padding_idx is not None and padding_row is None:
            padding_row = weight.new_zeros(d)
        super().__init__(options, padding_row)
        self.num_buckets = num_buckets
        self.num_hashes = num_hashes
        self.seed = seed
        self.weight = nn.Parameter(weight.detach().clone())
        if num_hashes == 2:
            self.importance = nn.Parameter(
                torch.full(
                    (options.num_embeddings, 2), 0.5, dtype=weight.dtype, device=weight.device
                )
            )
        else:
            self.importance = None

    def buckets(self, ids: torch.Tensor) -> torch.Tensor:
        """Bucket of each id for each hash: ``(*ids.shape, num_hashes)`` int64."""
        return torch.stack(
            [hash_ids(ids, self.num_buckets, self.seed + k) for k in range(self.num_hashes)], -1
        )

    def _rows(self, idx: torch.Tensor) -> torch.Tensor:
        if self.importance is None:
            return self._gather(hash_ids(idx, self.num_buckets, self.seed), self.weight)
        b = self.buckets(idx)
        w = self._gather(idx, self.importance)
        return w[..., 0:1] * self._gather(b[..., 0], self.weight) + w[..., 1:2] * self._gather(
            b[..., 1], self.weight
        )

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, num_buckets={self.num_buckets}, num_hashes={self.num_hashes}"
        )


class QREmbedding(_SharedEmbedding):
    """Quotient–remainder rows: ``combine(quotient[i // R], remainder[i % R])``.

    Args:
        options: the replaced table's options.
        num_remainders: ``R``; default ``ceil(sqrt(N))``, which minimises ``ceil(N / R) + R``.
        operation: ``"sum"`` or ``"mult"`` (element-wise product).
        dtype, device: of the two tables.
        padding_row: the exact ``(D,)`` padding row (default zeros) when ``padding_idx`` is set.

    Parameters: ``quotient`` ``(ceil(N / R), D)`` and ``remainder`` ``(R, D)``. Initialised so a
    row has ``nn.Embedding``'s ``N(0, 1)`` statistics: for ``"sum"`` both ``N(0, 1/2)``; for
    ``"mult"`` ``quotient ~ N(0, 1)`` and ``remainder = 1``.
    """

    def __init__(
        self,
        options: EmbeddingOptions,
        num_remainders: int | None = None,
        *,
        operation: str = "mult",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        padding_row: torch.Tensor | None = None,
    ) -> None:
        n, d = options.num_embeddings, options.embedding_dim
        r = math.isqrt(n - 1) + 1 if num_remainders is None else num_remainders
        r = whole_number(r, "num_remainders", 1)
        if operation not in ("sum", "mult"):
            raise ValueError(f"operation={operation!r}; expected 'sum' or 'mult'")
        if options.padding_idx is not None and padding_row is None:
            padding_row = torch.zeros(d, dtype=dtype, device=device)
        super().__init__(options, padding_row)
        self.num_remainders = r
        self.operation = operation
        nq = -(-n // r)
        if operation == "sum":
            q = torch.randn(nq, d, dtype=dtype, device=device) * math.sqrt(0.5)
            rem = torch.randn(r, d, dtype=dtype, device=device) * math.sqrt(0.5)
        else:
            q = torch.randn(nq, d, dtype=dtype, device=device)
            rem = torch.ones(r, d, dtype=dtype, device=device)
        self.quotient = nn.Parameter(q)
        self.remainder = nn.Parameter(rem)

    def _rows(self, idx: torch.Tensor) -> torch.Tensor:
        r = self.num_remainders
        q = self._gather(torch.div(idx, r, rounding_mode="floor"), self.quotient)
        rem = self._gather(torch.remainder(idx, r), self.remainder)
        return q + rem if self.operation == "sum" else q * rem

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, num_remainders={self.num_remainders}, "
            f"operation={self.operation}"
        )


class HybridEmbedding(_SharedEmbedding):
    """Hot ids keep unique rows; cold ids share hashed buckets.

    Args:
        options: the replaced table's options.
        hot_ids: ``(K,)`` distinct ids in ``[0, N)`` that keep a row of their own (any order; kept
            sorted in the ``hot_ids`` buffer, ``hot_weight[k]`` is the row of ``hot_ids[k]``).
        num_buckets: ``B``, rows shared by the other ids (bucket ``hash_ids(i, B, seed)``).
        seed: the hash's seed.
        hot_weight, cold_weight: initial ``(K, D)`` and ``(B, D)`` tables (default ``N(0, 1)``).
        dtype, device: of default-initialised tables.
        padding_row: the exact ``(D,)`` padding row (default zeros) when ``padding_idx`` is set.

    Bytes: ``(K + B) * D`` elements plus ``K`` int64 hot ids (looked up by binary search, so no
    ``(N,)`` map is stored).

    Raises:
        ValueError: for ids out of range, repeated hot ids, or shapes that do not match.
        TypeError: ``hot_ids`` that are not integers (floats were truncated).
    """

    def __init__(
        self,
        options: EmbeddingOptions,
        hot_ids: torch.Tensor,
        num_buckets: int,
        *,
        seed: int = 0,
        hot_weight: torch.Tensor | None = None,
        cold_weight: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        padding_row: torch.Tensor | None = None,
    ) -> None:
        n, d = options.num_embeddings, options.embedding_dim
        num_buckets = whole_number(num_buckets, "num_buckets", 1)
        hash_params(seed)
        hot = id_list(hot_ids, "hot_ids", n)
        sorted_hot, order = torch.sort(hot)
        if sorted_hot.numel() > 1 and bool((sorted_hot[1:] == sorted_hot[:-1]).any()):
            raise ValueError("hot_ids has repeated ids")
        k = sorted_hot.numel()
        if hot_weight is None:
            hot_weight = torch.randn(k, d, dtype=dtype, device=device)
        elif tuple(hot_weight.shape) != (k, d):
            raise ValueError(f"hot_weight has shape {tuple(hot_weight.shape)}; expected ({k}, {d})")
        else:
            hot_weight = hot_weight[order.to(hot_weight.device)]
        if cold_weight is None:
            cold_weight = torch.randn(
                num_buckets, d, dtype=hot_weight.dtype, device=hot_weight.device
            )
        elif tuple(cold_weight.shape) != (num_buckets, d):
            raise ValueError(
                f"cold_weight has shape {tuple(cold_weight.shape)}; expected ({num_buckets}, {d})"
            )
        if options.padding_idx is not None and padding_row is None:
            padding_row = hot_weight.new_zeros(d)
        super().__init__(options, padding_row)
        self.num_buckets = num_buckets
        self.seed = seed
        self.register_buffer("hot_ids", sorted_hot.to(hot_weight.device))
        self.hot_weight = nn.Parameter(hot_weight.detach().clone())
        self.cold_weight = nn.Parameter(cold_weight.detach().clone())

    @property
    def num_hot(self) -> int:
        """``K``: ids with a row of their own."""
        return int(self.hot_ids.numel())

    def hot_slots(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(is_hot, slot)`` for each id: ``hot_weight[slot]`` is its row where ``is_hot``."""
        k = self.num_hot
        if k == 0:
            return torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
        pos = torch.searchsorted(self.hot_ids, ids.contiguous()).clamp_(max=k - 1)
        return self.hot_ids[pos] == ids, pos

    def _rows(self, idx: torch.Tensor) -> torch.Tensor:
        is_hot, slot = self.hot_slots(idx)
        cold = self._gather(hash_ids(idx, self.num_buckets, self.seed), self.cold_weight)
        if self.num_hot == 0:
            return cold
        hot = self._gather(slot, self.hot_weight)
        return torch.where(is_hot.unsqueeze(-1), hot, cold)

    def split_rows(
        self, table: torch.Tensor, *, reduce: str = "mean", chunk_rows: int = 65536
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Map a per-id ``(N, D)`` tensor onto this module's rows: ``(hot (K, D), cold (B, D))``.

        Hot rows are copied (in ``hot_ids`` order); each bucket gets the ``reduce`` (``"mean"`` or
        ``"sum"``) of its cold members' rows, the padding row left out (an empty bucket is zero).
        Used for the weight (mean: the model keeps working), the optimizer's per-element state
        (mean) and a gradient (sum: the chain rule through a shared row). Works ``chunk_rows`` rows
        at a time: the temporary memory is one chunk plus the ``(B, D)`` sums, not a copy of the
        table. The result is in ``table``'s dtype, on its device.

        Raises:
            ValueError: for a shape other than ``(N, D)`` or another ``reduce``.
        """
        n, d = self.options.num_embeddings, self.options.embedding_dim
        if tuple(table.shape) != (n, d):
            raise ValueError(f"table has shape {tuple(table.shape)}; expected ({n}, {d})")
        if reduce not in ("mean", "sum"):
            raise ValueError(f"reduce={reduce!r}; expected 'mean' or 'sum'")
        t = table.detach()
        hot_ids = self.hot_ids.to(t.device)
        acc = torch.float64 if t.dtype == torch.float64 else torch.float32
        sums = torch.zeros(self.num_buckets, d, dtype=acc, device=t.device)
        counts = torch.zeros(self.num_buckets, dtype=acc, device=t.device)
        pad = self.options.padding_idx
        for start in range(0, n, chunk_rows):
            ids = torch.arange(start, min(n, start + chunk_rows), device=t.device)
            is_hot, _ = self.hot_slots(ids.to(self.hot_ids.device))
            cold = ~is_hot.to(t.device)
            if pad is not None:
                cold &= ids != pad
            ids = ids[cold]
            b = hash_ids(ids, self.num_buckets, self.seed)
            sums.index_add_(0, b, t[ids].to(acc))
            counts.index_add_(0, b, torch.ones_like(b, dtype=acc))
        if reduce == "mean":
            sums /= counts.clamp(min=1).unsqueeze(1)
        return t[hot_ids].clone(), sums.to(t.dtype)

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        options: EmbeddingOptions,
        hot_ids: torch.Tensor,
        num_buckets: int,
        *,
        seed: int = 0,
        chunk_rows: int = 65536,
    ) -> HybridEmbedding:
        """Convert a trained ``(N, D)`` table: hot rows copied, each bucket the mean of its cold
        members' rows (:meth:`split_rows`), the padding row kept exact. Result on ``weight``'s
        device, in its dtype, with ``requires_grad`` as ``weight`` has it. ``hot_ids`` are
        checked as the constructor checks them (:func:`~edo_monitor.nn.table_checks.id_list`).
        """
        n, d = weight.shape
        if (n, d) != (options.num_embeddings, options.embedding_dim):
            raise ValueError(
                f"weight has shape {(n, d)}; options say "
                f"({options.num_embeddings}, {options.embedding_dim})"
            )
        w = weight.detach()
        hot = id_list(hot_ids, "hot_ids", n, w.device)
        module = cls(
            options,
            hot,
            num_buckets,
            seed=seed,
            hot_weight=w.new_zeros(hot.numel(), d),
            cold_weight=w.new_zeros(num_buckets, d),
            padding_row=w[options.padding_idx] if options.padding_idx is not None else None,
        )
        hot_rows, cold_rows = module.split_rows(w, chunk_rows=chunk_rows)
        with torch.no_grad():
            module.hot_weight.copy_(hot_rows)
            module.cold_weight.copy_(cold_rows)
        module.hot_weight.requires_grad_(weight.requires_grad)
        module.cold_weight.requires_grad_(weight.requires_grad)
        return module

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_hot={self.num_hot}, num_buckets={self.num_buckets}"
