"""The default policy under a load that comes in phases: actions taken and free memory kept.

    .venv/bin/python benchmarks/policy_loads.py [--steps 300] [--phases 5,10,20,30,45,100]
        [--dir /tmp/edo-policy-loads]

A real training loop under ``watch()`` in CPU-budget mode (a 40,000 x 32 ``EmbeddingBag`` trained
with Adam, a 32 -> 512 -> 2 head; budget 24 MiB): batches of 64 bags in the light phases and 2,048
in the heavy ones (square wave, light first, each phase ``P`` steps). The table with Adam's
moments and its dense gradient does not fit beside the first step: the policy caches it at step
1 and grows the cache back to 39,999 rows in the light phase (resident again would not fit with
the dense gradient); a heavy phase at that size is under the 20 % floor, and a shrink by 4,096
rows keeps it at 25 %. Each run is one of two policies, side by side for each ``P``:

- ``fixed``: the default policy with its 20-step grow look-back held (as before the look-back
  learned: a ``Policy`` whose ``_learn_from_undone_grow`` learns nothing);
- ``learning``: the default ``Policy()`` (a crossing within 4 look-backs of an applied grow
  doubles the look-back, up to 320 steps).

Prints, per run: the actions applied (and how many were ``grow_cache``), the lowest free fraction
of the heavy phases after the first one, the steps under the 20 % floor, the look-back at the end
and the wall time. Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sqlite3
import time
from pathlib import Path

import torch
from torch import nn

import edo_monitor
from edo_monitor.store.history import History

ROWS, DIM, HIDDEN = 40_000, 32, 512
LIGHT, HEAVY = 64, 2048
BUDGET = 24 * 2**20


class FixedLookBack(edo_monitor.Policy):
    """The default policy with the look-back it starts with kept for the whole run."""

    def _learn_from_undone_grow(self, grown: int | None, step: int) -> None:
        pass


def train(db: Path, policy: edo_monitor.Policy, phase_steps: int, steps: int) -> int:
    """One run of ``steps`` steps, light and heavy phases of ``phase_steps``; its run id."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.EmbeddingBag(ROWS, DIM), nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 2)
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    with edo_monitor.watch(
        model, db=str(db), budget=BUDGET, policy=policy, interval_s=0.005, run_name="loads"
    ) as mon:
        for step in range(steps):
            bags = HEAVY if (step // phase_steps) % 2 else LIGHT
            ids = torch.randint(0, ROWS, (bags, 8), generator=gen)
            target = torch.randint(0, 2, (bags,), generator=gen)
            nn.functional.cross_entropy(model(ids), target).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.01)  # the loader's time: the sampler reads each step
    return mon.run_id


def summary(db: Path, run: int, phase_steps: int, steps: int) -> dict[str, object]:
    """What the run did: actions, grows, lowest heavy free after the first heavy phase, steps
    under the floor (the steps of the loop: not the reading at the block's end, step ``steps``)."""
    with History(db) as h:
        actions = [e.data["action"] for e in h.events(run, kind="action")]
    con = sqlite3.connect(db)
    try:
        lowest = dict(
            con.execute(
                "SELECT step, MIN(free_fraction) FROM samples WHERE run_id = ? AND "
                "step < ? AND free_fraction IS NOT NULL GROUP BY step",
                (run, steps),
            ).fetchall()
        )
    finally:
        con.close()
    later_heavy = [f for s, f in lowest.items() if (s // phase_steps) % 2 and s >= 2 * phase_steps]
    return {
        "actions": len(actions),
        "grows": actions.count("grow_cache"),
        "min_free_later_heavy": min(later_heavy) if later_heavy else None,
        "steps_under_floor": sum(1 for f in lowest.values() if f < 0.20),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--phases", default="5,10,20,30,45,100", help="phase lengths, steps")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/edo-policy-loads"))
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    print(
        f"# policy under phased loads, {now} UTC, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, load {load:.1f}, "
        f"torch {torch.__version__}, {args.steps} steps a run\n"
    )
    print(
        "| phase steps | policy | actions | of them grow_cache | lowest free, heavy phases "
        "after the first | steps under 20 % | look-back at the end | wall s |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for phase_steps in (int(p) for p in args.phases.split(",")):
        for name, policy in (("fixed", FixedLookBack()), ("learning", edo_monitor.Policy())):
            db = args.dir / f"loads-{phase_steps}-{name}.db"
            for suffix in ("", "-wal", "-shm"):
                Path(f"{db}{suffix}").unlink(missing_ok=True)
            t0 = time.perf_counter()
            run = train(db, policy, phase_steps, args.steps)
            wall = time.perf_counter() - t0
            s = summary(db, run, phase_steps, args.steps)
            low = s["min_free_later_heavy"]
            print(
                f"| {phase_steps} | {name} | {s['actions']} | {s['grows']} | "
                f"{'-' if low is None else f'{low:.1%}'} | {s['steps_under_floor']} | "
                f"{policy.grow_lookback_steps} | {wall:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
