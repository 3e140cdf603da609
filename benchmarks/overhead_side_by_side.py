"""Step time bare and under ``watch()``, side by side: interleaved blocks, ratio per round.

    .venv/bin/python benchmarks/overhead_side_by_side.py [--steps 40] [--rounds 12]

The model, optimizer and batch of ``benchmarks/overhead.py`` (``Trainer``: the example's
``HashedWordModel``, Adam, batch 1024, one intra-op thread). Each round runs one block bare and one
under ``watch(model)`` (defaults, a fresh SQLite history), in an order alternating from round to
round; a block is 2 untimed steps, then ``--steps`` timed ones. Printed: each round's mean step
times and watched / bare, then the median of the per-round ratios and their range. Then the
training thread's time inside the agent's hooks in one more watched block (the optimizer step
post-hook, the saved-tensor pack hook, the LookupCounter's forward pre-hook; ``perf_counter``
around each call), as a fraction of that block's step time.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead as ob
import torch

import edo_monitor
from edo_monitor.agent.activations import ActivationTracker
from edo_monitor.agent.safe_point import SafePoint
from edo_monitor.measure import frequency


def _block(tr: ob.Trainer, steps: int, db: str | None) -> float:
    """Mean seconds per step of ``steps`` steps, under ``watch`` when ``db`` is given."""
    cm = edo_monitor.watch(tr.model, db=db) if db else contextlib.nullcontext()
    with cm:
        for _ in range(2):
            tr.step()
        t = time.perf_counter()
        for _ in range(steps):
            tr.step()
        return (time.perf_counter() - t) / steps


def _timed_parts(tr: ob.Trainer, steps: int, db: str) -> tuple[float, dict[str, float]]:
    """(seconds per step, training-thread seconds per step in each hook) of one watched block."""
    totals: dict[str, float] = {}

    def timed(label: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                return fn(*args, **kwargs)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - t

        return wrapper

    saved = [(SafePoint, "on_optimizer_step"), (ActivationTracker, "pack")]
    originals = [getattr(c, n) for c, n in saved]
    SafePoint.on_optimizer_step = timed("optimizer step post-hook (safe point)", originals[0])
    ActivationTracker.pack = timed("saved-tensor pack hook", originals[1])
    watch_table = frequency.LookupCounter.watch

    def watch(self: Any, name: str, module: Any) -> None:
        watch_table(self, name, module)
        hooks = module._forward_pre_hooks
        hid = self._handles[name].id
        hooks[hid] = timed("LookupCounter forward pre-hook", hooks[hid])

    frequency.LookupCounter.watch = watch  # type: ignore[method-assign]
    try:
        with edo_monitor.watch(tr.model, db=db):
            for _ in range(2):
                tr.step()
            totals.clear()
            t = time.perf_counter()
            for _ in range(steps):
                tr.step()
            step_s = (time.perf_counter() - t) / steps
    finally:
        for (c, n), fn in zip(saved, originals, strict=True):
            setattr(c, n, fn)
        frequency.LookupCounter.watch = watch_table  # type: ignore[method-assign]
    return step_s, {k: v / steps for k, v in totals.items()}


def main() -> None:
    """Run the rounds and print the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tr = ob.Trainer(ob.load_example(), 1024)
    tmp = tempfile.mkdtemp(prefix="edo-side-")
    print(f"# load average {os.getloadavg()[0]:.1f} at the start")
    ratios = []
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        res = {
            w: _block(tr, args.steps, os.path.join(tmp, f"h{r}.db") if w else None) for w in order
        }
        ratios.append(res[True] / res[False])
        print(
            f"round {r}: bare {1e3 * res[False]:.1f} ms/step, watched {1e3 * res[True]:.1f} "
            f"ms/step, watched / bare {ratios[-1]:.3f}",
            flush=True,
        )
    print(
        f"watched / bare, median of {len(ratios)} rounds: {statistics.median(ratios):.3f}x "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}x); load average {os.getloadavg()[0]:.1f}"
    )
    step_s, parts = _timed_parts(tr, args.steps, os.path.join(tmp, "parts.db"))
    for label, s in parts.items():
        print(f"{label}: {1e6 * s:.0f} us/step, {100 * s / step_s:.2f} % of a step")


if __name__ == "__main__":
    main()
