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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib.util
import inspect
import logging
import os
import platform
import random
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from torch import nn
from torch.optim import optimizer as torch_optimizer

import edo_monitor
from edo_monitor.actions.checkpoint_activations import ActivationRecorder
from edo_monitor.agent.activations import ActivationTracker
from edo_monitor.agent.monitor import DEFAULT_INTERVAL_S, Monitor
from edo_monitor.agent.safe_point import SafePoint
from edo_monitor.measure.frequency import LookupCounter
from edo_monitor.probes.readings import Reading
from edo_monitor.store.engine import open_engine
from edo_monitor.store.models import Run, Sample
from edo_monitor.store.writer import Writer

ROOT = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 2
AGENT_THREADS = ("edo-sampler", "edo-writer")
#: the history queue bound a ``watch()`` uses by default
AGENT_QUEUE_SIZE: int = inspect.signature(edo_monitor.watch).parameters["queue_size"].default


# ---------------------------------------------------------------------------------------- setup
def load_example() -> ModuleType:
    """``examples/train_embedding.py`` imported by path (examples are scripts, not a package)."""
    path = ROOT / "examples" / "train_embedding.py"
    spec = importlib.util.spec_from_file_location("train_embedding", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Trainer:
    """The example's model, Adam and data; :meth:`step` is one training step."""

    def __init__(self, example: ModuleType, batch: int, device: str = "cpu") -> None:
        torch.manual_seed(0)
        features, targets = example.build_dataset(example.default_text())
        self.features, self.targets = features.to(device), targets.to(device)
        self.model = example.HashedWordModel().to(device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.batch = batch
        self.gen = torch.Generator().manual_seed(1)

    def step(self) -> float:
        idx = torch.randint(0, len(self.targets), (self.batch,), generator=self.gen)
        idx = idx.to(self.features.device)
        loss = nn.functional.cross_entropy(self.model(self.features[idx]), self.targets[idx])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


# ---------------------------------------------------------------------------------------- modes
@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    label: str
    watch_kwargs: dict[str, Any] | None  # None: no agent at all


MODES = (
    Mode("off", "no agent", None),
    Mode("off-control", "no agent (A/A control: the method's noise)", None),
    Mode("default", f"watch(model), defaults (interval {DEFAULT_INTERVAL_S:g} s)", {}),
    Mode("no-activations", "watch(model, track_activations=False)", {"track_activations": False}),
    Mode(
        "profile-every-step",
        "watch(model, profile_interval_s=1e-6)",
        {"profile_interval_s": 1e-6},
    ),
    # issue 25: the default takes incident snapshots (built only at an incident); off, the cost
    # of having them on is default / snapshots-off
    Mode("snapshots-off", "watch(model, snapshots=False)", {"snapshots": False}),
)


class AgentTimer:
    """CPU time the training thread spends inside the agent's hooks, by part.

    The agent's training-thread entry points are wrapped on their classes (before any ``watch()``
    binds them), so every call from the main thread adds its thread CPU time
    (``time.thread_time``: time the thread was preempted does not count, which on a loaded machine
    would swamp these microseconds) to a total; calls from the sampler thread (which also runs
    ``Monitor._account``) are not counted. The agent's code is not changed.

    ``time.thread_time`` is a system call (~1 µs); :meth:`calibrate` measures what a wrapper adds
    inside its own interval and around it, and :meth:`net` takes that out of each part (and out of
    the step hook's total, the nested parts' wrappers).
    """

    PARTS: tuple[tuple[str, type, str], ...] = (
        ("step hook (safe point), total", SafePoint, "on_optimizer_step"),
        ("  of which accounting", Monitor, "_account"),
        ("  of which profile arm", SafePoint, "arm_activation_profile"),
        ("  of which profile collect", SafePoint, "collect_activation_profile"),
        ("saved-tensor pack hook (tracker)", ActivationTracker, "pack"),
        ("saved-tensor unpack hook (tracker)", ActivationTracker, "unpack"),
        ("profile module hooks", ActivationRecorder, "_pre"),
        ("profile module hooks", ActivationRecorder, "_post"),
        ("profile pack hook", ActivationRecorder, "_pack"),
        ("lookup counter hook", LookupCounter, "_on_forward"),
    )

    def __init__(self) -> None:
        self.totals: dict[str, float] = {name: 0.0 for name, _, _ in self.PARTS}
        self.calls: dict[str, int] = {name: 0 for name, _, _ in self.PARTS}
        self._saved: list[tuple[type, str, Any]] = []
        self._main = threading.get_ident()
        self.inner_s = 0.0  # what one wrapper adds to its own measured interval
        self.outer_s = 0.0  # what one wrapped call adds to an enclosing interval

    def _wrap(self, name: str, fn: Any) -> Any:
        totals, calls, main = self.totals, self.calls, self._main

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != main:
                return fn(*args, **kwargs)
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.thread_time() - t
                calls[name] += 1

        return timed

    def calibrate(self, n: int = 20_000) -> None:
        """Measure the wrapper's own cost on a function that does nothing (best of 5)."""
        probe = AgentTimer()
        probe.totals["noop"], probe.calls["noop"] = 0.0, 0

        def noop() -> None:
            return None

        wrapped = probe._wrap("noop", noop)
        inner, outer = [], []
        for _ in range(5):
            probe.totals["noop"] = 0.0
            t = time.thread_time()
            for _ in range(n):
                wrapped()
            t_wrapped = time.thread_time() - t
            t = time.thread_time()
            for _ in range(n):
                noop()
            t_plain = time.thread_time() - t
            inner.append(probe.totals["noop"] / n)
            outer.append((t_wrapped - t_plain) / n)
        self.inner_s, self.outer_s = min(inner), min(outer)

    def net(self, totals: dict[str, float], calls: dict[str, int]) -> dict[str, float]:
        """``totals`` less the wrappers' own cost (clamped at 0)."""
        out = {name: max(0.0, t - calls[name] * self.inner_s) for name, t in totals.items()}
        nested = sum(c for name, c in calls.items() if name.startswith("  "))
        top = self.PARTS[0][0]
        out[top] = max(0.0, out[top] - nested * self.outer_s)
        return out

    def __enter__(self) -> AgentTimer:
        for name, cls, attr in self.PARTS:
            fn = cls.__dict__.get(attr)
            if fn is None:  # the agent changed: that part reads 0; say so
                print(f"note: {cls.__name__}.{attr} not found; '{name.strip()}' is not timed")
                continue
            self._saved.append((cls, attr, fn))
            if isinstance(fn, staticmethod):
                setattr(cls, attr, staticmethod(self._wrap(name, fn.__func__)))
            else:
                setattr(cls, attr, self._wrap(name, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, attr, fn in reversed(self._saved):
            setattr(cls, attr, fn)
        self._saved.clear()


TIMER = AgentTimer()


class GcClock:
    """Wall time spent in the cyclic garbage collector (any thread), via ``gc.callbacks``."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._start


GC = GcClock()
gc.callbacks.append(GC)


#: the default agent in one long watch (the steady state: no per-watch start-up in the window)
LONG = Mode("default-long", "watch(model), defaults, one long watch", {})


@dataclasses.dataclass
class Block:
    wall_s: float
    cpu_s: float
    steps: list[float]
    samples: int
    thread_cpu_s: dict[str, float]
    hook_s: dict[str, float]
    hook_calls: dict[str, int]
    gc_s: float
    agent_errors: int
    reading: Reading | None = None

    @property
    def mean_step_s(self) -> float:
        return self.wall_s / len(self.steps)

    @property
    def cpu_step_s(self) -> float:
        return self.cpu_s / len(self.steps)


def _thread_clocks() -> dict[str, int]:
    """CPU clock ids of the agent's threads, by name (Linux/Unix; empty where unsupported)."""
    clocks: dict[str, int] = {}
    if not hasattr(time, "pthread_getcpuclockid"):
        return clocks
    for t in threading.enumerate():
        if t.name in AGENT_THREADS and t.ident is not None:
            with contextlib.suppress(OSError):
                clocks[t.name] = time.pthread_getcpuclockid(t.ident)
    return clocks


def _read_clocks(clocks: dict[str, int]) -> dict[str, float]:
    out = {}
    for name, clock in clocks.items():
        with contextlib.suppress(OSError):
            out[name] = time.clock_gettime(clock)
    return out


@contextlib.contextmanager
def _agent(mode: Mode, trainer: Trainer, db: Path) -> Iterator[Any]:
    if mode.watch_kwargs is None:
        yield None
        return
    with edo_monitor.watch(trainer.model, db=db, run_name=mode.name, **mode.watch_kwargs) as mon:
        yield mon


#: the global optimizer step post-hooks registered at import (edo_monitor.actions'
#: checkpoint_activations keeps one for the life of the process: it counts optimizer steps so
#: that an optimizer's reads of a weight are not taken for a forward's); an agent adds its own
_IMPORT_HOOKS = frozenset(getattr(torch_optimizer, "_global_optimizer_post_hooks", {}))


def _assert_no_agent() -> None:
    """Nothing of an agent is left: no agent thread, no global optimizer step hook beyond the
    ones registered at import."""
    alive = [t.name for t in threading.enumerate() if t.name.startswith("edo-")]
    hooks = set(getattr(torch_optimizer, "_global_optimizer_post_hooks", {})) - _IMPORT_HOOKS
    assert not alive and not hooks, f"agent left behind: threads {alive}, {len(hooks)} step hooks"


def run_block(mode: Mode, trainer: Trainer, k: int, db: Path, warmup: int = WARMUP_STEPS) -> Block:
    """One block: a fresh agent (or none), ``warmup`` untimed steps, then ``k`` timed steps."""
    times: list[float] = []
    if mode.watch_kwargs is None:
        _assert_no_agent()
    with _agent(mode, trainer, db) as mon:
        for _ in range(warmup):
            trainer.step()
        clocks = _thread_clocks()
        c0 = _read_clocks(clocks)
        n0 = mon.summary().samples if mon is not None else 0
        h0, k0, g0 = dict(TIMER.totals), dict(TIMER.calls), GC.total_s
        p0, w0 = time.process_time(), time.perf_counter()
        for _ in range(k):
            t = time.perf_counter()
            trainer.step()
            times.append(time.perf_counter() - t)
        wall, cpu = time.perf_counter() - w0, time.process_time() - p0
        hooks = {name: TIMER.totals[name] - h0[name] for name in h0}
        calls = {name: TIMER.calls[name] - k0[name] for name in k0}
        gc_s = GC.total_s - g0
        n1 = mon.summary().samples if mon is not None else 0
        c1 = _read_clocks(clocks)
        reading = mon.latest if mon is not None else None
    errors = mon.summary().events.get("agent_error", 0) if mon is not None else 0
    thread_cpu = {name: c1[name] - c0[name] for name in c1 if name in c0}
    return Block(
        wall, cpu, times, n1 - n0, thread_cpu, TIMER.net(hooks, calls), calls, gc_s, errors, reading
    )


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclasses.dataclass
class StepResults:
    batch: int
    k: list[int]
    rounds: int
    blocks: dict[str, list[Block]]
    ratios: dict[str, list[float]]
    cpu_ratios: dict[str, list[float]]


def bench_steps(trainer: Trainer, seconds: float, block_s: float, db: Path) -> StepResults:
    """Interleaved blocks of every mode until ``seconds`` are spent (at least 5 rounds)."""
    for _ in range(3):
        trainer.step()
    probe = []
    for _ in range(5):
        t = time.perf_counter()
        trainer.step()
        probe.append(time.perf_counter() - t)
    step_s = statistics.median(probe)
    for m in MODES:  # warm-up round, discarded: first-use costs (SQL compilation, schema, caches)
        run_block(m, trainer, 2, db)
    blocks: dict[str, list[Block]] = {m.name: [] for m in MODES}
    ratios: dict[str, list[float]] = {m.name: [] for m in MODES[1:]}
    cpu_ratios: dict[str, list[float]] = {m.name: [] for m in MODES[1:]}
    t_end = time.monotonic() + seconds
    rounds = 0
    ks = []
    while rounds < 5 or time.monotonic() < t_end:
        k = max(4, round(block_s / step_s))  # the load drifts: re-aim at block_s every round
        ks.append(k)
        order = MODES[rounds % len(MODES) :] + MODES[: rounds % len(MODES)]
        got = {m.name: run_block(m, trainer, k, db) for m in order}
        step_s = got["off"].mean_step_s
        for name, blk in got.items():
            blocks[name].append(blk)
        off = got["off"]
        for name in ratios:
            ratios[name].append(got[name].mean_step_s / off.mean_step_s)
            cpu_ratios[name].append(got[name].cpu_step_s / off.cpu_step_s)
        rounds += 1
        print(
            f"  round {rounds:3d}: off {off.mean_step_s * 1e3:6.1f} ms; ratios "
            + " ".join(f"{n} {ratios[n][-1]:.3f}" for n in ratios),
            flush=True,
        )
    return StepResults(trainer.batch, ks, rounds, blocks, ratios, cpu_ratios)


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
