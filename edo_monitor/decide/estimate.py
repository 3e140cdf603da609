"""Bytes an embedding table will need for training, before it is built.

:func:`estimate` counts, for one ``num_embeddings × embedding_dim`` table, the parameters, their
gradients and the optimizer's state, exactly as PyTorch's optimizers store them (dense gradients,
as ``nn.Embedding(sparse=False)`` produces). Per element of each trainable parameter tensor:

=============  ==========================================  ==========================
optimizer      state tensors the size of the parameter     scalar ``step`` tensor
=============  ==========================================  ==========================
sgd            none (``momentum=0`` keeps no state)        no
sgd-momentum   ``momentum_buffer``                         no
adam, adamw    ``exp_avg``, ``exp_avg_sq``                 yes
adagrad        ``sum``                                     yes
rmsprop        ``square_avg`` (default: no momentum,       yes
               not centered)
=============  ==========================================  ==========================

**The scalar step counter.** Adam, AdamW, Adagrad and RMSprop also keep ``state["step"]``, a
0-d float32 tensor (4 bytes) per parameter tensor. With the default options (not ``capturable``,
not ``fused``) PyTorch keeps it *on the CPU* even when the parameter is on a GPU, so it is not
device memory. The estimate therefore reports it apart, as ``step_state_bytes``:

* ``total_bytes`` = ``params_bytes + grads_bytes + optimizer_state_bytes``: the device memory of
  the table (step counters excluded). This is the headline figure, e.g. 500,000 × 12,288 float32
  with Adam: 98,304,000,000 bytes.
* ``total_with_step_bytes`` = ``total_bytes + step_state_bytes``: every byte the optimizer and
  model hold, wherever it lives. It equals, to the byte,
  :func:`edo_monitor.measure.accounting.account`'s ``total_bytes`` in CPU-budget mode after one
  optimizer step (where every tensor counts, and accounting's ``optimizer_state_bytes`` = our
  ``optimizer_state_bytes + step_state_bytes``). On CUDA, accounting's device-tier ``total_bytes``
  equals our ``total_bytes`` (the step tensors land in its ``host_bytes``).

**Compression** (the EDO strategies, see DESIGN.md §1):

* ``None``: the table in ``dtype``, trainable.
* ``"fp16"`` / ``"bf16"``: the table stored in that 16-bit type, trainable; gradients and optimizer
  state in the same type, unless ``master_weights=True``: then the optimizer also keeps an fp32
  master copy of the weights and its state in fp32 (both counted in ``optimizer_state_bytes``;
  gradients stay 16-bit). ``dtype`` is then the type the table was trained in before.
* ``"int8"``: row-wise symmetric int8 quantization: one int8 per element plus one float32 scale per
  row (``num_embeddings × 4`` bytes); no zero point/offset is stored. The quantized table is frozen:
  no gradients and no optimizer state.
* ``"lowrank:K"`` or ``("lowrank", K)``: two trainable factors ``num_embeddings × K`` and
  ``K × embedding_dim`` in ``dtype`` (two parameter tensors, so two step counters).
* ``"hash:B"`` or ``("hash", B)``: ``B × embedding_dim`` shared rows in ``dtype``, trainable
  (ids are hashed into ``B`` buckets; the hash itself stores nothing).
* ``"hash2:B"`` or ``("hash2", B)``: two hashes into the same ``B × embedding_dim`` rows, mixed by
  learned per-id weights ``num_embeddings × 2`` (two trainable tensors).
* ``"qr:R"`` or ``("qr", R)``: quotient–remainder rows, a ``ceil(num_embeddings / R) ×
  embedding_dim`` and an ``R × embedding_dim`` table (two trainable tensors).
* ``"hybrid:K:B"`` or ``("hybrid", K, B)``: ``K`` hot ids with rows of their own plus ``B``
  hashed buckets for the rest (two trainable tensors ``K × embedding_dim`` and ``B ×
  embedding_dim``), and the sorted hot ids as an int64 buffer (``K × 8`` bytes, in
  ``params_bytes``).

* ``"int4"`` / ``"int2"`` (or ``"int4:G"`` / ``"int2:G"``, group size ``G``, a multiple of 8,
  default 64, never wider than the row rounded up to 8 columns): group-wise affine codes,
  ``ceil(D/G)·G`` codes a row packed two int4 / four int2 a byte, plus a float16 scale and a
  float16 zero-point per group (4 bytes per ``G`` columns).
  Frozen: no gradients, no optimizer state.
* ``"2of8"`` (or ``"2of8:G"``): 2 of every 8 values kept, at 2 bits, each with a 3-bit position
  (10 bits per 8 columns), plus a float16 scale and zero-point per group of ``G`` columns.
  Frozen.
* ``"perrow:K"`` (or ``"perrow:K:BITS"`` / ``"perrow:K:BITS:G"``, ``BITS`` 4 or 2, default 4,
  ``G`` default 64; ``("perrow", K)``): ``K`` rows in ``dtype`` with their sorted int64 ids
  (``K × 8`` bytes) and the other rows group-wise at ``BITS`` bits in groups of ``G``. Frozen.

These are the tables of :mod:`edo_monitor.nn.lowbit`, byte for byte (padding row aside).

The sharing kinds are the tables of :mod:`edo_monitor.nn.sharing`, byte for byte.

**One count for every caller.** :func:`table_bytes` is the count itself, for any element size,
trainable or frozen, any number of per-element state tensors and per-tensor state bytes, and an
exact padding row kept in a buffer: :func:`estimate` names the optimizer, the
``compress_embedding`` and ``share_embedding`` actions pass the state the optimizers keep for
the table now (their plans and recorded savings are the bytes after the next step), and
``replay`` passes the recorded table (:mod:`edo_monitor.hindsight.recorded`).

Everything here is arithmetic; nothing touches a device, and torch is not imported (a
``torch.dtype`` is recognised when the caller has imported torch).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from edo_monitor.checks import whole_number
from edo_monitor.errors import ConfigError

__all__ = ["OPTIMIZERS", "Estimate", "TableBytes", "estimate", "table_bytes"]

logger = logging.getLogger(__name__)

# name -> (state tensors per parameter element, keeps a scalar step tensor)
_OPTIMIZER_STATE: dict[str, tuple[int, bool]] = {
    "sgd": (0, False),
    "sgd-momentum": (1, False),
    "adam": (2, True),
    "adamw": (2, True),
    "adagrad": (1, True),
    "rmsprop": (1, True),
}
OPTIMIZERS: tuple[str, ...] = tuple(_OPTIMIZER_STATE)
_OPTIMIZER_ALIASES = {
    "sgd_momentum": "sgd-momentum",
    "sgdmomentum": "sgd-momentum",
    "sgd-m": "sgd-momentum",
    "momentum": "sgd-momentum",
    "rms-prop": "rmsprop",
    "rms_prop": "rmsprop",
    "adam-w": "adamw",
    "adam_w": "adamw",
}
_STEP_TENSOR_BYTES = 4  # torch.tensor(0.0): float32 under the default dtype

_DTYPES: dict[str, tuple[str, int]] = {
    "float32": ("float32", 4),
    "fp32": ("float32", 4),
    "float": ("float32", 4),
    "float16": ("float16", 2),
    "fp16": ("float16", 2),
    "half": ("float16", 2),
    "bfloat16": ("bfloat16", 2),
    "bf16": ("bfloat16", 2),
    "float64": ("float64", 8),
    "fp64": ("float64", 8),
    "double": ("float64", 8),
}
_DTYPES_ALLOWED = "float32, float16, bfloat16, float64 (or fp32, fp16, bf16, fp64, a torch.dtype)"
_COMPRESSION_ALLOWED = (
    "None, 'fp16', 'bf16', 'int8', 'lowrank:K' / ('lowrank', K), 'hash:B' / ('hash', B), "
    "'hash2:B' / ('hash2', B), 'qr:R' / ('qr', R), 'hybrid:K:B' / ('hybrid', K, B), "
    "'int4[:G]', 'int2[:G]', '2of8[:G]' (G a multiple of 8), 'perrow:K[:BITS]'"
)
_LOWBIT_DEFAULT_GROUP = 64
_LOWBIT_BITS = {"int4": 4, "int2": 2}
# compression kinds with integer arguments -> how many
_COMPRESSION_ARGS = {
    "lowrank": 1,
    "hash": 1,
    "hash2": 1,
    "qr": 1,
    "hybrid": 2,
    "int4": 1,
    "int2": 1,
    "2of8": 1,
    "perrow": 3,
}


class _Totals:
    """The two totals of a table's byte counts (:class:`Estimate`, :class:`TableBytes`)."""

    params_bytes: int
    grads_bytes: int
    optimizer_state_bytes: int
    step_state_bytes: int

    @property
    def total_bytes(self) -> int:
        """Device bytes: params + grads + per-element optimizer state (step counters and other
        per-tensor state excluded)."""
        return self.params_bytes + self.grads_bytes + self.optimizer_state_bytes

    @property
    def total_with_step_bytes(self) -> int:
        """Every byte, step counters included: what CPU-budget accounting measures."""
        return self.total_bytes + self.step_state_bytes


@dataclass(frozen=True)
class Estimate(_Totals):
    """Bytes of one embedding table in training (see the module docstring for every rule).

    Attributes:
        num_embeddings, embedding_dim: the table's rows and columns.
        dtype: element type of the uncompressed table (``"float32"`` …).
        optimizer: canonical optimizer name (one of :data:`OPTIMIZERS`).
        compression: canonical compression (``None``, ``"fp16"``, ``"bf16"``, ``"int8"``,
            ``"lowrank:K"``, ``"hash:B"``, ``"hash2:B"``, ``"qr:R"``, ``"hybrid:K:B"``,
            ``"int4:G"``, ``"int2:G"``, ``"2of8:G"``, ``"perrow:K:BITS"``).
        master_weights: whether an fp32 master copy is kept for a 16-bit table.
        params_bytes: parameters and buffers (int8 scales included).
        grads_bytes: gradients (0 for a frozen table).
        optimizer_state_bytes: optimizer state the size of the parameters (moments, master copy);
            the scalar step counters are in ``step_state_bytes``.
        step_state_bytes: 4 bytes per parameter tensor for optimizers with a ``step`` tensor
            (a CPU tensor with PyTorch's default options).
    """

    num_embeddings: int
    embedding_dim: int
    dtype: str
    optimizer: str
    compression: str | None
    master_weights: bool
    params_bytes: int
    grads_bytes: int
    optimizer_state_bytes: int
    step_state_bytes: int

    def as_dict(self) -> dict[str, Any]:
        """The inputs and every byte count (totals included) as a plain, JSON-ready dict."""
        result = asdict(self)
        result["total_bytes"] = self.total_bytes
        result["total_with_step_bytes"] = self.total_with_step_bytes
        return result


def _positive_int(value: object, name: str) -> int:
    return whole_number(value, name, 1, error=ConfigError)


def _dtype(value: object) -> tuple[str, int]:
    torch_module = sys.modules.get("torch")  # a torch.dtype exists only once torch is imported
    if torch_module is not None and isinstance(value, torch_module.dtype):
        key = str(value).removeprefix("torch.")
    elif isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
    else:
        key = ""
    if key not in _DTYPES:
        raise ConfigError(f"dtype={value!r} is not allowed; expected one of {_DTYPES_ALLOWED}")
    return _DTYPES[key]


def _optimizer(value: object) -> str:
    key = value.strip().lower() if isinstance(value, str) else ""
    key = _OPTIMIZER_ALIASES.get(key, key)
    if key not in _OPTIMIZER_STATE:
        raise ConfigError(
            f"optimizer={value!r} is not allowed; expected one of {', '.join(OPTIMIZERS)}"
        )
    return key


def _compression(value: object) -> tuple[str | None, tuple[int, ...]]:
    """Canonical (kind, arguments): (None, ()), ("lowrank", (K,)), ("hybrid", (K, B)) …"""
    if value is None:
        return None, ()
    bad = ConfigError(f"compression={value!r} is not allowed; expected {_COMPRESSION_ALLOWED}")
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "none"):
            return None, ()
        if text in ("fp16", "float16", "half"):
            return "fp16", ()
        if text in ("bf16", "bfloat16"):
            return "bf16", ()
        if text in ("int8", "int8-rowwise", "int8_rowwise"):
            return "int8", ()
        if text in ("int4", "int2", "2of8"):
            return text, (_LOWBIT_DEFAULT_GROUP,)
        kind, *parts = (part.strip() for part in text.split(":"))
        try:
            numbers = tuple(int(part) for part in parts)
        except ValueError:
            raise bad from None
    elif isinstance(value, tuple) and value and isinstance(value[0], str):
        kind = value[0].strip().lower()
        try:
            # ints (NumPy's too); their range is checked below, by kind
            numbers = tuple(whole_number(n, "", None) for n in value[1:])
        except ValueError:
            raise bad from None
    else:
        raise bad
    if kind in ("int4", "int2", "2of8") and not numbers:
        numbers = (_LOWBIT_DEFAULT_GROUP,)
    if kind == "perrow" and len(numbers) == 1:
        numbers = (numbers[0], 4)
    if kind == "perrow" and len(numbers) == 2:
        numbers = (*numbers, _LOWBIT_DEFAULT_GROUP)
    if _COMPRESSION_ARGS.get(kind) != len(numbers):
        raise bad
    return kind, numbers


def _stored_group(cols: int, group: int) -> int:
    """The group size a ``cols``-column row is stored with: never wider than the row rounded up
    to 8 columns (as :func:`edo_monitor.nn.lowbit.quantize_groupwise` stores it; this module
    does not import torch)."""
    return min(group, max(8, -(-cols // 8) * 8))


def _lowbit_row_bytes(cols: int, bits: int, group: int) -> int:
    """Bytes of one group-wise row: packed codes + float16 scale and zero-point a group."""
    group = _stored_group(cols, group)
    groups = -(-cols // group)
    return -(-groups * group * bits // 8) + groups * 4


def _sparse_row_bytes(cols: int, group: int) -> int:
    """Bytes of one 2:8-sparse 2-bit row: codes, 3-bit positions, scale and zero-point."""
    group = _stored_group(cols, group)
    groups = -(-cols // group)
    kept = groups * group // 8 * 2
    return -(-kept * 2 // 8) + -(-kept * 3 // 8) + groups * 4


def estimate(
    num_embeddings: int,
    embedding_dim: int,
    *,
    dtype: str | torch.dtype = "float32",
    optimizer: str = "adam",
    compression: str | tuple[str, int] | None = None,
    master_weights: bool = False,
) -> Estimate:
    """Estimate the training memory of one embedding table (rules: module docstring).

    Args:
        num_embeddings: rows (a positive int).
        embedding_dim: columns (a positive int).
        dtype: element type of the table and, for low-rank and hashing, of its factors:
            float32 (default), float16, bfloat16, float64; aliases fp32/fp16/bf16/fp64, half,
            double, or a ``torch.dtype``.
        optimizer: ``"sgd"``, ``"sgd-momentum"`` (also ``"sgd_momentum"``, ``"momentum"``),
            ``"adam"``, ``"adamw"``, ``"adagrad"``, ``"rmsprop"``.
        compression: ``None``, ``"fp16"``, ``"bf16"``, ``"int8"``, ``"lowrank:K"`` or
            ``("lowrank", K)`` with ``1 <= K <= min(num_embeddings, embedding_dim)``,
            ``"hash:B"`` / ``"hash2:B"`` with ``1 <= B <= num_embeddings``, ``"qr:R"`` with
            ``1 <= R <= num_embeddings``, ``"hybrid:K:B"`` with ``0 <= K < num_embeddings`` and
            ``1 <= B <= num_embeddings - K`` (tuple forms ``("hash", B)`` … as well), ``"int4"``,
            ``"int2"``, ``"2of8"`` (``":G"`` for a group size other than 64), ``"perrow:K"`` /
            ``"perrow:K:BITS"``.
        master_weights: keep an fp32 master copy (and fp32 optimizer state) for a 16-bit
            trainable table; only allowed when the trainable storage is 16-bit.

    Returns:
        An :class:`Estimate`; all byte counts are ints.

    Raises:
        ConfigError: (a ``ValueError``) naming the bad value and what is allowed.
    """
    rows = _positive_int(num_embeddings, "num_embeddings")
    cols = _positive_int(embedding_dim, "embedding_dim")
    dtype_name, dtype_bytes = _dtype(dtype)
    opt = _optimizer(optimizer)
    if not isinstance(master_weights, bool):
        raise ConfigError(f"master_weights={master_weights!r} is not allowed; expected a bool")
    states_per_element, has_step = _OPTIMIZER_STATE[opt]
    counted = table_bytes(
        rows,
        cols,
        compression,
        element_bytes=dtype_bytes,
        state_tensors=states_per_element,
        step_bytes_per_tensor=_STEP_TENSOR_BYTES if has_step else 0,
        master_weights=master_weights,
    )
    result = Estimate(
        num_embeddings=rows,
        embedding_dim=cols,
        dtype=dtype_name,
        optimizer=opt,
        compression=counted.compression,
        master_weights=master_weights,
        params_bytes=counted.params_bytes,
        grads_bytes=counted.grads_bytes,
        optimizer_state_bytes=counted.optimizer_state_bytes,
        step_state_bytes=counted.step_state_bytes,
    )
    logger.debug("estimate: %s", result)
    return result


@dataclass(frozen=True)
class TableBytes(_Totals):
    """Bytes of one (compressed) table once an optimizer step has run on it: what
    :func:`table_bytes` returns.

    Attributes:
        compression: the canonical compression (as :attr:`Estimate.compression`).
        params_bytes: parameters and buffers (scales, ids, the padding row's buffer).
        grads_bytes: the dense gradients of the trainable tensors (0 when frozen).
        optimizer_state_bytes: the per-element optimizer state (moments, master copy).
        step_state_bytes: the optimizer's other state, per trainable tensor (Adam's ``step``).
        trainable_tensors: how many trainable parameter tensors the table has.
    """

    compression: str | None
    params_bytes: int
    grads_bytes: int
    optimizer_state_bytes: int
    step_state_bytes: int
    trainable_tensors: int


def table_bytes(
    num_embeddings: int,
    embedding_dim: int,
    compression: str | tuple[Any, ...] | None = None,
    *,
    element_bytes: int = 4,
    trainable: bool = True,
    state_tensors: int = 0,
    step_bytes_per_tensor: int = 0,
    master_weights: bool = False,
    padding_row: bool = False,
) -> TableBytes:
    """Bytes of one table under an optimizer and a compression, after the next optimizer step.

    The one count of a table's bytes: :func:`estimate` calls it with an optimizer's state by name,
    the ``compress_embedding`` and ``share_embedding`` actions with the state the optimizers keep
    for the table now, the replay with the recorded table. Rules: the module docstring.

    Args:
        num_embeddings, embedding_dim: the table's rows and columns (ints >= 1).
        compression: as :func:`estimate`'s, plus ``"perrow:K:BITS:G"`` / ``("perrow", K, BITS,
            G)`` (the low-bit rows' group size, default 64).
        element_bytes: bytes per element of the uncompressed table (4 for float32).
        trainable: whether the kinds that can train do (``None``, ``"fp16"``, ``"bf16"``, the
            low-rank factors, the shared rows): a frozen table has no gradient and no state. The
            quantised kinds (``"int8"``, ``"int4"``, ``"int2"``, ``"2of8"``, ``"perrow"``) are
            frozen whatever it says.
        state_tensors: optimizer state tensors the size of each trainable tensor (Adam 2, SGD 0;
            summed over the optimizers holding it), each in the trainable storage's dtype.
        step_bytes_per_tensor: the optimizer's other state bytes per trainable tensor (Adam's
            4-byte ``step``; 0 where not counted).
        master_weights: an fp32 master copy and fp32 state (16-bit trainable storage only).
        padding_row: the compressed module keeps the ``padding_idx`` row exact in a buffer of
            ``embedding_dim`` elements of ``element_bytes`` (every kind but ``None``/16-bit,
            whose padding row is a row of the weight).

    Returns:
        A :class:`TableBytes` (ints).

    Raises:
        ConfigError: (a ``ValueError``) a bad compression or argument, named.
    """
    rows = _positive_int(num_embeddings, "num_embeddings")
    cols = _positive_int(embedding_dim, "embedding_dim")
    kind, args = _compression(compression)
    # (elements of each trainable tensor, bytes per element of the trainable storage)
    tensors: list[int] = []
    storage_bytes = element_bytes
    params = 0
    if kind is None:
        tensors = [rows * cols]
    elif kind in ("fp16", "bf16"):
        storage_bytes = 2
        tensors = [rows * cols]
    elif kind == "int8":
        params = rows * cols + rows * 4  # int8 weights + one float32 scale per row
    elif kind in ("int4", "int2", "2of8"):
        (group,) = args
        _check_lowbit_group(compression, group)
        if kind == "2of8":
            params = rows * _sparse_row_bytes(cols, group)
        else:
            params = rows * _lowbit_row_bytes(cols, _LOWBIT_BITS[kind], group)
    elif kind == "perrow":
        k, bits, group = args
        if not 0 <= k <= rows or bits not in (2, 4):
            raise ConfigError(
                f"compression={compression!r} is not allowed; the full-precision rows K must "
                f"be between 0 and num_embeddings = {rows}, BITS 4 or 2"
            )
        _check_lowbit_group(compression, group)
        low = (rows - k) * _lowbit_row_bytes(cols, bits, group)
        params = k * cols * element_bytes + k * 8 + low
    elif kind == "lowrank":
        (k,) = args
        if not 1 <= k <= min(rows, cols):
            raise ConfigError(
                f"compression={compression!r} is not allowed; the rank K must be between 1 and "
                f"min(num_embeddings, embedding_dim) = {min(rows, cols)}"
            )
        tensors = [rows * k, k * cols]
    elif kind in ("hash", "hash2"):
        (b,) = args
        if not 1 <= b <= rows:
            raise ConfigError(
                f"compression={compression!r} is not allowed; the number of buckets B must be "
                f"between 1 and num_embeddings = {rows}"
            )
        tensors = [b * cols] if kind == "hash" else [b * cols, rows * 2]
    elif kind == "qr":
        (r,) = args
        if not 1 <= r <= rows:
            raise ConfigError(
                f"compression={compression!r} is not allowed; the number of remainders R must be "
                f"between 1 and num_embeddings = {rows}"
            )
        tensors = [-(-rows // r) * cols, r * cols]
    else:  # hybrid
        k, b = args
        if not 0 <= k < rows or not 1 <= b <= rows - k:
            raise ConfigError(
                f"compression={compression!r} is not allowed; the hot ids K must be between 0 "
                f"and num_embeddings - 1 = {rows - 1}, the buckets B between 1 and "
                f"num_embeddings - K"
            )
        tensors = [k * cols, b * cols] if k else [b * cols]  # no hot rows: no hot tensor
        params = k * 8  # the sorted hot ids, int64
    if padding_row and kind not in (None, "fp16", "bf16"):
        params += cols * element_bytes
    numel = sum(tensors)
    params += numel * storage_bytes
    if master_weights and (not tensors or not trainable or storage_bytes != 2):
        raise ConfigError(
            f"master_weights=True is not allowed with {element_bytes}-byte elements and "
            f"compression={compression!r}; it needs a trainable 16-bit table (dtype "
            "float16/bfloat16, or compression 'fp16'/'bf16')"
        )
    if not trainable:
        tensors, numel = [], 0
    if master_weights:
        state = numel * 4 + numel * 4 * state_tensors
    else:
        state = numel * storage_bytes * state_tensors
    return TableBytes(
        compression=_canonical(kind, args),
        params_bytes=params,
        grads_bytes=numel * storage_bytes,
        optimizer_state_bytes=state,
        step_state_bytes=step_bytes_per_tensor * len(tensors),
        trainable_tensors=len(tensors),
    )


def _check_lowbit_group(compression: object, group: int) -> None:
    """Refuse a low-bit group size ``group`` of ``compression`` (as the user wrote it)."""
    if group < 8 or group % 8:
        raise ConfigError(
            f"compression={compression!r} is not allowed; the group size G must be a "
            "positive multiple of 8"
        )


def _canonical(kind: str | None, args: tuple[int, ...]) -> str | None:
    """``"lowrank:8"``, ``"perrow:K:BITS"`` (``":G"`` added when not 64) …; ``None``."""
    if kind is None:
        return None
    if kind == "perrow" and args[2] == _LOWBIT_DEFAULT_GROUP:
        args = args[:2]
    return ":".join([kind, *map(str, args)])
