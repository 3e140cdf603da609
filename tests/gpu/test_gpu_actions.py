"""Each action on a real CUDA device: the bytes it frees, measured by the allocator.

Expected values come from the sizes the test chose (elements x bytes per element), the
allocator's documented rules (blocks of 1 MiB and more come from their own segments; a segment
holding no allocated block is "wholly free", the only kind ``empty_cache()`` returns; the pinned
host allocator rounds each block up to a power of two) and ``torch.cuda``'s own counters, never
from the action's own report. Run them with ``tests/gpu/run.sh`` (docs/gpu.md).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from gpu_helpers import MiB, recorded_profile
from torch import nn

from edo_monitor.actions import ACTIONS, ActionContext, ActivationRecorder, Plan
from edo_monitor.actions.checkpoint_activations import checkpointed_modules

pytestmark = pytest.mark.gpu

CUDA0 = torch.device("cuda", 0)


def _allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(0)


def _pinned_in_use_bytes() -> int:
    """Bytes of pinned host blocks handed out now (the caching host allocator's own count)."""
    stats = torch.cuda.host_memory_stats()
    for key in ("active_bytes.current", "allocated_bytes.current"):
        if key in stats:
            return int(stats[key])
    raise AssertionError(f"torch.cuda.host_memory_stats() has no byte count: {sorted(stats)}")


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_release_cache_returns_the_wholly_free_segments() -> None:
    """A 256 MiB segment wholly free and a 64 MiB one with 32 MiB free in four holes between live
    tensors: ``empty_cache()`` can return only the first. The estimate, the recorded saving, the
    allocator's reserved bytes and the driver's free memory all move by 256 MiB."""
    model = nn.Linear(4, 4).to(CUDA0)
    base_reserved = torch.cuda.memory_reserved(0)
    carved = torch.empty(64 * MiB, dtype=torch.uint8, device=CUDA0)
    del carved
    parts = [torch.empty(8 * MiB, dtype=torch.uint8, device=CUDA0) for _ in range(8)]
    del parts[1::2]  # 4 holes of 8 MiB: 32 MiB unallocated that no empty_cache() returns
    big = torch.empty(256 * MiB, dtype=torch.uint8, device=CUDA0)
    del big  # a wholly free segment of 256 MiB
    torch.cuda.synchronize()
    reserved_before = torch.cuda.memory_reserved(0)
    assert (
        reserved_before - base_reserved == (64 + 256) * MiB
    )  # the pattern, as the allocator has it
    assert reserved_before - torch.cuda.memory_allocated(0) >= (32 + 256) * MiB
    free_before = torch.cuda.mem_get_info(0)[0]

    ctx = ActionContext(model, cuda_mode=True, device=CUDA0)
    action = ACTIONS["release_cache"]
    plan = action.plan(ctx)
    assert isinstance(plan, Plan), plan
    result = action.apply(ctx, plan)
    torch.cuda.synchronize()
    reserved_after = torch.cuda.memory_reserved(0)
    free_after = torch.cuda.mem_get_info(0)[0]
    print(result)
    assert result.status == "applied", result.reason
    assert reserved_before - reserved_after == 256 * MiB
    assert result.saved_bytes == 256 * MiB
    assert abs((free_after - free_before) - 256 * MiB) <= 2 * MiB  # the driver has it back
    # issue 9, item 8: the estimate counts what empty_cache() can return, not all the slack
    assert plan.estimated_saving_bytes == 256 * MiB
    assert len(parts) == 4  # the live tensors held the 64 MiB segment until here


def _table_model(n: int, d: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(n, d), nn.Linear(d, 8)).to(CUDA0)


def _step(model: nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor) -> float:
    loss = model(idx.to(CUDA0)).square().mean()
    loss.backward()
    opt.step()
    return float(loss)


def test_offload_embedding_moves_the_table_to_pinned_host_memory() -> None:
    """At a step's peak (gradient alive), offloading a 200,000 x 64 fp32 table under Adam frees
    weight, gradient and both Adam states: 4 x 51,200,000 bytes of device memory. The weight (the
    same Parameter) is pinned: the pinned allocator hands out 2**26 bytes for its 51,200,000, and
    that is what the action records. Training goes on as an untouched twin's."""
    n, d = 200_000, 64
    table_bytes = n * d * 4
    model = _table_model(n, d)
    profile = recorded_profile(copy.deepcopy(model), torch.zeros(1, dtype=torch.long, device=CUDA0))
    gc.collect()  # the profiled copy is left in reference cycles: freed before bytes are counted
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, n, (512,), generator=g) for _ in range(4)]
    _step(model, opt, batches[0])
    _step(twin, twin_opt, batches[0])
    weight = model[0].weight
    allocated_before = _allocated()
    pinned_before = _pinned_in_use_bytes()

    ctx = ActionContext(model, [opt], cuda_mode=True, activation_profile=profile)
    result = ACTIONS["offload_embedding"].apply(ctx)
    allocated_after = _allocated()
    pinned = _pinned_in_use_bytes() - pinned_before
    print(result, f"pinned {pinned}")
    assert result.status == "applied", result.reason
    assert result.target == "0"
    assert allocated_before - allocated_after == 4 * table_bytes
    assert result.estimated_saving_bytes == 4 * table_bytes
    assert result.saved_bytes == 4 * table_bytes
    assert model[0].weight is weight
    assert weight.device.type == "cpu" and weight.is_pinned()
    assert weight.grad is not None and weight.grad.device.type == "cpu"
    assert {k: v.device.type for k, v in opt.state[weight].items() if v.dim() > 0} == {
        "exp_avg": "cpu",
        "exp_avg_sq": "cpu",
    }
    assert pinned >= _next_power_of_two(table_bytes) == 2**26  # the allocator rounds up
    # issue 9, item 12: the action records the bytes really pinned
    assert result.details.get("pinned_bytes") == pinned, result.details

    for idx in batches[1:]:
        for m, o in ((model, opt), (twin, twin_opt)):
            o.zero_grad(set_to_none=True)
            _step(m, o, idx)
    torch.testing.assert_close(weight.detach(), twin[0].weight.detach().cpu())
    torch.testing.assert_close(model[1].weight.detach(), twin[1].weight.detach())


def test_compress_embedding_bf16_halves_the_table_on_the_device() -> None:
    """A trainable 100,000 x 64 fp32 table under Adam, compressed (``compress_embedding`` picks
    bf16 for a trainable table): weight, gradient and both states go from 4 to 2 bytes an element,
    4 x 12,800,000 bytes freed. The stored table is the fp32 one rounded to bf16, its recorded
    error the largest rounding error; training goes on in bf16 with fp32 outputs."""
    n, d = 100_000, 64
    model = _table_model(n, d)
    profile = recorded_profile(copy.deepcopy(model), torch.zeros(1, dtype=torch.long, device=CUDA0))
    gc.collect()  # the profiled copy is left in reference cycles: freed before bytes are counted
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    _step(model, opt, torch.randint(0, n, (512,), generator=g))
    original = model[0].weight.detach().cpu().clone()
    allocated_before = _allocated()

    ctx = ActionContext(model, [opt], cuda_mode=True, activation_profile=profile)
    result = ACTIONS["compress_embedding"].apply(ctx)
    allocated_after = _allocated()
    print(result)
    assert result.status == "applied", result.reason
    assert result.details["variant"] == "bf16"
    assert allocated_before - allocated_after == 4 * n * d * 2
    assert result.estimated_saving_bytes == 4 * n * d * 2
    assert result.saved_bytes == 4 * n * d * 2
    weight = model[0].weight
    assert weight.dtype == torch.bfloat16 and weight.is_cuda
    rounded = original.to(torch.bfloat16)
    assert torch.equal(weight.detach().cpu(), rounded)  # round to nearest even, on either device
    expected_error = (original - rounded.float()).abs().max().item()
    assert result.error is not None
    assert result.error["max_abs_error"] == pytest.approx(expected_error, rel=1e-6)

    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        idx = torch.randint(0, n, (512,), generator=g).to(CUDA0)
        out = model(idx)
        assert out.dtype == torch.float32
        loss = out.square().mean()
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    assert weight.dtype == torch.bfloat16
    assert {v.dtype for v in opt.state[weight].values() if v.dim() > 0} == {torch.bfloat16}


class Block(nn.Module):
    """Linear -> GELU -> Linear: a block whose saved activations are its own, not its input's."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _forward_held_bytes(model: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Device bytes a forward leaves alive for its backward; runs the backward; the loss."""
    before = _allocated()
    loss = model(x).sum()
    held = _allocated() - before
    loss.backward()
    return held, loss.detach()


def test_checkpoint_activations_frees_the_blocks_saved_tensors() -> None:
    """Four blocks, batch 4096, 1024 -> 4096 -> 1024. Without checkpointing a forward keeps per
    block the fc1 output (saved by GELU) and the GELU output (saved by fc2), 2 x 64 MiB, plus the
    three inner block outputs (16 MiB each) and the 4-byte loss: 560 MiB + 512 bytes. With the
    four blocks checkpointed, only the block inputs are kept: 512 MiB less. Losses and gradients
    equal an untouched twin's."""
    batch, dim, hidden = 4096, 1024, 4096
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(dim, hidden) for _ in range(4))).to(CUDA0)
    twin = copy.deepcopy(model)
    x = torch.randn(batch, dim, device=CUDA0)
    act_bytes, io_bytes = batch * hidden * 4, batch * dim * 4  # 64 MiB, 16 MiB
    twin(x).sum().backward()  # warm-up: cuBLAS's workspace is allocated once, outside the counts
    twin.zero_grad(set_to_none=True)

    held_before, _ = _forward_held_bytes(model, x)
    assert held_before == 4 * 2 * act_bytes + 3 * io_bytes + 512
    model.zero_grad(set_to_none=True)
    with ActivationRecorder(model) as rec:
        loss = model(x).sum()
    loss.backward()
    profile = rec.profile()
    model.zero_grad(set_to_none=True)
    # every saved tensor once: x, 4 x (fc1 out, GELU out), the 3 inner block outputs
    assert profile.total_bytes == io_bytes + 4 * 2 * act_bytes + 3 * io_bytes

    ctx = ActionContext(model, cuda_mode=True, activation_profile=profile)
    result = ACTIONS["checkpoint_activations"].apply(ctx)
    print(result)
    assert result.status == "applied", result.reason
    assert sorted(checkpointed_modules(model)) == ["0", "1", "2", "3"]
    assert result.estimated_saving_bytes == 4 * 2 * act_bytes

    held_after, loss = _forward_held_bytes(model, x)
    print(f"held by a forward: {held_before / MiB:.3f} MiB before, {held_after / MiB:.3f} after")
    assert abs((held_before - held_after) - 4 * 2 * act_bytes) <= 1 * MiB  # RNG states: CPU
    twin_loss = twin(x).sum()
    twin_loss.backward()
    torch.testing.assert_close(loss, twin_loss.detach())
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
