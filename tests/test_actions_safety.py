"""Issue 9: actions under real-world models, and numbers that stay true.

* a weight read outside its own module (tied by use) is never changed (item 3);
* checkpointing never recomputes a forward that changes buffers (item 4:
  tests/test_checkpoint_state.py);
* sparse tensors are sized by indices + values, a model that is a table is accounted (item 5);
* ``release_cache`` estimates from wholly free segments; an ineffective action makes the ladder
  move on (item 8); fragmentation and the estimate keep the watched device's segments (item 9);
* ``offload_embedding`` checks host headroom first (item 12).

Hardware is faked only at the probe boundary: recorded ``memory_stats`` / ``memory_snapshot``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import edo_monitor
from edo_monitor.actions import ACTIONS, ActionContext, ActivationRecorder, Plan, Refusal
from edo_monitor.decide.policy import Policy
from edo_monitor.decide.policy_events import Decision
from edo_monitor.decide.ranking import make_planner
from edo_monitor.measure.accounting import account, tensor_bytes, tensor_bytes_as
from edo_monitor.measure.fragmentation import releasable_bytes, snapshot_fragmentation
from edo_monitor.probes.cuda import AllocatorProbe
from edo_monitor.probes.readings import Reading

MiB = 1024**2
GiB = 1024**3


# ------------------------------------------------------------ item 3: weight read outside module


class TiedByUse(nn.Module):
    """The output layer reads the table's weight directly: tied by use, not by Parameter."""

    def __init__(self, frozen: bool = False, detach_hidden: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(500, 16)
        self.emb.weight.requires_grad_(not frozen)
        self.mix = nn.Linear(16, 16)
        self.detach_hidden = detach_hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mix(self.emb(x).mean(dim=1))
        if self.detach_hidden:  # the weight is then not saved for backward by F.linear
            h = h.detach()
        return F.linear(h, self.emb.weight)


def one_recorded_step(model: nn.Module, opt: torch.optim.Optimizer):
    x = torch.randint(0, 500, (8, 4), generator=torch.Generator().manual_seed(0))
    with ActivationRecorder(model) as rec:
        loss = F.cross_entropy(model(x), x[:, 0])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return rec.profile()


@pytest.mark.parametrize(
    ("frozen", "detach_hidden"),
    [(False, False), (True, False), (False, True)],
    ids=["trainable", "frozen", "weight-not-saved"],
)
@pytest.mark.parametrize(
    "name", ["compress_embedding_bf16", "compress_embedding", "offload_embedding"]
)
def test_weight_read_outside_its_module_is_refused(
    name: str, frozen: bool, detach_hidden: bool
) -> None:
    torch.manual_seed(0)
    model = TiedByUse(frozen=frozen, detach_hidden=detach_hidden)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-2, weight_decay=0.01)
    profile = one_recorded_step(model, opt)
    # F.linear in the root's own forward, outside emb's; Adam's reads inside step() do not count
    assert profile.outside_uses == {"emb": ("<model>: linear",)}
    ctx = ActionContext(model, [opt], activation_profile=profile)
    refusal = ACTIONS[name].plan(ctx)
    assert isinstance(refusal, Refusal)
    assert "read outside emb's forward (<model>: linear)" in refusal.reason
    assert ACTIONS[name].apply(ctx).status == "refused"
    assert type(model.emb) is nn.Embedding and model.emb.weight.dtype == torch.float32


def test_a_table_read_only_by_its_module_is_not_refused_and_no_profile_is_a_refusal() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(500, 16), nn.Linear(16, 500))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    x = torch.randint(0, 500, (8, 4))
    with ActivationRecorder(model) as rec:
        F.cross_entropy(model(x), x[:, 0]).backward()
        opt.step()
    assert rec.profile().outside_uses == {}
    ctx = ActionContext(model, [opt], activation_profile=rec.profile())
    assert isinstance(ACTIONS["compress_embedding_bf16"].plan(ctx), Plan)
    blind = ACTIONS["offload_embedding"].plan(ActionContext(model, [opt]))
    assert isinstance(blind, Refusal) and "no recorded step yet" in blind.reason


def test_agent_never_compresses_a_table_tied_by_use_and_training_goes_on(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedByUse()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    static = account(model).total_bytes
    policy = edo_monitor.Policy(allow_lossy=True, ladder=["compress_embedding_bf16"])
    g = torch.Generator().manual_seed(1)
    with edo_monitor.watch(
        model, db=tmp_path / "h.db", budget=static * 3, policy=policy, interval_s=0.01
    ) as mon:
        for _ in range(12):  # before the fix the step after compression failed (dtype mismatch)
            x = torch.randint(0, 500, (8, 4), generator=g)
            F.cross_entropy(model(x), x[:, 0]).backward()
            opt.step()
            opt.zero_grad()
    summary = mon.summary()
    assert summary.status == "finished" and summary.steps == 12
    assert "action" not in summary.events
    assert model.emb.weight.dtype == torch.float32


# -------------------------------------- a block to checkpoint (item 4: test_checkpoint_state.py)


class MLP(nn.Module):
    """A block whose inner activations are its own (what checkpointing frees)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 64), nn.Linear(64, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


# ------------------------------------------------------------ item 5: sparse sizes, root table


def test_sparse_gradients_are_accounted_by_indices_and_values_and_do_not_trip_enforce(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = nn.Embedding(1_000_000, 64, sparse=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    table_bytes = 1_000_000 * 64 * 4  # 256 MB
    ids = torch.tensor([3, 70_000, 512_345, 999_999])
    with edo_monitor.watch(
        model, db=tmp_path / "h.db", budget=table_bytes + 2 * MiB, enforce=True, interval_s=0.05
    ) as mon:
        for _ in range(3):
            model(ids).sum().backward()
            # 4 lookups: int64 indices (1 x 4) + fp32 values (4 x 64)
            assert account(model, [opt]).grads_bytes == 4 * 8 + 4 * 64 * 4
            opt.step()
            opt.zero_grad()
    assert mon.summary().status == "finished" and "oom" not in mon.summary().events
    # the model is itself a table: its one module row holds its bytes and shape
    (row,) = [r for r in mon.breakdown() if r["module"] == "<model>"]
    assert row["params_bytes"] == table_bytes
    assert (row["num_embeddings"], row["embedding_dim"]) == (1_000_000, 64)
    assert row["grads_bytes"] == 4 * 8 + 4 * 64 * 4


def test_a_model_that_is_a_table_is_accounted_once() -> None:
    acc = account(nn.Embedding(100_000, 64))
    assert acc.params_bytes == 100_000 * 64 * 4
    (table,) = acc.tables
    assert (table.module, table.params_bytes) == ("<model>", 100_000 * 64 * 4)
    assert (table.num_embeddings, table.embedding_dim) == (100_000, 64)
    assert acc.modules == ()  # no second, empty row for the root


class _TiedOnMeta(nn.Module):
    """A tied table and output head, built on ``meta`` and loaded with ``assign=True`` (the fast
    loading path): two ``Parameter`` objects over one storage."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1_000, 64)
        self.head = nn.Linear(64, 1_000, bias=False)
        self.head.weight = self.emb.weight


def test_memory_is_counted_once_per_region_and_meta_tensors_hold_none() -> None:
    """Regression: two parameters over one storage were counted twice (10,240,000 for 5,120,000
    bytes: the dedup was by object), and parameters on ``meta`` were counted as device bytes
    (a head never materialised made ``enforce=True`` refuse the run). Disjoint views of one
    buffer stay counted each."""
    with torch.device("meta"):
        model = _TiedOnMeta()
    table = torch.randn(1_000, 64)
    model.load_state_dict({"emb.weight": table, "head.weight": table}, assign=True)
    assert model.emb.weight is not model.head.weight
    assert account(model).params_bytes == 1_000 * 64 * 4
    with torch.device("meta"):
        unused = nn.Linear(4_096, 4_096)
    assert account(nn.Sequential(nn.Linear(8, 8), unused)).params_bytes == (64 + 8) * 4
    flat = torch.zeros(2 * 8 * 8)  # one buffer, two parameters as disjoint views of it
    two = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    two[0].weight = nn.Parameter(flat[:64].view(8, 8))
    two[1].weight = nn.Parameter(flat[64:].view(8, 8))
    assert account(two).params_bytes == 2 * 64 * 4


def test_converted_sizes_of_sparse_tensors_keep_their_indices() -> None:
    grad = torch.sparse_coo_tensor(torch.tensor([[1, 5, 9, 12]]), torch.ones(4, 64), (1000, 64))
    assert tensor_bytes(grad) == 4 * 8 + 4 * 64 * 4
    assert tensor_bytes_as(grad, torch.bfloat16) == 4 * 8 + 4 * 64 * 2
    assert tensor_bytes_as(torch.ones(1000, 64), torch.bfloat16) == 1000 * 64 * 2


# ------------------------------------------------------------ items 8 and 9: allocator


def segment(device: int, blocks: list[tuple[int, str]], base: int, **extra: object) -> dict:
    """A segment as ``torch.cuda.memory_snapshot()`` lists it (addresses contiguous)."""
    out, address = [], base
    for size, state in blocks:
        out.append({"address": address, "size": size, "requested_size": size, "state": state})
        address += size
    total = sum(s for s, _ in blocks)
    used = sum(s for s, st in blocks if st != "inactive")
    return {
        "device": device,
        "address": base,
        "total_size": total,
        "allocated_size": used,
        "active_size": used,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "blocks": out,
        **extra,
    }


# device 0: 1 GiB of slack held by a live 2 MiB block (unreleasable), 20 MiB wholly free;
# device 1: 512 MiB wholly free, and holes of 100 MiB and 300 MiB around a live block
SNAPSHOT = [
    segment(0, [(2 * MiB, "active_allocated"), (GiB, "inactive")], 0x7F0000000000),
    segment(0, [(20 * MiB, "inactive")], 0x7F0100000000),
    segment(1, [(512 * MiB, "inactive")], 0x7E0000000000),
    segment(
        1, [(100 * MiB, "inactive"), (8 * MiB, "active_allocated"), (300 * MiB, "inactive")], 0
    ),
]
STATS = {  # device 0: reserved - allocated = 1044 MiB + 2 MiB - 2 MiB of slack
    "allocated_bytes.all.current": 2 * MiB,
    "reserved_bytes.all.current": GiB + 22 * MiB,
    "active_bytes.all.current": 2 * MiB,
    "inactive_split_bytes.all.current": GiB,
    "allocated_bytes.all.peak": 2 * MiB,
    "num_alloc_retries": 0,
    "num_ooms": 0,
}


def test_releasable_bytes_count_only_wholly_free_segments_of_the_device() -> None:
    assert releasable_bytes(SNAPSHOT, 0) == 20 * MiB  # not 1 GiB + 20 MiB of slack
    assert releasable_bytes(SNAPSHOT, 1) == 512 * MiB
    pending = [segment(0, [(64 * MiB, "active_pending_free")], 0)]
    graph_pool = [segment(0, [(64 * MiB, "inactive")], 0, segment_pool_id=(1, 2))]
    assert releasable_bytes(pending, 0) == 0 and releasable_bytes(graph_pool, 0) == 0
    # an expandable segment gives back the whole 2 MiB pages inside each free block
    exp = [
        segment(0, [(3 * MiB, "active_allocated"), (6 * MiB, "inactive")], 0, is_expandable=True)
    ]
    assert releasable_bytes(exp, 0) == 4 * MiB  # free 3..9 MiB: pages 4..6 and 6..8


def test_fragmentation_of_device_1_ignores_device_0_segments() -> None:
    probe = AllocatorProbe(
        1,
        is_initialized=lambda: True,
        memory_stats=lambda i: STATS,
        memory_snapshot=lambda: SNAPSHOT,
        mem_get_info=lambda i: (0, 0),
    )
    r = probe.read(now_s=0.0)
    # device 1's holes: 512, 100 and 300 MiB -> 1 - 512 / 912
    assert r["fragmentation"] == pytest.approx(1 - 512 / 912)
    assert r["largest_inactive_block_bytes"] == 512 * MiB
    assert r["segment_count"] == 2
    assert snapshot_fragmentation(SNAPSHOT, 0).total_inactive_bytes == GiB + 20 * MiB


def cuda_reading(step: int, free_fraction: float, device: int = 0) -> Reading:
    probe = AllocatorProbe(
        device,
        is_initialized=lambda: True,
        memory_stats=lambda i: STATS,
        memory_snapshot=lambda: SNAPSHOT,
        mem_get_info=lambda i: (0, 0),
    )
    values = probe.read(now_s=float(step))
    return Reading(
        time_s=float(step), step=step, device_kind="cuda", free_fraction=free_fraction, **values
    )


def checkpointable() -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    model = nn.Sequential(MLP(), nn.Linear(16, 4))
    x = torch.randn(32, 16, requires_grad=True)
    with ActivationRecorder(model) as rec:
        model(x).sum().backward()
    return model, rec.profile()


def test_unreleasable_slack_makes_the_ladder_escalate_at_once() -> None:
    model, profile = checkpointable()
    policy = Policy(ladder=["release_cache", "checkpoint_activations"], cooldown_steps=0)
    decisions: list[str] = []
    for step in range(1, 61):
        reading = cuda_reading(step, free_fraction=0.10)
        assert reading.reserved_unallocated_bytes == GiB + 20 * MiB
        ctx = ActionContext(
            model,
            cuda_mode=True,
            device=torch.device("cuda", 0),
            reserved_unallocated_bytes=reading.reserved_unallocated_bytes,
            memory_snapshot=lambda: SNAPSHOT,
            activation_profile=profile,
        )
        for event in policy.evaluate(reading, make_planner(ctx)):
            if isinstance(event, Decision):
                decisions.append(event.action)
                policy.resolve(event, "refused")  # not applied here: only the choice matters
    # 20 MiB of wholly free segments is below the 64 MiB minimum: never release_cache
    assert decisions and set(decisions) == {"checkpoint_activations"}
    refusal = ACTIONS["release_cache"].plan(
        ActionContext(
            model,
            cuda_mode=True,
            device=torch.device("cuda", 0),
            reserved_unallocated_bytes=GiB + 20 * MiB,
            memory_snapshot=lambda: SNAPSHOT,
        )
    )
    assert isinstance(refusal, Refusal) and "wholly free segments hold 20 MiB" in refusal.reason


def test_an_ineffective_action_is_skipped_until_the_episode_ends() -> None:
    """Device 1's snapshot promises 512 MiB; this machine's allocator frees nothing (no CUDA):
    measured 0 of 512 MiB is ineffective, and the next reading climbs to the next rung."""
    model, profile = checkpointable()
    policy = Policy(ladder=["release_cache", "checkpoint_activations"], cooldown_steps=5)

    def ctx() -> ActionContext:
        return ActionContext(
            model,
            cuda_mode=True,
            device=torch.device("cuda", 1),
            memory_snapshot=lambda: SNAPSHOT,
            activation_profile=profile,
        )

    (decision,) = [
        e
        for e in policy.evaluate(cuda_reading(1, 0.10, 1), make_planner(ctx()))
        if isinstance(e, Decision)
    ]
    assert (decision.action, decision.estimated_saving_bytes) == ("release_cache", 512 * MiB)
    result = ACTIONS["release_cache"].apply(ctx(), decision.plan)
    assert result.status == "applied" and result.saved_bytes == 0
    why = policy.resolve(decision, result)
    assert why == "measured saving 0 bytes is below 50% of the estimated 512 MiB"
    (nxt,) = [
        e
        for e in policy.evaluate(cuda_reading(2, 0.10, 1), make_planner(ctx()))
        if isinstance(e, Decision)
    ]
    assert nxt.action == "checkpoint_activations"  # at the very next reading: no cooldown
    policy.resolve(nxt, "refused")
    policy.evaluate(cuda_reading(3, 0.30, 1), make_planner(ctx()))  # pressure ends
    (again,) = [
        e
        for e in policy.evaluate(cuda_reading(4, 0.10, 1), make_planner(ctx()))
        if isinstance(e, Decision)
    ]
    assert again.action == "release_cache"  # a new episode tries it again


# ------------------------------------------------------------ item 12: offload host headroom


def test_offload_in_cpu_budget_mode_allocates_no_host_memory() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 32), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randint(0, 1000, (8,))
    with ActivationRecorder(model) as rec:
        model(x).sum().backward()
        opt.step()
    # the table is in host memory already (CPU-budget mode models the device): nothing to fit
    ctx = ActionContext(model, [opt], activation_profile=rec.profile(), host_available_bytes=0)
    plan = ACTIONS["offload_embedding"].plan(ctx)
    assert isinstance(plan, Plan) and plan.details["host_bytes_needed"] == 0
    result = ACTIONS["offload_embedding"].apply(ctx, plan)
    assert result.status == "applied" and result.details["pinned_bytes"] is None


@pytest.mark.parametrize("made", ["deepcopy", "assign"])
def test_a_copy_of_an_offloaded_table_is_accounted_on_the_host(made: str) -> None:
    """Regression: the host tier was a mark on the weight ``Parameter``, which ``deepcopy`` and
    ``load_state_dict(assign=True)`` do not carry: a copy of an offloaded model was accounted
    with its table on the device (64,068 bytes against 68), in CPU-budget mode what
    ``enforce`` counts. The offloaded module's tensors are the host's now."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 16), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters())
    with ActivationRecorder(model) as rec:
        model(torch.randint(0, 1000, (8,))).sum().backward()
        opt.step()
    ctx = ActionContext(model, [opt], activation_profile=rec.profile())
    assert ACTIONS["offload_embedding"].apply(ctx).status == "applied"
    if made == "deepcopy":
        copy_ = copy.deepcopy(model)
    else:
        copy_ = copy.deepcopy(model)
        copy_.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    want, got = account(model), account(copy_)
    assert got.params_bytes == want.params_bytes == 4 * (16 * 4 + 4)  # the Linear only
    assert got.host_bytes == 1000 * 16 * 4


def test_context_device_is_not_the_cpu_of_an_offloaded_first_table() -> None:
    """After offload_embedding moved the first table to the host, the model's first parameter is
    on the CPU: the context's device is the first parameter that is not (``meta`` stands in for
    CUDA here), so release_cache does not read the CPU's allocator (``torch.cuda`` raised
    "Expected a cuda device, but got: cpu" on a GPU)."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2, device="meta"))
    assert ActionContext(model).device == torch.device("meta")
    assert ActionContext(nn.Linear(2, 2)).device == torch.device("cpu")


def test_the_tuner_gives_actions_the_watched_cuda_device() -> None:
    """The agent's context names the watched device, whatever the model's first parameter."""
    from types import SimpleNamespace

    from edo_monitor.agent.tuner import Tuner

    monitor = SimpleNamespace(
        model=nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)),
        optimizers=(),
        device_kind="cuda",
        device_index=1,
        policy=Policy(),
        activation_profile=None,
        _lookups=None,
        spill_dir=None,
        steps=0,
    )
    assert Tuner(monitor).action_context().device == torch.device("cuda", 1)
    monitor.device_kind, monitor.device_index = "cpu-budget", None
    assert Tuner(monitor).action_context().device == torch.device("cpu")


def test_cuda_mode_counts_only_optimizer_state_in_gpu_memory() -> None:
    """Adam's ``step`` of a CUDA table is a CPU scalar: on the device tier in CUDA mode only the
    GPU tensors of the state count (the H200 saw an offload estimate 4 bytes above what it
    freed). Here every tensor is on the CPU: all of it counts in CPU-budget mode, none in CUDA
    mode."""
    from edo_monitor.measure.accounting import optimizer_state_bytes

    table = nn.Embedding(100, 8)
    opt = torch.optim.Adam(table.parameters())
    table(torch.arange(10)).sum().backward()
    opt.step()
    assert optimizer_state_bytes(opt, table.weight) == 2 * 100 * 8 * 4 + 4
    assert optimizer_state_bytes(opt, table.weight, cuda_only=True) == 0


def test_release_cache_is_not_repeated_before_another_action_frees_memory() -> None:
    """Under a budget the allocator reserves again what empty_cache() returned: on an H200 the
    ladder applied release_cache six times in a row (each "effective", 64-78 MiB) and never
    climbed, until the run ran out of memory. Once applied, it waits for another action; after
    that one (its freed segments are worth returning) it may come again."""
    from edo_monitor.actions.base import ActionResult

    policy = Policy(ladder=["release_cache", "offload_embedding"], cooldown_steps=0)
    plans = {
        "release_cache": Plan("release_cache", "allocator", 64 * MiB, "wholly free segments"),
        "offload_embedding": Plan("offload_embedding", "0", 100 * MiB, "largest table"),
    }

    def decide(step: int) -> Decision:
        (decision,) = [
            e for e in policy.evaluate(cuda_reading(step, 0.10), plans) if isinstance(e, Decision)
        ]
        return decision

    def applied(decision: Decision) -> None:
        saved = decision.estimated_saving_bytes
        result = ActionResult(decision.action, decision.target, "applied", saved, saved, 0)
        assert policy.resolve(decision, result) is None  # effective

    order = []
    for step in range(1, 4):
        decision = decide(step)
        order.append(decision.action)
        applied(decision)
    assert order == ["release_cache", "offload_embedding", "release_cache"]
