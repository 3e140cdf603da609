"""Low-bit frozen tables (issue 24): group-wise int4/int2, 2:8 sparse int2, per-row precision.

Errors against their definitions (round trip within half a step per group, 2 of 8 kept by
magnitude, exact full rows), bytes counted exactly, packing, refusals, the plan's error against
the measured one, the policy's ranking, and the estimate CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from edo_monitor.actions import ACTIONS, ActionContext, ActivationRecorder
from edo_monitor.actions.expected_error import table_distribution
from edo_monitor.decide.estimate import estimate
from edo_monitor.decide.policy import Policy
from edo_monitor.decide.ranking import lossy_score, make_planner
from edo_monitor.errors import ConfigError
from edo_monitor.measure.frequency import LookupCounter
from edo_monitor.nn.embedding import EmbeddingOptions
from edo_monitor.nn.lowbit import (
    GroupwiseEmbedding,
    PerRowPrecisionEmbedding,
    Sparse2of8Embedding,
    dequantize_groupwise,
    dequantize_sparse_2of8,
    groupwise_bytes,
    pack_bits,
    quantize_groupwise,
    sparse_2of8_bytes,
    sparsify_2of8,
    unpack_bits,
)
from edo_monitor.probes.readings import Reading
from edo_monitor.surfaces.cli.estimate_text import estimate_command

N, D = 600, 40  # D not a multiple of the group: the last group is padded


def _table(n: int = N, d: int = D) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(n, d) * torch.linspace(0.1, 3.0, n).unsqueeze(1)


def test_pack_two_int4_and_four_int2_a_byte_and_round_trip() -> None:
    codes = torch.tensor([[1, 2, 15, 0, 7, 9]])
    packed = pack_bits(codes, 4)
    assert packed.tolist() == [[1 | 2 << 4, 15 | 0 << 4, 7 | 9 << 4]]
    codes2 = torch.tensor([[3, 0, 1, 2, 1]])
    assert pack_bits(codes2, 2).tolist() == [[3 | 0 << 2 | 1 << 4 | 2 << 6, 1]]
    rand = torch.randint(0, 8, (5, 33))
    assert torch.equal(unpack_bits(pack_bits(rand, 3), 3, 33), rand)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("group", [8, 16, 64])
def test_groupwise_round_trip_within_half_a_step_per_group(bits: int, group: int) -> None:
    w = _table()
    q = quantize_groupwise(w, bits, group)
    # a group is never wider than the row rounded up to 8 columns (64 on 40 columns: 40)
    assert q.group_size == min(group, 40)
    group = q.group_size
    x = dequantize_groupwise(q.codes, q.scale, q.zero, bits, group, D)
    step = q.scale.float().repeat_interleave(group, dim=1)[:, :D]
    err = (x - w).abs()
    assert bool((err <= step / 2 * (1 + 1e-5) + 1e-6 * w.abs()).all())
    # codes span the whole range: each group's min and max are reached within half a step
    levels = (1 << bits) - 1
    grouped = torch.cat([w, w[:, -1:].expand(N, (-D) % group)], 1).reshape(N, -1, group)
    assert bool((q.zero.float() <= grouped.amin(-1)).all())
    top = q.zero.float() + levels * q.scale.float()
    assert bool((top >= grouped.amax(-1) * (1 - 1e-6)).all())
    # bytes: exactly the packed codes, a float16 scale and zero-point per group
    groups = -(-D // group)
    expected = N * (groups * group * bits // 8) + N * groups * 4
    assert q.nbytes == groupwise_bytes(N, D, bits, group) == expected


def test_a_group_wider_than_the_row_is_cut_to_it_in_bytes_and_estimate_alike() -> None:
    # regression: a 32-column table in the default groups of 64 was padded to 64 codes a row, so
    # int4 took int8's bytes (1,440,000 for 40,000 rows) and a 3-column table grew past float32
    w = torch.randn(400, 32, generator=torch.Generator().manual_seed(0))
    q, s = quantize_groupwise(w, 4), sparsify_2of8(w)
    assert (q.group_size, s.group_size) == (32, 32)
    assert q.nbytes == groupwise_bytes(400, 32, 4, 64) == 400 * (16 + 4)
    assert s.nbytes == sparse_2of8_bytes(400, 32, 64) == 400 * (2 + 3 + 4)
    narrow = quantize_groupwise(torch.randn(10, 3), 4)
    assert narrow.group_size == 8 and narrow.nbytes == 10 * (4 + 4) < 10 * 3 * 4
    for compression, per_row in (("int4", 20), ("int2", 12), ("2of8", 9)):
        assert estimate(40_000, 32, compression=compression).params_bytes == 40_000 * per_row
    # the same rows as an explicit group of 32
    same = quantize_groupwise(w, 4, 32)
    assert torch.equal(q.codes, same.codes) and torch.equal(q.scale, same.scale)


def test_constant_and_zero_groups_are_exact() -> None:
    w = torch.zeros(3, 16)
    w[1] = 0.5
    q = quantize_groupwise(w, 2, 8)
    assert torch.equal(dequantize_groupwise(q.codes, q.scale, q.zero, 2, 8, 16), w)


def test_2of8_keeps_the_two_largest_of_every_block_and_counts_positions() -> None:
    w = _table(n=50, d=64)
    s = sparsify_2of8(w, 32)
    x = dequantize_sparse_2of8(s.codes, s.positions, s.scale, s.zero, 32, 64)
    blocks_w, blocks_x = w.reshape(50, 8, 8), x.reshape(50, 8, 8)
    top2 = blocks_w.abs().topk(2, dim=-1).indices
    kept = torch.zeros_like(blocks_w, dtype=torch.bool).scatter_(-1, top2, True)
    assert bool((blocks_x[~kept] == 0).all())  # 6 of 8 dropped, the smallest ones
    step = s.scale.float().repeat_interleave(32 // 8, dim=1).reshape(50, 8, 1)
    err = (blocks_x - blocks_w).abs().masked_fill(~kept, 0)
    assert bool((err <= step / 2 * (1 + 1e-5) + 1e-6).all())
    # bytes: per 8 columns 2 codes of 2 bits + 2 positions of 3 bits = 10 bits; 4 bytes a group
    assert s.nbytes == sparse_2of8_bytes(50, 64, 32) == 50 * (64 // 8 * 10 // 8 + 2 * 4)


def test_modules_keep_padding_row_full_rows_and_bags() -> None:
    w = _table()
    opts = EmbeddingOptions(N, D, padding_idx=7)
    full = torch.tensor([500, 3, 42])
    per_row = PerRowPrecisionEmbedding(w, full, opts, 4, 16)
    ids = torch.tensor([[3, 7, 42, 8], [500, 599, 0, 41]])
    out = per_row(ids)
    for pos, i in ((0, 3), (1, 7), (2, 42)):
        assert torch.equal(out[0, pos], w[i])
    assert torch.equal(out[1, 0], w[500])
    low = quantize_groupwise(w[[8, 599, 0, 41]], 4, 16)  # row-local: same codes as in the table
    ref = dequantize_groupwise(low.codes, low.scale, low.zero, 4, 16, D)
    assert torch.equal(out[0, 3], ref[0]) and torch.equal(out[1, 1:], ref[1:])
    assert per_row.nbytes == 3 * D * 4 + 3 * 8 + groupwise_bytes(N - 3, D, 4, 16) + D * 4
    bag = GroupwiseEmbedding(w, EmbeddingOptions(N, D, padding_idx=7, bag_mode="sum"), 2, 8)
    got = bag(torch.tensor([1, 7, 2]), torch.tensor([0]))
    table = bag.dequantized()
    assert torch.allclose(got[0], table[1] + table[2], atol=1e-6)
    sp = Sparse2of8Embedding(w, opts, 8)
    assert torch.equal(sp(torch.tensor([7]))[0], w[7])
    with pytest.raises(ValueError, match="max_norm"):
        GroupwiseEmbedding(w, EmbeddingOptions(N, D, max_norm=1.0), 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_groupwise(w, 4, 12)
    with pytest.raises(ValueError, match="float16"):
        quantize_groupwise(torch.full((1, 8), 1e6), 4, 8)


@pytest.mark.parametrize("bag", [None, "sum", "mean", "max"])
def test_an_empty_batch_of_ids_gives_what_nn_embedding_gives(bag: str | None) -> None:
    """No ids: ``(0, D)`` (Embedding), one zero row a bag (EmbeddingBag): ``unpack_bits`` and
    the reconstructions used a ``-1`` dimension, which is ambiguous with 0 rows (RuntimeError)."""
    w = _table()
    opts = EmbeddingOptions(N, D, padding_idx=7, bag_mode=bag)
    ref: nn.Module = nn.Embedding(N, D) if bag is None else nn.EmbeddingBag(N, D, mode=bag)
    empty = torch.empty(0, dtype=torch.long)
    args = (empty,) if bag is None else (empty, torch.tensor([0, 0]))
    expected = ref(*args)
    assert tuple(expected.shape) == ((0, D) if bag is None else (2, D))
    for module in (
        GroupwiseEmbedding(w, opts, 4),
        GroupwiseEmbedding(w, opts, 2, 8),
        Sparse2of8Embedding(w, opts),
        PerRowPrecisionEmbedding(w, torch.tensor([1, 2]), opts),
    ):
        got = module(*args)
        assert got.shape == expected.shape and got.dtype == expected.dtype
        assert torch.equal(got, torch.zeros_like(got)), type(module).__name__
    if bag is None:  # a 2-D batch of no ids: (B, 0, D)
        assert tuple(GroupwiseEmbedding(w, opts, 4)(torch.empty(3, 0, dtype=torch.long)).shape) == (
            3,
            0,
            D,
        )
    assert unpack_bits(torch.zeros(0, 5, dtype=torch.uint8), 4, 9).shape == (0, 9)
    assert pack_bits(torch.zeros(0, 9, dtype=torch.long), 4).shape == (0, 5)


class Model(nn.Module):
    def __init__(self, n: int = N, d: int = D, **kw: object) -> None:
        super().__init__()
        self.emb = nn.Embedding(n, d, **kw)  # type: ignore[arg-type]
        self.head = nn.Linear(d, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).squeeze(-1)


def _ctx(model: nn.Module, counter: LookupCounter | None = None) -> ActionContext:
    with torch.no_grad(), ActivationRecorder(copy.deepcopy(model)) as rec:
        rec.model(torch.arange(8))
    return ActionContext(model, [], activation_profile=rec.profile(), lookup_counter=counter)


def _frozen(**kw: object) -> Model:
    model = Model(**kw)
    with torch.no_grad():
        model.emb.weight.copy_(_table())
    model.emb.weight.requires_grad_(False)
    return model


def _counted(model: Model) -> LookupCounter:
    counter = LookupCounter()
    counter.watch("emb", model.emb)
    gen = torch.Generator().manual_seed(1)
    p = torch.arange(1, N + 1, dtype=torch.float64).pow(-1.1)
    with torch.no_grad():
        for _ in range(20):
            model.emb(torch.multinomial(p, 512, replacement=True, generator=gen))
    return counter


@pytest.mark.parametrize("variant", ["int4", "int2", "2of8", "perrow"])
def test_apply_saves_the_planned_bytes_and_the_planned_error(variant: str) -> None:
    model = _frozen()
    counter = _counted(model)
    ctx = _ctx(model, counter)
    before = model.emb.weight.detach().clone()
    action = ACTIONS[f"compress_embedding_{variant}"]
    plan = action.plan(ctx)
    assert plan.details["variant"] == variant, plan
    result = action.apply(ctx, plan)
    assert result.status == "applied", result.reason
    assert N * D * 4 - model.emb.nbytes == plan.estimated_saving_bytes
    after = model.emb.dequantized()
    # the plan's error: all N rows fit one sample, so it is exact over the counted lookups
    dist = table_distribution(counter, "emb", N)
    p = torch.zeros(N, dtype=torch.float64)
    p[dist.seen_ids] = dist.seen_probs
    p[~dist.seen_mask] = dist.p0 / max(1, N - dist.seen_ids.numel())
    err = (after.double() - before.double()).pow(2).sum(1)
    measured = float((p * err).sum() / (p * before.double().pow(2).sum(1)).sum())
    assert plan.expected_error == pytest.approx(measured, rel=1e-6)
    if variant == "perrow":
        hot = torch.topk(counter.counts("emb"), plan.details["full_rows"]).indices
        assert torch.equal(after[hot], before[hot])


def test_refusals_trainable_uncounted_and_too_large_for_fp16() -> None:
    trainable = Model()
    for variant in ("int4", "int2", "2of8", "perrow"):
        r = ACTIONS[f"compress_embedding_{variant}"].plan(_ctx(trainable))
        assert "frozen tables" in r.reason, r
    frozen = _frozen()
    assert "lookup counts" in ACTIONS["compress_embedding_perrow"].plan(_ctx(frozen)).reason
    with torch.no_grad():
        frozen.emb.weight[3, 0] = 1e6
    assert "float16" in ACTIONS["compress_embedding_int4"].plan(_ctx(frozen)).reason
    sparse = Model(sparse=True)
    sparse.emb.weight.requires_grad_(False)
    assert "sparse=True" in ACTIONS["compress_embedding_int2"].plan(_ctx(sparse)).reason
    with pytest.raises(ValueError, match="group_size"):
        type(ACTIONS["compress_embedding_int4"])("int4", group_size=12)


def test_policy_ranks_the_low_bit_plans_by_saving_per_error() -> None:
    model = _frozen()
    ctx = _ctx(model, _counted(model))
    planner = make_planner(ctx)
    ladder = [
        "compress_embedding_int8",
        "compress_embedding_int4",
        "compress_embedding_int2",
        "compress_embedding_2of8",
        "compress_embedding_perrow",
    ]
    plans = {name: planner(name) for name in ladder}
    errors = {n: p.expected_error for n, p in plans.items()}
    # more bits, less error; 2:8 drops 6 of 8 values: the largest error
    assert errors["compress_embedding_int8"] < errors["compress_embedding_int4"]
    assert errors["compress_embedding_int4"] < errors["compress_embedding_int2"]
    assert errors["compress_embedding_int2"] < errors["compress_embedding_2of8"]
    best = max(ladder, key=lambda n: lossy_score(plans[n]))
    policy = Policy(allow_lossy=True, ladder=ladder)
    reading = Reading(time_s=0.0, step=1, device_kind="cpu-budget", free_fraction=0.1)
    decision = policy.evaluate(reading, planner)[-1]
    assert decision.action == best


def test_estimate_counts_the_module_bytes_and_the_cli_lists_the_modes() -> None:
    w = _table()
    opts = EmbeddingOptions(N, D)
    for text, module in (
        ("int4", GroupwiseEmbedding(w, opts, 4, 64)),
        ("int2:16", GroupwiseEmbedding(w, opts, 2, 16)),
        ("2of8:8", Sparse2of8Embedding(w, opts, 8)),
        ("perrow:3", PerRowPrecisionEmbedding(w, torch.tensor([1, 2, 3]), opts, 4, 64)),
        ("perrow:3:2", PerRowPrecisionEmbedding(w, torch.tensor([1, 2, 3]), opts, 2, 64)),
    ):
        est = estimate(N, D, compression=text)
        assert est.total_bytes == est.params_bytes == module.nbytes, text
        assert est.grads_bytes == est.optimizer_state_bytes == 0
    assert estimate(N, D, compression="int4").compression == "int4:64"
    out = json.loads(estimate_command(N, D, "float32", "adam", "2of8", False, True))
    assert out["compression"] == "2of8:64" and out["total_bytes"] == sparse_2of8_bytes(N, D, 64)
    for bad in ("int4:12", "int3", "perrow:3:3", "2of8:0"):
        with pytest.raises(ConfigError, match="not allowed"):
            estimate(N, D, compression=bad)


def test_cli_help_lists_the_new_modes() -> None:
    from typer.testing import CliRunner

    from edo_monitor.surfaces.cli import app

    text = CliRunner().invoke(app, ["estimate", "--help"], env={"COLUMNS": "200"}).output
    for mode in ("int4", "int2", "2of8", "perrow"):
        assert mode in text


def test_cold_rule_keeps_the_rarely_looked_up_rows_exact() -> None:
    from edo_monitor.actions.compress_embedding import CompressEmbedding

    model = _frozen()
    counter = _counted(model)
    ctx = _ctx(model, counter)
    before = model.emb.weight.detach().clone()
    action = CompressEmbedding("perrow", per_row="cold", cold_below=5, per_row_bits=2)
    plan = action.plan(ctx)
    counts = counter.counts("emb")
    cold = torch.nonzero(counts < 5).flatten()
    assert plan.details["full_rows"] == cold.numel() and plan.details["cold_below"] == 5
    assert action.apply(ctx, plan).status == "applied"
    after = model.emb.dequantized()
    assert torch.equal(after[cold], before[cold])
    hot = torch.nonzero(counts >= 5).flatten()
    assert not torch.equal(after[hot], before[hot])


def test_sampled_estimate_of_a_large_table_is_near_the_measured_error() -> None:
    n = 40_000  # ten samples' worth of rows: the plan reads a draw, not the table
    model = Model(n=n, d=16)
    torch.manual_seed(2)
    with torch.no_grad():
        model.emb.weight.copy_(torch.randn(n, 16) * torch.rand(n, 1))
    model.emb.weight.requires_grad_(False)
    before = model.emb.weight.detach().clone()
    ctx = _ctx(model)
    for variant in ("int4", "2of8"):
        plan = ACTIONS[f"compress_embedding_{variant}"].plan(ctx)
        trial = copy.deepcopy(model)
        tctx = _ctx(trial)
        assert ACTIONS[f"compress_embedding_{variant}"].apply(tctx, plan).status == "applied"
        after = trial.emb.dequantized().double()
        measured = float((after - before).pow(2).sum() / before.double().pow(2).sum())
        assert plan.expected_error == pytest.approx(measured, rel=0.1), variant
