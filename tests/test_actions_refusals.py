"""Actions on real CPU training loops: what they refuse (distributed wrappers, tied weights, options
they cannot keep, stale plans) and the CPU-budget enforcement's out-of-memory error.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from action_helpers import (
    DIM,
    VOCAB,
    Net,
    assert_rel_equal,
    batches,
    ctx_of,
    make,
    profile_of,
    train,
    twin_losses,
)
from torch import nn

from edo_monitor.actions import (
    ACTIONS,
    Plan,
    Refusal,
    enforce_budget,
)
from edo_monitor.errors import BudgetOutOfMemoryError
from edo_monitor.measure.accounting import account
from edo_monitor.measure.frequency import LookupCounter
from edo_monitor.measure.oom import parse_oom_message

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


OPTIMIZER_ACTIONS = [*TABLE_ACTIONS, "compress_embedding_bf16", "share_embedding"]


@pytest.mark.parametrize("name", OPTIMIZER_ACTIONS)
def test_refuses_a_trainable_table_that_no_optimizer_of_the_run_steps(name: str) -> None:
    """Regression: with the table's own optimizer not given to the run (``watch(model,
    dense_opt)``), bf16 left that optimizer's Adam state float32 (a RuntimeError at its next
    step), low rank and sharing put new parameters no optimizer steps while the old weight
    stayed alive in it. Refused now, as the row cache refuses it; a frozen table is taken."""
    model, _ = make()
    table_opt = torch.optim.Adam([model.emb.weight], lr=1e-2)
    dense = [p for n, p in model.named_parameters() if not n.startswith("emb.")]
    dense_opt = torch.optim.Adam(dense, lr=1e-2)
    train(model, _TwoOptimizers(dense_opt, table_opt), batches(2))
    ctx = ctx_of(model, dense_opt, lookup_counter=_counted(model))
    r = ACTIONS[name].plan(ctx)
    assert isinstance(r, Refusal) and "emb: no optimizer the run knows steps it" in r.reason, r
    assert ACTIONS[name].apply(ctx).status == "refused"
    assert isinstance(model.emb, nn.Embedding) and model.emb.weight.dtype == torch.float32
    model.emb.weight.requires_grad_(False)  # frozen: nothing to follow
    assert not isinstance(ACTIONS["offload_embedding"].plan(ctx), Refusal)


@pytest.mark.parametrize("name", ["compress_embedding_bf16", "share_embedding"])
def test_refuses_optimizer_state_that_is_not_per_element(name: str) -> None:
    """Regression: Adafactor's factored state (``row_var`` ``(N, 1)``, ``col_var`` ``(1, D)``)
    was left float32 by bf16 and copied whole onto each of sharing's new parameters: both
    raised at the next ``opt.step()``. Refused now, naming the state; before Adafactor's first
    step (no state yet) the table is taken and trains on."""
    model, _ = make()
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    ctx = ctx_of(model, opt, lookup_counter=_counted(model))
    assert not isinstance(ACTIONS[name].plan(ctx), Refusal)
    train(model, opt, batches(2))
    r = ACTIONS[name].plan(ctx)
    assert isinstance(r, Refusal), r
    assert f"emb: Adafactor keeps state 'row_var' of shape ({VOCAB}, 1)" in r.reason, r
    fresh, fresh_opt = make()
    fresh_opt = torch.optim.Adafactor(fresh.parameters(), lr=1e-2)
    ctx = ctx_of(fresh, fresh_opt, lookup_counter=_counted(fresh))
    assert ACTIONS[name].apply(ctx).status == "applied"
    losses = train(fresh, fresh_opt, batches(3))
    assert all(math.isfinite(x) for x in losses)


def test_refuses_a_table_of_an_optimizer_with_its_own_parameter_list() -> None:
    """Regression: LBFGS keeps the parameters in ``_params`` beside its param groups: after int8
    it held the old weight, and its ``state_dict()`` raised ``KeyError``. Refused."""
    model, _ = make(frozen=True)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.01)
    r = ACTIONS["compress_embedding_int8"].plan(ctx_of(model, opt))
    assert isinstance(r, Refusal) and "LBFGS keeps its own list of the parameters" in r.reason


def test_sharing_refuses_a_sparse_optimizer_state() -> None:
    """Regression: SGD's momentum of a ``sparse=True`` table is a sparse tensor, which sharing's
    split of rows failed on at apply (rolled back, with torch's dispatcher table in the log).
    Refused at the plan."""
    model, _ = make(sparse=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    train(model, opt, batches(2))
    r = ACTIONS["share_embedding"].plan(ctx_of(model, opt, lookup_counter=_counted(model)))
    assert isinstance(r, Refusal) and "SGD's state 'momentum_buffer' is a sparse tensor" in r.reason


class _TwoOptimizers:
    """Steps two optimizers as one (``train`` takes one)."""

    def __init__(self, *opts: torch.optim.Optimizer) -> None:
        self.opts = opts

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def _counted(model: Net) -> LookupCounter:
    """Lookup counts of ``model``'s table over a few batches (sharing's hot rows need them)."""
    counter = LookupCounter()
    counter.watch("emb", model.emb)
    with torch.no_grad():
        for x, _ in batches(3):
            model(x)
    return counter


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
