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
