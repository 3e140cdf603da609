"""Low-bit frozen tables: group-wise int4 / int2, 2:8 structured sparsity + int2, per-row precision.

Every format here stores a frozen ``(N, D)`` table and reconstructs looked-up rows on the fly
(Embedding and EmbeddingBag semantics as in :mod:`edo_monitor.nn.embedding`; the ``padding_idx``
row kept exact in a ``padding_row`` buffer).

**Group-wise affine quantisation** (:func:`quantize_groupwise`). A row is cut into groups of
``group_size`` consecutive columns (the last group padded by repeating the row's last value, so the
padding never widens a group's range). Each group gets a float16 ``scale`` ``s`` and a float16
zero-point ``z`` (the group's offset in value units, ``z ≤ min``) and every value is stored as a
``bits``-bit code ``q = round((x − z) / s)`` in ``[0, 2^bits − 1]``; ``x̂ = q·s + z``. ``z`` is the
group minimum rounded *down* to float16 and ``s = (max − z) / (2^bits − 1)`` rounded *up* to
float16, so every value of the group lies on ``[z, z + (2^bits − 1) s]`` and the round-trip error is
at most ``s / 2`` per element (plus float32 rounding of ``q·s + z``). Codes are packed
little-endian into bytes: two int4 or four int2 per byte (:func:`pack_bits`). Bytes of a table:
``N·ceil(D/g)·g·bits/8`` codes + ``N·ceil(D/g)·4`` scales and zero-points (+ the padding row),
``g`` never wider than the row rounded up to 8 columns (a group of 64 on a 32-column table would
pad every row to 64: int4 at int8's bytes).
Values that are not finite, or beyond float16's range (``|x| > 65504``: float16 scales cannot
describe them), make :func:`quantize_groupwise` raise ``ValueError``.

**2:8 structured sparsity + int2** (:func:`sparsify_2of8`). In every block of 8 consecutive
columns the 2 values of largest magnitude are kept (ties: the lower column), the other 6 are zero.
The kept values are quantised group-wise at 2 bits (a group's scale and zero-point over its kept
values only), and each kept value's position in its block is stored as a 3-bit index: per block
``2 × 2 + 2 × 3 = 10`` bits. ``group_size`` must be a multiple of 8.

**Per-row precision** (:class:`PerRowPrecisionEmbedding`): the rows in ``full_ids`` keep the
table's dtype, the other rows are a group-wise low-bit table of their own (``N − K`` rows); a
looked-up id finds its place with one ``searchsorted`` over the ``K`` sorted ``full_ids`` (no
``(N,)`` map is stored). Bytes: ``K·D·itemsize + K·8`` + the low-bit part.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F  # noqa: N812

from edo_monitor.checks import int_choice, whole_number
from edo_monitor.nn.embedding import EmbeddingOptions, _RowComputedEmbedding, _StoredForm
from edo_monitor.nn.table_checks import check_finite, check_weight, id_list

__all__ = [
    "LOW_BITS",
    "SPARSE_BLOCK",
    "GroupQuantized",
    "GroupwiseEmbedding",
    "PerRowPrecisionEmbedding",
    "Sparse2of8Embedding",
    "SparseQuantized",
    "dequantize_groupwise",
    "dequantize_sparse_2of8",
    "groupwise_bytes",
    "pack_bits",
    "quantize_groupwise",
    "sparse_2of8_bytes",
    "sparsify_2of8",
    "unpack_bits",
]

logger = logging.getLogger(__name__)

#: Bit widths of the group-wise codes.
LOW_BITS: tuple[int, ...] = (2, 4)
#: Block of the structured sparsity (2 kept of every 8).
SPARSE_BLOCK = 8
_SPARSE_KEEP = 2
_POSITION_BITS = 3
_SCALE_BYTES = 2  # float16 scale
_ZERO_BYTES = 2  # float16 zero-point
_FP16_MAX = 65504.0
_CHUNK_ROWS = 4096  # rows quantised / reconstructed at a time


def _check_group(bits: int, group_size: int, d: int) -> int:
    """The group size a ``d``-column table is stored with: ``group_size``, but never wider
    than the row rounded up to 8 columns (a wider group padded every row to it: int4 on 32
    columns took the bytes of int8). Raises ``ValueError`` naming a bad ``bits`` or size."""
    int_choice(bits, "bits", LOW_BITS)
    group_size = whole_number(group_size, "group_size", 8)
    if group_size % 8:
        raise ValueError(f"group_size={group_size}; expected a multiple of 8")
    return min(group_size, max(8, -(-d // 8) * 8))


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``bits``-bit fields into bytes, little-endian (field 0 in the lowest bits of byte 0).

    Args:
        codes: ``(N, F)`` integer tensor with values in ``[0, 2^bits)``.
        bits: field width, 1..8.

    Returns:
        ``(N, ceil(F·bits / 8))`` uint8; with ``bits = 4`` byte ``j`` is
        ``codes[2j] | codes[2j+1] << 4``, with ``bits = 2`` four fields a byte.
    """
    n, f = codes.shape
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    bit = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # (N, F, bits)
    flat = bit.reshape(n, f * bits)
    pad = (-flat.shape[1]) % 8
    if pad:
        flat = F.pad(flat, (0, pad))
    weights = 1 << torch.arange(8, device=codes.device, dtype=torch.int32)
    # explicit sizes, never -1: with no rows (an empty batch of ids) -1 is ambiguous
    return (flat.reshape(n, flat.shape[1] // 8, 8) * weights).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, fields: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``(N, B)`` uint8 → ``(N, fields)`` int64 (``N`` may be 0:
    an empty batch of ids gives ``(0, fields)``)."""
    n, width = packed.shape
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    bit = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # (N, B, 8)
    flat = bit.reshape(n, width * 8)[:, : fields * bits].reshape(n, fields, bits)
    weights = 1 << torch.arange(bits, device=packed.device, dtype=torch.int32)
    return (flat * weights).sum(-1).to(torch.long)


def _fp16_down(x: torch.Tensor) -> torch.Tensor:
    """The largest float16 ``≤ x`` (float32 in, float32 out)."""
    h = x.to(torch.float16)
    low = h.float() > x
    h = torch.where(low, torch.nextafter(h, torch.full_like(h, -float("inf"))), h)
    return h.float()


def _fp16_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest float16 ``≥ x`` (float32 in, float32 out)."""
    h = x.to(torch.float16)
    high = h.float() < x
    h = torch.where(high, torch.nextafter(h, torch.full_like(h, float("inf"))), h)
    return h.float()


def _grouped(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(N, D)`` → ``(N, G, group_size)`` float32, the last group padded with the row's last
    value."""
    w = weight.detach().float()
    n, d = w.shape
    pad = (-d) % group_size
    if pad:
        w = torch.cat([w, w[:, -1:].expand(n, pad)], dim=1)
    return w.reshape(n, w.shape[1] // group_size, group_size)


class GroupQuantized:
    """A group-wise quantised ``(N, D)`` table (see the module docstring).

    Attributes:
        codes: ``(N, ceil(G·g·bits/8))`` uint8, packed codes.
        scale: ``(N, G)`` float16.
        zero: ``(N, G)`` float16 zero-points (value units).
        bits, group_size, dim: the format.
    """

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bits: int,
        gs: int,
        d: int,
    ) -> None:
        self.codes, self.scale, self.zero = codes, scale, zero
        self.bits, self.group_size, self.dim = bits, gs, d

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales and zero-points."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


def _affine(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, float16 scale and zero of ``values`` ``(N, G, k)`` (one scale per ``(N, G)``)."""
    levels = (1 << bits) - 1
    if values.numel() and float(values.abs().max()) > _FP16_MAX:
        raise ValueError(
            f"a value of magnitude {float(values.abs().max()):g} exceeds float16's range "
            f"({_FP16_MAX:g}); its group scale cannot be stored"
        )
    zero = _fp16_down(values.amin(dim=-1))
    scale = _fp16_up((values.amax(dim=-1) - zero) / levels)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    q = torch.clamp(torch.round((values - zero.unsqueeze(-1)) / safe), 0, levels)
    return q.to(torch.uint8), scale.to(torch.float16), zero.to(torch.float16)


def quantize_groupwise(weight: torch.Tensor, bits: int, group_size: int = 64) -> GroupQuantized:
    """Group-wise affine quantisation of ``weight`` ``(N, D)`` (rules: module docstring).

    Raises:
        ValueError: ``bits`` not in :data:`LOW_BITS`, ``group_size`` not a positive multiple of 8,
            a value that is not finite (:func:`~edo_monitor.nn.table_checks.check_finite`) or one
            beyond float16's range.
    """
    group_size = _check_group(bits, group_size, int(weight.shape[1]))
    check_finite(weight, f"int{bits} groups")
    return _quantize_groupwise(weight, bits, group_size)


def _quantize_groupwise(weight: torch.Tensor, bits: int, group_size: int) -> GroupQuantized:
    """:func:`quantize_groupwise` of a checked table (``group_size`` checked, values finite)."""
    n, d = weight.shape
    parts = []
    for start in range(0, n, _CHUNK_ROWS):  # bounded temporaries (the bit planes are int32)
        groups = _grouped(weight[start : start + _CHUNK_ROWS], group_size)
        q, scale, zero = _affine(groups, bits)
        parts.append((pack_bits(q.flatten(1), bits), scale, zero))
    if not parts:  # no rows
        g = -(-d // group_size)
        empty = torch.zeros(0, g, dtype=torch.float16)
        parts.append((torch.zeros(0, g * group_size * bits // 8, dtype=torch.uint8), empty, empty))
    codes, scale, zero = (torch.cat([p[i] for p in parts]) for i in range(3))
    return GroupQuantized(codes, scale, zero, bits, group_size, d)


def dequantize_groupwise(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int, d: int
) -> torch.Tensor:
    """Rows from packed codes ``(M, B)``, ``scale``/``zero`` ``(M, G)`` → ``(M, d)`` float32
    (``M`` may be 0)."""
    m, g = scale.shape
    q = unpack_bits(codes, bits, g * group_size).reshape(m, g, group_size).float()
    x = q * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return x.reshape(m, g * group_size)[:, :d]


def groupwise_bytes(n: int, d: int, bits: int, group_size: int) -> int:
    """Bytes of :func:`quantize_groupwise`'s output for an ``n × d`` table (codes, scales,
    zero-points; no padding row)."""
    group_size = _check_group(bits, group_size, d)
    g = -(-d // group_size)
    return n * (-(-g * group_size * bits // 8)) + n * g * (_SCALE_BYTES + _ZERO_BYTES)


class SparseQuantized:
    """A 2:8-sparse, 2-bit table (see the module docstring).

    Attributes:
        codes: ``(N, ceil(K·2/8))`` uint8, the kept values' 2-bit codes (``K = 2·blocks``).
        positions: ``(N, ceil(K·3/8))`` uint8, each kept value's 3-bit column in its block.
        scale, zero: ``(N, G)`` float16 over the kept values of each group.
        group_size, dim: the format.
    """

    def __init__(
        self,
        codes: torch.Tensor,
        positions: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        gs: int,
        d: int,
    ) -> None:
        self.codes, self.positions, self.scale, self.zero = codes, positions, scale, zero
        self.group_size, self.dim = gs, d

    @property
    def nbytes(self) -> int:
        """Bytes of codes, positions, scales and zero-points."""
        tensors = (self.codes, self.positions, self.scale, self.zero)
        return sum(t.numel() * t.element_size() for t in tensors)


def sparsify_2of8(weight: torch.Tensor, group_size: int = 64) -> SparseQuantized:
    """Keep the 2 largest-magnitude values of every 8 columns, store them at 2 bits.

    Raises:
        ValueError: ``group_size`` not a positive multiple of 8, a value that is not finite
            (:func:`~edo_monitor.nn.table_checks.check_finite`) or one beyond float16's range.
    """
    group_size = _check_group(2, group_size, int(weight.shape[1]))
    check_finite(weight, "2:8 groups")
    return _sparsify_2of8(weight, group_size)


def _sparsify_2of8(weight: torch.Tensor, group_size: int) -> SparseQuantized:
    """:func:`sparsify_2of8` of a checked table (``group_size`` checked, values finite)."""
    n, d = weight.shape
    if n > _CHUNK_ROWS:  # bounded temporaries: one chunk of rows at a time
        chunks = [
            _sparsify_chunk(weight[s : s + _CHUNK_ROWS], group_size)
            for s in range(0, n, _CHUNK_ROWS)
        ]
        return SparseQuantized(
            torch.cat([c.codes for c in chunks]),
            torch.cat([c.positions for c in chunks]),
            torch.cat([c.scale for c in chunks]),
            torch.cat([c.zero for c in chunks]),
            group_size,
            d,
        )
    return _sparsify_chunk(weight, group_size)


def _sparsify_chunk(weight: torch.Tensor, group_size: int) -> SparseQuantized:
    """:func:`_sparsify_2of8` of at most ``_CHUNK_ROWS`` rows."""
    n, d = weight.shape
    groups = _grouped(weight, group_size)  # (N, G, g)
    g = groups.shape[1]
    blocks = groups.reshape(n, g, group_size // SPARSE_BLOCK, SPARSE_BLOCK)
    # stable top-2 by magnitude: ties go to the lower column
    order = torch.sort(blocks.abs(), dim=-1, descending=True, stable=True).indices
    pos = torch.sort(order[..., :_SPARSE_KEEP], dim=-1).values  # (N, G, b, 2), ascending
    kept = torch.gather(blocks, -1, pos).reshape(n, g, group_size // SPARSE_BLOCK * _SPARSE_KEEP)
    q, scale, zero = _affine(kept, 2)
    return SparseQuantized(
        pack_bits(q.flatten(1), 2),
        pack_bits(pos.flatten(1), _POSITION_BITS),
        scale,
        zero,
        group_size,
        d,
    )


def dequantize_sparse_2of8(
    codes: torch.Tensor,
    positions: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    d: int,
) -> torch.Tensor:
    """Rows of a :class:`SparseQuantized` slice → ``(M, d)`` float32 (dropped values zero; ``M``
    may be 0)."""
    m, g = scale.shape
    per_group = group_size // SPARSE_BLOCK * _SPARSE_KEEP
    q = unpack_bits(codes, 2, g * per_group).reshape(m, g, per_group).float()
    vals = q * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    pos = unpack_bits(positions, _POSITION_BITS, g * per_group)
    pos = pos.reshape(m, g, group_size // SPARSE_BLOCK, _SPARSE_KEEP)
    out = torch.zeros(m, g, group_size // SPARSE_BLOCK, SPARSE_BLOCK, device=codes.device)
    out.scatter_(-1, pos, vals.reshape(pos.shape))
    return out.reshape(m, g * group_size)[:, :d]


def sparse_2of8_bytes(n: int, d: int, group_size: int) -> int:
    """Bytes of :func:`sparsify_2of8`'s output for an ``n × d`` table (codes, 3-bit positions,
    scales and zero-points; no padding row)."""
    group_size = _check_group(2, group_size, d)
    g = -(-d // group_size)
    kept = g * group_size // SPARSE_BLOCK * _SPARSE_KEEP
    return n * (-(-kept * 2 // 8) + -(-kept * _POSITION_BITS // 8)) + n * g * (
        _SCALE_BYTES + _ZERO_BYTES
    )


class _FrozenLowBit(_StoredForm, _RowComputedEmbedding):
    """Shared parts: options check, exact padding row, output dtype, ``nbytes``."""

    def __init__(
        self, weight: torch.Tensor, options: EmbeddingOptions, output_dtype: torch.dtype
    ) -> None:
        check_weight(weight, options)
        # once, over the whole table: its rows' own numbers (the quantisers below are not
        # asked again; per-row precision quantises a subset of the rows)
        check_finite(weight, "a low-bit table")
        super().__init__(options)
        if options.padding_idx is not None:
            self.register_buffer("padding_row", weight.detach()[options.padding_idx].clone())
        else:
            self.padding_row = None
        self.output_dtype = _StoredForm.result_dtype(output_dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer (codes, scales, zero-points, positions, full rows, padding row)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def dequantized(self) -> torch.Tensor:
        """The reconstructed table ``(N, D)`` in ``output_dtype`` (padding row exact)."""
        ids = torch.arange(self.options.num_embeddings, device=self.padding_row_device())
        w = torch.cat([self._rows(c) for c in ids.split(_CHUNK_ROWS)])
        if self.padding_row is not None:
            w[self.options.padding_idx] = self.padding_row.to(w.dtype)
        return w

    def padding_row_device(self) -> torch.device:
        """Device of the stored buffers."""
        return next(self.buffers()).device


class GroupwiseEmbedding(_FrozenLowBit):
    """A frozen table as group-wise ``bits``-bit codes (:func:`quantize_groupwise`).

    Args:
        weight: the float table ``(N, D)`` (not kept).
        options: the replaced module's options (``max_norm`` raises ``ValueError``).
        bits: 4 or 2. group_size: columns per scale/zero-point (a multiple of 8).
        output_dtype: dtype of the results.

    Buffers: ``codes`` uint8, ``scale`` and ``zero`` float16 ``(N, G)``, ``padding_row``.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        options: EmbeddingOptions,
        bits: int,
        group_size: int = 64,
        output_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(weight, options, output_dtype)  # values checked there
        qt = _quantize_groupwise(weight, bits, _check_group(bits, group_size, weight.shape[1]))
        self.bits, self.group_size = bits, qt.group_size
        self.register_buffer("codes", qt.codes)
        self.register_buffer("scale", qt.scale)
        self.register_buffer("zero", qt.zero)

    def _rows(self, idx: torch.Tensor) -> torch.Tensor:
        rows = dequantize_groupwise(
            self.codes[idx],
            self.scale[idx],
            self.zero[idx],
            self.bits,
            self.group_size,
            self.embedding_dim,
        )
        return rows.to(self.output_dtype)


class Sparse2of8Embedding(_FrozenLowBit):
    """A frozen table as 2:8 structured-sparse 2-bit values (:func:`sparsify_2of8`).

    Buffers: ``codes``, ``positions`` uint8, ``scale`` and ``zero`` float16 ``(N, G)``,
    ``padding_row``. Args as :class:`GroupwiseEmbedding` (no ``bits``).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        options: EmbeddingOptions,
        group_size: int = 64,
        output_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(weight, options, output_dtype)  # values checked there
        st = _sparsify_2of8(weight, _check_group(2, group_size, weight.shape[1]))
        self.group_size = st.group_size
        self.register_buffer("codes", st.codes)
        self.register_buffer("positions", st.positions)
        self.register_buffer("scale", st.scale)
        self.register_buffer("zero", st.zero)

    def _rows(self, idx: torch.Tensor) -> torch.Tensor:
        rows = dequantize_sparse_2of8(
            self.codes[idx],
            self.positions[idx],
            self.scale[idx],
            self.zero[idx],
            self.group_size,
            self.embedding_dim,
        )
        return rows.to(self.output_dtype)


class PerRowPrecisionEmbedding(_FrozenLowBit):
    """A frozen table whose ``full_ids`` rows keep full precision, the rest group-wise low-bit.

    Args:
        weight: the float table ``(N, D)`` (not kept).
        full_ids: ``(K,)`` ids that keep ``weight``'s dtype (any order, duplicates ignored; a
            tensor or a sequence of ints: :func:`~edo_monitor.nn.table_checks.id_list`, which
            raises ``TypeError`` for floats or a boolean mask, ``ValueError`` outside ``[0, N)``).
        options, bits, group_size, output_dtype: as :class:`GroupwiseEmbedding`.

    Buffers: ``full_ids`` ``(K,)`` int64 sorted, ``full_rows`` ``(K, D)`` in ``weight.dtype``, the
    low-bit ``codes``/``scale``/``zero`` of the other ``N − K`` rows in id order, ``padding_row``.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        full_ids: torch.Tensor,
        options: EmbeddingOptions,
        bits: int = 4,
        group_size: int = 64,
        output_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(weight, options, output_dtype)
        w = weight.detach()
        n = w.shape[0]
        ids = torch.unique(id_list(full_ids, "full_ids", n, w.device))
        low = torch.ones(n, dtype=torch.bool, device=w.device)
        low[ids] = False
        qt = _quantize_groupwise(w[low], bits, _check_group(bits, group_size, w.shape[1]))
        self.bits, self.group_size = bits, qt.group_size
        self.register_buffer("full_ids", ids)
        self.register_buffer("full_rows", w[ids].clone())
        self.register_buffer("codes", qt.codes)
        self.register_buffer("scale", qt.scale)
        self.register_buffer("zero", qt.zero)

    def _rows(self, idx: torch.Tensor) -> torch.Tensor:
        k = self.full_ids.numel()
        before = torch.searchsorted(self.full_ids, idx)  # full ids below idx
        at = before.clamp(max=max(k - 1, 0))
        is_full = (self.full_ids[at] == idx) if k else torch.zeros_like(idx, dtype=torch.bool)
        slot = (idx - before).clamp(0, max(self.codes.shape[0] - 1, 0))
        out = torch.empty(
            *idx.shape, self.embedding_dim, dtype=self.output_dtype, device=idx.device
        )
        if self.codes.shape[0]:
            low = dequantize_groupwise(
                self.codes[slot],
                self.scale[slot],
                self.zero[slot],
                self.bits,
                self.group_size,
                self.embedding_dim,
            )
            out.copy_(low.to(self.output_dtype))
        if k:
            full = self.full_rows[at].to(self.output_dtype)
            out = torch.where(is_full.unsqueeze(-1), full, out)
        return out
