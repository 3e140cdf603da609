"""``checkpoint_activations`` frees nothing at once: the agent records the next step's forward and
measures the saving there (``action_measured``), and the policy judges that figure, not the
estimate (agent/tuner.py ``record_measured``, decide/outcomes.py ``remeasured``)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

import edo_monitor
from edo_monitor.decide.plans import Plan
from edo_monitor.decide.policy_events import Decision
from edo_monitor.store.history import History

ROWS, DIM, HIDDEN, BATCH = 20_000, 32, 256, 1024
RELU_BYTES = BATCH * HIDDEN * 4  # what each block saves only inside itself: 1 MiB
MEMORY_ROWS = 1536  # the memory bank the model passes to its blocks after its first forward


class Block(nn.Module):
    """``x + fc2(relu(fc1(x)))`` (+ a read of ``memory``: a no-grad input nothing saves)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if memory is not None:  # adds 0, saves nothing: checkpointing holds it to recompute
            h = h + memory.mean() * 0
        return x + self.fc2(h)


class Model(nn.Module):
    """A table, two blocks and a head; with ``memory=True``, from the second forward on the
    blocks also get a memory bank of ``MEMORY_ROWS x HIDDEN`` floats made in the forward (a
    retrieval memory switched on after warm-up)."""

    def __init__(self, memory: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, 1)
        self.memory = memory
        self.forwards = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        bank = None
        if self.memory and self.forwards > 1:
            bank = torch.ones(MEMORY_ROWS, HIDDEN)
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h, bank)
        return self.head(h).squeeze(-1)


def run(
    db_path: Path, model: Model, ladder: list[str], batches: list[int], cooldown_steps: int = 1
) -> edo_monitor.Monitor:
    """Train on ``batches`` (batch sizes) under a budget the table's Adam state and the blocks'
    activations go over at once (free below 20 %). The profile is recorded at the first step only
    (every hour): the plan's estimate comes from that forward, whenever the action comes."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    policy = edo_monitor.Policy(ladder=ladder, cooldown_steps=cooldown_steps)
    with edo_monitor.watch(
        model,
        opt,
        db=db_path,
        budget=13_000_000,
        policy=policy,
        interval_s=0.005,
        profile_interval_s=3600,
    ) as mon:
        for batch in batches:
            ids = torch.randint(0, ROWS, (batch,), generator=gen)
            model(ids).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.05)  # readings between steps: a decision can come after every step
    return mon


def events_of(db_path: Path) -> list[tuple[str, dict]]:
    with History(db_path) as history:
        return [(e.kind, e.data) for e in history.events("latest")]


def test_the_saving_is_measured_on_the_next_forward_and_the_summary_says_so(
    db_path: Path,
) -> None:
    model = Model()
    mon = run(db_path, model, ["checkpoint_activations"], [BATCH] * 8)
    events = events_of(db_path)
    (action,) = [d for k, d in events if k == "action"]
    (measured,) = [d for k, d in events if k == "action_measured"]
    assert action["target"] == "blocks.0,blocks.1"
    assert action["estimated_saving_bytes"] == 2 * RELU_BYTES
    # the next forward of the same batch: both ReLU outputs gone, the rest as it was
    assert measured["comparable"] is True
    assert measured["saved_bytes"] == 2 * RELU_BYTES
    assert measured["bytes_before"] - measured["bytes_after"] == 2 * RELU_BYTES
    assert "action_ineffective" not in [k for k, _ in events]
    (line,) = [s for s in str(mon.summary()).splitlines() if s.startswith("action ")]
    assert "saved 2 MiB measured on the next forward (estimated 2 MiB)" in line


def test_another_batch_on_the_next_forward_is_not_judged(db_path: Path) -> None:
    # the next forward has half the batch: the head and table saved other bytes, so the
    # difference (more than the estimate) is not the action's; the estimate stands
    model = Model()
    mon = run(db_path, model, ["checkpoint_activations"], [BATCH] * 2 + [BATCH // 2] * 6)
    events = events_of(db_path)
    (measured,) = [d for k, d in events if k == "action_measured"]
    assert measured["comparable"] is False
    assert measured["saved_bytes"] > measured["estimated_saving_bytes"] == 2 * RELU_BYTES
    (line,) = [s for s in str(mon.summary()).splitlines() if s.startswith("action ")]
    assert "saved 2 MiB (estimate) in" in line


def test_a_saving_measured_below_half_the_estimate_moves_the_ladder_on(db_path: Path) -> None:
    """From the 2nd forward the blocks read a 1.5 MiB memory bank that nothing saves: without
    checkpointing it is freed after the forward, checkpointed each block holds it (the same
    storage, counted once) to recompute from. Planned on the first forward, without it,
    checkpointing was estimated at 2 MiB; measured, it saves 2 MiB - 1.5 MiB = 0.5 MiB, under
    half: ineffective, and the next reading climbs to the next rung (offload) in the same
    episode, without waiting for the cooldown (100 steps). Before, the estimate stood and offload
    waited for the cooldown."""
    model = Model(memory=True)
    ladder = ["checkpoint_activations", "offload_embedding"]
    run(db_path, model, ladder, [BATCH] * 12, cooldown_steps=100)
    events = events_of(db_path)
    kinds = [k for k, _ in events]
    (measured,) = [d for k, d in events if k == "action_measured"]
    assert measured["comparable"] is True
    assert measured["estimated_saving_bytes"] == 2 * RELU_BYTES
    assert measured["saved_bytes"] == 2 * RELU_BYTES - MEMORY_ROWS * HIDDEN * 4
    ineffective = [d for k, d in events if k == "action_ineffective"]
    assert [(d["action"], d["target"]) for d in ineffective] == [
        ("checkpoint_activations", "blocks.0,blocks.1")
    ]
    assert "measured saving 512 KiB is below 50% of the estimated 2 MiB" in ineffective[0]["reason"]
    actions = [d["action"] for k, d in events if k == "action"]
    assert actions == ["checkpoint_activations", "offload_embedding"]
    assert kinds.index("action_ineffective") < kinds.index("decision", kinds.index("action") + 1)


def test_the_forecast_adds_back_the_measured_saving() -> None:
    """The forecast's series adds back the savings in force: a measured figure replaces the
    estimate, before it is in force and after."""
    plan = Plan("checkpoint_activations", "b", 1000, "why")
    for measured_at_step in (None, 5):
        policy = edo_monitor.Policy(forecast_steps=10)
        decision = Decision(plan.action, "b", 1000, "why", 2, 0.0, 0.1, "auto", plan)
        assert policy.resolve(decision, "applied") is None  # in force as the estimate: 1000
        if measured_at_step is not None:  # already in force when measured
            policy.observe_step(measured_at_step, 0)
        policy.remeasured(decision, 1000, 300)
        policy.observe_step(6, 0)
        assert policy._series.points()[-1] == (6, 300)  # in use 0 + the saving in force
