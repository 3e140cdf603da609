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

The tables that compute their rows (int8, low rank: :mod:`edo_monitor.nn.compressed`; low-bit:
:mod:`edo_monitor.nn.lowbit`; shared rows: :mod:`edo_monitor.nn.sharing`) build on
:class:`_RowComputedEmbedding` here; the id, weight and argument checks they and the cache share
are :mod:`edo_monitor.nn.table_checks`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from edo_monitor.checks import whole_number
from edo_monitor.nn.table_checks import check_bag_arguments, check_ids, check_weight

__all__ = [
    "BAG_MODES",
    "EmbeddingOptions",
    "LowPrecisionEmbedding",
    "OffloadedEmbedding",
]

logger = logging.getLogger(__name__)

BAG_MODES: tuple[str, ...] = ("sum", "mean", "max")


@dataclass(frozen=True)
class EmbeddingOptions:
    """The options of an ``nn.Embedding`` / ``nn.EmbeddingBag`` that the EDO modules carry over.

    ``bag_mode`` is ``None`` for Embedding semantics, else the EmbeddingBag ``mode``.
    ``padding_idx`` is normalised to a non-negative row index (or ``None``).

    Raises:
        ValueError: ``num_embeddings`` or ``embedding_dim`` not an int >= 1, ``padding_idx`` not
            an int in ``[0, num_embeddings)``, ``max_norm`` not a number > 0, ``norm_type`` not
            a number, ``scale_grad_by_freq`` / ``sparse`` / ``include_last_offset`` not a bool,
            ``bag_mode`` not one of :data:`BAG_MODES` or ``None``, ``include_last_offset``
            without a bag mode (each named with what is allowed). NumPy's ints count as ints.
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
        n = whole_number(self.num_embeddings, "num_embeddings", 1)
        whole_number(self.embedding_dim, "embedding_dim", 1)
        if self.padding_idx is not None:
            pad = self.padding_idx
            if isinstance(pad, bool) or not hasattr(pad, "__index__") or not 0 <= pad < n:
                raise ValueError(f"padding_idx={pad!r}; expected an int in [0, {n}) or None")
        number = (int, float)
        if self.max_norm is not None and not (
            isinstance(self.max_norm, number)
            and not isinstance(self.max_norm, bool)
            and self.max_norm > 0
        ):
            raise ValueError(f"max_norm={self.max_norm!r}; expected a number > 0 or None")
        if isinstance(self.norm_type, bool) or not isinstance(self.norm_type, number):
            raise ValueError(f"norm_type={self.norm_type!r}; expected a number")
        for name in ("scale_grad_by_freq", "sparse", "include_last_offset"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}; expected True or False")
        if self.bag_mode is not None and self.bag_mode not in BAG_MODES:
            raise ValueError(f"bag_mode={self.bag_mode!r}; expected one of {BAG_MODES} or None")
        if self.include_last_offset and self.bag_mode is None:
            raise ValueError("include_last_offset=True needs a bag_mode (it is an EmbeddingBag's)")

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


def ids_in_bags(
    input: torch.Tensor,
    offsets: torch.Tensor | None,
    per_sample_weights: torch.Tensor | None,
    include_last_offset: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``input`` and ``per_sample_weights`` of a bag lookup, none of their ids kept when a 1-D
    ``input`` has no bag to go in (``offsets`` empty, or only the closing offset with
    ``include_last_offset``): ``nn.EmbeddingBag`` leaves ids outside every bag out and returns
    ``(0, D)``, but its max-mode and padded bags crash the process on such a batch (torch
    2.13, a segmentation fault), so every edo bag lookup passes its ids through here."""
    if offsets is None or input.dim() != 1 or offsets.numel() > int(include_last_offset):
        return input, per_sample_weights
    return input[:0], None if per_sample_weights is None else per_sample_weights[:0]


def _functional_lookup(
    weight: torch.Tensor,
    options: EmbeddingOptions,
    input: torch.Tensor,
    offsets: torch.Tensor | None,
    per_sample_weights: torch.Tensor | None,
) -> torch.Tensor:
    """``F.embedding`` / ``F.embedding_bag`` on ``weight`` with ``options``.

    Raises:
        TypeError: bag arguments for a table without a bag mode (:func:`check_bag_arguments`),
            ``input`` not an integer tensor.
        IndexError: an id outside ``[0, N)`` of a host ``input``, named as every edo table
            names it (:func:`check_ids`; on a device, torch's own device-side assert).
    """
    check_bag_arguments(options, offsets, per_sample_weights)
    if not isinstance(input, torch.Tensor) or input.is_cpu:
        check_ids(input, options.num_embeddings)
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
    input, per_sample_weights = ids_in_bags(
        input, offsets, per_sample_weights, options.include_last_offset
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
    ``F.embedding_bag`` over the gathered rows, so sum/mean/max, ``per_sample_weights``,
    ``include_last_offset`` and the checks of ``offsets`` behave exactly as in
    ``nn.EmbeddingBag``; with a ``padding_idx``, one zero row stands for its entries (excluded
    as there). A batch of no bags gives ``(0, D)`` (:func:`ids_in_bags`).

    Raises:
        TypeError, IndexError: ``input`` is not an integer tensor, or an id is outside
            ``[0, N)`` (:func:`check_ids`); bag arguments for a table without a bag mode
            (:func:`check_bag_arguments`).
    """
    check_bag_arguments(options, offsets, per_sample_weights)
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
    flat, per_sample_weights = ids_in_bags(flat, offsets, per_sample_weights, include_last)
    m = flat.numel()
    is_pad = flat == pad if pad is not None else None
    rows = rows_fn(flat if is_pad is None else torch.where(is_pad, torch.zeros_like(flat), flat))
    if is_pad is None:  # nn.EmbeddingBag's own call over the gathered rows
        return F.embedding_bag(
            torch.arange(m, device=flat.device),
            rows,
            offsets,
            mode=options.bag_mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=include_last,
        )
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
        if not isinstance(input, torch.Tensor):
            check_ids(input, self.options.num_embeddings)  # a TypeError naming it
        input = input.to(host)  # the ids are checked there (_functional_lookup)
        if offsets is not None:
            offsets = offsets.to(host)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(host)
        out = _functional_lookup(self.weight, self.options, input, offsets, per_sample_weights)
        return out.to(self.output_device, non_blocking=True)


class _StoredForm:
    """Mixed into the tables whose stored dtype is their compression (fp16 / bf16 weights, int8
    and low-bit codes with their scales) and whose results come out as ``output_dtype``.

    ``model.to(dtype)``, ``.double()``, ``.half()`` change ``output_dtype`` (the next layer gets
    the model's dtype, as from a plain table) and leave the stored tensors' dtypes as they are;
    a device move moves them. Converted, the results kept the old dtype (the next layer failed:
    "mat1 and mat2 must have the same dtype"), a float32 row scale under ``.half()`` underflowed
    to 0 (small rows read back zero), and a bf16 weight under ``.double()`` lost its saving.
    """

    output_dtype: torch.dtype

    @staticmethod
    def result_dtype(dtype: object) -> torch.dtype:
        """``dtype`` checked as a table's ``output_dtype``.

        Raises:
            ValueError: not a floating-point ``torch.dtype``.
        """
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"output_dtype={dtype!r}; expected a floating-point torch.dtype")
        return dtype

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        stored = [*self._buffers.values(), *self._parameters.values()]  # type: ignore[attr-defined]
        device = next((t.device for t in stored if t is not None), torch.device("cpu"))
        probe = fn(torch.empty(0, dtype=self.output_dtype, device=device))
        if probe.is_floating_point():
            self.output_dtype = probe.dtype

        def keep_form(t: torch.Tensor) -> torch.Tensor:
            """``fn(t)`` where it keeps ``t``'s dtype (a device move), else ``t`` moved only:
            ``.float()`` of a float32 model cast a bf16 weight to float32 (its saving gone, and
            Adam's bf16 state then failed the step)."""
            moved = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            return fn(t) if moved.dtype == t.dtype else t.to(moved.device)

        return super()._apply(keep_form, recurse)  # type: ignore[misc]

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Refuse, loading nothing of this table, a state dict whose tensor for one of its integer
        codes (int8's ``weight``, the low-bit ``codes``) is of another dtype: torch's load casts
        it, so the uncompressed table's float ``weight`` became truncated int8 codes, the table
        garbage even though the load then raised about the missing ``row_scale`` (and silently
        with ``strict=False``). ``load_state_dict`` raises with the message, strict or not."""
        own = {**self._buffers, **self._parameters}  # type: ignore[attr-defined]
        for name, stored in own.items():
            given = state_dict.get(prefix + name)
            if stored is None or stored.is_floating_point() or not isinstance(given, torch.Tensor):
                continue
            if given.dtype != stored.dtype:
                error_msgs.append(
                    f"{prefix}{name}: {type(self).__name__} stores {stored.dtype} codes there, "
                    f"the state dict holds {given.dtype} (a state dict of the table before it "
                    "was compressed does not load into the compressed one)"
                )
                return
        super()._load_from_state_dict(  # type: ignore[misc]
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


class LowPrecisionEmbedding(_StoredForm, _EdoEmbedding):
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
        self.output_dtype = _StoredForm.result_dtype(output_dtype)

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
