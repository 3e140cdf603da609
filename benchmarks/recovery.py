"""Out-of-memory recovery in the step (issue 14, item 1) against accelerate's approach, on one loop.

    .venv/bin/python benchmarks/recovery.py [--batch 256] [--steps 30] [--long-from 20]

The loop: a token model (``nn.Embedding(1000, 64)`` -> ``Linear(64, 256)`` -> ReLU ->
``Linear(256, 1)``, mean over the sequence; MSE; SGD lr 0.05), ``--steps`` batches of ``--batch``
rows; the first ``--long-from`` batches have sequences of 32 tokens, the rest 64 (a length-bucketed
loader: the activations double mid-run). CPU-budget mode with ``enforce=True``; the budget is the
params + grads plus 1.5 x the saved-for-backward peak of one 32-token batch (measured with
``ActivationTracker``), so the first 64-token batch runs out of memory in forward.

- **run_step**: ``Monitor.run_step(step_fn, batch, optimizer=opt)``: the failing step is split in
  two micro-batches with gradient accumulation and retried; later steps keep the split.
- **accelerate**: the logic of ``accelerate.utils.find_executable_batch_size`` (re-implemented
  here in a few lines, accelerate is not a dependency): on an out-of-memory error, collect garbage
  and call the whole training function again with half the batch, from the start of the data.

Columns: optimizer steps run, steps lost (optimizer steps whose work was thrown away by a
restart), the batch of the updates after the OOM (the effective batch), out-of-memory errors,
wall seconds (both runs side by side on the same machine: compare the ratio), and for run_step the
seconds of the failed attempt (``lost_s`` of the ``oom_recovered`` event). Last line: the largest
relative difference, over the parameters, between the gradients of the recovered (split) step and
those of the same step unsplit on an unwatched twin (max |g_split - g| / max |g|).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import edo_monitor
from edo_monitor.agent.activations import ActivationTracker
from edo_monitor.store.history import History

VOCAB, DIM, HIDDEN = 1000, 64, 256


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(tokens)).mean(dim=1)  # [rows, 1]


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).pow(2).mean()


def dataset(batch: int, steps: int, long_from: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    short = torch.randint(0, VOCAB, (long_from * batch, 32), generator=gen)
    long = torch.randint(0, VOCAB, ((steps - long_from) * batch, 64), generator=gen)
    return short, long, torch.randn(steps * batch, 1, generator=gen)


def loader(data: tuple[torch.Tensor, ...], batch: int):
    short, long, y = data
    offset = 0
    for xs in (short, long):
        for i in range(0, xs.shape[0], batch):
            x = xs[i : i + batch]
            yield x, y[offset : offset + x.shape[0]]
            offset += x.shape[0]


def budget_bytes(batch: int) -> int:
    torch.manual_seed(0)
    model = TokenModel()
    static = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # params + grads
    data = dataset(batch, 1, 1)
    with ActivationTracker(list(model.parameters())) as tracker:
        loss_of(model, next(loader(data, batch))).backward()
        peak = tracker.step_peak_bytes
    return static + int(1.5 * peak)


def run_step_loop(data, batch: int, budget: int, db: Path) -> dict:
    torch.manual_seed(0)
    model = TokenModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rel = None
    check = None
    t0 = time.perf_counter()
    with edo_monitor.watch(model, opt, db=db, budget=budget, enforce=True) as mon:
        for batch_ in loader(data, batch):
            recovered = mon.summary().events.get("oom_recovered", 0)
            twin = None
            if recovered == 0:
                twin = TokenModel()
                twin.load_state_dict(model.state_dict())
            mon.run_step(lambda mb: loss_of(model, mb), batch_)
            if twin is not None and mon.summary().events.get("oom_recovered", 0) == 1:
                check = (twin, batch_, [p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
    wall = time.perf_counter() - t0
    if check is not None:  # the recovered step, unsplit, outside the watch (its hooks are global)
        twin, batch_, grads = check
        loss_of(twin, batch_).backward()
        rel = max(
            ((g - q.grad).abs().max() / q.grad.abs().max()).item()
            for g, q in zip(grads, twin.parameters(), strict=True)
        )
    with History(db) as history:
        events = history.events("latest", kind="oom_recovered")
    summary = mon.summary()
    return {
        "steps": summary.steps,
        "lost": 0,
        "effective": batch,
        "ooms": summary.events.get("oom", 0),
        "wall_s": wall,
        "lost_s": sum(e.data["lost_s"] for e in events),
        "rel": rel,
        "split": events[0].data["micro_batch_rows"] if events else None,
    }


def accelerate_loop(data, batch: int, budget: int, db: Path) -> dict:
    steps_done = {"total": 0, "kept": 0}
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = TokenModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def train(batch_size: int) -> int:  # the function accelerate's decorator restarts
        steps_done["kept"] = 0
        for batch_ in loader(data, batch_size):
            loss_of(model, batch_).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps_done["total"] += 1
            steps_done["kept"] += 1
        return batch_size

    with edo_monitor.watch(model, opt, db=db, budget=budget, enforce=True) as mon:
        batch_size = batch
        while True:  # accelerate.utils.find_executable_batch_size, in short
            try:
                final = train(batch_size)
                break
            except torch.OutOfMemoryError:
                gc.collect()
                opt.zero_grad(set_to_none=True)
                batch_size //= 2
                if batch_size == 0:
                    raise
    wall = time.perf_counter() - t0
    summary = mon.summary()
    return {
        "steps": steps_done["total"],
        "lost": steps_done["total"] - steps_done["kept"],
        "effective": final,
        "ooms": summary.events.get("oom", 0),
        "wall_s": wall,
        "lost_s": None,
        "rel": None,
        "split": None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--long-from", type=int, default=20)
    args = parser.parse_args()
    data = dataset(args.batch, args.steps, args.long_from)
    budget = budget_bytes(args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        ours = run_step_loop(data, args.batch, budget, Path(tmp) / "ours.db")
        theirs = accelerate_loop(data, args.batch, budget, Path(tmp) / "accelerate.db")
    print(
        f"batch {args.batch}, {args.steps} batches ({args.long_from} of 32 tokens, then 64), "
        f"budget {budget:,} bytes"
    )
    print(
        f"{'approach':<12} {'opt steps':>9} {'steps lost':>10} {'batch after OOM':>15} "
        f"{'OOMs':>4} {'wall s':>7} {'failed attempt s':>16}"
    )
    for name, r in (("run_step", ours), ("accelerate", theirs)):
        lost_s = "-" if r["lost_s"] is None else f"{r['lost_s']:.3f}"
        print(
            f"{name:<12} {r['steps']:>9} {r['lost']:>10} {r['effective']:>15} {r['ooms']:>4} "
            f"{r['wall_s']:>7.2f} {lost_s:>16}"
        )
    print(f"wall-time ratio run_step / accelerate: {ours['wall_s'] / theirs['wall_s']:.2f}")
    print(f"run_step split: micro-batches of {ours['split']} rows (gradient accumulation)")
    print(f"max relative gradient difference, split vs unsplit step: {ours['rel']:.2e}")


if __name__ == "__main__":
    main()
