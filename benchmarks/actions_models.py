"""Part 1's models and copies for ``benchmarks/actions.py``: the example with two MLP blocks, a
warmed-up model and optimizer snapshotted at the step's peak and fresh copies of it, a training
step, and the cases (one action on one model) that part measures; see that file's docstring."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn

from edo_monitor.actions import (
    ACTIONS,
    ActionContext,
    ActionResult,
    ActivationProfile,
    ActivationRecorder,
    Refusal,
)
from edo_monitor.measure.accounting import account
from edo_monitor.nn import row_error

LR = 0.01


# ------------------------------------------------------------------- part 1: models and copies
class MLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(x)))``: a block that saves activations of its own for backward."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


def mlp_variant_class(example: ModuleType) -> type[nn.Module]:
    """The example's model with two :class:`MLPBlock` between the table and the classifier."""
    base: type[nn.Module] = example.HashedWordModel

    class HashedWordModelMLP(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(MLPBlock(64, 512), MLPBlock(64, 512))

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            return self.classifier(self.blocks(self.features(features)))

    return HashedWordModelMLP


@dataclass
class Snapshot:
    """A warmed-up model and optimizer at the last warm-up step's peak (after ``opt.step()``,
    before ``zero_grad``): state dicts and the gradients, from which fresh copies are built."""

    model_cls: Callable[[], nn.Module]
    model_state: dict[str, torch.Tensor]
    optim_state: dict[str, Any]
    grads: dict[str, torch.Tensor]

    def fresh(self, frozen: bool = False, grads: bool = True) -> tuple[nn.Module, torch.optim.Adam]:
        """An independent copy (own tensors, own optimizer state), with the gradients of the
        step's peak unless ``grads=False`` (as after ``zero_grad(set_to_none=True)``); the table
        frozen (and without a gradient) if asked."""
        model = self.model_cls()
        model.load_state_dict(self.model_state)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        opt.load_state_dict(copy.deepcopy(self.optim_state))
        if grads:
            for name, p in model.named_parameters():
                if name in self.grads:
                    p.grad = self.grads[name].clone()
        if frozen:
            model.features.weight.requires_grad_(False)
            model.features.weight.grad = None
        return model, opt


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    zero_grad: bool = True,
) -> tuple[float, float, int]:
    """One step; returns (seconds, loss, device-tier bytes at the step's static peak). The
    gradients are freed (``set_to_none=True``) at the end unless ``zero_grad=False``."""
    t0 = time.perf_counter()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    dt = time.perf_counter() - t0
    peak = account(model, [opt]).total_bytes  # after step, before zero_grad: grads still alive
    if zero_grad:
        opt.zero_grad(set_to_none=True)
    return dt, float(loss.item()), peak


def warm_up(
    model_cls: Callable[[], nn.Module], batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> Snapshot:
    """Train a new model for ``len(batches)`` steps and snapshot it at the last step's peak."""
    torch.manual_seed(0)
    model = model_cls()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for i, (x, y) in enumerate(batches):
        train_step(model, opt, x, y, zero_grad=i < len(batches) - 1)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return Snapshot(
        model_cls, copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), grads
    )


def profile_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> ActivationProfile:
    """The activation profile of one forward + loss (what the agent records at a step)."""
    with ActivationRecorder(model) as rec:
        loss = nn.functional.cross_entropy(model(x), y)
    del loss
    return rec.profile()


def action_context(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> ActionContext:
    """An action's context in CPU-budget mode with a fresh activation profile (the agent records
    one at a step: ``checkpoint_activations`` plans from it, and an embedding action is refused
    without it, not knowing whether the weight is read outside its module)."""
    return ActionContext(model, [opt], cuda_mode=False, activation_profile=profile_of(model, x, y))


@dataclass
class Case:
    """One action measured on one model."""

    label: str
    action: str
    snapshot: Snapshot
    frozen: bool = False
    twin: str = ""
    needs_profile: bool = False  # its saving is activations: re-recorded after the action
    results: list[ActionResult] = field(default_factory=list)
    refusal: Refusal | None = None
    model: nn.Module | None = None
    opt: torch.optim.Optimizer | None = None
    measured_activation_saving: int | None = None
    row_error_s: float | None = None
    saved_without_grads: int | None = None


def result_is_lossy(case: Case) -> bool:
    """Whether the case's action is lossy (its duration includes the error measurement)."""
    return ACTIONS[case.action].lossy


def time_row_error(original: torch.Tensor, module: nn.Module) -> float:
    """Seconds of ``edo_monitor.nn.row_error`` on the table before and after (its share of
    ``duration_s``)."""
    if hasattr(module, "dequantized"):
        approx = module.dequantized()
    elif hasattr(module, "reconstructed"):
        approx = module.reconstructed()
    else:
        approx = module.weight.detach()
    t0 = time.perf_counter()
    row_error(original, approx)
    return time.perf_counter() - t0
