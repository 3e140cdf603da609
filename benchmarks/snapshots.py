"""Incident snapshots of the main demo: how large they are stored, and what taking one costs.

    .venv/bin/python benchmarks/snapshots.py [--steps 100] [--dir /tmp/edo-snapshots]
        [--repeat 200]

Runs the main example (``examples/train_embedding.py``, CPU, its default 158 MiB budget and
policy, ``--steps``) into a fresh history, then prints one row per stored snapshot: its event,
phase, allocated bytes, pickle and stored (zlib) bytes, and the time taking it cost the thread it
ran on (``edo.take_s``, recorded by the agent: building it from the accounting). Then the
encode (pickle + zlib) time of the crossing's snapshot, the median of ``--repeat`` runs. The
goal (issue 25): the crossing's snapshot ≤ 1 MiB stored. The load average is printed beside it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/edo-snapshots"))
    args = ap.parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    db = args.dir / "demo.db"
    cmd = [sys.executable, str(ROOT / "examples/train_embedding.py"), "--device", "cpu",
           "--db", str(db), "--steps", str(args.steps)]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wall_s = time.perf_counter() - t0
    if done.returncode not in (0, 1):  # 1: the demo may stop on an out-of-memory error
        print(done.stderr[-3000:], file=sys.stderr)
        return done.returncode

    from edo_monitor.measure.snapshots import encode
    from edo_monitor.store.history import History
    from edo_monitor.store.snapshot_store import load_snapshot, snapshot_infos
    from edo_monitor.units import format_bytes

    print(f"{' '.join(cmd[1:])}: exit {done.returncode}, {wall_s:.1f} s")
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    print()
    print("| event | kind | phase | allocated | pickle | stored | take (ms) |")
    print("|---|---|---|---|---|---|---|")
    crossing = None
    with History(db) as h:
        run = h.run("latest")
        for info in snapshot_infos(h, run.id):
            snap = load_snapshot(h, info)
            take_ms = snap.get("edo", {}).get("take_s", float("nan")) * 1e3
            print(
                f"| {info.event_id} | {info.event_kind} | {info.phase} | "
                f"{format_bytes(info.allocated_bytes)} | {info.raw_bytes:,} | "
                f"{info.stored_bytes:,} | {take_ms:.3f} |"
            )
            if crossing is None and info.event_kind == "threshold_crossed":
                crossing = (info, snap)
    if crossing is None:
        print("\nno crossing in this run")
        return 1
    info, snap = crossing
    times = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        encode(snap)
        times.append(time.perf_counter() - t)
    print(
        f"\ncrossing snapshot (event {info.event_id}): stored {info.stored_bytes:,} bytes "
        f"({'within' if info.stored_bytes <= 2**20 else 'OVER'} the 1 MiB goal); encode median "
        f"{statistics.median(times) * 1e3:.3f} ms over {args.repeat}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
