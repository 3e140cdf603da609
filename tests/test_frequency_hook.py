"""The LookupCounter's forward pre-hook counts ids and the batch's distinct ids without sorting
the batch: its counts and its distinct-id peak equal ``torch.unique``'s on the same batches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edo_monitor.measure.frequency import LookupCounter


def test_counts_and_distinct_peak_equal_unique() -> None:
    gen = torch.Generator().manual_seed(0)
    emb = nn.Embedding(50, 4, padding_idx=0)
    bag = nn.EmbeddingBag(30, 4, mode="mean")
    counter = LookupCounter()
    counter.watch("emb", emb)
    counter.watch("bag", bag)
    want = {"emb": torch.zeros(50, dtype=torch.long), "bag": torch.zeros(30, dtype=torch.long)}
    peaks = {"emb": 0, "bag": 0}
    for batch in (7, 64, 3, 200, 1):
        ids = torch.randint(0, 50, (batch, 5), generator=gen)  # many repeats, padding 0 too
        emb(ids)
        kept = ids.reshape(-1)[ids.reshape(-1) != 0]
        uniq, mult = torch.unique(kept, return_counts=True)
        want["emb"].index_add_(0, uniq, mult)
        peaks["emb"] = max(peaks["emb"], uniq.numel())
        flat = torch.randint(0, 30, (batch * 3,), generator=gen)
        bag(flat, torch.arange(0, batch * 3, 3))
        uniq, mult = torch.unique(flat, return_counts=True)
        want["bag"].index_add_(0, uniq, mult)
        peaks["bag"] = max(peaks["bag"], uniq.numel())
    for name in ("emb", "bag"):
        assert torch.equal(counter.counts(name), want[name])
        assert counter.peak_unique_ids(name) == peaks[name]
    counter.close()


def test_a_batch_of_padding_counts_nothing() -> None:
    emb = nn.Embedding(10, 2, padding_idx=3)
    counter = LookupCounter()
    counter.watch("emb", emb)
    emb(torch.full((4, 2), 3))
    assert int(counter.counts("emb").sum()) == 0 and counter.peak_unique_ids("emb") is None
    emb(torch.tensor([3, 5, 5, 9]))
    assert counter.counts("emb").tolist() == [0, 0, 0, 0, 0, 2, 0, 0, 0, 1]
    assert counter.peak_unique_ids("emb") == 2


def test_ids_given_by_keyword_are_counted() -> None:
    """Regression: ``emb(input=ids)`` and ``bag(input=ids, offsets=...)`` were not counted (the
    hook read the first positional argument only): 6 lookups of 12, and 0 of 6."""
    emb, bag = nn.Embedding(100, 4), nn.EmbeddingBag(100, 4, mode="sum")
    counter = LookupCounter()
    counter.watch("emb", emb)
    counter.watch("bag", bag)
    ids = torch.tensor([1, 2, 2, 3, 3, 3])
    emb(input=ids)
    emb(ids)
    bag(input=ids, offsets=torch.tensor([0, 3]))
    for name, times in (("emb", 2), ("bag", 1)):
        freq = counter.frequency(name, k=3)
        assert freq.sampled_lookups == 6 * times
        assert list(zip(freq.top_ids, freq.top_counts, strict=True)) == [
            (3, 3 * times),
            (2, 2 * times),
            (1, times),
        ]


def test_a_batch_with_an_id_outside_the_table_is_skipped_and_counting_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression: a batch holding an id outside the table (the user's own lookup then raised
    IndexError, and the user skipped the batch) stopped the counting for the rest of the run:
    the later batches' ids were not counted, and the ``lookup_frequency`` event and the cache's
    sizing read the counts up to it. Such a batch is left out, one warning, and counting goes
    on."""
    emb = nn.Embedding(10, 2)
    counter = LookupCounter()
    counter.watch("emb", emb)
    emb(torch.tensor([1, 2, 2]))
    for bad in (torch.tensor([3, 10]), torch.tensor([-1, 4])):
        with pytest.raises(IndexError):
            emb(bad)
    emb(torch.tensor([5, 5, 5, 6]))
    want = torch.zeros(10, dtype=torch.long)
    want[[1, 2, 5, 6]] = torch.tensor([1, 2, 3, 1])
    assert torch.equal(counter.counts("emb"), want)
    assert counter.peak_unique_ids("emb") == 2
    warned = [r.getMessage() for r in caplog.records if "lookup counting" in r.getMessage()]
    assert warned == [
        "lookup counting: a batch of emb holds id 10, outside its 10 rows; batches like it are "
        "not counted"
    ]
    counter.close()
