"""Checkpointing never recomputes a forward that changes state (issue 9, item 4): blocks whose
forward changes a buffer (BatchNorm's running statistics, a counter buffer) or a plain tensor or
number attribute (a running mean kept outside the buffers, a call counter) are excluded, and the
checkpointed model stays bit-identical to an untouched twin."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from test_actions_safety import MLP
from torch import nn

from edo_monitor.actions import ACTIONS, ActionContext, ActivationRecorder, Plan, Refusal


class Counter(nn.Module):
    """Not a BatchNorm: counts its calls in a buffer (any running state)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return torch.tanh(x)


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(n, 32), nn.BatchNorm1d(32), nn.ReLU()) for n in (16, 32, 32)]
    counted = nn.Sequential(nn.Linear(32, 16), Counter())
    return nn.Sequential(*blocks, MLP(32), counted, nn.Linear(16, 4))


def _train_steps(model: nn.Module, opt: torch.optim.Optimizer, data: list, profile: bool = False):
    out = None
    for i, (x, y) in enumerate(data):
        with ActivationRecorder(model) if profile and i == 0 else _Null() as rec:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        if profile and i == 0:
            out = rec.profile()
    return out


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class AttributeState(nn.Module):
    """An MLP block keeping state outside its buffers: a running mean in a plain tensor
    attribute and its calls in a Python int (the tester's blocks: recomputed under checkpointing
    they counted 116 calls for 60 and their running means drifted)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
        self.kind = kind
        self.mean = torch.zeros(64)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.training and self.kind == "tensor":
            self.mean.mul_(0.9).add_(0.1 * h.detach().mean(0))
        if self.training and self.kind == "int":
            self.calls += 1
        return self.fc2(h)


def _excluded_and_twin_identical(block: nn.Module, steps: int) -> tuple[nn.Module, nn.Module]:
    """``block`` as block "1" of Linear-block-MLP-Linear, profiled at the first of ``steps``
    steps (one batch, Python's and NumPy's generators seeded alike for model and twin): it is
    excluded from checkpointing, the MLP ("2") is checkpointed, and the parameters after the
    other steps are bit-identical to the untouched twin's. Returns ``(model, twin)``."""
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))]
    data *= steps
    torch.manual_seed(0)
    twin = nn.Sequential(nn.Linear(16, 32), block, MLP(32), nn.Linear(32, 4))
    model = copy.deepcopy(twin)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    random.seed(0)
    np.random.seed(0)
    _train_steps(twin, twin_opt, data)
    random.seed(0)
    np.random.seed(0)
    profile = _train_steps(model, opt, data[:1], profile=True)
    assert profile is not None and "1" in profile.buffer_mutating
    assert "2" not in profile.buffer_mutating
    ctx = ActionContext(model, [opt], activation_profile=profile)
    plan = ACTIONS["checkpoint_activations"].plan(ctx)
    assert isinstance(plan, Plan), plan
    assert plan.details["blocks"] == ["2"]  # the plain MLP only
    assert plan.details["excluded_buffer_mutating"] == ["1"]
    assert ACTIONS["checkpoint_activations"].apply(ctx, plan).status == "applied"
    _train_steps(model, opt, data[1:])
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    return model, twin


@pytest.mark.parametrize("kind", ["tensor", "int"])
def test_checkpointing_excludes_blocks_whose_forward_changes_plain_attribute_state(
    kind: str,
) -> None:
    model, twin = _excluded_and_twin_identical(AttributeState(kind), steps=4)
    assert model[1].calls == twin[1].calls == (4 if kind == "int" else 0)
    assert torch.equal(model[1].mean, twin[1].mean)


def test_checkpointing_excludes_blocks_whose_forward_changes_buffers_twin_bit_identical() -> None:
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))]
    data += [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))]
    data += [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))]
    data += [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))]
    twin = bn_model()
    model = copy.deepcopy(twin)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train_steps(twin, twin_opt, data)
    profile = _train_steps(model, opt, data[:1], profile=True)
    assert profile is not None
    # every BatchNorm, the Counter, and every block holding one changed a buffer
    assert {"0.1", "1.1", "2.1", "4.1", "0", "1", "2", "4", ""} <= set(profile.buffer_mutating)
    assert "3" not in profile.buffer_mutating
    ctx = ActionContext(model, [opt], activation_profile=profile)
    plan = ACTIONS["checkpoint_activations"].plan(ctx)
    assert isinstance(plan, Plan), plan
    assert plan.details["blocks"] == ["3"]  # the MLP; before the fix the BatchNorms were picked
    assert {"0.1", "1.1", "2.1", "4.1"} <= set(plan.details["excluded_buffer_mutating"])
    assert ACTIONS["checkpoint_activations"].apply(ctx, plan).status == "applied"
    _train_steps(model, opt, data[1:])  # 3 more steps, checkpointed blocks recomputed
    for bn in (model[0][1], model[1][1], model[2][1]):
        assert int(bn.num_batches_tracked) == 4  # one update per training forward: 1 + 3
    assert int(model[4][1].calls) == 4
    for (n, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items(), strict=True):
        assert torch.equal(a, b), n  # parameters and buffers bit-identical
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        for k, v in opt.state[p].items():
            assert torch.equal(v, twin_opt.state[q][k]), k


def test_checkpointing_refuses_when_only_buffer_changing_blocks_are_left() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(16), Counter())
    x = torch.randn(8, 16, requires_grad=True)
    with ActivationRecorder(model) as rec:
        model(x).sum().backward()
    r = ACTIONS["checkpoint_activations"].plan(
        ActionContext(model, [], activation_profile=rec.profile())
    )
    assert isinstance(r, Refusal) and "changes buffers, module state" in r.reason


class Unreplayable(nn.Module):
    """An MLP block whose forward a recomputing checkpoint would not replay as it ran: it
    scales its input in place (``"inplace"``), or skips itself by a draw from Python's ``random``
    or NumPy's global generator (a LayerDrop: the checkpoint restores torch's generators only)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "inplace":
            x.mul_(0.5)
        else:
            draw = random.random if self.kind == "random" else np.random.random
            if draw() < 0.3:
                return x * 1.0
        return x + self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize("kind", ["inplace", "random", "numpy"])
def test_checkpointing_excludes_blocks_a_recomputation_would_not_replay(kind: str) -> None:
    """Regression: such a block was checkpointed (the default ladder's lossless rung) and the
    user's backward failed: "modified by an inplace operation" for an input changed in place,
    ``CheckpointError`` ("a different number of tensors was saved") for a draw from Python's or
    NumPy's random state, which also moved the user's random stream. Excluded now; the plan
    takes the plain MLP, and training stays bit-identical to the untouched twin."""
    _excluded_and_twin_identical(Unreplayable(kind), steps=6)


class Switchable(nn.Module):
    """An MLP block with keywords named as ``torch.utils.checkpoint.checkpoint``'s own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(
        self, x: torch.Tensor, debug: bool = False, context_fn: float = 1.0
    ) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        return x + self.fc2(h * 0 if debug else h) * context_fn


class SwitchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Switchable(), Switchable()])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, **kw: object) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, **kw)
        return self.head(x)


def test_a_checkpointed_block_gets_its_own_keywords() -> None:
    """Regression: the block's keywords were passed on as ``checkpoint``'s, which takes its own
    (``debug``, ``context_fn`` ...) out of them: a block called with ``debug=True`` ran with
    ``debug=False`` (0.39 off the untouched twin), one with ``context_fn=`` failed inside torch.
    Outputs and gradients now equal the twin's, bit for bit."""
    torch.manual_seed(0)
    model = SwitchNet()
    twin = copy.deepcopy(model)
    x = torch.randn(8, 16)
    recorded = copy.deepcopy(model)
    with ActivationRecorder(recorded) as rec:
        recorded(x)
    ctx = ActionContext(model, [], activation_profile=rec.profile())
    assert ACTIONS["checkpoint_activations"].apply(ctx).status == "applied"
    for kw in ({}, {"debug": True}, {"context_fn": 0.5}, {"debug": True, "context_fn": 2.0}):
        got, want = model(x, **kw), twin(x, **kw)
        assert torch.equal(got, want), kw
        got.sum().backward()
        want.sum().backward()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), kw
