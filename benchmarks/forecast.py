"""Foresight (issue 14, item 2): warning before the crossing, and false alarms.

    .venv/bin/python benchmarks/forecast.py [--forecast 10] [--data ../shared/data/movielens-small]
        [--dir /tmp/edo-forecast] [--noise-runs 1000]

1. **The demo** (`examples/train_embedding.py`, CPU budget 158 MiB, 100 steps, the batch growing
   linearly from 512 to 8,192 rows: ``--ramp linear``): observed with forecasting (``--no-tune
   --forecast N``: the prediction against the crossing that really happens), tuned without
   forecasting (acts at the crossing), tuned with forecasting (acts ahead).
2. **False alarms** over the other example runs, each with ``--forecast N``: the pressure demo as
   shipped (doubling ramp), tuned and observed; the recommender (MovieLens, one epoch) with an
   8 MiB budget (tuned: cached at the first step) and a 64 MiB one (no pressure). Then every run
   recorded above replayed offline with ``forecast_steps`` 5, 10, 20 and 40 (``replay``: the
   same Policy, the actions modelled).
3. **Noise**: ``--noise-runs`` synthetic runs of 400 steps, flat between 22 % and 30 % free with
   uniform noise of 0.1 % to 2 % of the budget, through ``Policy(forecast_steps=10 / 50)``.

A false alarm is a forecast judged ``came_true=False``: free memory (without the actions applied
since the forecast) stayed at or above the floor until past the predicted step +
``FORECAST_GRACE_STEPS``. "Open" forecasts were still waiting when the run ended. Warning: steps
from the forecast to the crossing it predicted (``lead_steps``). Prints markdown tables.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from edo_monitor.decide.policy import Policy
from edo_monitor.decide.policy_events import Forecast
from edo_monitor.hindsight.replay import replay
from edo_monitor.probes.readings import Reading
from edo_monitor.store.history import History

ROOT = Path(__file__).resolve().parents[1]


def run_example(script: str, db: Path, args: list[str]) -> tuple[int, float]:
    """Run ``examples/<script>`` into its own database; returns (exit code, wall seconds)."""
    db.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--db", str(db), *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode not in (0, 1):
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"{script} {' '.join(args)} exited {proc.returncode}")
    return proc.returncode, time.perf_counter() - t0


def summarise(db: Path) -> dict[str, Any]:
    """Forecasts, outcomes, first crossing and action, minimum free of the run in ``db``."""
    with History(db) as h:
        info = h.run("latest")
        events = h.events(info.id)
    forecasts = [e for e in events if e.kind == "forecast"]
    outcomes = [e.data for e in events if e.kind == "forecast_outcome"]
    below = [
        e.step for e in events if e.kind == "threshold_crossed" and e.data["direction"] == "below"
    ]
    actions = [e.step for e in events if e.kind == "action"]
    return {
        "steps": info.steps,
        "status": info.status,
        "forecasts": len(forecasts),
        "first_forecast": forecasts[0].step if forecasts else None,
        "first_predicted": forecasts[0].data["predicted_step"] if forecasts else None,
        "true": sum(o["came_true"] is True for o in outcomes),
        "false": sum(o["came_true"] is False for o in outcomes),
        "open": sum(o["came_true"] is None for o in outcomes),
        "leads": [o["lead_steps"] for o in outcomes if o["came_true"]],
        "first_crossing": below[0] if below else None,
        "crossings": len(below),
        "first_action": actions[0] if actions else None,
        "actions": len(actions),
        "min_free": info.min_free_fraction,
        "run_id": info.id,
    }


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1%}"
    if isinstance(v, list):
        return ", ".join(map(str, v)) or "-"
    return str(v)


def noise_runs(n: int, forecast_steps: int) -> tuple[int, int]:
    """(runs with a forecast, forecasts) over ``n`` noisy flat runs."""
    budget = 100 * 2**20
    with_forecast = total = 0
    for seed in range(n):
        rng = random.Random(seed)
        level = rng.uniform(0.70, 0.78) * budget
        noise = rng.uniform(0.001, 0.02) * budget
        policy = Policy(forecast_steps=forecast_steps, mode="observe")
        count = 0
        for step in range(1, 400):
            in_use = int(level + rng.uniform(-noise, noise))
            r = Reading(
                time_s=float(step),
                step=step,
                device_kind="cpu-budget",
                budget_bytes=budget,
                in_use_bytes=in_use,
                free_fraction=(budget - in_use) / budget,
            )
            count += sum(isinstance(e, Forecast) for e in policy.evaluate(r))
        with_forecast += count > 0
        total += count
    return with_forecast, total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forecast", type=int, default=10, help="forecast_steps (default 10)")
    parser.add_argument(
        "--data", type=Path, default=ROOT.parent / "shared" / "data" / "movielens-small"
    )
    parser.add_argument("--dir", type=Path, default=Path("/tmp/edo-forecast"))
    parser.add_argument("--noise-runs", type=int, default=1000)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    f = str(args.forecast)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; forecast_steps {f}"
    )

    demo = [
        (
            "linear ramp, observe, forecast",
            "train_embedding.py",
            ["--ramp", "linear", "--no-tune", "--forecast", f],
        ),
        ("linear ramp, tuned, no forecast", "train_embedding.py", ["--ramp", "linear"]),
        (
            "linear ramp, tuned, forecast",
            "train_embedding.py",
            ["--ramp", "linear", "--forecast", f],
        ),
    ]
    others = [
        ("doubling ramp (the shipped demo), tuned", "train_embedding.py", ["--forecast", f]),
        ("doubling ramp, observe", "train_embedding.py", ["--no-tune", "--forecast", f]),
    ]
    if (args.data / "ratings.csv").is_file():
        rec = ["--data", str(args.data), "--epochs", "1", "--no-compare", "--forecast", f]
        others += [
            (
                "recommender, 8 MiB budget, tuned",
                "train_recommender.py",
                [*rec, "--budget", "8MiB"],
            ),
            (
                "recommender, 64 MiB budget (no pressure)",
                "train_recommender.py",
                [*rec, "--budget", "64MiB"],
            ),
        ]
    else:
        print(f"(no MovieLens at {args.data}: recommender runs skipped)")

    results: dict[str, dict[str, Any]] = {}
    for i, (label, script, extra) in enumerate(demo + others):
        db = args.dir / f"run{i}.db"
        code, wall = run_example(script, db, extra)
        results[label] = {**summarise(db), "exit": code, "wall_s": wall, "db": db}

    print("\n## The demo: batch ramp 512 -> 8,192 linear, 158 MiB, 100 steps\n")
    print(
        "| run | exit | first forecast (predicted step) | forecasts | came true | false | open "
        "| warning steps | first action | crossings below the floor (first) | min free |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|")
    for label, *_ in demo:
        r = results[label]
        print(
            f"| {label} | {r['exit']} | {fmt(r['first_forecast'])} ({fmt(r['first_predicted'])}) "
            f"| {r['forecasts']} | {r['true']} | {r['false']} | {r['open']} | {fmt(r['leads'])} "
            f"| {fmt(r['first_action'])} | {r['crossings']} ({fmt(r['first_crossing'])}) "
            f"| {fmt(r['min_free'])} |"
        )

    print("\n## False alarms over the other examples' runs (live, forecast_steps", f + ")\n")
    print(
        "| run | exit | steps | forecasts | came true | false | open "
        "| crossings below the floor | min free |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for label, *_ in others:
        r = results[label]
        print(
            f"| {label} | {r['exit']} | {r['steps']} | {r['forecasts']} | {r['true']} "
            f"| {r['false']} | {r['open']} | {r['crossings']} | {fmt(r['min_free'])} |"
        )

    print("\n## Replayed offline with forecast_steps 5 / 10 / 20 / 40 (every run above)\n")
    print("| run | forecasts | came true | false | open |")
    print("|---|--:|--:|--:|--:|")
    totals = [0, 0, 0, 0]
    for label, r in results.items():
        row = [0, 0, 0, 0]
        for n in (5, 10, 20, 40):
            res = replay(r["db"], "latest", {"forecast_steps": n})
            row[0] += len(res.forecasts)
            row[1] += sum(x.came_true is True for x in res.forecasts)
            row[2] += sum(x.came_true is False for x in res.forecasts)
            row[3] += sum(x.came_true is None for x in res.forecasts)
        totals = [a + b for a, b in zip(totals, row, strict=True)]
        print(f"| {label} | {row[0]} | {row[1]} | {row[2]} | {row[3]} |")
    print(f"| **all** | {totals[0]} | {totals[1]} | **{totals[2]}** | {totals[3]} |")

    print(f"\n## Noise: {args.noise_runs} flat runs of 400 steps, 22-30 % free, uniform noise\n")
    print("| forecast_steps | runs with a forecast | forecasts |")
    print("|--:|--:|--:|")
    for n in (10, 50):
        runs_with, count = noise_runs(args.noise_runs, n)
        print(f"| {n} | {runs_with} | {count} |")
    print(
        "\nwall time of the example runs: "
        + ", ".join(f"{r['wall_s']:.0f} s" for r in results.values())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
