"""The action interface: context, plan, refusal, result, and the transaction keeping actions safe.

An :class:`Action` is used in two halves:

* :meth:`Action.plan` (pure read of sizes; may run on the sampler thread) returns a :class:`Plan`
  (target and estimated saving) or a :class:`Refusal` (with the reason);
* :meth:`Action.apply` (training thread, at a step boundary only) re-checks the plan, changes model
  and optimizer inside a :class:`Transaction`, and returns an :class:`ActionResult` with the bytes
  measured before and after by :func:`edo_monitor.measure.accounting.account` (plus what the
  optimizers hold for parameters no longer the model's), the duration, and for lossy actions the
  measured error. ``apply`` never raises for a failure inside the action (an optimizer still holding
  a parameter the action replaced is one, see :mod:`edo_monitor.actions.leftovers`): the model and
  optimizer are restored bit-identical and the result says ``status="failed"`` (with the
  exception kept for ``strict`` callers).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from edo_monitor.actions.leftovers import optimizer_leftovers, optimizer_only_bytes, record_params
from edo_monitor.decide.plans import Plan, Refusal
from edo_monitor.measure.accounting import Accounting, account

__all__ = [
    "Action",
    "ActionContext",
    "ActionResult",
    "InjectedFailureError",
    "OptimizerLeftoverError",
    "Plan",
    "Refusal",
    "Transaction",
]

logger = logging.getLogger(__name__)


class InjectedFailureError(RuntimeError):
    """Raised at a named stage of an action when :attr:`ActionContext.fail_at` names it (tests)."""


class OptimizerLeftoverError(RuntimeError):
    """Raised inside an action's transaction when the optimizers still hold a parameter the action
    replaced, or state a converted parameter outgrew (see :mod:`edo_monitor.actions.leftovers`);
    the action is rolled back and its result is ``"failed"`` with this message."""


@dataclass
class ActionContext:
    """What an action needs to see and change.

    Attributes:
        model: the watched model.
        optimizers: the optimizers stepping its parameters (their state moves/converts with them).
        cuda_mode: ``True`` when the model trains on CUDA (tier rule of the accounting); ``False``
            in CPU-budget mode.
        device: the training device (``torch.device("cuda:0")`` or ``"cpu"``); ``None`` = taken
            from the model's first parameter not on the CPU (a table offloaded to the host does
            not make a CUDA model's device the CPU), else ``"cpu"``.
        reserved_unallocated_bytes: latest allocator slack (``release_cache`` uses it).
        release_cache_min_bytes: below this slack ``release_cache`` is not applicable.
        activation_profile: saved-activation bytes per module from an
            :class:`edo_monitor.actions.checkpoint_activations.ActivationRecorder` run;
            ``checkpoint_activations`` needs one to plan.
        max_checkpoint_blocks: most blocks ``checkpoint_activations`` wraps in one application.
        low_rank_fraction: rank of ``compress_embedding_lowrank`` as a fraction of
            ``embedding_dim``.
        lookup_counter: an :class:`edo_monitor.measure.frequency.LookupCounter` watching the model's
            tables (``share_embedding`` takes its hot ids from it); ``None`` = no counts.
        share_hot_fraction, share_bucket_fraction: ``share_embedding``'s hot rows and buckets as
            fractions of the table's rows.
        fail_at: name of a stage at which the action raises :class:`InjectedFailureError`
            (tests of the transaction); ``None`` in normal use.
        budget_bytes, in_use_bytes: the latest reading's (``None`` without one); the row cache
            sizes itself from them.
        rearm_free_fraction: the policy's re-arm level (``cache_embedding`` frees enough to get
            back to it).
        grow_margin_fraction: ``grow_cache`` keeps ``rearm + margin`` of the budget free.
        memory_snapshot: the allocator-snapshot reader (hardware boundary: default
            ``torch.cuda.memory_snapshot`` once CUDA is initialised; tests pass recorded ones).
            ``release_cache`` estimates from it.
        host_available_bytes: host memory this process may still use (the host probe's cgroup-
            aware ``host_available_bytes``); ``None`` = read it now. Host-tier actions check
            their headroom against it.
        spill_dir: the folder of the disk tier's file (``watch(spill_dir=)``); ``None`` =
            ``spill_embedding`` is not applicable.
        grad_spent: ``grad_spent(weight)`` is ``True`` when ``weight``'s gradient is the one its
            optimizer's last step took (no backward since: the agent notes each step); ``None``
            (or ``False``): it may be waiting for that step, and a conversion keeps it.
        steps_done: step boundaries the agent has seen; ``None``: not known (a direct call).
            At 0, an optimizer not given to ``watch()`` is not known yet (it is from its
            first step).
    """

    model: nn.Module
    optimizers: Sequence[torch.optim.Optimizer] = ()
    cuda_mode: bool = False
    device: torch.device | None = None
    reserved_unallocated_bytes: int | None = None
    release_cache_min_bytes: int = 64 * 1024 * 1024
    activation_profile: Any = None
    max_checkpoint_blocks: int = 4
    low_rank_fraction: float = 0.5
    lookup_counter: Any = None
    share_hot_fraction: float = 0.05
    share_bucket_fraction: float = 0.05
    fail_at: str | None = None
    budget_bytes: int | None = None
    in_use_bytes: int | None = None
    rearm_free_fraction: float | None = None
    grow_margin_fraction: float = 0.05
    memory_snapshot: Callable[[], Any] | None = None
    host_available_bytes: int | None = None
    spill_dir: str | os.PathLike[str] | None = None
    grad_spent: Callable[[nn.Parameter], bool] | None = None
    steps_done: int | None = None

    def __post_init__(self) -> None:
        self.optimizers = tuple(self.optimizers)
        if self.device is None:
            devices = (p.device for p in self.model.parameters() if p.device.type != "cpu")
            self.device = next(devices, torch.device("cpu"))
        else:
            self.device = torch.device(self.device)

    def stage(self, name: str) -> None:
        """Mark a stage of an action; :class:`InjectedFailureError` when ``fail_at == name``."""
        if self.fail_at == name:
            raise InjectedFailureError(f"injected failure at stage {name!r}")

    def allocator_snapshot(self) -> Any:
        """An allocator snapshot (all devices' segments), or ``None`` when there is none to take
        (no reader given and CUDA not initialised: the agent never initialises CUDA)."""
        if self.memory_snapshot is not None:
            return self.memory_snapshot()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.memory_snapshot()
        return None

    def accounting(self) -> Accounting:
        """:func:`edo_monitor.measure.accounting.account` of model and optimizers under this tier
        rule."""
        return account(self.model, self.optimizers, cuda_mode=self.cuda_mode)


@dataclass(frozen=True)
class ActionResult:
    """The outcome of :meth:`Action.apply`.

    Attributes:
        action, target: as in the plan.
        status: ``"applied"``, ``"refused"`` (re-check at apply time failed; ``reason`` says why)
            or ``"failed"`` (exception mid-way; model and optimizer were restored).
        estimated_saving_bytes: the plan's estimate.
        bytes_before, bytes_after: device-tier bytes (params + grads + optimizer state, or the
            allocator's reserved bytes for ``release_cache``, or saved activations for
            ``checkpoint_activations``) measured just before and just after.
        saved_bytes: ``bytes_before - bytes_after`` (0 unless applied).
        duration_s: wall time of ``apply``.
        lossy: whether the action changes numerics.
        error: for lossy actions, ``{"max_abs_error", "mean_row_cosine", "min_row_cosine"}`` of the
            table after against before; ``None`` otherwise.
        reason: refusal or failure message; the plan's reason when applied.
        details: action-specific values (variant, dtype, rank, blocks ...).
        exception: the exception of a failed action (not serialisable; for ``strict`` re-raise).
    """

    action: str
    target: str
    status: Literal["applied", "refused", "failed"]
    estimated_saving_bytes: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    duration_s: float = 0.0
    lossy: bool = False
    error: dict[str, float] | None = None
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    exception: BaseException | None = field(default=None, compare=False, repr=False)

    @property
    def saved_bytes(self) -> int:
        """``bytes_before - bytes_after``."""
        return self.bytes_before - self.bytes_after


class Transaction:
    """Snapshot of model structure, parameter data/grads and optimizer state, restorable exactly.

    Actions never modify tensors in place: they build new tensors and rebind them (``param.data =``,
    ``module._modules[name] =``, ``optimizer.state[p][k] =``), so restoring the saved references
    gives back bit-identical values and the same ``Parameter`` objects.

    Use as a context manager: on an exception inside the block, everything is restored and the
    exception propagates.
    """

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.model = model
        self.optimizers = tuple(optimizers)
        self._modules: list[tuple[nn.Module, dict[str, Any], dict[str, Any], dict, dict]] = []
        self._params: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor | None, bool, Any]] = []
        self._optim: list[tuple[torch.optim.Optimizer, list, list[list], dict]] = []

    _MISSING: ClassVar[object] = object()

    def snapshot(self) -> None:
        """Record the current state (called by ``__enter__``)."""
        seen_params: set[int] = set()
        for module in self.model.modules():
            self._modules.append(
                (
                    module,
                    dict(module.__dict__),
                    dict(module._parameters),
                    dict(module._buffers),
                    dict(module._modules),
                )
            )
            for p in module._parameters.values():
                if p is not None and id(p) not in seen_params:
                    seen_params.add(id(p))
                    self._add_param(p)
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in seen_params:
                        seen_params.add(id(p))
                        self._add_param(p)
            states = {id(p): (p, s, dict(s)) for p, s in opt.state.items()}
            self._optim.append(
                (
                    opt,
                    list(opt.param_groups),
                    [list(g["params"]) for g in opt.param_groups],
                    states,
                )
            )

    def _add_param(self, p: nn.Parameter) -> None:
        self._params.append(
            (p, p.data, p.grad, p.requires_grad, getattr(p, "_edo_host", self._MISSING))
        )

    def restore(self) -> None:
        """Put every recorded reference back."""
        for module, attrs, params, buffers, modules in self._modules:
            module.__dict__.clear()
            module.__dict__.update(attrs)
            for live, saved in (
                (module._parameters, params),
                (module._buffers, buffers),
                (module._modules, modules),
            ):
                live.clear()
                live.update(saved)
        for p, data, grad, requires_grad, host in self._params:
            p.grad = None
            p.data = data
            p.grad = grad
            p.requires_grad_(requires_grad)
            if host is self._MISSING:
                if hasattr(p, "_edo_host"):
                    del p._edo_host
            else:
                p._edo_host = host
        for opt, groups, group_params, states in self._optim:
            opt.param_groups[:] = groups
            for g, ps in zip(groups, group_params, strict=True):
                g["params"] = ps
            opt.state.clear()
            for p, state_obj, contents in states.values():
                state_obj.clear()
                state_obj.update(contents)
                opt.state[p] = state_obj
        logger.info("restored model and optimizer state after a failed action")

    def __enter__(self) -> Transaction:
        self.snapshot()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc is not None:
            self.restore()
        return False


def find_wrapped_parallel(model: nn.Module) -> str | None:
    """Name of the DDP/FSDP wrapper class in ``model``'s tree, or of one that holds ``model``
    (``watch(net)`` while the loop trains ``DistributedDataParallel(net)``), or ``None``.

    Checks ``torch.nn.parallel.DistributedDataParallel``, ``FullyShardedDataParallel`` and
    FSDP2's ``FSDPModule`` with ``isinstance`` only (no process group is touched). FSDP's classes
    are looked up only when ``torch.distributed.fsdp`` is imported already (a model wrapped in
    them needs it): this never imports it (~1.3 s on its own), and every ``watch()`` asks. A
    wrapper outside ``model`` is looked for only while a default process group is initialised
    (no wrapper works without one): one pass over the objects the garbage collector tracks,
    remembered for ``model`` once found and repeated at most every
    :data:`OUTSIDE_RESCAN_S` seconds while none is (a table action under such a wrapper was
    applied, and its next backward failed in DDP's reducer).
    """
    classes = _parallel_classes()
    for module in model.modules():
        if isinstance(module, classes):
            return type(module).__name__
    return _wrapper_outside(model, classes)


#: Seconds between two looks for a DDP/FSDP wrapper that holds a model and had none.
OUTSIDE_RESCAN_S = 2.0

#: model -> (the wrapper's class name or ``None``, when last looked for)
_OUTSIDE: weakref.WeakKeyDictionary[nn.Module, tuple[str | None, float]] = (
    weakref.WeakKeyDictionary()
)


def _parallel_classes() -> tuple[type, ...]:
    classes: list[type] = [nn.parallel.DistributedDataParallel]
    fsdp = sys.modules.get("torch.distributed.fsdp")
    for name in ("FullyShardedDataParallel", "FSDPModule"):
        cls = getattr(fsdp, name, None) if fsdp is not None else None
        if isinstance(cls, type):
            classes.append(cls)
    return tuple(classes)


def _wrapper_outside(model: nn.Module, classes: tuple[type, ...]) -> str | None:
    """The class name of a wrapper (``classes``) whose tree holds ``model``, or ``None``."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    now = time.monotonic()
    known = _OUTSIDE.get(model)
    if known is not None and (known[0] is not None or now - known[1] < OUTSIDE_RESCAN_S):
        return known[0]
    found = None
    for obj in gc.get_objects():
        # type(), not isinstance: isinstance reads __class__, which some module-level objects
        # answer with a warning (torch.distributed.reduce_op's FutureWarning)
        if issubclass(type(obj), classes) and any(m is model for m in obj.modules()):
            found = type(obj).__name__
            break
    _OUTSIDE[model] = (found, now)
    return found


class Action:
    """Base class. Subclasses set ``name``/``lossy`` and implement ``plan`` and ``_apply``.

    ``_apply(ctx, plan)`` runs inside a :class:`Transaction`; it returns
    ``(details, error)`` (``error`` only for lossy actions). ``_measure(ctx)`` gives the bytes
    compared before and after (device-tier accounting by default).
    """

    name: ClassVar[str] = ""
    lossy: ClassVar[bool] = False

    def plan(self, ctx: ActionContext) -> Plan | Refusal:
        """Choose a target and estimate the saving, or refuse with a reason. Reads sizes only."""
        raise NotImplementedError

    def _apply(
        self, ctx: ActionContext, plan: Plan
    ) -> tuple[dict[str, Any], dict[str, float] | None]:
        raise NotImplementedError

    def _measure(self, ctx: ActionContext) -> int:
        """Device-tier bytes of the model's parameters, gradients and optimizer state, plus
        whatever the optimizers hold for parameters that are not the model's
        (:func:`~edo_monitor.actions.leftovers.optimizer_only_bytes`): a replaced weight left in a
        param group is bytes not saved."""
        return ctx.accounting().total_bytes + optimizer_only_bytes(
            ctx.model, ctx.optimizers, cuda_mode=ctx.cuda_mode
        )

    def refuse(self, target: str, reason: str) -> Refusal:
        """A :class:`Refusal` of this action."""
        return Refusal(self.name, target, reason)

    def refuse_tables(self, tables: Sequence[Any], reasons: Sequence[str]) -> Refusal:
        """A refusal of every candidate table (``tables``, each with a ``name``): ``reasons``
        ``"<table>: <why>"`` joined by ``"; "`` (``explain`` reads them per table). Its target
        is the table when there is one, else ``""``: the reasons name the tables (a first
        table named as the target read as if the others' reasons were its own)."""
        return self.refuse(tables[0].name if len(tables) == 1 else "", "; ".join(reasons))

    def apply(self, ctx: ActionContext, plan: Plan | None = None) -> ActionResult:
        """Apply ``plan`` (or a fresh :meth:`plan`) at a step boundary; training thread only.

        The plan is re-made now (the model may have changed since it was decided); when its target
        differs from ``plan.target`` or the action no longer applies, the result is ``"refused"``.

        Returns:
            An :class:`ActionResult`; never raises for a failure inside the action or its
            planning (the model and optimizer are restored first, and the result has
            ``status="failed"``).
        """
        t0 = time.perf_counter()
        try:
            fresh = self.plan(ctx)
        except Exception as exc:  # nothing changed yet: the model is as it was
            logger.warning("action %s could not be planned: %s", self.name, exc)
            return ActionResult(
                self.name,
                plan.target if plan else "",
                "failed",
                estimated_saving_bytes=plan.estimated_saving_bytes if plan else 0,
                duration_s=time.perf_counter() - t0,
                lossy=self.lossy,
                reason=f"{type(exc).__name__}: {exc}",
                exception=exc,
            )
        if isinstance(fresh, Refusal):
            return ActionResult(
                self.name,
                fresh.target or (plan.target if plan else ""),
                "refused",
                estimated_saving_bytes=plan.estimated_saving_bytes if plan else 0,
                duration_s=time.perf_counter() - t0,
                lossy=self.lossy,
                reason=fresh.reason,
            )
        if plan is not None and plan.target != fresh.target:
            return ActionResult(
                self.name,
                plan.target,
                "refused",
                estimated_saving_bytes=plan.estimated_saving_bytes,
                duration_s=time.perf_counter() - t0,
                lossy=self.lossy,
                reason=f"target changed since the decision: now {fresh.target!r}",
            )
        before = self._measure(ctx)
        params_before = record_params(ctx.model)
        try:
            with Transaction(ctx.model, ctx.optimizers):
                details, error = self._apply(ctx, fresh)
                leftovers = optimizer_leftovers(params_before, ctx.model, ctx.optimizers)
                if leftovers:  # the transaction rolls the action back
                    raise OptimizerLeftoverError("; ".join(leftovers))
        except Exception as exc:
            logger.warning(
                "action %s on %s failed and was rolled back: %s", self.name, fresh.target, exc
            )
            return ActionResult(
                self.name,
                fresh.target,
                "failed",
                estimated_saving_bytes=fresh.estimated_saving_bytes,
                bytes_before=before,
                bytes_after=before,
                duration_s=time.perf_counter() - t0,
                lossy=self.lossy,
                reason=f"{type(exc).__name__}: {exc}",
                exception=exc,
            )
        after = self._measure(ctx)
        result = ActionResult(
            self.name,
            fresh.target,
            "applied",
            estimated_saving_bytes=fresh.estimated_saving_bytes,
            bytes_before=before,
            bytes_after=after,
            duration_s=time.perf_counter() - t0,
            lossy=self.lossy,
            error=error,
            reason=fresh.reason,
            details={**fresh.details, **details},
        )
        logger.info(
            "action %s on %s: %d -> %d bytes in %.3f s",
            self.name,
            fresh.target,
            before,
            after,
            result.duration_s,
        )
        return result
