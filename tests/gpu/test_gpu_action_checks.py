"""Issue 9 on a real GPU: what only the CUDA allocator can answer for the actions' checks.

* ``release_cache``'s estimate (wholly free segments of a real snapshot) against what
  ``empty_cache()`` really returned;
* ``offload_embedding`` pins once and records the bytes the caching host allocator pinned, and
  refuses when the host cannot hold the table;
* a weight read outside its module (directly or through a view) is refused on CUDA as on a CPU;
* offload leaves no optimizer state on the device (issue 21.5).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from gpu_helpers import MiB, recorded_profile
from torch import nn

from edo_monitor.actions import ACTIONS, ActionContext, Plan, Refusal
from edo_monitor.measure.fragmentation import releasable_bytes


def test_release_cache_estimate_is_what_empty_cache_frees() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    keep = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)  # its own segment stays
    free = [torch.empty(96 * MiB, dtype=torch.uint8, device=dev) for _ in range(3)]
    del free  # three wholly free segments of >= 96 MiB
    torch.cuda.synchronize()
    model = nn.Linear(4, 4).to(dev)
    ctx = ActionContext(model, cuda_mode=True)
    plan = ACTIONS["release_cache"].plan(ctx)
    assert isinstance(plan, Plan), plan
    assert plan.estimated_saving_bytes == releasable_bytes(torch.cuda.memory_snapshot(), dev.index)
    result = ACTIONS["release_cache"].apply(ctx, plan)
    assert result.status == "applied"
    assert result.saved_bytes == plan.estimated_saving_bytes  # the estimate is exact here
    assert result.saved_bytes >= 3 * 96 * MiB
    del keep


def test_offload_pins_once_and_records_the_pinned_bytes() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(3000, 32), nn.Linear(32, 4)).to(dev)
    x = torch.randint(0, 3000, (16,), device=dev)
    profile = recorded_profile(model, x)
    table_bytes = 3000 * 32 * 4  # 384,000 bytes; the pinned block is its next power of two
    ctx = ActionContext(model, cuda_mode=True, activation_profile=profile)
    plan = ACTIONS["offload_embedding"].plan(ctx)
    assert isinstance(plan, Plan), plan
    assert plan.details["host_bytes_needed"] == 524_288 + table_bytes  # weight pinned + its grad
    result = ACTIONS["offload_embedding"].apply(ctx, plan)
    assert result.status == "applied", result.reason
    assert result.details["pinned"] is True
    assert result.details["pinned_bytes"] == 524_288
    assert model[0].weight.is_pinned() and model(x).device == dev


def test_offload_refuses_when_the_host_cannot_hold_the_table() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    model = nn.Sequential(nn.Embedding(3000, 32), nn.Linear(32, 4)).to(dev)
    x = torch.randint(0, 3000, (16,), device=dev)
    ctx = ActionContext(
        model,
        cuda_mode=True,
        activation_profile=recorded_profile(model, x),
        host_available_bytes=MiB // 2,
    )
    refusal = ACTIONS["offload_embedding"].plan(ctx)
    assert isinstance(refusal, Refusal)
    # 524,288 pinned weight bytes + 384,000 gradient bytes = 908,288 = 887 KiB
    assert "needs 887 KiB of host memory, 512 KiB available" in refusal.reason
    assert model[0].weight.is_cuda


class TiedByUse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(500, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.emb(x).mean(dim=1), self.emb.weight)


@pytest.mark.parametrize("name", ["compress_embedding_bf16", "offload_embedding"])
def test_weight_read_outside_its_module_is_refused_on_cuda(name: str) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    model = TiedByUse().to(dev)
    profile = recorded_profile(model, torch.randint(0, 500, (4, 3), device=dev))
    refusal = ACTIONS[name].plan(ActionContext(model, cuda_mode=True, activation_profile=profile))
    assert isinstance(refusal, Refusal) and "read outside emb's forward" in refusal.reason


class TiedByTranspose(nn.Module):
    """Issue 21.1 on CUDA: the read is through the view ``emb.weight.T`` (found by address)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(500, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb(x).mean(dim=1) @ self.emb.weight.T


@pytest.mark.parametrize("name", ["cache_embedding", "offload_embedding", "share_embedding"])
def test_weight_read_through_a_view_is_refused_on_cuda(name: str) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    model = TiedByTranspose().to(dev)
    profile = recorded_profile(model, torch.randint(0, 500, (4, 3), device=dev))
    assert profile.outside_uses == {"emb": ("<model>: matmul (a view of the weight)",)}
    refusal = ACTIONS[name].plan(ActionContext(model, cuda_mode=True, activation_profile=profile))
    assert isinstance(refusal, Refusal) and "read outside emb's forward" in refusal.reason


def test_offload_on_cuda_leaves_no_device_state_and_saves_its_estimate() -> None:
    """Issue 21.5 on CUDA: the moved weight's Adam state follows it to the host (a moment left on
    the device would be a leftover: rolled back), and the measured saving is the estimate."""
    from edo_monitor.actions.leftovers import optimizer_leftovers, record_params

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(3000, 32), nn.Linear(32, 4)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randint(0, 3000, (16,), device=dev)
    profile = recorded_profile(model, x)
    opt.step()
    model(x).float().sum().backward()
    ctx = ActionContext(model, [opt], cuda_mode=True, activation_profile=profile)
    before = record_params(model)
    result = ACTIONS["offload_embedding"].apply(ctx)
    assert result.status == "applied", result.reason
    assert optimizer_leftovers(before, model, [opt]) == []
    assert all(not v.is_cuda for v in opt.state[model[0].weight].values() if v.dim())
    # weight, gradient, exp_avg, exp_avg_sq: 4 x 3000 x 32 x 4 bytes left the device (the
    # scalar step lives on the host already)
    assert result.saved_bytes == 4 * 3000 * 32 * 4
