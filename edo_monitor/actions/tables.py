"""Helpers of the table actions: finding tables, sharing checks, module swaps, optimizer edits."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from edo_monitor.decide.plans import NOT_YET_KNOWN, ROOT_TABLE_REASON, TABLE_BLOCKERS
from edo_monitor.measure.accounting import optimizer_state_bytes, tensor_bytes
from edo_monitor.measure.module_hooks import is_agent_hook
from edo_monitor.measure.module_tree import module_label

__all__ = [
    "ReplacedForward",
    "TableCandidate",
    "convert_optimizer_state",
    "device_tables",
    "grad_edit_blocker",
    "optimizer_blocker",
    "optimizer_holders",
    "outside_use_blocker",
    "replace_module",
    "replace_param_in_optimizers",
    "sharing_users",
    "tied_blocker",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TableCandidate:
    """A plain ``nn.Embedding`` / ``nn.EmbeddingBag`` on the device tier.

    ``name`` is its qualified name as refusals and plans show it (``<model>`` when the table is
    the model itself: :func:`~edo_monitor.decide.plans.module_label`; no action takes that one,
    :func:`tied_blocker`).
    ``params_bytes`` and ``optimizer_state_bytes`` are its weight's bytes now; ``grads_bytes`` is
    the gradient it has at a step's peak: for a dense trainable weight its own size (a gradient of
    that shape and dtype appears at every backward), else 0. It is derived, never read from
    ``.grad``: plans run on the sampler thread while autograd may be writing ``.grad``.
    """

    name: str
    module: nn.Module
    weight: nn.Parameter
    params_bytes: int
    grads_bytes: int
    optimizer_state_bytes: int

    @property
    def total_bytes(self) -> int:
        """params + grads + optimizer state."""
        return self.params_bytes + self.grads_bytes + self.optimizer_state_bytes


def device_tables(
    model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], cuda_mode: bool
) -> list[TableCandidate]:
    """Plain embedding tables whose weight is on the device tier, largest ``total_bytes`` first."""
    out = []
    for name, module in model.named_modules():
        if type(module) not in (nn.Embedding, nn.EmbeddingBag):
            continue
        w = module.weight
        on_device = w.is_cuda if cuda_mode else not getattr(w, "_edo_host", False)
        if not on_device:
            continue
        ob = sum(optimizer_state_bytes(opt, w, cuda_only=cuda_mode) for opt in optimizers)
        # never read w.grad here: plans are made on the sampler thread, and autograd writes .grad
        # without the GIL during backward (reading it concurrently corrupts memory)
        dense_trainable = w.requires_grad and not getattr(module, "sparse", False)
        gb = tensor_bytes(w) if dense_trainable else 0
        out.append(TableCandidate(module_label(name), module, w, tensor_bytes(w), gb, ob))
    out.sort(key=lambda c: c.total_bytes, reverse=True)
    return out


def sharing_users(model: nn.Module, module: nn.Module, param: nn.Parameter) -> list[str]:
    """Names of other modules that hold ``param`` as one of their own parameters (tied weights)."""
    users = []
    for name, m in model.named_modules(remove_duplicate=False):
        if m is module:
            continue
        if any(p is param for p in m._parameters.values()):
            users.append(f"{module_label(name)} ({type(m).__name__})")
    return users


def tied_blocker(model: nn.Module, module: nn.Module, param: nn.Parameter) -> str | None:
    """Why no table action may take ``module`` (whose weight is ``param``), or ``None``: the
    table is ``model`` itself (a bare ``nn.Embedding`` watched as the model: an action swaps a
    table for another module in its parent, :func:`replace_module`, and the model has no parent
    here; deciding it only made the action fail and be rolled back), another module of
    ``model`` holds ``param`` too (tied weights: :func:`sharing_users`), or ``param`` has
    gradient hooks (``register_hook``: a table action makes a new weight, which they would not
    follow: a gradient scaled or masked by one would silently train unscaled). Each table action
    asks it first; its reason begins with one of
    :data:`~edo_monitor.decide.plans.TABLE_BLOCKERS`, so ``explain`` rules out every remedy on
    that table."""
    if module is model:
        return ROOT_TABLE_REASON
    if param._backward_hooks:
        return (
            f"{TABLE_BLOCKERS[3]} (register_hook): a table action makes a new weight, and the "
            "hooks would not follow it"
        )
    if module._backward_hooks or module._backward_pre_hooks:
        return (
            f"{TABLE_BLOCKERS[4]} (register_full_backward_hook): a table action puts a new "
            "module in its place, which would not call them"
        )
    users = sharing_users(model, module, param)
    return f"{TABLE_BLOCKERS[0]} {', '.join(users)}" if users else None


def outside_use_blocker(profile: object, table: str) -> str | None:
    """Why a table's weight may not change dtype, shape, storage or device, or ``None``.

    A weight read outside its own module's forward (``F.linear(h, self.emb.weight)``: an output
    layer tied by use, not by ``Parameter`` identity) would meet the changed weight there: a dtype
    or device mismatch in the next step. The reads are recorded by
    :class:`edo_monitor.actions.checkpoint_activations.ActivationRecorder` over one whole step
    (``ActivationProfile.outside_uses``); without such a profile nothing is known, and the answer
    is a refusal too.

    Args:
        profile: ``ActionContext.activation_profile`` (an ``ActivationProfile`` or ``None``).
        table: the table module's qualified name.
    """
    uses = getattr(profile, "outside_uses", None)
    if uses is None:
        return (
            f"{NOT_YET_KNOWN[0]}: cannot tell whether its weight is read outside its module "
            "(one profiled step is needed)"
        )
    where = uses.get(table)
    if where:
        shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
        return f"{TABLE_BLOCKERS[1]} {table}'s forward ({shown}); changing it would break that"
    return None


def grad_edit_blocker(profile: object, table: str) -> str | None:
    """Why an action after which ``table``'s ``weight`` gets no gradient (the row cache: its
    gradient is ``batch_rows.grad``; a low-rank factorisation: the factors') may not take it, or
    ``None``: the training loop changes that gradient alone between the backward and the step
    (``ActivationProfile.grad_edits``: ``clip_grad_norm_(model.emb.weight, 1.0)``,
    ``model.emb.weight.grad.mul_(0.5)``); after the action such code would fail on a ``None``
    gradient or clip nothing. Without a recorded step nothing is known: a refusal too.

    Args:
        profile: ``ActionContext.activation_profile`` (an ``ActivationProfile`` or ``None``).
        table: the table module's qualified name.
    """
    edits = getattr(profile, "grad_edits", None)
    if edits is None:
        return (
            f"{NOT_YET_KNOWN[0]}: cannot tell whether the training loop changes its weight's "
            "gradient (one profiled step is needed)"
        )
    if table in edits:
        return (
            f"the training loop changes {table}.weight.grad itself between backward and the "
            "optimizer's step (clip_grad_norm_ or a scaling of that weight alone?); after this "
            "action the weight has no gradient, so that code would fail or clip nothing"
        )
    return None


def optimizer_holders(
    optimizers: Sequence[torch.optim.Optimizer], param: nn.Parameter
) -> list[torch.optim.Optimizer]:
    """The optimizers among ``optimizers`` with ``param`` in a param group."""
    return [o for o in optimizers if any(p is param for g in o.param_groups for p in g["params"])]


def optimizer_blocker(
    optimizers: Sequence[torch.optim.Optimizer], param: nn.Parameter
) -> str | None:
    """Why a table action may not take the table whose weight is ``param`` for the run's
    ``optimizers``, or ``None``.

    A table action converts the weight (dtype, device) and its optimizer state, or puts new
    parameters in the weight's place in the optimizers that hold it. Two cases it cannot follow:

    - a trainable weight that none of ``optimizers`` holds, while the run knows optimizers (one
      given to ``watch()`` or found at its step): another optimizer steps it (the table's own,
      not given to ``watch()``), which keeps the old weight and its state. A converted weight
      then met float32 state (bf16: a ``RuntimeError`` at its next step), new parameters were
      never trained and the old weight stayed alive (low rank, sharing: the saving not real).
      With no optimizer known at all nothing is refused here (before the first step, or a loop
      that updates the parameters itself);
    - a state tensor of a holder that is neither per-element (``param``'s shape) nor a scalar:
      Adafactor's factored ``row_var`` ``(N, 1)`` / ``col_var`` ``(1, D)``, which no conversion
      or split of rows carries (bf16 and sharing raised at the next step);
    - a holder that keeps the parameters in a list of its own beside ``param_groups`` (LBFGS's
      ``_params``): it kept stepping the old weight, and its ``state_dict()`` raised
      ``KeyError``.
    """
    holders = optimizer_holders(optimizers, param)
    if not holders and optimizers and param.requires_grad:
        return (
            "no optimizer the run knows steps it (one not given to watch() would keep the old "
            "weight and its state); pass that optimizer to watch(), or freeze the table "
            "(requires_grad_(False))"
        )
    for opt in holders:
        if hasattr(opt, "_params"):  # LBFGS: a list of its own, beside param_groups
            return (
                f"{type(opt).__name__} keeps its own list of the parameters, which a table "
                "action cannot edit"
            )
        for key, value in opt.state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != param.shape:
                return (
                    f"{type(opt).__name__} keeps state {key!r} of shape {tuple(value.shape)}, "
                    f"neither per-element {tuple(param.shape)} nor a scalar: a table action "
                    "cannot carry it"
                )
    return None


def replace_module(model: nn.Module, old: nn.Module, new: nn.Module) -> list[str]:
    """Put ``new`` wherever ``old`` is a child in ``model``'s tree; returns the places.

    ``old``'s forward pre-hooks and forward hooks (the user's: a pre-hook mapping ids, a hook
    logging or scaling the output) run around ``new``'s forward from then on, each with ``new``
    as the module, in their order (:class:`_CarriedHooks`; a handle's ``remove()`` still takes
    one off). ``old`` itself then calls ``new``: its ``forward`` becomes ``new``'s call (an
    instance attribute, undone with the rest by a :class:`~edo_monitor.actions.base.Transaction`). A
    module held outside ``model`` too (a teacher or target network sharing the table module, a
    reference the training loop kept) was left with a weight the action had changed (a row
    cache ``(C, D)``: an ``IndexError`` at its next call). A later replacement of ``new`` is
    followed the same way.

    Raises:
        ValueError: when ``old`` is ``model`` itself or is not found.
    """
    if old is model:
        raise ValueError("cannot replace the root model")
    places = []
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        for child_name, child in list(parent._modules.items()):
            if child is old:
                parent._modules[child_name] = new
                places.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    if not places:
        raise ValueError("module not found in the model")
    old.__dict__["forward"] = ReplacedForward(new)  # not a submodule: new's call
    _CarriedHooks.carry(old, new)
    return places


class ReplacedForward:
    """A replaced table module's ``forward``: the call of its :attr:`replacement`, so that a
    reference held outside the model reads the rows the model trains. The hooks carried to the
    replacement from the replaced module are skipped in that call: the replaced module's own
    call has run them (they ran twice)."""

    def __init__(self, replacement: nn.Module) -> None:
        #: the module that replaced this one (it may have been replaced in turn)
        self.replacement = replacement

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        new = self.replacement
        outer = getattr(_CarriedHooks.as_old, "module", None)
        _CarriedHooks.as_old.module = new
        try:
            return new(*args, **kwargs)
        finally:
            _CarriedHooks.as_old.module = outer


class _CarriedHooks:
    """Runs a replaced module's forward pre-hooks and forward hooks for its replacement, as
    ``nn.Module.__call__`` runs a module's own: a pre-hook's result replaces the arguments, a
    forward hook's the output. It holds the old module's hook dictionaries (not the module),
    so a hook removed through its handle is not run any more, and a model holding it pickles
    as its hooks do; a hook added to the old module later runs too. The agent's own
    dispatching hook is left out (it serves the old module). A call of the old module itself
    (a reference held outside the model) runs its hooks once, in its own call."""

    #: the replacement whose call the old module's call is making (its carried hooks skipped)
    as_old = threading.local()

    def __init__(self, old: nn.Module, post: bool) -> None:
        self.post = post
        if post:
            self.hooks, self.with_kwargs = old._forward_hooks, old._forward_hooks_with_kwargs
        else:
            self.hooks = old._forward_pre_hooks
            self.with_kwargs = old._forward_pre_hooks_with_kwargs

    @staticmethod
    def carry(old: nn.Module, new: nn.Module) -> None:
        """Register on ``new`` the runners of ``old``'s forward pre-hooks and forward hooks."""
        new.register_forward_pre_hook(_CarriedHooks(old, post=False), with_kwargs=True)
        new.register_forward_hook(_CarriedHooks(old, post=True), with_kwargs=True)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, *output: object) -> object:
        """A pre-hook's ``(module, args, kwargs)`` -> ``(args, kwargs)``; a forward hook's
        ``(module, args, kwargs, output)`` -> the output."""
        if getattr(_CarriedHooks.as_old, "module", None) is module:
            return None  # the old module's own call: its hooks ran there
        for hook_id, hook in list(self.hooks.items()):
            if is_agent_hook(hook):
                continue
            keywords = hook_id in self.with_kwargs
            if self.post:
                given = (args, kwargs) if keywords else (args,)
                got = hook(module, *given, *output)
                if got is not None:
                    output = (got,)
                continue
            got = hook(module, args, kwargs) if keywords else hook(module, args)
            if got is None:
                continue
            if keywords:
                args, kwargs = got  # torch's rule: a (args, kwargs) pair
            else:
                args = got if isinstance(got, tuple) else (got,)
        return output[0] if self.post else (args, kwargs)


def convert_optimizer_state(
    optimizers: Sequence[torch.optim.Optimizer],
    param: nn.Parameter,
    *,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Rebind every per-element state tensor of ``param`` to ``device``/``dtype`` (new tensors).

    A state tensor is per-element when it has ``param``'s shape; scalars such as Adam's ``step``
    stay as they are (on the CPU, fp32), as ``torch.optim`` expects.
    """
    for opt in optimizers:
        state = opt.state.get(param)
        if not state:
            continue
        for key, value in list(state.items()):
            if not isinstance(value, torch.Tensor) or value.shape != param.shape:
                continue
            new = value
            if dtype is not None and value.is_floating_point():
                new = new.to(dtype)
            if device is not None:
                new = new.to(device)
            if new is value:
                continue
            state[key] = new


def replace_param_in_optimizers(
    optimizers: Sequence[torch.optim.Optimizer],
    old: nn.Parameter,
    new: Sequence[nn.Parameter],
) -> int:
    """Replace ``old`` by ``new`` (possibly none) in every param group holding it; drop its state.

    The new parameters take ``old``'s place and hyper-parameters (same group); their state starts
    empty, as for a freshly added parameter. Returns how many groups changed. Lists are rebuilt,
    not edited in place, so a :class:`~edo_monitor.actions.base.Transaction` can restore them.
    """
    changed = 0
    for opt in optimizers:
        for group in opt.param_groups:
            params = group["params"]
            if not any(p is old for p in params):
                continue
            rebuilt: list[nn.Parameter] = []
            for p in params:
                if p is old:
                    rebuilt.extend(new)
                else:
                    rebuilt.append(p)
            group["params"] = rebuilt
            changed += 1
        if old in opt.state:
            del opt.state[old]
    return changed


def optimizer_group_flags(optimizers: Sequence[torch.optim.Optimizer], param: nn.Parameter) -> str:
    """``"fused"``/``"capturable"`` when a group holding ``param`` uses them, else ``""``."""
    for opt in optimizers:
        for group in opt.param_groups:
            if any(p is param for p in group["params"]):
                for flag in ("fused", "capturable"):
                    if group.get(flag):
                        return flag
    return ""
