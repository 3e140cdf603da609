"""The step-time part of ``benchmarks/overhead.py``: the example's trainer, the modes, the
agent-time accounting (:class:`AgentTimer`, :class:`GcClock`) and the interleaved blocks of every
mode (:func:`bench_steps`). See that file's docstring for what is measured and how."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib.util
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

import edo_monitor
from edo_monitor.actions.activation_profile import ActivationRecorder
from edo_monitor.agent.activations import ActivationTracker
from edo_monitor.agent.monitor import DEFAULT_INTERVAL_S, Monitor
from edo_monitor.agent.safe_point import SafePoint
from edo_monitor.measure.frequency import LookupCounter
from edo_monitor.probes.readings import Reading

ROOT = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 2
AGENT_THREADS = ("edo-sampler", "edo-writer")


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
