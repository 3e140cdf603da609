"""EDO embedding modules: what the actions swap in for ``nn.Embedding`` / ``nn.EmbeddingBag``.

Every module here has ``edo_placement`` (``"device"`` or ``"host"``), ``num_embeddings`` and
``embedding_dim``, so :func:`edo_monitor.measure.accounting.account` reports it as a table. Each one
keeps the semantics of the module it replaces:

* Embedding semantics (``bag_mode=None``): ``forward(input)`` with ``input`` an integer tensor of
  any shape ``(*)`` returns ``(*, embedding_dim)``; the ``padding_idx`` row is returned as stored
  and gets no gradient.
* EmbeddingBag semantics (``bag_mode`` in ``"sum" | "mean" | "max"``):
  ``forward(input, offsets=None, per_sample_weights=None)`` with ``input`` either ``(B, L)``
  (``offsets`` must be ``None``) or 1-D ``(M,)`` with ``offsets`` ``(B,)`` (or ``(B + 1,)`` with
  ``include_last_offset``) returns ``(B, embedding_dim)``; entries equal to ``padding_idx`` are
  left out of their bag (and of the mean's count); ``per_sample_weights`` (same shape as
  ``input``) only with ``"sum"``.

Modules:

* :class:`OffloadedEmbedding` — the weight (the *same* ``Parameter`` object, so an optimizer keeps
  stepping it) lives in host memory (pinned when CUDA is available); lookups run on the host and the
  result moves to ``output_device``. All options (``max_norm``, ``scale_grad_by_freq``, ``sparse``)
  are preserved, since the lookup is the same ``torch.nn.functional`` call.
* :class:`LowPrecisionEmbedding` — the same ``Parameter`` stored as fp16/bf16; the output is cast
  back to ``output_dtype`` so the rest of the model is unchanged.
* :class:`Int8RowwiseEmbedding` — a frozen table as int8 rows with one fp32 scale per row
  (``row = int8_row * scale``, ``scale = max|row| / 127``).
* :class:`LowRankEmbedding` — ``weight ≈ left @ right`` with ``left`` ``(N, k)`` and ``right``
  ``(k, D)`` from a truncated SVD; trainable or frozen.

Int8 and low-rank keep the ``padding_idx`` row bit-exact in a ``padding_row`` buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

__all__ = [
    "BAG_MODES",
    "EmbeddingOptions",
    "Int8RowwiseEmbedding",
    "LowPrecisionEmbedding",
    "LowRankEmbedding",
    "OffloadedEmbedding",
    "dequantize_int8_rowwise",
    "quantize_int8_rowwise",
    "row_error",
]

logger = logging.getLogger(__name__)

BAG_MODES: tuple[str, ...] = ("sum", "mean", "max")


def _index(value: Any, name: str, low: int) -> int:
    """``value`` as an int (NumPy's ints too) at least ``low``; ``ValueError`` naming it."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or value < low:
        raise ValueError(f"{name}={value!r}; expected an int >= {low}")
    return int(value)


@dataclass(frozen=True)
class EmbeddingOptions:
    """The options of an ``nn.Embedding`` / ``nn.EmbeddingBag`` that the EDO modules carry over.

    ``bag_mode`` is ``None`` for Embedding semantics, else the EmbeddingBag ``mode``.
    ``padding_idx`` is normalised to a non-negative row index (or ``None``).

    Raises:
        ValueError: ``num_embeddings`` or ``embedding_dim`` not an int >= 1, ``padding_idx`` not
            an int in ``[0, num_embeddings)``, ``max_norm`` not a number > 0, ``bag_mode`` not
            one of :data:`BAG_MODES` or ``None`` (each named with what is allowed). NumPy's
            ints count as ints.
    """

    num_embeddings: int
    embedding_dim: int
    padding_idx: int | None = None
    max_norm: float | None = None
    norm_type: float = 2.0
    scale_grad_by_freq: bool = False
    sparse: bool = False
    bag_mode: str | None = None
    include_last_offset: bool = False

    def __post_init__(self) -> None:
        n = _index(self.num_embeddings, "num_embeddings", 1)
        _index(self.embedding_dim, "embedding_dim", 1)
        if self.padding_idx is not None:
            pad = self.padding_idx
            if isinstance(pad, bool) or not hasattr(pad, "__index__") or not 0 <= pad < n:
                raise ValueError(f"padding_idx={pad!r}; expected an int in [0, {n}) or None")
        if self.max_norm is not None and not (
            isinstance(self.max_norm, int | float) and self.max_norm > 0
        ):
            raise ValueError(f"max_norm={self.max_norm!r}; expected a number > 0 or None")
        if self.bag_mode is not None and self.bag_mode not in BAG_MODES:
            raise ValueError(f"bag_mode={self.bag_mode!r}; expected one of {BAG_MODES} or None")

    @classmethod
    def from_module(cls, module: nn.Module) -> EmbeddingOptions:
        """Read the options of an ``nn.Embedding``, ``nn.EmbeddingBag`` or EDO module.

        Raises:
            TypeError: when ``module`` is none of those.
        """
        if isinstance(module, _EdoEmbedding):
            return module.options
        if isinstance(module, nn.EmbeddingBag):
            bag_mode: str | None = str(module.mode)
            include_last = bool(module.include_last_offset)
        elif isinstance(module, nn.Embedding):
            bag_mode, include_last = None, False
        else:
            raise TypeError(f"{type(module).__name__} is not an embedding table")
        pad = module.padding_idx
        if pad is not None and pad < 0:
            pad += module.num_embeddings
        return cls(
            num_embeddings=int(module.num_embeddings),
            embedding_dim=int(module.embedding_dim),
            padding_idx=pad,
            max_norm=module.max_norm,
            norm_type=float(module.norm_type),
            scale_grad_by_freq=bool(module.scale_grad_by_freq),
            sparse=bool(module.sparse),
            bag_mode=bag_mode,
            include_last_offset=include_last,
        )


class _EdoEmbedding(nn.Module):
    """Common base: options, ``edo_placement`` and the lookup entry point."""

    edo_placement: str = "device"

    def __init__(self, options: EmbeddingOptions) -> None:
        super().__init__()
        self.options = options  # its values checked when it was made
        # the replaced module's attributes, readable as on nn.Embedding / nn.EmbeddingBag
        self.num_embeddings = options.num_embeddings
        self.embedding_dim = options.embedding_dim
        self.padding_idx = options.padding_idx
        self.max_norm = options.max_norm
        self.norm_type = options.norm_type
        self.scale_grad_by_freq = options.scale_grad_by_freq
        self.sparse = options.sparse
        if options.bag_mode is not None:
            self.mode = options.bag_mode
            self.include_last_offset = options.include_last_offset

    def extra_repr(self) -> str:
        o = self.options
        s = f"{o.num_embeddings}, {o.embedding_dim}, placement={self.edo_placement}"
        if o.bag_mode is not None:
            s += f", mode={o.bag_mode}"
        if o.padding_idx is not None:
            s += f", padding_idx={o.padding_idx}"
        return s


def _functional_lookup(
    weight: torch.Tensor,
    options: EmbeddingOptions,
    input: torch.Tensor,
    offsets: torch.Tensor | None,
    per_sample_weights: torch.Tensor | None,
) -> torch.Tensor:
    """``F.embedding`` / ``F.embedding_bag`` on ``weight`` with ``options``."""
    if options.bag_mode is None:
        return F.embedding(
            input,
            weight,
            options.padding_idx,
            options.max_norm,
            options.norm_type,
            options.scale_grad_by_freq,
            options.sparse,
        )
    return F.embedding_bag(
        input,
        weight,
        offsets,
        options.max_norm,
        options.norm_type,
        options.scale_grad_by_freq,
        options.bag_mode,
        options.sparse,
        per_sample_weights,
        options.include_last_offset,
        options.padding_idx,
    )


def check_weight(weight: Any, options: EmbeddingOptions, name: str = "weight") -> None:
    """Refuse a table that is not a floating-point tensor of the options' shape ``(N, D)``
    (``TypeError`` / ``ValueError`` naming it and the shape expected): a wrong one failed
    later, at a lookup, inside torch."""
    n, d = options.num_embeddings, options.embedding_dim
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a tensor ({n}, {d}), got {type(weight).__name__}")
    if tuple(weight.shape) != (n, d):
        raise ValueError(f"{name} has shape {tuple(weight.shape)}; expected {(n, d)}")
    if not weight.dtype.is_floating_point:
        raise ValueError(f"{name} has dtype {weight.dtype}; expected a floating-point table")


def check_ids(input: Any, num_embeddings: int) -> None:
    """Refuse what ``nn.Embedding`` refuses: ``input`` not an integer tensor (``TypeError``),
    an id outside ``[0, num_embeddings)`` (``IndexError`` naming the range and the ids'; on a
    device, an asynchronous device-side assert, as ``nn.Embedding``'s, so the check never waits
    for the device). Tables that compute rows from ids (hashed, quotient-remainder, hybrid)
    would return a row for any id: they check here."""
    if not isinstance(input, torch.Tensor):
        kind = type(input).__name__
        raise TypeError(f"input must be an integer tensor (int64/int32), got {kind}")
    if input.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input must be an integer tensor (int64/int32), got {input.dtype}")
    if input.numel() == 0 or input.is_meta:
        return
    if input.device.type != "cpu":
        inside = (input >= 0).logical_and_(input < num_embeddings).all()
        torch._assert_async(inside, f"index out of range: ids must be in [0, {num_embeddings})")
        return
    lo, hi = (int(v) for v in torch.aminmax(input))
    if lo < 0 or hi >= num_embeddings:
        raise IndexError(
            f"index out of range: ids must be in [0, {num_embeddings}), got [{lo}, {hi}]"
        )


def _lookup_from_rows(
    rows_fn: Callable[[torch.Tensor], torch.Tensor],
    options: EmbeddingOptions,
    padding_row: torch.Tensor | None,
    input: torch.Tensor,
    offsets: torch.Tensor | None,
    per_sample_weights: torch.Tensor | None,
) -> torch.Tensor:
    """Embedding / EmbeddingBag semantics for tables that can only reconstruct rows.

    ``rows_fn(indices)`` maps 1-D indices ``(M,)`` to rows ``(M, D)``. Bags are formed with
    ``F.embedding_bag`` over the gathered rows (plus one zero row standing for padding entries), so
    sum/mean/max, ``per_sample_weights``, ``include_last_offset`` and the exclusion of
    ``padding_idx`` entries behave exactly as in ``nn.EmbeddingBag``.

    Raises:
        TypeError, IndexError: ``input`` is not an integer tensor, or an id is outside
            ``[0, N)`` (:func:`check_ids`).
    """
    check_ids(input, options.num_embeddings)
    pad = options.padding_idx
    if options.bag_mode is None:
        flat = input.reshape(-1)
        rows = rows_fn(flat)
        if pad is not None and padding_row is not None:
            mask = (flat == pad).unsqueeze(-1)
            rows = torch.where(mask, padding_row.to(rows.dtype), rows)
        return rows.reshape(*input.shape, options.embedding_dim)
    include_last = options.include_last_offset
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError("offsets has to be None if input is 2D")
        b, seq = input.shape
        flat = input.reshape(-1)
        offsets = torch.arange(0, b * seq, seq, device=input.device, dtype=torch.long)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
        include_last = False
    elif input.dim() == 1:
        if offsets is None:
            raise ValueError("offsets has to be a 1D Tensor but got None")
        flat = input
    else:
        raise ValueError(
            f"input has to be 1D or 2D Tensor, but got Tensor of dimension {input.dim()}"
        )
    m = flat.numel()
    is_pad = flat == pad if pad is not None else torch.zeros_like(flat, dtype=torch.bool)
    safe = torch.where(is_pad, torch.zeros_like(flat), flat)
    rows = rows_fn(safe)
    table = torch.cat([rows, rows.new_zeros(1, options.embedding_dim)], dim=0)
    idx = torch.arange(m, device=flat.device, dtype=torch.long)
    idx = torch.where(is_pad, torch.full_like(idx, m), idx)
    return F.embedding_bag(
        idx,
        table,
        offsets,
        mode=options.bag_mode,
        per_sample_weights=per_sample_weights,
        include_last_offset=include_last,
        padding_idx=m,
    )


def _pin_if_possible(t: torch.Tensor) -> torch.Tensor:
    if torch.cuda.is_available():
        try:
            return t.pin_memory()
        except RuntimeError as exc:  # pinned memory can run out; pageable still works
            logger.warning(
                "could not pin %d bytes of host memory (%s); using pageable", t.nbytes, exc
            )
    return t


class OffloadedEmbedding(_EdoEmbedding):
    """A table whose weight lives in host memory; lookups run on the host.

    Args:
        weight: the table's ``Parameter`` ``(num_embeddings, embedding_dim)``. It is kept as the
            same object (an optimizer holding it keeps working); the caller moves its data to the
            host (see :meth:`offload_parameter`).
        options: the options of the replaced module (all preserved).
        output_device: where results go (the replaced table's device).

    ``forward`` moves ``input``/``offsets``/``per_sample_weights`` to the host, looks up, and moves
    the result ``(*, D)`` or ``(B, D)`` to ``output_device``; gradients flow back to the host
    weight.
    """

    edo_placement = "host"

    def __init__(
        self,
        weight: nn.Parameter,
        options: EmbeddingOptions,
        output_device: torch.device | str,
    ) -> None:
        check_weight(weight, options)
        super().__init__(options)
        self.weight = weight
        self.output_device = torch.device(output_device)

    @staticmethod
    def offload_parameter(param: nn.Parameter) -> None:
        """Move ``param``'s data (and grad) to host memory in place, keeping the object.

        Pinned when CUDA is available. Marks ``param._edo_host = True`` (the accounting tier rule).
        """
        if not param.data.is_cpu:  # CPU-budget mode: the data already is in host memory
            param.data = _pin_if_possible(param.data.detach().to("cpu"))
            if param.grad is not None:
                param.grad = param.grad.to("cpu")
        param._edo_host = True  # type: ignore[attr-defined]

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Look up on the host; result on ``output_device``. Shapes as in the module docstring."""
        host = self.weight.device
        input = input.to(host)
        if offsets is not None:
            offsets = offsets.to(host)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(host)
        out = _functional_lookup(self.weight, self.options, input, offsets, per_sample_weights)
        return out.to(self.output_device, non_blocking=True)


class LowPrecisionEmbedding(_EdoEmbedding):
    """A table stored as fp16 or bf16, returning ``output_dtype``.

    Args:
        weight: the same ``Parameter`` object as the replaced table, its data already converted to
            fp16/bf16 ``(num_embeddings, embedding_dim)``.
        options: the replaced module's options.
        output_dtype: dtype of the results (the replaced table's dtype, e.g. ``torch.float32``).
    """

    def __init__(
        self, weight: nn.Parameter, options: EmbeddingOptions, output_dtype: torch.dtype
    ) -> None:
        check_weight(weight, options)
        super().__init__(options)
        self.weight = weight
        self.output_dtype = output_dtype

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Look up in low precision, cast the result to ``output_dtype``."""
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(self.weight.dtype)
        out = _functional_lookup(self.weight, self.options, input, offsets, per_sample_weights)
        return out.to(self.output_dtype)


def quantize_int8_rowwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric row-wise int8 quantisation.

    Args:
        weight: ``(N, D)`` floating tensor.

    Returns:
        ``(q, scale)``: ``q`` ``(N, D)`` int8 in [-127, 127] and ``scale`` ``(N,)`` float32 with
        ``row ≈ q * scale``; an all-zero row gets scale 0 and is reconstructed exactly.

    Raises:
        ValueError: a value beyond float32's range (a float64 table's): its row's scale cannot
            be stored (the row read back as NaN).
    """
    w = weight.detach()
    if w.numel() and w.dtype.itemsize > 4:
        top = float(w.abs().max())
        if top > torch.finfo(torch.float32).max:
            raise ValueError(
                f"a value of magnitude {top:g} exceeds float32's range; the row's int8 scale "
                "(float32) cannot be stored"
            )
    w = w.float()
    scale = w.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(w / safe.unsqueeze(1)), -127, 127).to(torch.int8)
    return q, scale


def dequantize_int8_rowwise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_int8_rowwise`: ``(N, D)`` int8, ``(N,)`` → ``(N, D)`` float32."""
    return q.float() * scale.unsqueeze(-1)


class _RowComputedEmbedding(_EdoEmbedding):
    """Base of the tables that compute looked-up rows (``_rows(idx) -> (*, D)``) instead of
    indexing a weight: lookups and bags go through :func:`_lookup_from_rows`.

    None honours ``max_norm`` (it renormalises looked-up rows of a weight in place); the options
    in :attr:`_refused_options` are refused too (a table whose gradients do not reach rows per
    id: ``scale_grad_by_freq``, ``sparse``). Raises ``ValueError`` naming the option."""

    padding_row: torch.Tensor | None
    _refused_options: tuple[str, ...] = ()

    def __init__(self, options: EmbeddingOptions) -> None:
        name = type(self).__name__
        if options.max_norm is not None:
            raise ValueError(
                f"{name} cannot honour max_norm={options.max_norm} (it renormalises looked-up "
                "rows of a weight in place; this table computes its rows)"
            )
        for option in self._refused_options:
            value = getattr(options, option)
            if value:
                raise ValueError(
                    f"{name} cannot honour {option}={value!r} (its gradients reach factors or "
                    "shared rows, not one row per id)"
                )
        super().__init__(options)

    def _rows(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Compute the looked-up rows (or bags of them). Shapes as in the subclass docstring."""
        return _lookup_from_rows(
            self._rows, self.options, self.padding_row, input, offsets, per_sample_weights
        )


class Int8RowwiseEmbedding(_RowComputedEmbedding):
    """A frozen table as int8 rows with per-row fp32 scales (buffers ``weight`` and ``row_scale``).

    Args:
        weight: the float table ``(N, D)`` to quantise (not kept).
        options: the replaced module's options; ``max_norm`` cannot be honoured (it rewrites rows)
            and raises ``ValueError``.
        output_dtype: dtype of the results.

    Buffers: ``weight`` ``(N, D)`` int8, ``row_scale`` ``(N,)`` float32, and ``padding_row``
    ``(D,)`` (the exact padding row) when ``padding_idx`` is set. No gradient flows (frozen).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        options: EmbeddingOptions,
        output_dtype: torch.dtype = torch.float32,
    ) -> None:
        check_weight(weight, options)
        super().__init__(options)
        q, scale = quantize_int8_rowwise(weight)
        self.register_buffer("weight", q)
        self.register_buffer("row_scale", scale)
        if options.padding_idx is not None:
            self.register_buffer("padding_row", weight.detach()[options.padding_idx].clone())
        else:
            self.padding_row = None
        self.output_dtype = output_dtype

    def dequantized(self) -> torch.Tensor:
        """The reconstructed table ``(N, D)`` in ``output_dtype`` (padding row exact)."""
        w = dequantize_int8_rowwise(self.weight, self.row_scale)
        if self.padding_row is not None:
            w[self.options.padding_idx] = self.padding_row.float()
        return w.to(self.output_dtype)

    def _rows(self, idx: torch.Tensor) -> torch.Tensor:
        q = F.embedding(idx, self.weight)
        s = F.embedding(idx, self.row_scale.unsqueeze(1))
        return (q.float() * s).to(self.output_dtype)


class LowRankEmbedding(_RowComputedEmbedding):
    """``weight ≈ left @ right`` with ``left`` ``(N, k)`` and ``right`` ``(k, D)``.

    Build with :meth:`from_weight`. ``left``/``right`` are parameters with ``requires_grad`` as
    given (trainable tables stay trainable: gradients reach both factors). The padding row is kept
    exact in the ``padding_row`` buffer and gets no gradient. ``max_norm``, ``sparse`` and, on
    trainable factors, ``scale_grad_by_freq`` are refused (``ValueError``): they were ignored.
    """

    _refused_options = ("sparse",)

    def __init__(
        self,
        left: nn.Parameter,
        right: nn.Parameter,
        options: EmbeddingOptions,
        padding_row: torch.Tensor | None = None,
    ) -> None:
        if options.scale_grad_by_freq and (left.requires_grad or right.requires_grad):
            raise ValueError(
                "LowRankEmbedding cannot honour scale_grad_by_freq=True on trainable factors "
                "(its gradients reach the factors, not one row per id)"
            )
        super().__init__(options)
        self.left = left
        self.right = right
        self.rank = int(left.shape[1])
        if padding_row is not None:
            self.register_buffer("padding_row", padding_row)
        else:
            self.padding_row = None

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        rank: int,
        options: EmbeddingOptions,
        *,
        requires_grad: bool,
    ) -> LowRankEmbedding:
        """Truncated SVD of ``weight`` ``(N, D)`` to ``rank`` (computed in float32).

        ``left = U_k * S_k`` ``(N, k)`` and ``right = V_kᵀ`` ``(k, D)``, both in ``weight.dtype``
        on ``weight.device``.

        Raises:
            ValueError: ``rank`` not an int in ``[1, min(N, D)]``; ``weight`` not of the
                options' shape (:func:`check_weight`).
        """
        check_weight(weight, options)
        n, d = weight.shape
        if isinstance(rank, bool) or not hasattr(rank, "__index__") or not 1 <= rank <= min(n, d):
            raise ValueError(f"rank={rank!r}; expected an int in [1, {min(n, d)}]")
        rank = int(rank)
        w = weight.detach().float()
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        left = (u[:, :rank] * s[:rank]).to(weight.dtype).contiguous()
        right = vh[:rank].to(weight.dtype).contiguous()
        pad_row = None
        if options.padding_idx is not None:
            pad_row = weight.detach()[options.padding_idx].clone()
        return cls(
            nn.Parameter(left, requires_grad=requires_grad),
            nn.Parameter(right, requires_grad=requires_grad),
            options,
            pad_row,
        )

    def reconstructed(self) -> torch.Tensor:
        """``left @ right`` ``(N, D)`` with the exact padding row (no gradient)."""
        with torch.no_grad():
            w = self.left @ self.right
            if self.padding_row is not None:
                w[self.options.padding_idx] = self.padding_row
        return w

    def _rows(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.left, self.options.padding_idx) @ self.right


def row_error(
    reference: torch.Tensor,
    approx: torch.Tensor,
    skip_rows: tuple[int, ...] = (),
    *,
    chunk_rows: int = 4096,
) -> dict[str, float]:
    """Error of ``approx`` against ``reference`` (both ``(N, D)``).

    Computed ``chunk_rows`` rows at a time in float64, so the temporary memory is a few chunks,
    not copies of the whole table (it runs when memory is short, on the device where the table
    lives).

    Returns:
        ``{"max_abs_error": ..., "mean_row_cosine": ..., "min_row_cosine": ...}``; a row whose two
        versions are both zero has cosine 1, one zero and one not has 0. Rows in ``skip_rows`` are
        left out of the cosines.
    """
    n = reference.shape[0]
    skip = set(skip_rows)
    max_abs, cos_sum, cos_min, count = 0.0, 0.0, 1.0, 0
    for start in range(0, n, chunk_rows):
        ref = reference[start : start + chunk_rows].detach().double()
        app = approx[start : start + chunk_rows].detach().to(ref.device).double()
        if ref.numel():
            max_abs = max(max_abs, float((ref - app).abs().max()))
        dot = (ref * app).sum(dim=1)
        nr, na = ref.norm(dim=1), app.norm(dim=1)
        denom = nr * na
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        cos = torch.where(denom > 0, dot / safe, 0.0)
        cos = torch.where((nr == 0) & (na == 0), torch.ones_like(cos), cos)
        local = [i - start for i in skip if start <= i < start + len(cos)]
        if local:
            keep = torch.ones(len(cos), dtype=torch.bool, device=cos.device)
            keep[local] = False
            cos = cos[keep]
        if cos.numel():
            cos_sum += float(cos.sum())
            cos_min = min(cos_min, float(cos.min()))
            count += cos.numel()
    if count == 0:
        return {"max_abs_error": max_abs, "mean_row_cosine": 1.0, "min_row_cosine": 1.0}
    return {"max_abs_error": max_abs, "mean_row_cosine": cos_sum / count, "min_row_cosine": cos_min}
