"""The checks the EDO tables share: the ids a lookup is given, the bag arguments, a table's
weight and its values, the id lists and padding rows a table is built with. Each refuses with a
message naming the value and what is allowed, where a wrong one failed later inside torch (or
gave wrong rows)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from edo_monitor.nn.embedding import EmbeddingOptions

__all__ = [
    "check_bag_arguments",
    "check_finite",
    "check_ids",
    "check_representable",
    "check_weight",
    "exact_padding_row",
    "id_list",
]


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


def check_bag_arguments(
    options: EmbeddingOptions,
    offsets: torch.Tensor | None,
    per_sample_weights: torch.Tensor | None,
) -> None:
    """Refuse ``offsets`` / ``per_sample_weights`` given to a table without a bag mode (one that
    replaces an ``nn.Embedding``, whose ``forward`` takes neither): it returned a row per id,
    ``(M, D)``, where the caller asked for bags.

    Raises:
        TypeError: naming the argument and the table's kind.
    """
    if options.bag_mode is not None:
        return
    for name, value in (("offsets", offsets), ("per_sample_weights", per_sample_weights)):
        if value is not None:
            raise TypeError(
                f"{name} given to a table without a bag mode (it replaces an nn.Embedding, a "
                f"row per id); {name} is only for a bag table (an nn.EmbeddingBag's, mode "
                "'sum', 'mean' or 'max')"
            )


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


def id_list(
    ids: object, name: str, n: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """``ids`` (a tensor or a sequence of ints) as a 1-D int64 tensor of ids of a table of ``n``
    rows, on ``device`` (``None``: where it is; a sequence: the CPU).

    Raises:
        TypeError: ``ids`` are not integers (floats would be truncated, a boolean mask read as
            ids 0 and 1), naming ``name``.
        ValueError: an id outside ``[0, n)``.
    """
    try:
        t = torch.as_tensor(ids, device=device)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"{name} must be integer ids, got {type(ids).__name__}: {exc}") from None
    if t.numel() == 0 and not isinstance(ids, torch.Tensor):  # [] reads as float32: no ids
        t = t.to(torch.long)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        hint = " (a boolean mask: pass mask.nonzero())" if t.dtype == torch.bool else ""
        raise TypeError(f"{name} must be integer ids{hint}, got {t.dtype}")
    t = t.detach().to(torch.long).reshape(-1)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n):
        raise ValueError(f"{name} must lie in [0, {n}); got [{int(t.min())}, {int(t.max())}]")
    return t


def exact_padding_row(
    options: EmbeddingOptions, padding_row: torch.Tensor | None, like: torch.Tensor | None
) -> torch.Tensor | None:
    """The ``(D,)`` row a table that computes its rows keeps exact for ``options.padding_idx``
    (``None`` without one): a copy of ``padding_row``, or zeros in ``like``'s dtype and device
    when it is ``None`` (as ``nn.Embedding`` starts its padding row); ``like=None``: the row is
    required.

    Raises:
        ValueError: ``padding_row`` not of shape ``(D,)``, or missing where required.
    """
    d = options.embedding_dim
    if options.padding_idx is None:
        return None
    if padding_row is None:
        if like is None:
            raise ValueError("padding_idx is set: padding_row (D,) is required")
        return like.new_zeros(d)
    if tuple(padding_row.shape) != (d,):
        raise ValueError(f"padding_row has shape {tuple(padding_row.shape)}; expected ({d},)")
    return padding_row.detach().clone()


def check_finite(weight: torch.Tensor, form: str, ids: torch.Tensor | None = None) -> None:
    """Refuse a table ``(N, D)`` holding a value that is not finite before it is compressed to
    ``form`` (named in the message): a quantised group or row spreads a NaN to its other values
    or reads it back as a number, and an SVD fails on it (``LinAlgError``). ``ids`` ``(N,)``:
    the table's rows that ``weight``'s are (a sample of them), named instead of the positions.

    Raises:
        ValueError: the first such value and its row.
    """
    if weight.numel() == 0:
        return
    bad = ~torch.isfinite(weight.detach())
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        value, at = weight[row, col].item(), row if ids is None else int(ids[row])
        raise ValueError(
            f"the table holds a value that is not finite ({value} at row {at}); {form} cannot "
            "hold it"
        )


def check_representable(weight: torch.Tensor, dtype: torch.dtype, form: str) -> None:
    """Refuse a table ``(N, D)`` that ``dtype`` cannot hold before it is converted to it
    (``form`` names the conversion): a value that is not finite (:func:`check_finite`), or one
    beyond ``dtype``'s range, which the cast turns into inf (``1e5`` in float16, whose largest
    is 65504). One ``aminmax`` over the table (no temporary of its size); the row is looked
    for only when one is found.

    Raises:
        ValueError: the first such value and its row.
    """
    if weight.numel() == 0:
        return
    w = weight.detach()
    extremes = torch.stack(torch.aminmax(w)).double()
    if not bool(torch.isfinite(extremes).all()):
        check_finite(w, form)
    if not bool(torch.isinf(extremes.to(dtype)).any()):
        return
    beyond = torch.isinf(w.to(dtype))
    row, col = (int(i) for i in beyond.nonzero()[0])
    raise ValueError(
        f"the table holds a value beyond {form}'s range ({w[row, col].item():g} at row {row}; "
        f"its largest is {torch.finfo(dtype).max:g})"
    )
