"""One rank of a real multi-process ``torch.distributed`` job, for tests/test_ranks.py.

Run as ``python ranks_worker.py SCENARIO DB RANK WORLD_SIZE STORE_FILE [KEY=VALUE ...]``: it
joins a gloo process group through a FileStore (``file://STORE_FILE``, no network port), trains
a small embedding model under ``edo_monitor.watch(db=DB)`` and prints one JSON line: its
summary, its job and rank, and what the scenario measured.

Scenarios:

* ``jobs``: a plain training loop (the job and rank columns). ``die_rank``: that rank ends
  with ``os._exit(3)`` right after joining the group, before any collective (after ``hang_s``
  seconds of sleep: alive but never taking part); ``strict=0``: the agent's errors are logged.
  ``allreduce=after``: the training's own collective, an ``all_reduce`` of ones after the
  ``watch()`` block (its result, ``after_block_sum``: the world size when the ranks'
  collectives paired), ``allreduce=step``: every step too; ``late_rank`` enters ``watch()``
  ``late_s`` seconds late; ``short_rank`` takes one step fewer.
* ``pressure``: CPU-budget mode (``budget=``) with a policy; rank ``heavy_rank`` trains on
  larger batches, so only its free fraction falls below the floor. Options: ``ladder`` (comma
  separated), ``ddp=1`` (wrap in ``DistributedDataParallel``), ``tie_rank`` (that rank's table
  is tied to an unused output layer: table actions refuse there), ``sync`` (sync_every_steps),
  ``steps``, ``budget``, ``heavy_batch``, ``light_batch``, ``heavy_from`` (the step from which
  the heavy rank's batches are heavy), ``heavy_width`` (ids per heavy example: a 2-D batch),
  ``model=plain`` (a table and one Linear, no blocks), ``watch=inner`` (with ``ddp=1``: watch
  the module DDP wraps, train through DDP), ``nopolicy_rank`` (that rank watches without a
  policy), ``init=late`` (the group is initialised inside the ``watch()`` block, before the first
  step).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import edo_monitor


def _options(argv: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in argv)


def scenario_jobs(db: str, rank: int, opts: dict[str, str]) -> dict[str, Any]:
    if rank == int(opts.get("die_rank", "-1")):  # gone before the first collective
        time.sleep(float(opts.get("hang_s", "0")))  # (alive but never taking part, first)
        os._exit(3)
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Embedding(2_000, 16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = int(opts.get("steps", "10")) - (rank == int(opts.get("short_rank", "-1")))
    strict = opts.get("strict", "1") == "1"
    allreduce = opts.get("allreduce")
    if rank == int(opts.get("late_rank", "-1")):
        time.sleep(float(opts.get("late_s", "0")))
    t0 = time.monotonic()
    with edo_monitor.watch(
        model,
        db=db,
        interval_s=0.01,
        run_name="ranks-test",
        strict=strict,
        tensorboard=opts.get("tensorboard"),
    ) as m:
        enter_s = time.monotonic() - t0
        for _ in range(steps):
            x = torch.randint(0, 2_000, (64,))
            model(x).logsumexp(-1).mean().backward()
            if allreduce == "step":
                dist.all_reduce(torch.ones(4))
            opt.step()
            opt.zero_grad()
            time.sleep(0.002)
    after = None
    if allreduce:
        after = torch.ones(4)
        dist.all_reduce(after)
    s = m.summary()
    return {
        "after_block_sum": None if after is None else float(after[0]),
        "run_id": s.run_id,
        "status": s.recorded_status,
        "steps": s.steps,
        "errors": s.agent_errors,
        "job_id": m.job_id,
        "rank": m.rank,
        "world_size": m.world_size,
        "local_rank": m.local_rank,
        "summary_job_id": s.job_id,
        "enter_s": enter_s,
    }


ROWS, DIM = 20_000, 32


class Block(nn.Module):
    """A residual MLP block: its hidden activations are its own (checkpointing drops them)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 128)
        self.fc2 = nn.Linear(128, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    """An embedding table (params + grads + Adam state ~10.2 MB) and two blocks and a head."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.head = nn.Sequential(Block(), Block(), nn.Linear(DIM, 4))
        if tie:  # an output layer sharing the table's weight (never called)
            self.tied = nn.Linear(DIM, ROWS, bias=False)
            self.tied.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def scenario_pressure(db: str, rank: int, opts: dict[str, str]) -> dict[str, Any]:
    torch.manual_seed(0)  # the same initial model on every rank (DDP broadcasts it anyway)
    model: nn.Module = Net(tie=rank == int(opts.get("tie_rank", "-1")))
    if opts.get("model") == "plain":
        model = nn.Sequential(nn.Embedding(ROWS, DIM), nn.Linear(DIM, 1))
    watched = model
    if opts.get("ddp") == "1":
        model = nn.parallel.DistributedDataParallel(model)
        if opts.get("watch") != "inner":
            watched = model
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ladder = opts.get("ladder")
    policy: edo_monitor.Policy | None = (
        edo_monitor.Policy(ladder=ladder.split(",")) if ladder else edo_monitor.Policy()
    )
    if rank == int(opts.get("nopolicy_rank", "-1")):
        policy = None
    heavy = rank == int(opts.get("heavy_rank", "1"))
    light = (int(opts.get("light_batch", "64")),)
    heavy_shape = (int(opts.get("heavy_batch", "8192")), int(opts.get("heavy_width", "1")))
    heavy_from = int(opts.get("heavy_from", "0"))
    gen = torch.Generator().manual_seed(100 + rank)
    steps = int(opts.get("steps", "40"))
    with edo_monitor.watch(
        watched,
        db=db,
        budget=int(opts.get("budget", "14000000")),
        policy=policy,
        interval_s=0.005,
        sync_every_steps=int(opts.get("sync", "4")),
        run_name="pressure",
    ) as m:
        if opts.get("init") == "late":
            _join(rank, int(opts["world"]), opts["store"])
        for step in range(steps):
            shape = heavy_shape if heavy and step >= heavy_from else light
            if shape[-1] == 1:
                shape = shape[:1]
            ids = torch.randint(0, ROWS, shape, generator=gen)
            loss = model(ids).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.01)  # readings between steps
    s = m.summary()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {
        "run_id": s.run_id,
        "status": s.recorded_status,
        "steps": s.steps,
        "errors": s.agent_errors,
        "events": s.events,
        "min_free_fraction": s.min_free_fraction,
        "sync": m.sync_stats(),
        "checksum": checksum,
        "job_id": m.job_id,
    }


SCENARIOS = {"jobs": scenario_jobs, "pressure": scenario_pressure}


def _join(rank: int, world: int, store: str) -> None:
    """Join the gloo group of ``world`` ranks through the FileStore ``store``."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    # every rank has returned from joining before any goes on: gloo can return on one rank while
    # a peer still connects, and a rank that ends right after joining (``die_rank``) then cut
    # that peer's join ("Gloo connectFullMesh failed ... Connection closed by peer"). A store of
    # its own, not a collective of the group.
    joined = dist.FileStore(f"{store}.joined", world)
    joined.set(str(rank), "1")
    joined.wait([str(r) for r in range(world)])


def main() -> None:
    scenario, db, rank, world, store = sys.argv[1:6]
    opts = _options(sys.argv[6:])
    if opts.get("init") == "late":  # the scenario joins, inside its watch() block
        opts.update(world=world, store=store)
    else:
        _join(int(rank), int(world), store)
    try:
        out = SCENARIOS[scenario](db, int(rank), opts)
        if "die_rank" not in opts:
            # the ranks tear the group down together, as a launcher's job ends: a rank that
            # finished first and destroyed its gloo group while its peer still trained aborted
            # ("terminate called without an active exception") once in CI
            finished = dist.FileStore(f"{store}.finished", int(world))
            finished.set(rank, "1")
            finished.wait([str(r) for r in range(int(world))], timedelta(seconds=60))
    finally:
        dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
