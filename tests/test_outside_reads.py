"""A table's weight read outside its module (an L2 penalty over the parameters) on some steps
only: table actions refuse once any recorded step saw it, and a row cache the agent made records
the step it saw a gradient on its weight itself (``action_inexact``)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

import edo_monitor
from edo_monitor.store.history import History

ROWS, DIM, HIDDEN = 20_000, 32, 512


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.head = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x).mean(1))


def train(db_path: Path, penalty_steps: set[int], batches: list[int], **watch: object) -> int:
    """SGD with momentum under an 11 MB budget (the table's weight, gradient and momentum take
    7.7 MB); ``1e-3 * ||emb.weight||^2`` is added to the loss at ``penalty_steps``."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    policy = edo_monitor.Policy(ladder=["cache_embedding"])
    with edo_monitor.watch(
        model, opt, db=db_path, budget=11_000_000, policy=policy, interval_s=0.005, **watch
    ) as mon:
        for step, batch in enumerate(batches):
            x = torch.randint(0, ROWS, (batch, 8), generator=gen)
            y = torch.randint(0, 10, (batch,), generator=gen)
            loss = nn.functional.cross_entropy(model(x), y)
            if step in penalty_steps:
                loss = loss + 1e-3 * model.emb.weight.pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.03)  # readings between steps
    return mon.run_id


def test_a_read_on_an_earlier_recorded_step_still_refuses_the_table_action(db_path: Path) -> None:
    """Every step is recorded; the penalty is on step 1 only and the pressure comes at step 6
    (the batch grows to 2,048). Before, the action read the latest recorded step alone (no
    read there) and cached the table; now the read seen on step 1 refuses it, naming it."""
    run_id = train(db_path, {1}, [64] * 6 + [2048] * 6, profile_interval_s=1e-6)
    with History(db_path) as history:
        events = history.events(run_id)
    assert [e.data["action"] for e in events if e.kind == "action"] == []
    refused = [e for e in events if e.kind == "no_action"]
    assert refused, [e.kind for e in events]
    reasons = {r["action"]: r["reason"] for r in refused[0].data["refusals"]}
    assert "emb" in reasons["cache_embedding"]
    assert reasons["cache_embedding"].startswith("emb: ")
    assert "<no module>: pow" in reasons["cache_embedding"], reasons  # the penalty's read


def test_a_gradient_on_the_cached_weight_is_recorded_as_the_step_training_became_inexact(
    db_path: Path,
) -> None:
    """Recorded once (the first step, no penalty), cached under pressure, then the penalty at
    step 9: the history says so at that step, naming the table (before: one log line only)."""
    run_id = train(db_path, {9}, [2048] * 12, profile_interval_s=3600)
    with History(db_path) as history:
        events = history.events(run_id)
    kinds = [e.kind for e in events]
    assert "action" in kinds
    (inexact,) = [e for e in events if e.kind == "action_inexact"]
    assert inexact.data["table"] == "emb" and inexact.step == 9
    assert kinds.index("action") < kinds.index("action_inexact")
    assert "not the resident table's from here" in inexact.message


def test_a_table_module_shared_with_an_unwatched_teacher_reads_the_new_table_exactly(
    db_path: Path,
) -> None:
    """Regression: a teacher network outside the watched model holding the same ``nn.Embedding``
    module (distillation, a target network) kept calling it after ``cache_embedding`` made its
    weight the ``(C, D)`` cache: ``IndexError: index out of range`` at the next step, and the
    run failed (offloaded, a device mismatch on a GPU). The replaced module now calls its
    replacement: training is the unwatched twin's, float64."""

    class Net(nn.Module):
        def __init__(self, emb: nn.Embedding) -> None:
            super().__init__()
            self.emb, self.head = emb, nn.Linear(16, 1, dtype=torch.float64)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids)).squeeze(-1)

    def run(watched: bool, ladder: str = "cache_embedding") -> tuple[list[float], str]:
        torch.manual_seed(1)
        emb = nn.Embedding(ROWS, 16, dtype=torch.float64)
        student, teacher = Net(emb), Net(emb)
        opt = torch.optim.Adam(student.parameters(), 1e-2)
        gen = torch.Generator().manual_seed(2)
        budget = int(sum(p.numel() * p.element_size() for p in student.parameters()) * 1.2)
        policy = edo_monitor.Policy(ladder=[ladder])
        losses = []
        with (
            edo_monitor.watch(student, db=db_path, budget=budget, interval_s=0.005, policy=policy)
            if watched
            else torch.enable_grad()
        ):
            for _ in range(12):
                ids = torch.randint(0, ROWS, (64,), generator=gen)
                y = torch.randn(64, generator=gen, dtype=torch.float64)
                with torch.no_grad():
                    target = teacher(ids)
                loss = nn.functional.mse_loss(student(ids), target + y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                time.sleep(0.02 if watched else 0)
        return losses, type(student.emb).__name__

    twin, _ = run(False)
    for ladder, kind in (("cache_embedding", "CachedTable"), ("offload_embedding", "Offloaded")):
        watched, made = run(True, ladder)
        assert made.startswith(kind)
        assert max(abs(a - b) for a, b in zip(watched, twin, strict=True)) < 1e-12
