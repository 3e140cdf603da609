"""Parameter-sharing tables (edo_monitor.nn.sharing) against references built independently."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from edo_monitor.decide.estimate import estimate
from edo_monitor.nn import EmbeddingOptions
from edo_monitor.nn.sharing import (
    HashedEmbedding,
    HybridEmbedding,
    QREmbedding,
    hash_ids,
    hash_params,
)

P = 2**31 - 1


def _reference_hash(i: int, buckets: int, seed: int) -> int:
    """The documented formula in Python's unbounded ints (no tensor arithmetic, no overflow)."""
    a, b, c = hash_params(seed)
    return ((a * (i % P) + c * (i // P) + b) % P) % buckets


def test_hash_params_are_in_range_and_differ_by_seed() -> None:
    seen = set()
    for seed in range(50):
        a, b, c = hash_params(seed)
        assert 1 <= a < P and 0 <= b < P and 0 <= c < P
        seen.add((a, b, c))
    assert len(seen) == 50
    with pytest.raises(ValueError, match="seed=-1"):
        hash_params(-1)


def test_hash_matches_the_formula_up_to_2_62() -> None:
    ids = [0, 1, 2, 7, P - 1, P, P + 1, 10**12, 2**40 + 3, 2**62 - 1]
    for seed in (0, 1, 12345):
        got = hash_ids(torch.tensor(ids), 1000, seed).tolist()
        assert got == [_reference_hash(i, 1000, seed) for i in ids]


def test_hash_is_the_same_in_another_process() -> None:
    code = (
        "import torch; from edo_monitor.nn.sharing import hash_ids; "
        "print(hash_ids(torch.arange(0, 10**9, 7919), 4096, 3).sum().item())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    here = hash_ids(torch.arange(0, 10**9, 7919), 4096, 3).sum().item()
    assert int(out.stdout.strip()) == here


@pytest.mark.parametrize("stride", [1, 1000, 4096])
def test_hash_spreads_sequential_and_strided_ids(stride: int) -> None:
    buckets, n = 1000, 200_000
    ids = torch.arange(n, dtype=torch.long) * stride
    counts = torch.bincount(hash_ids(ids, buckets, 0), minlength=buckets).double()
    expected = n / buckets
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # chi-square with 999 degrees of freedom: mean 999, sd ~44.7; 1300 is ~6.7 sd above the mean.
    # A modulo hash (i % 1000) would put every id of stride 1000 in bucket 0 (chi2 ~ 2e8).
    assert chi2 < 1300
    assert int(counts.min()) > 0


def _options(n: int, d: int, **kw: object) -> EmbeddingOptions:
    return EmbeddingOptions(num_embeddings=n, embedding_dim=d, **kw)  # type: ignore[arg-type]


def _full_table(module: nn.Module, n: int) -> torch.Tensor:
    """Every id's row, built from the shared parameters with the documented formula."""
    ids = torch.arange(n)
    if isinstance(module, HashedEmbedding):
        b0 = torch.tensor([_reference_hash(i, module.num_buckets, module.seed) for i in range(n)])
        if module.importance is None:
            return module.weight[b0]
        b1 = torch.tensor(
            [_reference_hash(i, module.num_buckets, module.seed + 1) for i in range(n)]
        )
        imp = module.importance
        return imp[:, 0:1] * module.weight[b0] + imp[:, 1:2] * module.weight[b1]
    if isinstance(module, QREmbedding):
        r = module.num_remainders
        q, rem = module.quotient[ids // r], module.remainder[ids % r]
        return q + rem if module.operation == "sum" else q * rem
    assert isinstance(module, HybridEmbedding)
    hot = {int(h): k for k, h in enumerate(module.hot_ids.tolist())}
    rows = []
    for i in range(n):
        if i in hot:
            rows.append(module.hot_weight[hot[i]])
        else:
            rows.append(module.cold_weight[_reference_hash(i, module.num_buckets, module.seed)])
    return torch.stack(rows)


def _modules(options: EmbeddingOptions) -> list[nn.Module]:
    torch.manual_seed(0)
    n = options.num_embeddings
    return [
        HashedEmbedding(options, 13),
        HashedEmbedding(options, 13, num_hashes=2, seed=5),
        QREmbedding(options, 7, operation="sum"),
        QREmbedding(options, 7, operation="mult"),
        HybridEmbedding(options, torch.tensor([40, 3, 17, 0, n - 1]), 11, seed=2),
    ]


@pytest.mark.parametrize("index", range(5))
def test_embedding_lookup_and_gradients_match_the_full_table(index: int) -> None:
    n, d = 60, 6
    module = _modules(_options(n, d))[index]
    ids = torch.tensor([[0, 5, 40], [59, 17, 5]])
    out = module(ids)
    out.pow(2).sum().backward()
    got = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad()
    ref = F.embedding(ids, _full_table(module, n))
    ref.pow(2).sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for name, p in module.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bags_match_nn_embedding_bag_on_the_full_table(mode: str) -> None:
    n, d = 50, 4
    options = _options(n, d, bag_mode=mode, padding_idx=3)
    torch.manual_seed(1)
    module = HybridEmbedding(options, torch.tensor([1, 2, 3]), 9)
    ids = torch.tensor([3, 1, 7, 8, 3, 49, 2, 11])
    offsets = torch.tensor([0, 2, 5])
    weights = torch.rand(8) if mode == "sum" else None
    out = module(ids, offsets, per_sample_weights=weights)
    table = _full_table(module, n)
    ref = F.embedding_bag(ids, table, offsets, mode=mode, per_sample_weights=weights, padding_idx=3)
    torch.testing.assert_close(out, ref)
    assert out.shape == (3, d)


def test_padding_row_is_exact_and_gets_no_gradient() -> None:
    options = _options(30, 4, padding_idx=2)
    torch.manual_seed(0)
    module = HashedEmbedding(options, 5)
    out = module(torch.tensor([2, 2, 7]))
    assert torch.equal(out[0], torch.zeros(4))  # nn.Embedding's padding row starts at zero
    out.sum().backward()
    # only id 7's bucket gets a gradient (the two padding lookups contribute nothing)
    bucket7 = _reference_hash(7, 5, 0)
    expected = torch.zeros(5, 4)
    expected[bucket7] = 1.0
    assert torch.equal(module.weight.grad, expected)


def test_sparse_gradients_train_with_sparse_adam() -> None:
    options = _options(100, 8, sparse=True)
    module = HashedEmbedding(options, 10)
    opt = torch.optim.SparseAdam(list(module.parameters()), lr=0.1)
    before = module.weight.detach().clone()
    module(torch.tensor([1, 2, 3])).sum().backward()
    assert module.weight.grad.is_sparse
    opt.step()
    changed = (module.weight.detach() != before).any(dim=1)
    touched = {_reference_hash(i, 10, 0) for i in (1, 2, 3)}
    assert set(torch.nonzero(changed).flatten().tolist()) == touched


def test_options_that_cannot_be_kept_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"max_norm=1\.0"):
        HashedEmbedding(_options(10, 2, max_norm=1.0), 3)
    with pytest.raises(ValueError, match="scale_grad_by_freq"):
        QREmbedding(_options(10, 2, scale_grad_by_freq=True))
    with pytest.raises(ValueError, match="num_hashes=3"):
        HashedEmbedding(_options(10, 2), 3, num_hashes=3)
    with pytest.raises(ValueError, match="hot_ids must lie in"):
        HybridEmbedding(_options(10, 2), torch.tensor([10]), 3)
    with pytest.raises(ValueError, match="repeated"):
        HybridEmbedding(_options(10, 2), torch.tensor([1, 1]), 3)


def test_qr_gives_every_id_a_distinct_pair_and_default_r_is_ceil_sqrt() -> None:
    module = QREmbedding(_options(1001, 2))
    assert module.num_remainders == 32  # ceil(sqrt(1001)) = 32
    assert tuple(module.quotient.shape) == (32, 2)  # ceil(1001 / 32) = 32
    pairs = {(i // 32, i % 32) for i in range(1001)}
    assert len(pairs) == 1001


def test_hybrid_from_weight_copies_hot_rows_and_averages_buckets() -> None:
    n, d, buckets = 40, 3, 6
    torch.manual_seed(3)
    weight = torch.randn(n, d)
    options = _options(n, d, padding_idx=0)
    hot = torch.tensor([9, 4, 31])
    module = HybridEmbedding.from_weight(weight, options, hot, buckets, seed=1, chunk_rows=7)
    for k, i in enumerate(sorted(hot.tolist())):
        assert torch.equal(module.hot_weight[k], weight[i])
    for b in range(buckets):
        members = [
            i for i in range(n) if i not in (0, 9, 4, 31) and _reference_hash(i, buckets, 1) == b
        ]
        expected = weight[members].mean(0) if members else torch.zeros(d)
        torch.testing.assert_close(module.cold_weight[b].detach(), expected)
    assert torch.equal(module(torch.tensor([0]))[0], weight[0])  # padding row exact
    assert torch.equal(module(torch.tensor([31]))[0], weight[31])  # a hot id: its own row


def test_parameter_bytes_equal_the_estimate() -> None:
    n, d = 1000, 16
    cases = [
        (HashedEmbedding(_options(n, d), 100), "hash:100"),
        (HashedEmbedding(_options(n, d), 100, num_hashes=2), "hash2:100"),
        (QREmbedding(_options(n, d), 30), "qr:30"),
        (HybridEmbedding(_options(n, d), torch.arange(20), 100), "hybrid:20:100"),
    ]
    for module, compression in cases:
        params = sum(p.numel() * p.element_size() for p in module.parameters())
        buffers = sum(b.numel() * b.element_size() for b in module.buffers())
        est = estimate(n, d, optimizer="adam", compression=compression)
        assert est.params_bytes == params + buffers, compression
        assert est.grads_bytes == params, compression
        assert est.optimizer_state_bytes == 2 * params, compression
        assert est.compression == compression
    # and through a real Adam step, the state bytes match too
    module = HybridEmbedding(_options(n, d), torch.arange(20), 100)
    opt = torch.optim.Adam(module.parameters())
    module(torch.tensor([1, 500])).sum().backward()
    opt.step()
    state = sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for k, v in s.items()
        if k != "step"
    )
    steps = sum(1 for s in opt.state.values() if "step" in s)
    est = estimate(n, d, optimizer="adam", compression="hybrid:20:100")
    assert state == est.optimizer_state_bytes
    assert 4 * steps == est.step_state_bytes
