"""The lossy tables that compute their rows: int8 rows and low-rank factors, and the error measure.

* :class:`Int8RowwiseEmbedding` — a frozen table as int8 rows with one fp32 scale per row
  (``row = int8_row * scale``, ``scale = max|row| / 127``).
* :class:`LowRankEmbedding` — ``weight ≈ left @ right`` with ``left`` ``(N, k)`` and ``right``
  ``(k, D)`` from a truncated SVD; trainable or frozen.
* :func:`row_error` — how far a compressed table is from the one it replaced.

Both tables keep the semantics of the module they replace (see :mod:`edo_monitor.nn.embedding`) and
the ``padding_idx`` row bit-exact in a ``padding_row`` buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from edo_monitor.nn.embedding import EmbeddingOptions, _RowComputedEmbedding, _StoredForm
from edo_monitor.nn.table_checks import check_finite, check_weight, exact_padding_row

__all__ = [
    "Int8RowwiseEmbedding",
    "LowRankEmbedding",
    "dequantize_int8_rowwise",
    "quantize_int8_rowwise",
    "row_error",
]


def quantize_int8_rowwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric row-wise int8 quantisation.

    Args:
        weight: ``(N, D)`` floating tensor.

    Returns:
        ``(q, scale)``: ``q`` ``(N, D)`` int8 in [-127, 127] and ``scale`` ``(N,)`` float32 with
        ``row ≈ q * scale``; an all-zero row gets scale 0 and is reconstructed exactly.

    Raises:
        ValueError: a value that is not finite (inf, NaN: :func:`check_finite`), or one
            beyond float32's range (a float64 table's): its row's scale cannot be stored.
    """
    w = weight.detach()
    check_finite(w, "int8 rows with a scale")
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


class Int8RowwiseEmbedding(_StoredForm, _RowComputedEmbedding):
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
        self.output_dtype = _StoredForm.result_dtype(output_dtype)

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
    exact in the ``padding_row`` buffer (zeros when none is given) and gets no gradient.
    ``max_norm``, ``sparse`` and, on trainable factors, ``scale_grad_by_freq`` are refused
    (``ValueError``): they were ignored.
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
        self.register_buffer("padding_row", exact_padding_row(options, padding_row, left))

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
                options' shape (:func:`check_weight`) or holding a value that is not finite,
                or beyond float32's range (:func:`check_finite`).
        """
        check_weight(weight, options)
        n, d = weight.shape
        if isinstance(rank, bool) or not hasattr(rank, "__index__") or not 1 <= rank <= min(n, d):
            raise ValueError(f"rank={rank!r}; expected an int in [1, {min(n, d)}]")
        rank = int(rank)
        check_finite(weight, "a low-rank factorisation")
        w = weight.detach().float()
        if weight.element_size() > w.element_size():  # a float64 value beyond float32's range
            check_finite(w, "a low-rank factorisation in float32")
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
            worst = float((ref - app).abs().max())  # NaN where a value is NaN
            max_abs = worst if worst != worst or worst > max_abs else max_abs
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
            low = float(cos.min())
            cos_min = low if low != low or low < cos_min else cos_min
            count += cos.numel()
    if count == 0:
        return {"max_abs_error": max_abs, "mean_row_cosine": 1.0, "min_row_cosine": 1.0}
    return {"max_abs_error": max_abs, "mean_row_cosine": cos_sum / count, "min_row_cosine": cos_min}
