"""Replay speed: samples per second through the real Policy (``edo_monitor.hindsight.replay``).

    .venv/bin/python benchmarks/replay.py [--samples 1000000] [--repeats 3] [--dir /tmp/edo-bench]

Builds one synthetic run of ``--samples`` samples in a real SQLite file through the agent
writer's bulk path (:func:`edo_monitor.store.engine.write_samples`, rollups kept): CPU-budget
mode, a 1 GiB budget, one 100,000 x 64 float32 embedding table trained with Adam (its
``module_stats`` row), 4 samples a step, in-use bytes in a sawtooth that crosses the 20 % floor
once every 1,000 steps, so the policy decides (cache_embedding, then shrinks) again and again.
Then, interleaved ``--repeats`` times: reading the same sample columns alone (one ``SELECT``,
rows fetched and unpacked in Python) and the whole replay (reading + a ``Reading`` per sample +
``Policy.evaluate`` + the modelled effects). Prints medians and the ratio replay / reading.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
import uuid
from pathlib import Path

from sqlalchemy.orm import Session

from edo_monitor.hindsight.replay import replay, replay_samples
from edo_monitor.probes.readings import SAMPLE_FIELDS
from edo_monitor.store.engine import open_engine, write_samples
from edo_monitor.store.history import History
from edo_monitor.store.models import ModuleStat, Run

BUDGET = 2**30
ROWS, DIM = 100_000, 64


def build(path: Path, samples: int) -> int:
    """Write the synthetic run; returns its id."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    engine = open_engine(str(path))
    t0 = 1.7e9
    table_bytes = ROWS * DIM * 4
    with Session(engine) as s, s.begin():
        run = Run(
            uuid=str(uuid.UUID(int=1)),
            name="replay-bench",
            host="bench",
            pid=0,
            started_at_s=t0,
            status="finished",
            device_kind="cpu-budget",
            budget_bytes=BUDGET,
            interval_s=0.25,
            torch_version="bench",
            config={"floor": 0.2},
            tags=[],
            steps=samples // 4,
        )
        s.add(run)
        s.flush()
        s.add(
            ModuleStat(
                run_id=run.id,
                time_s=t0,
                step=0,
                module="features",
                kind="EmbeddingBag",
                num_embeddings=ROWS,
                embedding_dim=DIM,
                dtype="float32",
                device="cpu",
                placement="device",
                params_bytes=table_bytes,
                grads_bytes=table_bytes,
                optimizer_state_bytes=2 * table_bytes + 4,
            )
        )
        run_id = run.id
    index = {name: i for i, name in enumerate(SAMPLE_FIELDS)}
    base = 4 * table_bytes
    batch: list[list[object]] = []
    with engine.connect() as conn:
        for i in range(samples):
            step = i // 4
            act = int((0.2 + 0.6 * ((step % 1000) / 1000)) * BUDGET)  # sawtooth of activations
            in_use = base + act
            row: list[object] = [None] * len(SAMPLE_FIELDS)
            row[index["time_s"]] = t0 + i * 0.25
            row[index["step"]] = step
            row[index["device_kind"]] = "cpu-budget"
            row[index["params_bytes"]] = table_bytes
            row[index["grads_bytes"]] = table_bytes
            row[index["optimizer_state_bytes"]] = 2 * table_bytes
            row[index["activations_bytes"]] = act
            row[index["budget_bytes"]] = BUDGET
            row[index["in_use_bytes"]] = in_use
            row[index["free_fraction"]] = (BUDGET - in_use) / BUDGET
            batch.append(row)
            if len(batch) == 10_000:
                write_samples(conn, run_id, batch)
                conn.commit()
                batch = []
        if batch:
            write_samples(conn, run_id, batch)
            conn.commit()
    engine.dispose()
    return run_id


def _existing(path: Path, samples: int) -> int | None:
    """The id of the benchmark's run in ``path`` when it holds ``samples`` samples, else None."""
    if not path.exists():
        return None
    with History(str(path)) as h:
        runs = [r for r in h.runs() if r.name == "replay-bench"]
        return runs[0].id if runs and runs[0].sample_count == samples else None


def read_only(path: Path, run_id: int) -> float:
    """Seconds to read and unpack the columns replay reads, the way it reads them."""
    t0 = time.perf_counter()
    with History(str(path)) as h, h._read() as conn:
        n = 0
        for chunk in replay_samples(conn, run_id):
            for _t, _s, _k, _u, _b, _f, _r in chunk:
                n += 1
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/edo-bench"))
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="replay the run already in --dir when it has --samples samples (no rebuild)",
    )
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / "replay-bench.db"
    t0 = time.perf_counter()
    run_id = _existing(path, args.samples) if args.reuse else None
    reused = run_id is not None
    if run_id is None:
        run_id = build(path, args.samples)
    build_s = time.perf_counter() - t0
    reads, replays = [], []
    result = None
    for _ in range(args.repeats):
        reads.append(read_only(path, run_id))
        t1 = time.perf_counter()
        result = replay(str(path), run_id)
        replays.append(time.perf_counter() - t1)
    assert result is not None
    read_s, replay_s = statistics.median(reads), statistics.median(replays)
    print(
        f"# replay benchmark, {datetime.date.today()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    made = "reused" if reused else f"written in {build_s:.1f} s"
    print(f"synthetic run: {result.samples:,} samples, {made}")
    print(
        f"replayed decisions: {len(result.decisions):,} "
        f"(first: {result.decisions[0].action if result.decisions else '-'}), "
        f"crossings: {len(result.crossings):,}"
    )
    print()
    print("| what | median s | samples/s | ratio to reading |")
    print("|---|---:|---:|---:|")
    print(f"| reading the columns alone | {read_s:.2f} | {result.samples / read_s:,.0f} | 1.00 |")
    print(
        f"| replay (whole: read + policy + model) | {replay_s:.2f} | "
        f"{result.samples / replay_s:,.0f} | {replay_s / read_s:.2f} |"
    )
    goal = "met" if replay_s <= 10 * result.samples / 1_000_000 else "NOT met"
    print(f"\ngoal (1,000,000 samples in <= 10 s): {goal}")


if __name__ == "__main__":
    main()
