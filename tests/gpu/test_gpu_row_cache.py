"""The row cache on a real CUDA device: the cache's rows and optimizer state on the device, the
host table, its catch-up and the side stream's staging (a ``LookAhead``) against a resident twin.

Nothing here runs on the CPU machines: the catch-up's per-group tables are the host's and the rows
the device's, and only a device shows that each operation finds its operands where it runs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edo_monitor.nn import CachedEmbedding, LookAhead
from edo_monitor.probes.cuda import device_waits

pytestmark = pytest.mark.gpu

CUDA0 = torch.device("cuda", 0)
N, D, C = 4000, 8, 400


def _batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    probs = 1.0 / torch.arange(1, N + 1, dtype=torch.float64) ** 1.05
    return [torch.multinomial(probs, 128, True, generator=gen) for _ in range(steps)]


@pytest.mark.parametrize(
    ("name", "dtype", "tolerance"),
    [
        ("adam", torch.float64, 1e-12),
        ("adamw", torch.float64, 1e-12),
        ("adam", torch.float32, 1e-5),
    ],
)
def test_cached_table_on_cuda_equals_a_resident_twin(
    name: str, dtype: torch.dtype, tolerance: float
) -> None:
    torch.manual_seed(0)
    base = torch.randn(N, D, dtype=dtype)
    twin = nn.Embedding.from_pretrained(base.clone(), freeze=False).to(CUDA0)
    cached = CachedEmbedding(N, D, C, _weight=base.clone(), device=CUDA0)
    assert cached.weight.device.type == "cuda"
    make = {
        "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01),
    }[name]
    batches = _batches(80)
    targets = [torch.randn(ids.numel(), D, dtype=dtype, device=CUDA0) for ids in batches]
    opt = make(twin.parameters())
    for ids, target in zip(batches, targets, strict=True):
        ((twin(ids.to(CUDA0)) - target) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    opt = make(cached.parameters())
    loader = LookAhead(list(zip(batches, targets, strict=True)), ahead=4, tables=cached)
    for ids, target in loader:
        ((cached(ids.to(CUDA0)) - target) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    assert cached.stats().evicted > 100  # rows left the device and came back
    want = twin.weight.detach().cpu()
    got = cached.full_weight().cpu()
    assert float((got - want).abs().max() / want.abs().max()) <= tolerance


@pytest.mark.parametrize("ids_on", ["cpu", "cuda"])
def test_a_cached_step_waits_for_the_device_at_most_once(ids_on: str) -> None:
    """The row cache's host index arrays and tables go to the device through pinned memory
    without waiting, and an eviction brings a row's weight and optimizer state back in one copy:
    a training step with evictions waits for the device once (the write-back), and once more
    when the ids are on the device (the cache reads them on the host). Before: about 22 waits a
    step on the H200 (docs/benchmarks.md)."""
    torch.manual_seed(0)
    table = CachedEmbedding(N, D, C, device=CUDA0)
    opt = torch.optim.Adam(table.parameters(), lr=1e-2)
    batches = [ids.to(ids_on) for ids in _batches(60)]

    def steps(part: list[torch.Tensor]) -> None:
        for ids in part:
            table(ids).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()

    steps(batches[:40])  # the cache full, the optimizer's state made
    evicted = table.stats().evicted
    waits = device_waits(lambda: steps(batches[40:]))
    assert table.stats().evicted - evicted > 20 * 10  # rows left the device in the steps timed
    per_step = 1 if ids_on == "cpu" else 2
    assert waits <= per_step * 20, f"{waits} synchronizing calls in 20 steps"
