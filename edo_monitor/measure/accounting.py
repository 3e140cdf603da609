"""Attribution of memory to categories and embedding tables by walking the model's tensors.

Categories (DESIGN.md §2): ``params_bytes`` (parameters and buffers), ``grads_bytes`` (``.grad`` of
each parameter), ``optimizer_state_bytes`` (every tensor in ``optimizer.state[p]``, scalar ``step``
tensors included). Every storage is counted once, so tied weights are not counted twice.

Tiers: a tensor is on the *device tier* when it lives in GPU memory (``tensor.is_cuda``) in CUDA
mode; in CPU-budget mode every tensor is on the device tier unless an action marked it as moved to
the host (``tensor._edo_host = True``, set by the offload actions on a parameter; its gradient and
optimizer state follow it). Only device-tier bytes count against the budget.

Rows: every parameter and buffer belongs to one row, an embedding table's (its whole subtree) or
the module that holds it directly; a row gives its device-tier bytes by category and its host-tier
bytes. The category totals are the sums over the rows: one walk, so the totals of a sample and the
module rows recorded with it cannot disagree.

A module is reported as an embedding table when it is an ``nn.Embedding`` or ``nn.EmbeddingBag``
or any module with an ``edo_placement`` attribute (the EDO modules of :mod:`edo_monitor.nn`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parameter import UninitializedTensorMixin

from edo_monitor.measure.module_tree import module_label

__all__ = [
    "Accounting",
    "TableStats",
    "account",
    "is_table_module",
    "optimizer_state_bytes",
    "tensor_bytes",
    "tensor_bytes_as",
]

logger = logging.getLogger(__name__)


def is_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is an ``nn.Parameter`` or a view of one (``weight.t()``, which a
    ``Linear`` saves for backward): the memory of parameters, never saved activations, whatever
    model holds it and whenever it was made (a module added during the run)."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements: ``numel() * element_size()`` (not its whole storage).

    Sparse tensors are sized by what they store, not by their dense shape: a COO tensor as its
    ``indices()`` plus ``values()``; a compressed layout (CSR, CSC, BSR, BSC) as its compressed
    and plain index tensors plus ``values()``. The sparse gradient of an ``Embedding(1_000_000, 64,
    sparse=True)`` after 4 lookups is 4 x 8 index bytes + 4 x 64 x 4 value bytes, not 256 MB.
    A lazy module's parameter not yet materialised (``nn.LazyLinear`` before its first forward)
    and a tensor on the ``meta`` device hold no memory: 0 bytes.
    """
    layout = tensor.layout
    if layout == torch.strided:
        if isinstance(tensor, UninitializedTensorMixin) or tensor.is_meta:
            return 0
        return tensor.numel() * tensor.element_size()
    if layout == torch.sparse_coo:
        return tensor_bytes(tensor._indices()) + tensor_bytes(tensor._values())
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (tensor.crow_indices(), tensor.col_indices(), tensor.values())
    elif layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (tensor.ccol_indices(), tensor.row_indices(), tensor.values())
    else:  # a layout this torch adds later: its dense size is the safe upper bound
        return tensor.numel() * tensor.element_size()
    return sum(tensor_bytes(t) for t in parts)


def tensor_bytes_as(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    """Bytes ``tensor`` would take converted to ``dtype`` (``tensor.to(dtype)``), sized as
    :func:`tensor_bytes` does: a sparse tensor's index tensors keep their size, only its values
    change element size; a dense tensor is ``numel() * dtype's itemsize``.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    layout = tensor.layout
    if layout == torch.strided:
        return tensor.numel() * itemsize
    if layout == torch.sparse_coo:
        values = tensor._values()
    elif layout in (torch.sparse_csr, torch.sparse_bsr, torch.sparse_csc, torch.sparse_bsc):
        values = tensor.values()
    else:
        return tensor.numel() * itemsize
    return tensor_bytes(tensor) - tensor_bytes(values) + values.numel() * itemsize


def is_table_module(module: nn.Module) -> bool:
    """True for ``nn.Embedding``, ``nn.EmbeddingBag`` and edo-monitor's EDO embedding modules."""
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or hasattr(module, "edo_placement")


def _on_device_tier(tensor: torch.Tensor, owner: torch.Tensor, cuda_mode: bool) -> bool:
    if cuda_mode:
        return tensor.is_cuda
    return not getattr(owner, "_edo_host", False)


def optimizer_state_bytes(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, *, cuda_only: bool = False
) -> int:
    """Bytes of every tensor in ``optimizer.state[param]`` (0 before the first step); with
    ``cuda_only`` (the device tier in CUDA mode) only those in GPU memory: Adam's ``step`` of a
    CUDA parameter is a CPU scalar unless ``capturable`` or ``fused``."""
    state = optimizer.state.get(param)
    if not state:
        return 0
    return sum(
        tensor_bytes(v)
        for v in list(state.values())
        if isinstance(v, torch.Tensor) and (v.is_cuda or not cuda_only)
    )


@dataclass(frozen=True)
class TableStats:
    """One embedding table at one moment.

    Attributes:
        module: qualified module name in the model (``"encoder.tok_emb"``).
        kind: module class name (``"Embedding"``, ``"EmbeddingBag"``, ``"OffloadedEmbedding"`` ...).
        num_embeddings: rows. embedding_dim: columns.
        dtype: element type of the weight (``"torch.float32"``). device: the weight's device.
        placement: ``"device"``, ``"host"`` or ``"cached"`` (device row cache over a host table).
        params_bytes, grads_bytes, optimizer_state_bytes: device-tier bytes of the module's own
            parameters and buffers, their gradients and their optimizer state (a row cache: its
            device cache ``(C, D)``, its gradient and state).
        host_bytes: the module's bytes on the host tier, all categories together (an offloaded
            table's weight, gradient and state; a row cache's host table and host state).
    """

    module: str
    kind: str
    num_embeddings: int
    embedding_dim: int
    dtype: str
    device: str
    placement: str
    params_bytes: int
    grads_bytes: int
    optimizer_state_bytes: int
    host_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Device-tier params + grads + optimizer state."""
        return self.params_bytes + self.grads_bytes + self.optimizer_state_bytes


@dataclass(frozen=True)
class Accounting:
    """Bytes by category for a model and its optimizers (device tier only, see module doc).

    ``host_bytes`` is what actions moved to the host tier (all categories together). One walk
    gives both views: each category's total is the sum of that category over ``tables`` and
    ``modules`` (each tensor counted once, in the row of the first module that owns it), so
    a sample's totals and the module rows of the same accounting agree to the byte.
    """

    params_bytes: int = 0
    grads_bytes: int = 0
    optimizer_state_bytes: int = 0
    host_bytes: int = 0
    tables: tuple[TableStats, ...] = field(default_factory=tuple)
    #: the other modules that hold parameters directly (``nn.Linear`` …): module, kind and bytes
    #: by category; ``num_embeddings``/``embedding_dim`` are 0 and ``dtype`` that of the first one.
    modules: tuple[TableStats, ...] = field(default_factory=tuple)

    @property
    def total_bytes(self) -> int:
        """Device-tier params + grads + optimizer state."""
        return self.params_bytes + self.grads_bytes + self.optimizer_state_bytes


def account(
    model: nn.Module | None,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    *,
    cuda_mode: bool = False,
    include_grads: bool = True,
) -> Accounting:
    """Walk ``model`` and ``optimizers`` and return the bytes per category.

    Reads sizes only, never data, and copies the optimizer's state dicts before iterating them.
    From a thread other than the training thread, pass ``include_grads=False``.

    Args:
        model: the watched model; ``None`` gives an empty :class:`Accounting`.
        optimizers: optimizers whose state is counted (each tensor once).
        cuda_mode: tier rule, see the module docstring.
        include_grads: read ``.grad`` of each parameter. Only the training thread may: autograd
            writes ``.grad`` without holding the GIL during ``backward()``, so reading it from
            another thread at that moment is a data race (seen as crashes). Off, gradients
            count 0.
    """
    if model is None:
        return Accounting()
    walk = _Walk(optimizers, cuda_mode, include_grads)

    tables: list[TableStats] = []
    for name, module in model.named_modules():
        if not is_table_module(module):
            continue
        placement = getattr(module, "edo_placement", None)
        # an offloaded table's tensors are the host's whatever they are marked: a deepcopy or
        # load_state_dict(assign=True) makes its weight a new Parameter without the mark, and
        # a copy of the model was counted on the device
        row = _Row(walk, on_host=placement == "host" and not cuda_mode)
        for t in module.parameters(recurse=True):
            row.add_param(t)
        for b in module.buffers(recurse=True):
            row.add("params", b, b)
        if callable(getattr(module, "host_bytes", None)):  # a row cache's host table and state
            row.host += int(module.host_bytes())
        weight = _table_weight(module)
        if placement is None:
            on_device = weight is not None and (weight.is_cuda or not cuda_mode)
            placement = "device" if on_device else "host"
        tables.append(
            row.stats(
                module=module_label(name),
                kind=type(module).__name__,
                num_embeddings=int(getattr(module, "num_embeddings", 0)),
                embedding_dim=int(getattr(module, "embedding_dim", 0)),
                dtype=str(weight.dtype) if weight is not None else "",
                device=str(weight.device) if weight is not None else "",
                placement=str(placement),
            )
        )
    table_names = [name for name, module in model.named_modules() if is_table_module(module)]
    others: list[TableStats] = []
    for name, module in model.named_modules():
        own = [p for p in module._parameters.values() if p is not None]
        buffers = [b for b in module._buffers.values() if b is not None]
        if not (own or buffers) or any(_within(name, t) for t in table_names):
            continue
        row = _Row(walk)
        for p in own:
            row.add_param(p)
        for b in buffers:
            row.add("params", b, b)
        first = own[0] if own else buffers[0]
        others.append(
            row.stats(
                module=module_label(name),
                kind=type(module).__name__,
                num_embeddings=0,
                embedding_dim=0,
                dtype=str(first.dtype),
                device=str(first.device),
                placement="device" if _on_device_tier(first, first, cuda_mode) else "host",
            )
        )
    # every parameter and buffer is some module's own, inside a table or not: the rows hold every
    # tensor once, and the totals are their sums (the samples and the module rows agree)
    rows = tables + others
    return Accounting(
        params_bytes=sum(r.params_bytes for r in rows),
        grads_bytes=sum(r.grads_bytes for r in rows),
        optimizer_state_bytes=sum(r.optimizer_state_bytes for r in rows),
        host_bytes=sum(r.host_bytes for r in rows),
        tables=tuple(tables),
        modules=tuple(others),
    )


class _Walk:
    """What one :func:`account` walk shares: the tensors counted so far and how to count.

    Module level, not a class made inside :func:`account`: such a class is a reference cycle
    (a class refers to itself), and its methods' closures held the optimizers in it until the
    garbage collector ran, so an optimizer the user dropped lived on after ``del`` (a watched
    run's step count then missed the next optimizer's first step)."""

    def __init__(
        self, optimizers: Sequence[torch.optim.Optimizer], cuda_mode: bool, include_grads: bool
    ) -> None:
        self.seen: set[object] = set()
        self.optimizers, self.cuda_mode, self.include_grads = optimizers, cuda_mode, include_grads


class _Row:
    """One module's bytes: device tier by category, and the host tier."""

    def __init__(self, walk: _Walk, *, on_host: bool = False) -> None:
        self.walk, self.on_host = walk, on_host
        self.params = self.grads = self.optim = self.host = 0

    def add(self, cat: str, tensor: torch.Tensor, owner: torch.Tensor) -> None:
        n = tensor_bytes(tensor)
        key = _memory_key(tensor, n)
        if key in self.walk.seen:  # a tied or shared tensor belongs to the first module having it
            return
        self.walk.seen.add(key)
        if self.on_host or not _on_device_tier(tensor, owner, self.walk.cuda_mode):
            self.host += n
        else:
            setattr(self, cat, getattr(self, cat) + n)

    def add_param(self, p: torch.Tensor) -> None:
        self.add("params", p, p)
        grad = p.grad if self.walk.include_grads else None
        if grad is not None:
            self.add("grads", grad, p)
        for opt in self.walk.optimizers:
            state = opt.state.get(p)
            if state:
                for v in list(state.values()):
                    if isinstance(v, torch.Tensor):
                        self.add("optim", v, p)

    def stats(self, **fields: object) -> TableStats:
        return TableStats(
            params_bytes=self.params,
            grads_bytes=self.grads,
            optimizer_state_bytes=self.optim,
            host_bytes=self.host,
            **fields,  # type: ignore[arg-type]
        )


def _memory_key(tensor: torch.Tensor, nbytes: int) -> object:
    """What makes two tensors the same memory: a dense tensor's device, first byte and length
    (two ``Parameter`` objects over one storage, as ``load_state_dict(assign=True)`` of a tied
    model makes them, are one; disjoint views of one buffer are not); else the object."""
    if tensor.layout != torch.strided or nbytes == 0:
        return id(tensor)
    try:
        return (str(tensor.device), tensor.data_ptr(), nbytes)
    except RuntimeError:  # a tensor subclass without memory of its own
        return id(tensor)


def _within(name: str, ancestor: str) -> bool:
    """Whether module ``name`` is ``ancestor`` or inside it (``""`` is the root: holds all)."""
    return ancestor == "" or name == ancestor or name.startswith(ancestor + ".")


def _table_weight(module: nn.Module) -> torch.Tensor | None:
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight
    for t in module.parameters():
        return t
    for t in module.buffers():
        return t
    return None


def find_optimizers_for(
    model: nn.Module, candidates: Iterable[torch.optim.Optimizer]
) -> list[torch.optim.Optimizer]:
    """The optimizers among ``candidates`` that step at least one of ``model``'s parameters."""
    ids = {id(p) for p in model.parameters()}
    found = []
    for opt in candidates:
        if any(id(p) in ids for g in opt.param_groups for p in g["params"]):
            found.append(opt)
    return found
