"""Actions on real CPU training loops: estimates, twin runs, lossy error, rollback, refusals.

The model's embedding table dominates its memory (as in the workloads edo-monitor is for). Every
"twin" comparison trains two models built from the same seed on the same batches with the same
global RNG (dropout), one of them changed by an action at a step boundary.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from edo_monitor.actions import (
    ACTIONS,
    ActionContext,
    ActivationRecorder,
    InjectedFailureError,
    Plan,
    Refusal,
    enforce_budget,
    undo_checkpointing,
)
from edo_monitor.errors import BudgetOutOfMemoryError
from edo_monitor.measure.accounting import account
from edo_monitor.measure.oom import parse_oom_message
from edo_monitor.nn import (
    Int8RowwiseEmbedding,
    LowPrecisionEmbedding,
    LowRankEmbedding,
    OffloadedEmbedding,
    row_error,
)

VOCAB, DIM, HIDDEN, CLASSES, PAD = 3000, 32, 64, 5, 0


class Block(nn.Module):
    """Residual MLP block with dropout: saves activations for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.relu(self.fc1(x))))


class Net(nn.Module):
    """Embedding (or EmbeddingBag) → two blocks → linear head."""

    def __init__(self, bag_mode: str | None = None, frozen: bool = False, **emb_kwargs) -> None:
        super().__init__()
        if bag_mode is None:
            self.emb: nn.Module = nn.Embedding(VOCAB, DIM, padding_idx=PAD, **emb_kwargs)
        else:
            self.emb = nn.EmbeddingBag(VOCAB, DIM, mode=bag_mode, padding_idx=PAD, **emb_kwargs)
        self.emb.weight.requires_grad_(not frozen)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, CLASSES)
        self.bag = bag_mode is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.bag else self.emb(x).mean(dim=1)
        return self.head(self.blocks(h))


def make(seed: int = 0, **kwargs) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net(**kwargs)
    if kwargs.get("frozen"):
        # A "pretrained" frozen table: smooth rows so that compression error is realistic.
        with torch.no_grad():
            basis = torch.randn(8, DIM)
            model.emb.weight.copy_(torch.randn(VOCAB, 8) @ basis + 0.05 * torch.randn(VOCAB, DIM))
            model.emb.weight[PAD] = 0
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def batches(n: int, seed: int = 123) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        # every token of a sequence has the class of the sequence (token % CLASSES); ids < 400
        y = torch.randint(0, CLASSES, (16,), generator=g)
        x = y.unsqueeze(1) + CLASSES * torch.randint(1, 400 // CLASSES, (16, 6), generator=g)
        x[:, -1] = PAD  # every sequence ends with padding
        out.append((x, y))
    return out


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    at_step: dict[int, Callable[[], None]] | None = None,
) -> list[float]:
    """Train over ``data``; ``at_step[i]()`` runs at the step boundary before step ``i``."""
    losses = []
    for i, (x, y) in enumerate(data):
        if at_step and i in at_step:
            at_step[i]()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
    return losses


def twin_losses(action: Callable[[Net, torch.optim.Optimizer], None], steps: int, at: int, **kw):
    data = batches(steps)
    ref_model, ref_opt = make(**kw)
    torch.manual_seed(99)
    ref = train(ref_model, ref_opt, data)
    model, opt = make(**kw)
    torch.manual_seed(99)
    got = train(model, opt, data, {at: lambda: action(model, opt)})
    return ref, got, model, opt


def assert_rel_equal(a: list[float], b: list[float], rel: float = 1e-6) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert abs(x - y) <= rel * max(abs(x), 1e-12), (i, x, y)


def quiet_profile(model: nn.Module):
    """A recorded forward that changes nothing: no gradients, the RNG state restored.

    Table actions need one (it tells whether a weight is read outside its module). It runs on a
    copy: a table with ``max_norm`` renormalises rows in place even under ``no_grad``; the
    profile refers to modules by name, which the copy shares."""
    twin = copy.deepcopy(model)
    with torch.random.fork_rng(), torch.no_grad(), ActivationRecorder(twin) as rec:
        twin(batches(1, seed=5)[0][0])
    return rec.profile()


def ctx_of(model: nn.Module, opt: torch.optim.Optimizer, **kw) -> ActionContext:
    if isinstance(model, Net):
        kw.setdefault("activation_profile", quiet_profile(model))
    return ActionContext(model=model, optimizers=[opt], cuda_mode=False, **kw)


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


def profile_of(model: nn.Module, x: torch.Tensor):
    with ActivationRecorder(model) as rec:
        out = model(x)
    out.sum().backward()
    return rec.profile()


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

    def act(model: Net, opt: torch.optim.Optimizer) -> None:
        original = model.emb.weight.detach().clone()
        ctx = ctx_of(model, opt)
        plan = ACTIONS[name].plan(ctx)
        assert isinstance(plan, Plan), plan
        before = account(model, [opt])
        result = ACTIONS[name].apply(ctx, plan)
        after = account(model, [opt])
        assert result.status == "applied", result.reason
        assert isinstance(model.emb, cls)
        assert before.total_bytes - after.total_bytes == plan.estimated_saving_bytes > 0
        assert result.saved_bytes == plan.estimated_saving_bytes
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

    ref, got, _, _ = twin_losses(act, steps=LOSSY_STEPS, at=LOSSY_AT, frozen=frozen)
    assert results and results[0].lossy
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


# ---------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def gloo_group() -> Iterator[None]:
    """A real single-process gloo process group (rank 0 of 1, in-memory rendezvous store)."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    if dist.is_initialized():  # someone else's group: use it, leave it
        yield
        return
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


TABLE_ACTIONS = ["offload_embedding", "compress_embedding", "compress_embedding_lowrank"]


@pytest.mark.parametrize("name", [*TABLE_ACTIONS, "checkpoint_activations"])
def test_refuses_ddp_and_fsdp_wrapped_models(name: str, gloo_group: None) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    wrappers = {
        DistributedDataParallel: lambda m: DistributedDataParallel(m),
        FullyShardedDataParallel: lambda m: FullyShardedDataParallel(
            m, device_id=torch.device("cpu")
        ),
    }
    for cls, wrap in wrappers.items():
        if name == "checkpoint_activations" and cls is DistributedDataParallel:
            continue  # changes no parameter: applies under DDP (the test after this one)
        model, _ = make()
        wrapped = wrap(model)
        opt = torch.optim.Adam(wrapped.parameters())
        x, y = batches(1)[0]
        profile = None
        if name == "checkpoint_activations":
            profile = profile_of(wrapped, x)  # a real profile: the plan sees blocks
            opt.zero_grad()
        before = [p.detach().clone() for p in wrapped.parameters()]
        r = ACTIONS[name].plan(ctx_of(wrapped, opt, activation_profile=profile))
        assert isinstance(r, Refusal) and cls.__name__ in r.reason
        result = ACTIONS[name].apply(ctx_of(wrapped, opt, activation_profile=profile))
        assert result.status == "refused" and cls.__name__ in result.reason
        assert isinstance(wrapped, cls)  # nothing replaced, nothing changed
        after = list(wrapped.parameters())
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        train(wrapped, opt, [(x, y)])  # and the wrapped model still trains


def test_checkpoint_activations_under_ddp_is_lossless(gloo_group: None) -> None:
    """Under DistributedDataParallel checkpointing changes no registered parameter: it applies,
    and the wrapped model trains on bit-identically to an untouched DDP twin."""
    from torch.nn.parallel import DistributedDataParallel

    model, _ = make()
    twin, _ = make()
    ddp, ddp_twin = DistributedDataParallel(model), DistributedDataParallel(twin)
    opt = torch.optim.Adam(ddp.parameters())
    opt_twin = torch.optim.Adam(ddp_twin.parameters())
    data = batches(4)
    for m, o in ((ddp, opt), (ddp_twin, opt_twin)):
        torch.manual_seed(1)  # the same dropout masks for both
        train(m, o, data[:1])
    profile = profile_of(ddp, data[1][0])
    opt.zero_grad()
    result = ACTIONS["checkpoint_activations"].apply(ctx_of(ddp, opt, activation_profile=profile))
    assert result.status == "applied", result.reason
    assert result.target.startswith("module.") and isinstance(ddp, DistributedDataParallel)
    torch.manual_seed(2)
    got = train(ddp, opt, data[1:])
    torch.manual_seed(2)
    assert_rel_equal(got, train(ddp_twin, opt_twin, data[1:]))
    for a, b in zip(ddp.parameters(), ddp_twin.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", TABLE_ACTIONS)
def test_refuses_tied_weights(name: str) -> None:
    model, _ = make()
    tied = nn.Linear(DIM, VOCAB, bias=False)
    tied.weight = model.emb.weight  # input embedding shared with an output projection
    model.lm_head = tied
    opt = torch.optim.Adam(model.parameters())
    r = ACTIONS[name].plan(ctx_of(model, opt))
    assert isinstance(r, Refusal) and "tied to lm_head (Linear)" in r.reason


@pytest.mark.parametrize(
    ("name", "emb_kwargs", "frozen", "reason"),
    [
        ("compress_embedding", {"sparse": True}, False, "sparse=True"),
        ("compress_embedding", {"max_norm": 1.0}, False, "max_norm"),
        ("compress_embedding", {"max_norm": 1.0}, True, "max_norm"),
        ("compress_embedding_lowrank", {"scale_grad_by_freq": True}, False, "scale_grad_by_freq"),
        ("compress_embedding_int8", {}, False, "frozen tables"),
        ("compress_embedding_fp16", {}, False, "eps=1e-08 underflows in fp16"),
    ],
)
def test_refuses_options_it_cannot_preserve(
    name: str, emb_kwargs: dict, frozen: bool, reason: str
) -> None:
    model, opt = make(frozen=frozen, **emb_kwargs)
    r = ACTIONS[name].plan(ctx_of(model, opt))
    assert isinstance(r, Refusal) and reason in r.reason, r


def test_offload_preserves_options_instead_of_refusing() -> None:
    def act(model: Net, opt: torch.optim.Optimizer) -> None:
        assert ACTIONS["offload_embedding"].apply(ctx_of(model, opt)).status == "applied"

    kw = {"max_norm": 1.0, "scale_grad_by_freq": True}
    ref, got, _, _ = twin_losses(act, steps=15, at=3, **kw)
    assert_rel_equal(ref[3:], got[3:])


def test_offload_refuses_when_no_table_is_left_and_release_cache_in_cpu_mode() -> None:
    model, opt = make()
    ctx = ctx_of(model, opt)
    assert ACTIONS["offload_embedding"].apply(ctx).status == "applied"
    r = ACTIONS["offload_embedding"].plan(ctx)
    assert isinstance(r, Refusal) and "no embedding table left" in r.reason
    r = ACTIONS["release_cache"].plan(ctx)
    assert isinstance(r, Refusal) and "CPU-budget" in r.reason
    assert ACTIONS["release_cache"].apply(ctx).status == "refused"


def test_apply_refuses_a_stale_plan() -> None:
    model, opt = make()
    ctx = ctx_of(model, opt)
    stale = Plan("offload_embedding", "other_table", 1, "decided earlier")
    result = ACTIONS["offload_embedding"].apply(ctx, stale)
    assert result.status == "refused" and "target changed" in result.reason
    assert isinstance(model.emb, nn.Embedding)


# ---------------------------------------------------------------- CPU-budget enforcement


def test_enforce_budget_raises_pytorch_style_oom() -> None:
    enforce_budget(1000, 1000)  # at the budget: fine
    with pytest.raises(BudgetOutOfMemoryError) as info:
        # 4 KiB requested with 2 MiB - 2.5 KiB in use before it: 2.5 KiB free
        enforce_budget(2 * 1024 * 1024, 2 * 1024 * 1024 + 1536, requested_bytes=4096)
    assert isinstance(info.value, torch.OutOfMemoryError)
    msg = str(info.value)
    assert msg.startswith("CPU-budget out of memory. Tried to allocate 4.00 KiB.")
    assert "Budget of 2.00 MiB of which 2.50 KiB is free." in msg
    assert "2.00 MiB is accounted to the watched model." in msg  # 2,094,592 bytes
    parsed = parse_oom_message(msg)
    assert parsed is not None and parsed.backend == "cpu-budget"
    # what the message prints, read back: 4.00 KiB, 2.00 MiB, 2.50 KiB, 2.00 MiB
    assert (parsed.requested_bytes, parsed.total_bytes, parsed.free_bytes) == (4096, 2 << 20, 2560)
    assert parsed.allocated_bytes == 2 << 20


def test_enforce_budget_states_accounted_bytes_over_the_budget_and_zero_free() -> None:
    """Already over the budget before the request: the true accounted bytes, free 0 (the request
    is not stretched to the excess, which made the message read "budget accounted, 0 free")."""
    with pytest.raises(BudgetOutOfMemoryError) as info:
        enforce_budget(1024, 26_131_000 + 160, requested_bytes=160)
    msg = str(info.value)
    assert msg == (
        "CPU-budget out of memory. Tried to allocate 160 bytes. Budget of 1024 bytes of which "
        "0 bytes is free. 24.92 MiB is accounted to the watched model."
    )
    with pytest.raises(BudgetOutOfMemoryError) as info:
        enforce_budget(3 << 20, 4 << 20, accounted_bytes=3 << 20 | 512, requested_bytes=4096)
    assert "of which 0 bytes is free. 3.00 MiB is accounted" in str(info.value)


def test_budget_enforcement_fails_untuned_run_and_offload_saves_it() -> None:
    """Without the action the run goes over budget; offloading the table keeps it under."""
    model, opt = make()
    train(model, opt, batches(1))
    in_use = account(model, [opt]).total_bytes
    budget = int(in_use * 0.9)
    with pytest.raises(BudgetOutOfMemoryError):
        enforce_budget(budget, in_use)
    assert ACTIONS["offload_embedding"].apply(ctx_of(model, opt)).status == "applied"
    train(model, opt, batches(3))
    enforce_budget(budget, account(model, [opt]).total_bytes)


def test_the_run_records_whether_its_model_is_replicated_or_sharded(
    gloo_group: None, tmp_path: Path
) -> None:
    """The staged plan's stage 3 differs for replicas (DDP) and shards (FSDP): the run records
    the wrapper, and explain's plan reads it (tests/test_staged_plan.py checks the figures)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    from edo_monitor import History, watch

    wrappers = {
        "FullyShardedDataParallel": lambda m: FullyShardedDataParallel(
            m, device_id=torch.device("cpu")
        ),
        "DistributedDataParallel": DistributedDataParallel,
        None: lambda m: m,
    }
    db = tmp_path / "h.db"
    for name, wrap in wrappers.items():
        model = wrap(make()[0])
        opt = torch.optim.Adam(model.parameters())
        with watch(model, optimizer=opt, db=db, budget="64MiB", run_name=str(name)):
            train(model, opt, batches(2))
    with History(db) as h:
        recorded = {r.name: h.run(r.id).config["parallel_wrapper"] for r in h.runs()}
    assert recorded == {str(k): k for k in wrappers}
