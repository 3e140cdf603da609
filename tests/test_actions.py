"""Actions on real CPU training loops: estimates, twin runs, lossy error, rollback (refusals:
``test_actions_refusals.py``).

The model's embedding table dominates its memory (as in the workloads edo-monitor is for). Every
"twin" comparison trains two models built from the same seed on the same batches with the same
global RNG (dropout), one of them changed by an action at a step boundary.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from action_helpers import (
    DIM,
    PAD,
    VOCAB,
    Net,
    assert_rel_equal,
    batches,
    ctx_of,
    make,
    profile_of,
    quiet_profile,
    train,
    twin_losses,
)
from torch import nn

from edo_monitor.actions import (
    ACTIONS,
    InjectedFailureError,
    Plan,
    Refusal,
    undo_checkpointing,
)
from edo_monitor.measure.accounting import account
from edo_monitor.nn import (
    Int8RowwiseEmbedding,
    LowPrecisionEmbedding,
    LowRankEmbedding,
    OffloadedEmbedding,
    row_error,
)

# ---------------------------------------------------------------- lossless: offload_embedding


@pytest.mark.parametrize("bag_mode", [None, "sum", "mean", "max"])
def test_offload_estimate_matches_measured_and_next_20_losses_equal(bag_mode: str | None) -> None:
    results = []

    def act(model: Net, opt: torch.optim.Optimizer) -> None:
        weight = model.emb.weight
        ctx = ctx_of(model, opt)
        plan = ACTIONS["offload_embedding"].plan(ctx)
        assert isinstance(plan, Plan) and plan.target == "emb"
        before = account(model, [opt])
        t0 = time.perf_counter()
        result = ACTIONS["offload_embedding"].apply(ctx, plan)
        wall_s = time.perf_counter() - t0
        after = account(model, [opt])
        assert result.status == "applied", result.reason
        # its own duration: a positive part of the wall time around the call
        assert 0 < result.duration_s <= wall_s
        assert result.saved_bytes == plan.estimated_saving_bytes
        assert before.total_bytes - after.total_bytes == plan.estimated_saving_bytes
        # weight + grad + Adam's exp_avg and exp_avg_sq (the scalar step tensor too)
        assert plan.estimated_saving_bytes == 4 * VOCAB * DIM * 4 + 4
        assert isinstance(model.emb, OffloadedEmbedding) and model.emb.weight is weight
        assert any(p is weight for p in opt.param_groups[0]["params"])
        assert after.host_bytes == plan.estimated_saving_bytes
        results.append(result)

    ref, got, model, _ = twin_losses(act, steps=25, at=5, bag_mode=bag_mode)
    assert len(results) == 1
    assert_rel_equal(ref[5:25], got[5:25])
    assert torch.count_nonzero(model.emb.weight[PAD]) == 0  # padding row never trained


@pytest.mark.parametrize(
    ("name", "immediate_bytes", "estimate_bytes"),
    [
        # weight, exp_avg, exp_avg_sq (fp32) and Adam's 4-byte step move to the host at once;
        # the fp32 gradient too, from the next backward on
        ("offload_embedding", 3 * VOCAB * DIM * 4 + 4, 4 * VOCAB * DIM * 4 + 4),
        # weight, exp_avg, exp_avg_sq halve at once (fp32 -> bf16); the gradient comes back bf16
        ("compress_embedding_bf16", 3 * VOCAB * DIM * 2, 4 * VOCAB * DIM * 2),
    ],
)
def test_estimate_is_the_saving_at_the_steps_peak_when_gradients_are_freed(
    name: str, immediate_bytes: int, estimate_bytes: int
) -> None:
    """With ``zero_grad(set_to_none=True)`` the table has no gradient between steps: an action
    applied there saves the weight's and the optimizer state's share at once, and the gradient's
    share from the next backward on. The plan's estimate is the saving at the step's peak (after
    ``opt.step()``, before ``zero_grad``), measured against an untouched twin."""
    data = batches(5)
    runs = [make(), make()]  # acted, twin
    for model, opt in runs:
        torch.manual_seed(3)
        for x, y in data[:3]:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    model, opt = runs[0]
    assert model.emb.weight.grad is None
    ctx = ctx_of(model, opt)
    plan = ACTIONS[name].plan(ctx)
    assert isinstance(plan, Plan), plan
    result = ACTIONS[name].apply(ctx, plan)
    assert result.status == "applied", result.reason
    assert plan.estimated_saving_bytes == estimate_bytes
    assert result.saved_bytes == immediate_bytes  # no gradient to move or shrink yet
    peaks = []
    for m, o in runs:
        torch.manual_seed(4)
        for x, y in data[3:]:
            F.cross_entropy(m(x), y).backward()
            o.step()
            peaks.append(account(m, [o]).total_bytes)  # the step's peak: gradients alive
            o.zero_grad(set_to_none=True)
    acted_peaks, twin_peaks = peaks[: len(data) - 3], peaks[len(data) - 3 :]
    assert [t - a for a, t in zip(acted_peaks, twin_peaks, strict=True)] == [estimate_bytes] * 2


# ---------------------------------------------------------- lossless: checkpoint_activations


def test_checkpoint_estimate_matches_measured_and_losses_equal_and_undo() -> None:
    results = []

    def act(model: Net, opt: torch.optim.Optimizer) -> None:
        x, _ = batches(1, seed=7)[0]
        state = torch.random.get_rng_state()
        ctx = ctx_of(model, opt, activation_profile=profile_of(model, x))
        opt.zero_grad(set_to_none=False)
        plan = ACTIONS["checkpoint_activations"].plan(ctx)
        assert isinstance(plan, Plan), plan
        assert plan.details["blocks"] == ["blocks.0", "blocks.1"]
        result = ACTIONS["checkpoint_activations"].apply(ctx, plan)
        assert result.status == "applied", result.reason
        after = profile_of(model, x)
        opt.zero_grad(set_to_none=False)
        torch.random.set_rng_state(state)
        assert result.bytes_before - after.total_bytes == plan.estimated_saving_bytes
        assert result.saved_bytes == plan.estimated_saving_bytes > 0
        results.append(result)

    ref, got, model, opt = twin_losses(act, steps=25, at=5)
    assert results
    assert_rel_equal(ref[5:25], got[5:25])
    # no checkpointing again on what is already checkpointed; undo removes the wrappers
    x, _ = batches(1, seed=7)[0]
    ctx = ctx_of(model, opt, activation_profile=profile_of(model, x))
    refusal = ACTIONS["checkpoint_activations"].plan(ctx)
    assert isinstance(refusal, Refusal) and "no block" in refusal.reason
    assert undo_checkpointing(model) == ["blocks.0", "blocks.1"]
    assert "forward" not in model.blocks[0].__dict__


def test_checkpoint_takes_a_block_whose_layers_save_nothing_alone() -> None:
    """Regression: in a residual stack of ``Sequential(Linear, GELU, Linear)`` blocks each layer's
    saved tensor is its own input, so no layer frees anything alone, while a whole block frees
    128 KiB; the block was skipped as a container of candidate layers and the plan took the
    LayerNorm alone (1 KiB of 257). Checkpointed, training is the twin's."""
    import copy

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(500, 32)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(2)
            )
            self.ln = nn.LayerNorm(32)
            self.head = nn.Linear(32, 500)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            for block in self.blocks:
                h = h + block(h)
            return self.head(self.ln(h)).flatten(0, 1)

    torch.manual_seed(0)
    model = LM()
    twin = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), 1e-3) for m in (model, twin)]
    data = [(torch.randint(0, 500, (8, 16)), torch.randint(0, 500, (8 * 16,))) for _ in range(4)]
    ctx = ctx_of(model, opts[0], activation_profile=profile_of(model, data[0][0]))
    plan = ACTIONS["checkpoint_activations"].plan(ctx)
    assert isinstance(plan, Plan), plan
    assert plan.details["blocks"] == ["blocks.0", "blocks.1", "ln"]
    result = ACTIONS["checkpoint_activations"].apply(ctx, plan)
    assert result.status == "applied" and result.saved_bytes == plan.estimated_saving_bytes
    assert result.saved_bytes == 2 * 8 * 16 * 128 * 4 * 2 + 1024  # GELU's input and output
    opts[0].zero_grad()  # the profiles' backward
    for x, y in data:
        losses = []
        for m, o in zip((model, twin), opts, strict=True):
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1]


def test_a_checkpointed_model_copies_and_saves_whole() -> None:
    """Regression: the wrapper was a closure over the block's bound ``forward``, so a
    ``copy.deepcopy`` of the model (a best-model or EMA snapshot) computed with the original's
    weights, and ``torch.save(model)`` failed ("Can't pickle local object")."""
    import copy
    import io

    model, opt = make()
    x, _ = batches(1, seed=7)[0]
    ctx = ctx_of(model, opt, activation_profile=profile_of(model, x))
    assert ACTIONS["checkpoint_activations"].apply(ctx).status == "applied"
    model.eval()  # no dropout: outputs comparable
    expected = model(x).detach()
    snapshot = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the original trains on
    for other in (snapshot, loaded):
        assert torch.equal(other(x), expected)  # with grad: through the checkpoint
        with torch.no_grad():
            assert torch.equal(other(x), expected)
        other(x).sum().backward()
        assert all(p.grad is not None for p in other.blocks[0].parameters())
    assert not torch.equal(model(x), expected)
    assert undo_checkpointing(snapshot) == ["blocks.0", "blocks.1"]
    assert torch.equal(snapshot(x), expected)


def test_checkpointing_a_block_counts_the_inputs_it_keeps_alive() -> None:
    """Regression: in ``Linear -> GELU -> Dropout -> Linear`` the plan checkpointed the Dropout
    for an estimated 2 MiB (its mask), but checkpointing keeps its input, the GELU's output, that
    nothing saved before: measured, nothing was freed. The estimate is the exclusive bytes less
    such inputs; no block of this model frees anything, so the plan refuses."""
    from edo_monitor.actions.checkpoint_activations import _wrap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(512, 256)
    before = profile_of(model, x)
    gelu_out = 512 * 1024 * 4
    assert before.held_input_bytes.get("2") == gelu_out  # the Dropout's input: saved by none
    assert before.exclusive_bytes["2"] > 0 and before.net_saving_bytes("2") <= 0
    refusal = ACTIONS["checkpoint_activations"].plan(ctx_of(model, opt, activation_profile=before))
    assert isinstance(refusal, Refusal) and "no block" in refusal.reason
    _wrap(model[2], "2")  # what the old plan did: the measured saving is the net one
    after = profile_of(model, x)
    assert before.total_bytes - after.total_bytes == before.net_saving_bytes("2")


def test_checkpoint_refuses_without_profile() -> None:
    model, opt = make()
    r = ACTIONS["checkpoint_activations"].plan(ctx_of(model, opt, activation_profile=None))
    assert isinstance(r, Refusal) and "activation profile" in r.reason


# ---------------------------------------------------------------- lossy: compress_embedding

LOSSY_STEPS, LOSSY_AT = 60, 10
# Tolerances on the loss 50 steps after a lossy action, against the untouched twin.
# * Frozen tables (int8, fp16, low-rank of a table whose rows lie near an 8-dim subspace): only the
#   forward changes, by little: int8 rounds each weight by at most half a step (max|row|/254, row
#   cosine > 0.9999), fp16 by 2^-11 relative, rank D/2 keeps > 99.9 % of this table's energy. The
#   logits move by well under 1 %, and the rest of the model trains on nearly the same features, so
#   the final loss must agree within FROZEN_REL_TOL = 2 % (measured: < 0.5 %).
# * Trainable tables (bf16, low-rank): the trajectory itself changes. bf16 drops every Adam update
#   smaller than half a unit in the last place (lr=1e-2 against an ulp of 2^-7 for |w| in [1, 2) and
#   2^-6 above), so rows learn more slowly; rank D/2 of a freshly initialised (full-spectrum) table
#   throws away half its energy (row cosine ≈ 0.73) and must be re-learned. Neither may break
#   training: the loss must keep falling — at least half of the twin's fall over the same 50 steps —
#   and end within TRAINABLE_ABS_TOL = 0.2 nats of the twin (≈ 12 % of the initial ln 5 = 1.61;
#   measured 0.12 for bf16, 0.05 for low-rank). A broken table (wrong rows, lost gradients, NaN)
#   stays near ln 5 and fails both.
FROZEN_REL_TOL = 0.02
TRAINABLE_ABS_TOL = 0.2


@pytest.mark.parametrize(
    ("name", "frozen", "cls"),
    [
        ("compress_embedding", False, LowPrecisionEmbedding),  # auto → bf16 for trainable
        ("compress_embedding_fp16", True, LowPrecisionEmbedding),
        ("compress_embedding", True, Int8RowwiseEmbedding),  # auto → int8 for frozen
        ("compress_embedding_lowrank", False, LowRankEmbedding),
        ("compress_embedding_lowrank", True, LowRankEmbedding),
        ("compress_embedding_int8", True, Int8RowwiseEmbedding),
    ],
)
def test_compress_estimate_error_and_loss_after_50_steps(
    name: str, frozen: bool, cls: type
) -> None:
    results = []
    befores: list[int] = []

    def act(model: Net, opt: torch.optim.Optimizer) -> None:
        original = model.emb.weight.detach().clone()
        ctx = ctx_of(model, opt)
        plan = ACTIONS[name].plan(ctx)
        assert isinstance(plan, Plan), plan
        befores.append(account(model, [opt]).total_bytes)
        result = ACTIONS[name].apply(ctx, plan)
        assert result.status == "applied", result.reason
        assert isinstance(model.emb, cls)
        # estimate and recorded saving: the bytes once training went on (checked below)
        assert result.saved_bytes == plan.estimated_saving_bytes > 0
        # the recorded error is the error of the table the model now computes with
        if isinstance(model.emb, Int8RowwiseEmbedding):
            approx = model.emb.dequantized()
        elif isinstance(model.emb, LowRankEmbedding):
            approx = model.emb.reconstructed()
        else:
            approx = model.emb.weight.detach()
        expected = row_error(original, approx, skip_rows=(PAD,))
        assert result.error == pytest.approx(expected)
        assert torch.equal(approx[PAD].float(), original[PAD])  # padding row kept
        if isinstance(model.emb, Int8RowwiseEmbedding):
            assert result.error["mean_row_cosine"] > 0.9999
        # optimizer consistent: every trainable parameter of the model is stepped, no stale ones
        opt_params = {id(p) for g in opt.param_groups for p in g["params"]}
        model_params = {id(p) for p in model.parameters() if p.requires_grad}
        assert model_params <= opt_params
        assert all(id(p) in {id(q) for q in model.parameters()} for p in opt.state)
        results.append(result)

    ref, got, model, opt = twin_losses(act, steps=LOSSY_STEPS, at=LOSSY_AT, frozen=frozen)
    assert results and results[0].lossy
    # a trainable low-rank table's factors get their gradient and Adam state at the next step:
    # the saving that lasts is what was planned and recorded
    assert befores[0] - account(model, [opt]).total_bytes == results[0].saved_bytes
    final_ref, final_got = ref[-1], got[-1]
    assert LOSSY_STEPS - LOSSY_AT == 50
    if frozen:
        assert abs(final_got - final_ref) <= FROZEN_REL_TOL * final_ref, (final_ref, final_got)
    else:
        assert abs(final_got - final_ref) <= TRAINABLE_ABS_TOL, (final_ref, final_got)
        assert got[LOSSY_AT] - final_got >= 0.5 * (ref[LOSSY_AT] - final_ref), (ref, got)


def test_bf16_converts_optimizer_state_consistently() -> None:
    model, opt = make()
    train(model, opt, batches(3))
    weight = model.emb.weight
    exp_avg = opt.state[weight]["exp_avg"].clone()
    result = ACTIONS["compress_embedding_bf16"].apply(ctx_of(model, opt))
    assert result.status == "applied"
    assert model.emb.weight is weight and weight.dtype == torch.bfloat16
    state = opt.state[weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert state["step"].dtype == torch.float32
    assert torch.equal(state["exp_avg"], exp_avg.to(torch.bfloat16))
    assert weight.grad.dtype == torch.bfloat16


# ---------------------------------------------------------------- rollback


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer):
    return {
        "sd": {k: v.clone() for k, v in model.state_dict().items()},
        "params": list(model.parameters()),
        "modules": [(n, m) for n, m in model.named_modules()],
        "groups": [list(g["params"]) for g in opt.param_groups],
        "state": {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "host": [getattr(p, "_edo_host", None) for p in model.parameters()],
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["sd"].keys() == b["sd"].keys()
    for k in a["sd"]:
        assert a["sd"][k].dtype == b["sd"][k].dtype and torch.equal(a["sd"][k], b["sd"][k]), k
    assert len(a["params"]) == len(b["params"])
    assert all(p is q for p, q in zip(a["params"], b["params"], strict=True))
    assert [(n, id(m)) for n, m in a["modules"]] == [(n, id(m)) for n, m in b["modules"]]
    assert len(a["groups"]) == len(b["groups"])
    for ga, gb in zip(a["groups"], b["groups"], strict=True):
        assert all(p is q for p, q in zip(ga, gb, strict=True)) and len(ga) == len(gb)
    assert a["state"].keys() == b["state"].keys()
    for pid, s in a["state"].items():
        assert s.keys() == b["state"][pid].keys()
        for k in s:
            assert s[k].dtype == b["state"][pid][k].dtype and torch.equal(s[k], b["state"][pid][k])
    for ga, gb in zip(a["grads"], b["grads"], strict=True):
        assert (ga is None) == (gb is None) and (ga is None or torch.equal(ga, gb))
    assert a["host"] == b["host"]


ROLLBACK_CASES = [
    ("offload_embedding", False, "weight_moved"),
    ("offload_embedding", False, "optimizer_state_moved"),
    ("offload_embedding", False, "module_replaced"),
    ("compress_embedding_bf16", False, "weight_converted"),
    ("compress_embedding_bf16", False, "optimizer_state_converted"),
    ("compress_embedding_bf16", False, "module_replaced"),
    ("compress_embedding_int8", True, "quantized"),
    ("compress_embedding_int8", True, "module_replaced"),
    ("compress_embedding_lowrank", False, "factorized"),
    ("compress_embedding_lowrank", False, "optimizer_updated"),
    ("compress_embedding_lowrank", False, "module_replaced"),
    ("checkpoint_activations", False, "wrapped:blocks.1"),
]


@pytest.mark.parametrize(("name", "frozen", "stage"), ROLLBACK_CASES)
def test_failure_mid_action_rolls_back_bit_identical(name: str, frozen: bool, stage: str) -> None:
    data = batches(8)
    model, opt = make(frozen=frozen)
    torch.manual_seed(5)
    train(model, opt, data[:3])
    x, _ = data[0]
    profile = profile_of(model, x) if name == "checkpoint_activations" else quiet_profile(model)
    opt.zero_grad(set_to_none=False)
    before = _snapshot(model, opt)
    ctx = ctx_of(model, opt, activation_profile=profile, fail_at=stage)
    result = ACTIONS[name].apply(ctx)
    assert result.status == "failed"
    assert isinstance(result.exception, InjectedFailureError) and stage in result.reason
    _assert_same(before, _snapshot(model, opt))
    assert all("forward" not in m.__dict__ for m in model.modules())
    # and training goes on exactly like an untouched twin
    twin, twin_opt = make(frozen=frozen)
    torch.manual_seed(5)
    train(twin, twin_opt, data[:3])
    if profile is not None:
        profile_of(twin, x)
        twin_opt.zero_grad(set_to_none=False)
    rng = torch.random.get_rng_state()
    a = train(model, opt, data[3:])
    torch.random.set_rng_state(rng)
    b = train(twin, twin_opt, data[3:])
    assert a == b
