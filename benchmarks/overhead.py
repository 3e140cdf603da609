"""Agent overhead: step time with and without ``watch()``, enqueue cost, writer throughput.

    .venv/bin/python benchmarks/overhead.py [--batch 1024] [--seconds 150] [--block-s 2.5]
        [--writer-samples 200000] [--enqueue-calls 100000] [--threads N] [--dir /tmp/edo-overhead]
        [--device cpu|cuda]

What is measured, and how (issues 2 and 3, "Done when"):

1. **Step time.** The main example's model (``examples/train_embedding.py``: ``HashedWordModel``,
   its dataset from ``default_text()``, Adam lr 0.01), one training step = sample a batch of
   ``--batch`` positions, forward, cross-entropy, backward, ``opt.step()``,
   ``opt.zero_grad(set_to_none=True)``, ``loss.item()`` (which waits for the device, so a step's
   wall time includes its CUDA kernels with ``--device cuda``: model and data on the GPU, the
   agent then reads NVML and the CUDA allocator). No policy, no budget. Six modes:

   - ``off``: no agent at all (no ``watch()`` block, no hooks, no threads);
   - ``off-control``: the same again, an A/A control: its ratio to ``off`` is the method's noise;
   - ``default``: ``watch(model)`` with every default (interval ``DEFAULT_INTERVAL_S``,
     activation tracking on, per-module activation profile every 30 s);
   - ``no-activations``: ``watch(model, track_activations=False)``;
   - ``profile-every-step``: ``watch(model, profile_interval_s=1e-6)``: the per-module activation
     profile (forward hooks on every module) recorded on every step instead of every 30 s;
   - ``snapshots-off``: ``watch(model, snapshots=False)``: no incident snapshots (the default
     takes them, built only at an incident: ``default`` / ``snapshots-off`` is their cost).

   All modes run in one process, interleaved: each round runs one block of each mode, in an order
   rotated from round to round, until ``--seconds`` are spent. A block is a fresh ``watch()`` (or
   none): two untimed steps first (the sampler's first tick, the optimizer discovery and the first
   activation profile, which a fresh watch arms at once, fall there), then ``K`` timed steps (``K``
   chosen so that a block lasts about ``--block-s``, i.e. several sampler ticks). Per block: wall
   time / K (so the sampler's ticks, which hit only some steps, are charged to the mean), the
   process's CPU time / K, the per-step wall times, and the CPU time of the agent's threads
   (``edo-sampler``, ``edo-writer``; ``time.pthread_getcpuclockid``). The **ratio** of a mode is the
   median over rounds of (its block's mean step time / the ``off`` block's in the same round), shown
   with a 95 % bootstrap confidence interval of that median and the interquartile range of the
   per-round ratios; "CPU ratio" is the same for the process's CPU time per step. Medians of the
   per-step times are shown too (they hide the ticks: most steps see none). Before every ``off``
   block the script checks that no agent thread and no optimizer step hook is left.

   **Where the agent's time goes** (the second table), measured in the same blocks: the CPU time the
   training thread spends inside the agent's entry points (the optimizer step post-hook with its
   accounting and activation-profile parts, the saved-tensor pack and unpack hooks, the profile's
   module hooks; each wrapped on its class by :class:`AgentTimer`, net of the wrapper's own cost),
   the CPU time of the sampler and writer threads, and the time spent in garbage collection. Their
   sum per second of training, "agent CPU per training second", estimates the slowdown from above:
   it counts the agent's work as if none of it overlapped the training (GIL waits included: a thread
   holds the GIL no longer than it runs); not counted are cache effects, PyTorch's own dispatch into
   the hooks (e.g. the module-hook path of ``Module.__call__``) and the profile's unpack lambda,
   which cannot be wrapped. On a shared machine this estimate is much sharper than the wall ratio,
   whose resolution the A/A control row (a second ``off`` block per round) shows.

2. **Enqueue cost.** ``Writer.put_sample(reading)``, the sampler thread's side of the bounded
   history queue (it never blocks), timed per call with ``perf_counter_ns`` (which adds ~0.1 µs)
   while the writer thread runs and flushes into a SQLite file; calls come in bursts of 2,000 and
   the script waits for the writer to commit them before the next burst, so none is dropped. The
   reading is a real one from the ``default`` mode. Median and p99 in microseconds.

3. **Writer throughput.** ``--writer-samples`` readings pushed through a running ``Writer`` with
   the agent's queue bound (``watch(queue_size=...)``'s default) and the writer's own defaults
   (batch size, flush interval) into a fresh SQLite file; the producer waits while the queue could
   be full (``pushed - written >= bound``), so nothing is dropped. Samples/s = N / (first put ..
   ``close()`` returned, i.e. every row committed); the row count in the file is checked.

Compare modes only as the ratios printed here: on a shared machine absolute times drift, the
interleaving and the per-round ratios are what make the comparison fair.

The step-time part (the trainer, the modes, the agent-time accounting, the interleaved blocks)
is in ``overhead_steps.py``; this file measures the history path and prints the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import inspect
import logging
import os
import platform
import random
import sqlite3
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from overhead_steps import (
    AGENT_THREADS,
    LONG,
    MODES,
    TIMER,
    StepResults,
    Trainer,
    _quantile,
    bench_steps,
    load_example,
    run_block,
)
from sqlalchemy import func, select
from sqlalchemy.orm import Session

import edo_monitor
from edo_monitor.agent.monitor import DEFAULT_INTERVAL_S
from edo_monitor.probes.readings import Reading
from edo_monitor.store.engine import open_engine
from edo_monitor.store.models import Run, Sample
from edo_monitor.store.writer import Writer

#: the history queue bound a ``watch()`` uses by default
AGENT_QUEUE_SIZE: int = inspect.signature(edo_monitor.watch).parameters["queue_size"].default


# ---------------------------------------------------------------------------------------- writer
def _new_run(engine: Any) -> int:
    with Session(engine) as s, s.begin():
        run = Run(
            uuid=str(uuid.uuid4()),
            name="overhead-bench",
            host=platform.node(),
            pid=os.getpid(),
            started_at_s=time.time(),
            status="finished",
            device_kind="cpu-budget",
            interval_s=DEFAULT_INTERVAL_S,
            torch_version=torch.__version__,
            config={},
            tags=[],
            steps=0,
            samples_dropped=0,
        )
        s.add(run)
        s.flush()
        return run.id


def _fresh(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def _readings(proto: Reading, n: int) -> list[Reading]:
    rng = random.Random(0)
    t0 = time.time()
    return [
        dataclasses.replace(
            proto,
            time_s=t0 + i * DEFAULT_INTERVAL_S,
            step=i,
            process_rss_bytes=(proto.process_rss_bytes or 0) + rng.randint(0, 2**20),
        )
        for i in range(n)
    ]


def bench_enqueue(proto: Reading, calls: int, path: Path, burst: int = 2_000) -> list[float]:
    """Per-call ``put_sample`` times (µs) with the writer thread running."""
    _fresh(path)
    engine = open_engine(path)
    writer = Writer(engine, _new_run(engine), queue_size=AGENT_QUEUE_SIZE)
    readings = _readings(proto, burst)
    out: list[float] = []
    writer.start()
    try:
        pushed = 0
        while pushed < calls:
            for r in readings[: min(burst, calls - pushed)]:
                t = time.perf_counter_ns()
                writer.put_sample(r)
                out.append((time.perf_counter_ns() - t) / 1e3)
                pushed += 1
            while writer.written["samples"] < pushed:  # let the writer catch up (no drops)
                time.sleep(0.005)
    finally:
        writer.close()
        engine.dispose()
    assert writer.dropped == 0, f"{writer.dropped} samples dropped"
    return out


def bench_writer(proto: Reading, n: int, path: Path) -> tuple[float, int, int]:
    """Sustained samples/s of a running Writer with the agent's defaults; (rate, flushes, rows)."""
    _fresh(path)
    engine = open_engine(path)
    run_id = _new_run(engine)
    bound = AGENT_QUEUE_SIZE
    writer = Writer(engine, run_id, queue_size=bound)  # the agent's queue bound, other defaults
    pool = _readings(proto, 1_000)
    t = time.perf_counter()
    writer.start()
    for i in range(n):
        while i - writer.written["samples"] >= bound:  # the queue could be full: wait
            time.sleep(0.001)
        writer.put_sample(pool[i % len(pool)])
    writer.close(timeout_s=600)
    elapsed = time.perf_counter() - t
    with engine.connect() as conn:
        rows = conn.execute(
            select(func.count()).select_from(Sample).where(Sample.run_id == run_id)
        ).scalar_one()
    engine.dispose()
    assert writer.dropped == 0, f"{writer.dropped} samples dropped"
    return n / elapsed, writer.flushes, int(rows)


# ---------------------------------------------------------------------------------------- report
def machine() -> str:
    model = platform.processor() or "?"
    with contextlib.suppress(OSError):
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(
            (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if "Model name" in ln), model
        )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{model}, {cores} cores, Python {platform.python_version()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} intra-op threads), SQLite {sqlite3.sqlite_version}"
    )


def _median_ci(values: list[float], n: int = 2_000) -> str:
    """95 % bootstrap confidence interval of the median (percentile method, fixed seed)."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return f"{meds[int(0.025 * n)]:.3f}–{meds[int(0.975 * n) - 1]:.3f}"


def _iqr(values: list[float]) -> str:
    return f"{_quantile(values, 0.25):.3f}–{_quantile(values, 0.75):.3f}"


def _table(rows: list[list[str]]) -> str:
    """A Markdown table, columns padded (first column left-aligned, the others right-aligned)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(r: list[str]) -> str:
        cells = [r[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
        ]
        return "| " + " | ".join(cells) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths[:1]) + "|"
    sep += "|".join("-" * (w + 1) + ":" for w in widths[1:]) + "|"
    return "\n".join([line(rows[0]), sep, *(line(r) for r in rows[1:])])


def report(res: StepResults, enq: list[float], writer: tuple[float, int, int], n: int) -> None:
    """Print the three tables (Markdown, as recorded in docs/benchmarks.md)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nAgent overhead — {machine()}")
    print(
        f"{now:%Y-%m-%d %H:%M} UTC; batch {res.batch}; {res.rounds} rounds x {len(MODES)} "
        f"blocks of {min(res.k)}–{max(res.k)} timed steps (median {statistics.median(res.k):g}); "
        f"load average at the end {load}\n"
    )
    rows = [
        [
            "mode",
            "block mean ms",
            "step median ms",
            "wall ratio",
            "95% CI",
            "IQR",
            "CPU ratio",
            "GC ms/s",
        ]
    ]
    for m in MODES:
        bs = res.blocks[m.name]
        mean_ms = statistics.median(b.mean_step_s for b in bs) * 1e3
        step_ms = statistics.median(t for b in bs for t in b.steps) * 1e3
        if m.name == "off":
            ratio, ci, iqr, cpu = "1", "", "", "1"
        else:
            r = res.ratios[m.name]
            ratio, ci, iqr = f"{statistics.median(r):.3f}", _median_ci(r), _iqr(r)
            cpu = f"{statistics.median(res.cpu_ratios[m.name]):.3f}"
        gc_ms = sum(b.gc_s for b in bs) / sum(b.wall_s for b in bs) * 1e3
        rows.append(
            [m.label, f"{mean_ms:.1f}", f"{step_ms:.1f}", ratio, ci, iqr, cpu, f"{gc_ms:.2f}"]
        )
    print(_table(rows))

    agents = [m for m in MODES if m.watch_kwargs is not None]
    agents += [LONG] if LONG.name in res.blocks else []
    rows = [["where the agent's time goes", *(m.name for m in agents)]]
    per: dict[str, dict[str, float]] = {}
    for m in agents:
        bs = res.blocks[m.name]
        steps = sum(len(b.steps) for b in bs)
        wall = sum(b.wall_s for b in bs)
        samples = sum(b.samples for b in bs)
        d = {"samples/s": samples / wall, "step_s": wall / steps, "steps": steps, "wall": wall}
        for name in TIMER.totals:
            d[name] = sum(b.hook_s[name] for b in bs) / steps * 1e6
        for name in AGENT_THREADS:
            d[name] = sum(b.thread_cpu_s.get(name, 0.0) for b in bs) / wall * 1e3
        d["per tick"] = sum(b.thread_cpu_s.get("edo-sampler", 0.0) for b in bs) / max(1, samples)
        top = [p for p in TIMER.totals if not p.startswith("  ")]
        train_s = sum(d[p] for p in top) / 1e6
        gc_s = sum(b.gc_s for b in bs) / wall
        d["bound"] = train_s / d["step_s"] + (d["edo-sampler"] + d["edo-writer"]) / 1e3 + gc_s
        per[m.name] = d
    rows.append(
        ["samples taken per s (timed steps)", *(f"{per[m.name]['samples/s']:.2f}" for m in agents)]
    )
    for name in TIMER.totals:
        label = (
            f"training thread CPU µs/step: {name.strip()}" if not name.startswith("  ") else name
        )
        rows.append([label, *(f"{per[m.name][name]:.0f}" for m in agents)])
    pack = "saved-tensor pack hook (tracker)"
    rows.append(
        [
            "  tracker pack calls per step",
            *(
                f"{sum(b.hook_calls[pack] for b in res.blocks[m.name]) / per[m.name]['steps']:.1f}"
                for m in agents
            ),
        ]
    )
    rows.append(
        [
            "garbage collection ms/s (any thread)",
            *(
                f"{sum(b.gc_s for b in res.blocks[m.name]) / per[m.name]['wall'] * 1e3:.2f}"
                for m in agents
            ),
        ]
    )
    rows.append(["sampler thread CPU ms/s", *(f"{per[m.name]['edo-sampler']:.2f}" for m in agents)])
    rows.append(["  per sample (ms)", *(f"{per[m.name]['per tick'] * 1e3:.2f}" for m in agents)])
    rows.append(["writer thread CPU ms/s", *(f"{per[m.name]['edo-writer']:.2f}" for m in agents)])
    rows.append(
        [
            "agent CPU per training second (upper estimate)",
            *(f"{per[m.name]['bound']:.2%}" for m in agents),
        ]
    )
    print()
    print(_table(rows))
    print(
        f"(hook times are net of the timing wrapper's own cost: {TIMER.inner_s * 1e6:.2f} µs a "
        f"call inside its interval, {TIMER.outer_s * 1e6:.2f} µs around it)"
    )
    for m in agents:
        errors = sum(b.agent_errors for b in res.blocks[m.name])
        if errors:
            print(f"WARNING: {m.name}: {errors} agent_error event(s); see the log above")
        if per[m.name]["samples/s"] < 0.5 / DEFAULT_INTERVAL_S:
            print(
                f"WARNING: {m.name}: {per[m.name]['samples/s']:.2f} samples/s during the timed "
                f"steps, expected about {1 / DEFAULT_INTERVAL_S:g}: the sampler did not keep time"
            )

    med, p99 = statistics.median(enq), _quantile(enq, 0.99)
    rate, flushes, rows_in = writer
    rows = [
        ["history path", "value"],
        [f"Writer.put_sample() per call, median ({len(enq):,} calls)", f"{med:.1f} µs"],
        ["Writer.put_sample() per call, p99", f"{p99:.1f} µs"],
        [f"Writer sustained into SQLite, {n:,} samples", f"{rate:,.0f} samples/s"],
        ["  transactions / rows committed", f"{flushes} / {rows_in:,}"],
    ]
    print()
    print(_table(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1024, help="batch size (default 1024)")
    ap.add_argument("--seconds", type=float, default=150.0, help="time for the step part")
    ap.add_argument("--block-s", type=float, default=2.5, help="target seconds per block")
    ap.add_argument("--steady-s", type=float, default=12.0, help="one long default watch (0: none)")
    ap.add_argument("--writer-samples", type=int, default=200_000)
    ap.add_argument("--enqueue-calls", type=int, default=100_000)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/edo-overhead"))
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the model trains")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.dir.mkdir(parents=True, exist_ok=True)
    db = args.dir / "watch.db"
    _fresh(db)

    example = load_example()
    trainer = Trainer(example, args.batch, args.device)
    if args.device != "cpu":
        print(f"device {args.device}: {torch.cuda.get_device_name(args.device)}", flush=True)
    print(f"step time, {len(MODES)} modes interleaved, ~{args.seconds:.0f} s:", flush=True)
    TIMER.calibrate()
    with TIMER:
        res = bench_steps(trainer, args.seconds, args.block_s, db)
        if args.steady_s > 0:
            step_s = statistics.median(b.mean_step_s for b in res.blocks["default"])
            print(f"default agent, one watch, {args.steady_s:.0f} s ...", flush=True)
            long = run_block(
                LONG, trainer, max(4, round(args.steady_s / step_s)), db, round(2.0 / step_s) + 2
            )
            res.blocks[LONG.name] = [long]
    proto = next(b.reading for b in res.blocks["default"] if b.reading is not None)
    print("enqueue cost ...", flush=True)
    enq = bench_enqueue(proto, args.enqueue_calls, args.dir / "enqueue.db")
    print("writer throughput ...", flush=True)
    writer = bench_writer(proto, args.writer_samples, args.dir / "writer.db")
    assert writer[2] == args.writer_samples, f"{writer[2]} rows committed"
    report(res, enq, writer, args.writer_samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
