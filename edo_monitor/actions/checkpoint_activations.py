"""``checkpoint_activations``: non-reentrant activation checkpointing of the largest blocks.

The chosen blocks' ``forward`` is wrapped (an instance attribute, so :func:`undo_checkpointing`
removes it) in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
preserve_rng_state=True)`` while gradients are enabled: the tensors a block saves for backward are
dropped after its forward and recomputed during backward, with the RNG state of the forward
(dropout masks are the same), so losses and gradients are unchanged.

Estimating the saving needs to know which tensors each block saves for backward. An
:class:`ActivationRecorder` run around one forward (the agent does it on the training thread)
gives an :class:`ActivationProfile`: for every module, the bytes of saved tensors that only that
module's forward saves (*exclusive* bytes), minus the block's own inputs (checkpointing keeps
those alive). Parameters and buffers are not activations and are not counted. Blocks are the
children of ``nn.Sequential``/``nn.ModuleList`` and of the root, without embedding tables inside;
blocks whose forward changed a buffer during the recorded step
(``ActivationProfile.buffer_mutating``: BatchNorm's running statistics, any running state; also
inputs the forward changes in place and draws from Python's or NumPy's random state, which the
recomputation would not see as the forward did) or that
hold a normalisation layer tracking running statistics are excluded (recomputing them would update
the buffers twice, and lossless means buffers bit-identical too); a block enclosing two or more
other blocks is skipped in favour of the finer ones (checkpointing one outer block would recompute
everything at once and not lower the backward peak).

Measured bytes are saved-activation bytes: before = the profile's total, after = a new recorded
forward (``ActivationRecorder`` also counts the inputs that checkpointed blocks hold). Until the
agent records again, the result's ``bytes_after`` is the estimate
(``details["after_is_estimate"]``); the agent records the next step's forward and measures the
saving there, when the rest of that forward saved what it saved before (the same batch shapes:
:meth:`ActivationProfile.outside`), and judges it (``action_measured``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from edo_monitor.actions.activation_profile import (
    ActivationProfile,
    ActivationRecorder,
    _current_recorder,
)
from edo_monitor.actions.base import Action, ActionContext, ActionResult, find_wrapped_parallel
from edo_monitor.decide.plans import Plan, Refusal
from edo_monitor.measure.accounting import is_table_module
from edo_monitor.measure.module_tree import largest_disjoint, nested
from edo_monitor.units import format_bytes

__all__ = [
    "ActivationProfile",
    "ActivationRecorder",
    "CheckpointActivations",
    "checkpointed_modules",
    "undo_checkpointing",
]

logger = logging.getLogger(__name__)

_MARK = "_edo_checkpoint"


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Names of the modules whose forward this action wrapped."""
    return [n for n, m in model.named_modules() if _MARK in m.__dict__]


class _CheckpointedForward:
    """The forward of a checkpointed block (set as the module's instance ``forward``): a class
    holding its module, not a closure over the module's bound ``forward``, so that
    ``copy.deepcopy`` and pickling of the model carry it over to the copy's own module (a copy
    made by deepcopy computed with the original's weights, and ``torch.save(model)`` failed:
    "Can't pickle local object")."""

    def __init__(self, module: nn.Module, name: str, own: Any) -> None:
        self.module = module
        self.name = name
        #: the module's own instance ``forward`` before it was wrapped (``None``: its class's)
        self.own = own

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.own is not None:
            return self.own(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._forward(*args, **kwargs)
        rec = _current_recorder()
        if rec is not None:
            rec.note_held(args, kwargs, self.name)
        # the block's keywords go in through the function: checkpoint() takes its own (debug,
        # context_fn, determinism_check ...) out of **kwargs, so a block's debug=True was eaten
        forward = functools.partial(self._forward, **kwargs) if kwargs else self._forward
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True)


def _wrap(module: nn.Module, name: str) -> None:
    own = module.__dict__.get("forward")
    module.__dict__[_MARK] = True
    module.forward = _CheckpointedForward(module, name, own)


def undo_checkpointing(model: nn.Module, names: Iterable[str] | None = None) -> list[str]:
    """Remove the checkpoint wrapper from ``names`` (default: all); returns the names undone."""
    wanted = None if names is None else set(names)
    done = []
    for n, m in model.named_modules():
        if _MARK not in m.__dict__ or (wanted is not None and n not in wanted):
            continue
        del m.__dict__[_MARK]
        wrapper = m.__dict__.pop("forward")
        if wrapper.own is not None:
            m.forward = wrapper.own
        done.append(n)
    return done


def _contains_table(module: nn.Module) -> bool:
    return any(is_table_module(m) for m in module.modules())


def _has_running_stats(module: nn.Module) -> bool:
    """A normalisation layer that updates running statistics in training mode (BatchNorm*,
    SyncBatchNorm, InstanceNorm* with ``track_running_stats``) anywhere inside ``module``."""
    return any(
        isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
        for m in module.modules()
    )


def _block_candidates(model: nn.Module) -> list[str]:
    names = []
    for parent_name, parent in model.named_modules():
        if parent is not model and not isinstance(parent, (nn.Sequential, nn.ModuleList)):
            continue
        for child_name, child in parent.named_children():
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or _contains_table(child):
                continue
            names.append(full)
    return names


class CheckpointActivations(Action):
    """Wrap the largest blocks in non-reentrant checkpointing. Lossless; undo with :meth:`undo`."""

    name = "checkpoint_activations"
    lossy = False

    def plan(self, ctx: ActionContext) -> Plan | Refusal:
        """Choose up to ``ctx.max_checkpoint_blocks`` blocks by what checkpointing each frees
        (:meth:`ActivationProfile.net_saving_bytes`)."""
        wrapper = find_wrapped_parallel(ctx.model)
        # DistributedDataParallel is fine: non-reentrant checkpointing changes no parameter (the
        # reducer's hooks fire once per parameter, in the recomputing backward); FSDP's
        # unsharding around a block's forward is not, it has its own checkpoint wrapper
        if wrapper and wrapper != "DistributedDataParallel":
            return self.refuse("", f"model is wrapped in {wrapper}; wrap blocks before {wrapper}")
        profile = ctx.activation_profile
        if not isinstance(profile, ActivationProfile):
            return self.refuse("", "no activation profile yet (needs one recorded forward)")
        done = checkpointed_modules(ctx.model)
        cands = [c for c in _block_candidates(ctx.model) if c in profile.called]

        cands = [c for c in cands if not any(nested(c, d) for d in done)]
        # lossless means bit-identical state, buffers included: a block whose forward changes a
        # buffer (running statistics) would change it again when recomputed during backward
        stateful = [
            c
            for c in cands
            if c in profile.buffer_mutating or _has_running_stats(ctx.model.get_submodule(c))
        ]
        cands = [c for c in cands if c not in stateful]
        savings = {c: profile.net_saving_bytes(c) for c in cands}
        # a container of two or more blocks that save activations themselves is left for them
        # (checkpointed whole, its backward would recompute every block at once); one whose
        # blocks save nothing alone (a Linear-GELU-Linear Sequential: each layer's saved tensor
        # is its input) is the block: it was dropped, and only a LayerNorm was left to choose
        savings = {
            c: b
            for c, b in savings.items()
            if sum(1 for o in cands if o.startswith(c + ".") and savings[o] > 0) < 2
        }
        chosen = [c for c, _ in largest_disjoint(savings, ctx.max_checkpoint_blocks)]
        if not chosen:
            why = "no block with saved activations left to checkpoint"
            if stateful:
                why += (
                    f"; excluded {len(stateful)} block(s) whose forward changes buffers, module "
                    f"state, its inputs or Python's / NumPy's random state in training mode "
                    f"(recomputation would change them again or read them changed): "
                    f"{', '.join(stateful[:5])}"
                )
            return self.refuse("", why)
        est = sum(profile.net_saving_bytes(c) for c in chosen)
        return Plan(
            self.name,
            ",".join(chosen),
            est,
            f"checkpoint {len(chosen)} block(s) saving {format_bytes(est)} of activations",
            {
                "blocks": chosen,
                "activations_bytes_before": profile.total_bytes,
                "excluded_buffer_mutating": stateful,
            },
        )

    def _measure(self, ctx: ActionContext) -> int:
        profile = ctx.activation_profile
        return profile.total_bytes if isinstance(profile, ActivationProfile) else 0

    def _apply(
        self, ctx: ActionContext, plan: Plan
    ) -> tuple[dict[str, Any], dict[str, float] | None]:
        for name in plan.details["blocks"]:
            _wrap(ctx.model.get_submodule(name), name)
            ctx.stage(f"wrapped:{name}")
        after = plan.details["activations_bytes_before"] - plan.estimated_saving_bytes
        ctx.activation_profile = None  # stale now; the agent records a new one
        return {"after_is_estimate": True, "activations_bytes_after": after}, None

    def apply(self, ctx: ActionContext, plan: Plan | None = None) -> ActionResult:
        """As :meth:`Action.apply`; ``bytes_after`` is the estimate until re-measured."""
        profile = ctx.activation_profile
        result = super().apply(ctx, plan)
        if result.status == "applied":
            return replace(result, bytes_after=result.details["activations_bytes_after"])
        if result.status == "failed":
            ctx.activation_profile = profile
        return result

    @staticmethod
    def undo(ctx: ActionContext, names: Iterable[str] | None = None) -> list[str]:
        """Unwrap checkpointed blocks (all by default); returns their names."""
        return undo_checkpointing(ctx.model, names)
