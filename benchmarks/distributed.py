"""Multi-rank overhead: step time of a DDP job with and without ``watch()``, and the cost of the
ranks' agreement (issue 13, "Figures").

    .venv/bin/python benchmarks/distributed.py [--world-sizes 2,4] [--seconds 60]
        [--block-steps 12] [--batch 256] [--sync-every 4] [--dir /tmp/edo-distributed]

For each world size the script starts that many processes (``torch.multiprocessing.spawn``),
joined in a gloo process group over a FileStore, each with one CPU thread. Each rank trains the
same model wrapped in ``DistributedDataParallel``: an embedding table of 20,000 x 32 and two
residual MLP blocks (32 -> 128 -> 32) and a linear head (tests/ranks_worker.py's ``Net``), Adam,
``--batch`` random ids a step, so each step all-reduces the table's dense gradient (2.6 MB).

**Side by side.** Rounds of three blocks, ``off`` (no agent), ``off-control`` (the same again:
an A/A control whose ratio to ``off`` is the method's noise) and ``watched`` (``watch(model,
budget="1GiB", sync_every_steps=--sync-every)``: the agent samples, evaluates its policy and the
ranks agree every ``--sync-every`` steps; the budget is large, so nothing is decided), in an order
rotated each round, until ``--seconds`` are spent. Every rank runs the same blocks at the same
time (DDP's all-reduce keeps them in step). A block is two untimed steps (a fresh ``watch()``'s
start: the job id's broadcast, the first sample and activation profile) then ``--block-steps``
timed steps; its time is rank 0's wall time / steps (the all-reduce makes every rank's about the
same). The **ratio** is the median over rounds of watched / off in the same round, with the
interquartile range of the per-round ratios; absolute times drift on a shared machine, the
ratios are what count.

**Agreement cost.** Each watched block's ``Monitor.sync_stats()`` on every rank: the wall time
of one agreement (its ``all_gather`` of four int64 per rank, and its local checks), including
the wait for the slowest rank to reach it. Shown: the median over blocks of each rank's median,
and the largest rank's. For scale, the same ``all_gather`` of four int64 alone, timed 200 times
in a loop after the rounds (``raw all_gather``).

With 4 ranks on a 2-core machine, processes share cores: steps are slower, and waits at the
collectives grow, for watched and off blocks alike.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import edo_monitor

ROOT = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 2
ROWS, DIM = 20_000, 32


class Block(nn.Module):
    """``x + fc2(relu(fc1(x)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 128)
        self.fc2 = nn.Linear(128, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    """An embedding table, two blocks and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.head = nn.Sequential(Block(), Block(), nn.Linear(DIM, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, batch: int, gen: Any) -> float:
    """``n`` training steps; wall seconds per step."""
    t0 = time.perf_counter()
    for _ in range(n):
        ids = torch.randint(0, ROWS, (batch,), generator=gen)
        model(ids).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) / max(1, n)


def _block(
    mode: str, model: nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace, gen: Any
) -> tuple[float, dict[str, Any] | None]:
    if mode != "watched":
        _steps(model, opt, WARMUP_STEPS, args.batch, gen)
        return _steps(model, opt, args.block_steps, args.batch, gen), None
    with edo_monitor.watch(
        model,
        opt,
        db=str(Path(args.dir) / "history.db"),
        budget="1GiB",
        sync_every_steps=args.sync_every,
        run_name=f"distributed-bench-{dist.get_world_size()}",
    ) as monitor:
        _steps(model, opt, WARMUP_STEPS, args.batch, gen)
        per_step = _steps(model, opt, args.block_steps, args.batch, gen)
    return per_step, monitor.sync_stats()


def _rank_main(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        os.environ.pop(name, None)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    rounds: list[dict[str, float]] = []
    syncs: list[dict[str, Any]] = []
    start = time.monotonic()
    while True:  # rank 0 decides when to stop, every rank hears it
        go = torch.tensor([int(time.monotonic() - start < args.seconds or len(rounds) < 3)])
        dist.broadcast(go, 0)
        if not go.item():
            break
        modes = ("off", "off-control", "watched")
        k = len(rounds) % len(modes)
        order = modes[k:] + modes[:k]
        times: dict[str, float] = {}
        for mode in order:
            times[mode], stats = _block(mode, model, opt, args, gen)
            if stats is not None:
                syncs.append(stats)
        rounds.append(times)
    raw = []
    mine = torch.tensor([rank, 1, 2, 3], dtype=torch.int64)
    gathered = [torch.empty(4, dtype=torch.int64) for _ in range(world)]
    for _ in range(200):
        t0 = time.perf_counter()
        dist.all_gather(gathered, mine)
        raw.append(time.perf_counter() - t0)
    everything: list[Any] = [None] * world
    dist.all_gather_object(everything, {"rank": rank, "rounds": rounds, "syncs": syncs, "raw": raw})
    if rank == 0:
        import json

        Path(out).write_text(json.dumps(everything))
    dist.destroy_process_group()


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.2f}"


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def measure(world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run the rounds with ``world`` ranks; the summary row."""
    import json

    folder = Path(tempfile.mkdtemp(prefix=f"w{world}-", dir=args.dir))
    out = folder / "result.json"
    wall0 = time.monotonic()
    mp.spawn(
        _rank_main,
        args=(world, str(folder / "store"), args, str(out)),
        nprocs=world,
        join=True,
    )
    wall = time.monotonic() - wall0
    ranks = json.loads(out.read_text())
    rounds = ranks[0]["rounds"]
    ratios = [r["watched"] / r["off"] for r in rounds]
    q1, q3 = _quartiles(ratios)
    controls = [r["off-control"] / r["off"] for r in rounds]
    c1, c3 = _quartiles(controls)
    per_rank_median = [
        statistics.median(s["median_sync_s"] for s in r["syncs"] if s["syncs"]) for r in ranks
    ]
    per_rank_mean = [
        statistics.fmean(s["mean_sync_s"] for s in r["syncs"] if s["syncs"]) for r in ranks
    ]
    return {
        "world": world,
        "rounds": len(rounds),
        "off_ms": statistics.median(r["off"] for r in rounds) * 1000,
        "watched_ms": statistics.median(r["watched"] for r in rounds) * 1000,
        "ratio": statistics.median(ratios),
        "ratio_iqr": (q1, q3),
        "control": statistics.median(controls),
        "control_iqr": (c1, c3),
        "syncs_per_block": ranks[0]["syncs"][0]["syncs"],
        "sync_median_ms": [m * 1000 for m in per_rank_median],
        "sync_mean_ms": [m * 1000 for m in per_rank_mean],
        "raw_median_ms": [statistics.median(r["raw"]) * 1000 for r in ranks],
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated (default 2,4)")
    parser.add_argument("--seconds", type=float, default=60.0, help="per world size (default 60)")
    parser.add_argument("--block-steps", type=int, default=12, help="timed steps a block")
    parser.add_argument("--batch", type=int, default=256, help="ids a step on every rank")
    parser.add_argument("--sync-every", type=int, default=4, help="watch(sync_every_steps=)")
    parser.add_argument("--dir", default=None, help="folder for the history and the stores")
    args = parser.parse_args(argv)
    args.dir = args.dir or tempfile.mkdtemp(prefix="edo-distributed-")
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    worlds = [int(w) for w in args.world_sizes.split(",")]
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, "
        f"{platform.machine()} {os.cpu_count()} CPU(s), load {os.getloadavg()[0]:.2f}, "
        f"torch {torch.__version__}, gloo, {args.block_steps} steps a block, batch {args.batch}, "
        f"sync every {args.sync_every} steps"
    )
    rows = [measure(w, args) for w in worlds]
    print(
        "| ranks | rounds | off ms/step | watched ms/step | ratio watched/off (IQR) | "
        "A/A control off/off (IQR) | "
        "agreements a block | agreement median ms (by rank) | agreement mean ms (by rank) | "
        "raw all_gather median ms (by rank) | wall s |"
    )
    print("|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        print(
            f"| {r['world']} | {r['rounds']} | {r['off_ms']:.2f} | {r['watched_ms']:.2f} | "
            f"{r['ratio']:.3f} ({r['ratio_iqr'][0]:.3f}–{r['ratio_iqr'][1]:.3f}) | "
            f"{r['control']:.3f} ({r['control_iqr'][0]:.3f}–{r['control_iqr'][1]:.3f}) | "
            f"{r['syncs_per_block']} | {' / '.join(f'{m:.2f}' for m in r['sync_median_ms'])} | "
            f"{' / '.join(f'{m:.2f}' for m in r['sync_mean_ms'])} | "
            f"{' / '.join(f'{m:.3f}' for m in r['raw_median_ms'])} | {r['wall_s']:.0f} |"
        )
    print(f"# load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
