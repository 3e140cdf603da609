"""The lookup counter on CUDA: a table's ids are copied to pinned host memory without waiting for
the GPU and counted once the copy is done; the counts equal the ids' own, and the forward hook
makes no synchronizing call (``torch.cuda.set_sync_debug_mode("error")`` raises at one)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from edo_monitor.measure.frequency import LookupCounter

pytestmark = pytest.mark.gpu

CUDA0 = torch.device("cuda", 0)


def _expected(batches: list[torch.Tensor], rows: int, pad: int) -> tuple[torch.Tensor, int]:
    want = torch.zeros(rows, dtype=torch.long)
    peak = 0
    for ids in batches:
        flat = ids.cpu().reshape(-1)
        flat = flat[flat != pad]
        want += torch.bincount(flat, minlength=rows)
        peak = max(peak, int(torch.unique(flat).numel()))
    return want, peak


def test_counts_ids_on_cuda_without_a_sync(caplog: pytest.LogCaptureFixture) -> None:
    rows = 1000
    emb = nn.Embedding(rows, 8, padding_idx=0).to(CUDA0)
    counter = LookupCounter()
    counter.watch("emb", emb)
    gen = torch.Generator(device=CUDA0).manual_seed(0)
    batches = [
        torch.randint(0, rows, (256, 5), device=CUDA0, generator=gen)
        for _ in range(counter.MAX_PENDING)
    ]
    torch.cuda.synchronize()
    with caplog.at_level(logging.WARNING, logger="edo_monitor.measure.frequency"):
        torch.cuda.set_sync_debug_mode("error")
        try:
            for ids in batches:
                emb(ids)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # counting went on
    want, peak = _expected(batches, rows, pad=0)
    assert torch.equal(counter.counts("emb"), want)
    assert counter.peak_unique_ids("emb") == peak
    counter.close()


def test_more_copies_than_may_wait_are_all_counted() -> None:
    rows = 500
    emb = nn.Embedding(rows, 4).to(CUDA0)
    counter = LookupCounter()
    counter.MAX_PENDING = 2  # the third copy in flight waits for the oldest
    counter.watch("emb", emb)
    gen = torch.Generator(device=CUDA0).manual_seed(1)
    batches = [torch.randint(0, rows, (4096,), device=CUDA0, generator=gen) for _ in range(30)]
    for ids in batches:
        emb(ids)
    want, peak = _expected(batches, rows, pad=-1)
    assert torch.equal(counter.counts("emb"), want)
    assert counter.peak_unique_ids("emb") == peak
