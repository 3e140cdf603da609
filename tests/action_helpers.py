"""What the actions' tests share: a model whose embedding table dominates its memory, its batches,
a training loop, twin runs and an action context with the step's activation profile.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from edo_monitor.actions import (
    ActionContext,
    ActivationRecorder,
)

VOCAB, DIM, HIDDEN, CLASSES, PAD = 3000, 32, 64, 5, 0


class Recommender(nn.Module):
    """Users x items, float64 tables: the row-cache tests' recommender (``items`` rows of
    ``dim``, ``users`` rows)."""

    def __init__(self, items: int = 4000, users: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.items = nn.Embedding(items, dim, dtype=torch.float64)
        self.users = nn.Embedding(users, dim, dtype=torch.float64)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return (self.users(users) * self.items(items)).sum(-1)


class Block(nn.Module):
    """Residual MLP block with dropout: saves activations for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.relu(self.fc1(x))))


class Net(nn.Module):
    """Embedding (or EmbeddingBag) → two blocks → linear head."""

    def __init__(self, bag_mode: str | None = None, frozen: bool = False, **emb_kwargs) -> None:
        super().__init__()
        if bag_mode is None:
            self.emb: nn.Module = nn.Embedding(VOCAB, DIM, padding_idx=PAD, **emb_kwargs)
        else:
            self.emb = nn.EmbeddingBag(VOCAB, DIM, mode=bag_mode, padding_idx=PAD, **emb_kwargs)
        self.emb.weight.requires_grad_(not frozen)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, CLASSES)
        self.bag = bag_mode is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.bag else self.emb(x).mean(dim=1)
        return self.head(self.blocks(h))


def make(seed: int = 0, **kwargs) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net(**kwargs)
    if kwargs.get("frozen"):
        # A "pretrained" frozen table: smooth rows so that compression error is realistic.
        with torch.no_grad():
            basis = torch.randn(8, DIM)
            model.emb.weight.copy_(torch.randn(VOCAB, 8) @ basis + 0.05 * torch.randn(VOCAB, DIM))
            model.emb.weight[PAD] = 0
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def batches(n: int, seed: int = 123) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        # every token of a sequence has the class of the sequence (token % CLASSES); ids < 400
        y = torch.randint(0, CLASSES, (16,), generator=g)
        x = y.unsqueeze(1) + CLASSES * torch.randint(1, 400 // CLASSES, (16, 6), generator=g)
        x[:, -1] = PAD  # every sequence ends with padding
        out.append((x, y))
    return out


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    at_step: dict[int, Callable[[], None]] | None = None,
) -> list[float]:
    """Train over ``data``; ``at_step[i]()`` runs at the step boundary before step ``i``."""
    losses = []
    for i, (x, y) in enumerate(data):
        if at_step and i in at_step:
            at_step[i]()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
    return losses


def twin_losses(action: Callable[[Net, torch.optim.Optimizer], None], steps: int, at: int, **kw):
    data = batches(steps)
    ref_model, ref_opt = make(**kw)
    torch.manual_seed(99)
    ref = train(ref_model, ref_opt, data)
    model, opt = make(**kw)
    torch.manual_seed(99)
    got = train(model, opt, data, {at: lambda: action(model, opt)})
    return ref, got, model, opt


def assert_rel_equal(a: list[float], b: list[float], rel: float = 1e-6) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert abs(x - y) <= rel * max(abs(x), 1e-12), (i, x, y)


def quiet_profile(model: nn.Module):
    """A recorded forward that changes nothing: no gradients, the RNG state restored.

    Table actions need one (it tells whether a weight is read outside its module). It runs on a
    copy: a table with ``max_norm`` renormalises rows in place even under ``no_grad``; the
    profile refers to modules by name, which the copy shares."""
    twin = copy.deepcopy(model)
    with torch.random.fork_rng(), torch.no_grad(), ActivationRecorder(twin) as rec:
        twin(batches(1, seed=5)[0][0])
    return rec.profile()


def profile_of(model: nn.Module, x: torch.Tensor):
    """The activation profile of one forward and backward of ``x`` (gradients left in place)."""
    with ActivationRecorder(model) as rec:
        out = model(x)
    out.sum().backward()
    return rec.profile()


def ctx_of(model: nn.Module, opt: torch.optim.Optimizer, **kw) -> ActionContext:
    if isinstance(model, Net):
        kw.setdefault("activation_profile", quiet_profile(model))
    return ActionContext(model=model, optimizers=[opt], cuda_mode=False, **kw)
