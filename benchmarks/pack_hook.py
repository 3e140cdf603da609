"""Cost of the saved-tensor hooks per saved tensor, side by side in one process.

    .venv/bin/python benchmarks/pack_hook.py [--seconds 60] [--layers 8] [--width 64] [--batch 32]

A small MLP (``--layers`` x (Linear(width, width), ReLU), batch ``--batch``) makes the hooks a
visible part of a step: each layer saves its input and its ReLU output (one storage), so a step
saves about ``layers + 1`` tensors. One step = forward, ``.pow(2).mean()``, backward (no optimizer).
Four modes, interleaved in rounds (order rotated each round), each block ``--block-steps`` steps:

- ``none``: no saved-tensor hooks;
- ``identity``: a ``saved_tensors_hooks(lambda t: t, lambda t: t)`` pair: the floor of any Python
  hook (PyTorch's own cost of calling into Python twice per saved tensor);
- ``previous``: the previous tracker's pack hook, copied here (commit 84c0404: a per-step set of
  storage pointers and a byte sum; the tensor itself returned);
- ``tracker``: :class:`edo_monitor.agent.activations.ActivationTracker` (holders released with the
  graph, live bytes, peaks).

Printed per mode: the median over rounds of (block time per step / ``none``'s in the same round),
and the extra µs per saved tensor over ``none`` (median of per-round differences / tensors saved
per step). Process CPU time (``time.process_time``) is used, so preemption by other jobs on a
shared machine does not count.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from edo_monitor.agent.activations import ActivationTracker


class PreviousTracker:
    """The pack hook of the previous ``ActivationTracker`` (a per-step sum), for comparison."""

    def __init__(self, params: Any) -> None:
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self._seen: set[int] = set()
        self.current_step_bytes = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._seen and ptr not in self._param_ptrs:
            self._seen.add(ptr)
            self.current_step_bytes += storage.nbytes()
        return tensor

    def end_step(self) -> None:
        self.current_step_bytes = 0
        self._seen = set()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--block-steps", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers)
    x = torch.randn(args.batch, args.width)
    params = list(model.parameters())

    counted: list[int] = []

    def counting(t: torch.Tensor) -> torch.Tensor:
        counted.append(1)
        return t

    with torch.autograd.graph.saved_tensors_hooks(counting, lambda t: t):
        model(x).pow(2).mean().backward()
    saved_per_step = len(counted)

    previous = PreviousTracker(params)
    tracker = ActivationTracker(params)

    @contextlib.contextmanager
    def no_hooks() -> Iterator[None]:
        yield

    modes: dict[str, tuple[Callable[[], Any], Callable[[], None]]] = {
        "none": (no_hooks, lambda: None),
        "identity": (
            lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
            lambda: None,
        ),
        "previous": (
            lambda: torch.autograd.graph.saved_tensors_hooks(previous.pack, lambda t: t),
            previous.end_step,
        ),
        "tracker": (lambda: tracker, tracker.end_step),
    }
    names = list(modes)

    def block(name: str) -> float:
        enter, end_step = modes[name]
        with enter():
            model(x).pow(2).mean().backward()  # warm
            t = time.process_time()
            for _ in range(args.block_steps):
                model(x).pow(2).mean().backward()
                end_step()
            return (time.process_time() - t) / args.block_steps

    per_round: list[dict[str, float]] = []
    deadline = time.monotonic() + args.seconds
    r = 0
    while time.monotonic() < deadline or r < 3:
        order = names[r % len(names) :] + names[: r % len(names)]
        per_round.append({name: block(name) for name in order})
        r += 1

    print(
        f"Saved-tensor hook cost — {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, torch {torch.__version__} (1 intra-op thread)"
    )
    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; MLP {args.layers} x "
        f"Linear({args.width}, {args.width}) + ReLU, batch {args.batch}; {saved_per_step} "
        f"saved tensors per step; {len(per_round)} rounds x {args.block_steps} steps per mode"
    )
    print()
    print("| mode | step µs (median) | ratio to none | extra µs per saved tensor |")
    print("|---|--:|--:|--:|")
    for name in names:
        step = statistics.median(rd[name] for rd in per_round)
        ratio = statistics.median(rd[name] / rd["none"] for rd in per_round)
        extra = statistics.median(rd[name] - rd["none"] for rd in per_round) / saved_per_step
        print(f"| {name} | {step * 1e6:.1f} | {ratio:.3f} | {extra * 1e6:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
