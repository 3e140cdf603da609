"""The row cache's drop-ins: :class:`CachedEmbedding` for ``nn.Embedding`` and
:class:`CachedEmbeddingBag` for ``nn.EmbeddingBag`` (the same arguments, plus ``cache_rows`` and
the cache's options), and their ``from_pretrained``; the cache itself is
:class:`~edo_monitor.nn.cached.CachedTable`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from edo_monitor.nn.cache_parts import _check_bag_mode, _initial_weight, _options
from edo_monitor.nn.cached import CachedTable

__all__ = ["CachedEmbedding", "CachedEmbeddingBag", "attach_cached_tables"]


def attach_cached_tables(model: torch.nn.Module, optimizers: Sequence[Any]) -> list[str]:
    """Attach every row-cached table of ``model`` to the optimizer that steps its weight.

    A model the agent converted stays converted after ``watch()``; an optimizer built from its
    ``parameters()`` afterwards holds each cache's row buffer too, and torch refuses to load a
    checkpoint into it ("doesn't match the size of optimizer's group") until the table is
    attached (:meth:`CachedTable.attach`). Call this before ``optimizer.load_state_dict``; the
    Lightning callback calls it at the start of each fit.

    Args:
        model: the model, searched with ``modules()``.
        optimizers: the optimizers; objects that are not a ``torch.optim.Optimizer`` (a
            framework's wrapper) are skipped, and so is a table no optimizer steps.

    Returns:
        The names of the tables attached (``named_modules`` names), in model order.
    """
    attached = []
    opts = [o for o in optimizers if isinstance(o, torch.optim.Optimizer)]
    for name, module in model.named_modules():
        if not isinstance(module, CachedTable):
            continue
        for opt in opts:
            if any(p is module.weight for g in opt.param_groups for p in g["params"]):
                module.attach(opt)  # already attached to it: nothing to do
                attached.append(name)
                break
    return attached


class CachedEmbedding(CachedTable):
    """Drop-in ``nn.Embedding``: rows on the host, ``cache_rows`` of them cached on ``device``.

    ``CachedEmbedding(num_embeddings, embedding_dim, cache_rows, padding_idx=None, max_norm=None,
    norm_type=2.0, scale_grad_by_freq=False, sparse=False, _weight=None, _freeze=False,
    device=None, dtype=None, *, policy="lfu", block_rows=1, overflow="grow",
    id_frequencies=None)``. The table is initialised as ``nn.Embedding`` does (``N(0, 1)``,
    padding row zero) unless ``_weight`` is given. ``forward(input)`` with ``input`` ``(*)`` int64
    returns ``(*, embedding_dim)``. ``sparse=True`` raises ``ValueError`` (refused by name).
    The table's gradient is ``batch_rows.grad`` ``(U, D)`` (the rows touched since the step);
    ``weight.grad`` stays ``None``, so clip or read gradients over ``parameters()``, never
    ``weight`` alone (``clip_grad_norm_(table.weight, 1.0)`` sees none and clips nothing).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        cache_rows: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        _freeze: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **cache_options: Any,
    ) -> None:
        options = _options(
            num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
            scale_grad_by_freq, sparse, None, False,
        )  # fmt: skip
        weight = _initial_weight(options, _weight, dtype)
        super().__init__(
            options,
            weight,
            cache_rows,
            device=device if device is not None else "cpu",
            requires_grad=not _freeze,
            **cache_options,
        )

    @classmethod
    def from_pretrained(
        cls,
        embeddings: torch.Tensor,
        cache_rows: int,
        freeze: bool = True,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        **cache_options: Any,
    ) -> CachedEmbedding:
        """As ``nn.Embedding.from_pretrained``, with ``cache_rows`` rows cached: the table is
        ``embeddings`` ``(N, D)`` (copied to host memory; trainable when ``freeze=False``).

        Raises:
            ValueError: ``embeddings`` not 2-dimensional, or a bad option (named).
        """
        n, d = _table_shape(embeddings)
        return cls(
            n, d, cache_rows, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse,
            _weight=embeddings, _freeze=freeze, **cache_options,
        )  # fmt: skip


class CachedEmbeddingBag(CachedTable):
    """Drop-in ``nn.EmbeddingBag`` over a host table with ``cache_rows`` cached on ``device``.

    ``CachedEmbeddingBag(num_embeddings, embedding_dim, cache_rows, max_norm=None, norm_type=2.0,
    scale_grad_by_freq=False, mode="mean", sparse=False, _weight=None, include_last_offset=False,
    padding_idx=None, device=None, dtype=None, *, policy, block_rows, overflow, id_frequencies)``.
    ``forward(input, offsets=None, per_sample_weights=None)`` returns ``(B, embedding_dim)``.
    Gradients as for :class:`CachedEmbedding` (``batch_rows.grad``; ``weight.grad`` stays
    ``None``).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        cache_rows: int,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **cache_options: Any,
    ) -> None:
        options = _options(
            num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
            scale_grad_by_freq, sparse, _check_bag_mode(mode), include_last_offset,
        )  # fmt: skip
        weight = _initial_weight(options, _weight, dtype)
        super().__init__(
            options,
            weight,
            cache_rows,
            device=device if device is not None else "cpu",
            **cache_options,
        )

    @classmethod
    def from_pretrained(
        cls,
        embeddings: torch.Tensor,
        cache_rows: int,
        freeze: bool = True,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        **cache_options: Any,
    ) -> CachedEmbeddingBag:
        """As ``nn.EmbeddingBag.from_pretrained``, with ``cache_rows`` rows cached: the table is
        ``embeddings`` ``(N, D)`` (copied to host memory; trainable when ``freeze=False``).

        Raises:
            ValueError: ``embeddings`` not 2-dimensional, or a bad option (named).
        """
        n, d = _table_shape(embeddings)
        return cls(
            n, d, cache_rows, max_norm, norm_type, scale_grad_by_freq, mode, sparse, embeddings,
            include_last_offset, padding_idx, requires_grad=not freeze, **cache_options,
        )  # fmt: skip


def _table_shape(embeddings: torch.Tensor) -> tuple[int, int]:
    """``(N, D)`` of a pretrained table; ``ValueError`` naming any other shape."""
    if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2:
        shape = tuple(embeddings.shape) if isinstance(embeddings, torch.Tensor) else embeddings
        raise ValueError(f"embeddings must be a 2-dimensional tensor (N, D), got {shape!r}")
    return int(embeddings.shape[0]), int(embeddings.shape[1])
