"""parse_oom_message on the other backends' wordings (ROCm, XPU, Apple MPS) and edo-monitor's
CPU-budget mode; real messages from public issues where there are some.

Expected byte counts are written as ``round(printed value × unit)`` by hand from the message text.
"""

from __future__ import annotations

from oom_helpers import GiB, KiB, MiB, TiB, parse

from edo_monitor.measure.oom import format_cpu_budget_oom_message

# --- ROCm


def test_hip_new_wording_real_message() -> None:
    # https://github.com/Comfy-Org/ComfyUI/issues/9529
    message = (
        "HIP out of memory. Tried to allocate 432.00 MiB. GPU 0 has a total capacity of 15.92 GiB "
        "of which 7.12 GiB is free. Of the allocated memory 8.08 GiB is allocated by PyTorch, and "
        "321.96 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is "
        "large try setting PYTORCH_HIP_ALLOC_CONF=expandable_segments:True to avoid "
        "fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )
    info = parse(message)
    assert info.backend == "hip"
    assert info.requested_bytes == 432 * MiB
    assert info.device_index == 0
    assert info.total_bytes == round(15.92 * GiB)
    assert info.free_bytes == round(7.12 * GiB)
    assert info.allocated_bytes == round(8.08 * GiB)
    assert info.reserved_unallocated_bytes == round(321.96 * MiB)
    assert info.process_bytes is None


def test_hip_zero_bytes_real_message() -> None:
    # https://github.com/ROCm/TheRock/issues/1054
    message = (
        "torch.OutOfMemoryError: HIP out of memory. Tried to allocate 16.00 GiB. GPU 0 has a total "
        "capacity of 15.24 GiB of which 15.09 GiB is free. Of the allocated memory 0 bytes is "
        "allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If reserved but "
        "unallocated memory is large try setting PYTORCH_HIP_ALLOC_CONF=expandable_segments:True "
        "to avoid fragmentation."
    )
    info = parse(message)
    assert info.backend == "hip"
    assert info.requested_bytes == 16 * GiB
    assert info.total_bytes == round(15.24 * GiB)
    assert info.free_bytes == round(15.09 * GiB)
    assert info.allocated_bytes == 0
    assert info.reserved_unallocated_bytes == 0
    assert info.reserved_bytes == 0


def test_hip_old_wording() -> None:
    message = (
        "RuntimeError: HIP out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.98 GiB total "
        "capacity; 15.45 GiB already allocated; 0 bytes free; 15.75 GiB reserved in total by "
        "PyTorch)"
    )
    info = parse(message)
    assert info.backend == "hip"
    assert info.requested_bytes == 20 * MiB
    assert info.total_bytes == round(15.98 * GiB)
    assert info.allocated_bytes == round(15.45 * GiB)
    assert info.free_bytes == 0
    assert info.reserved_bytes == 15 * GiB + 768 * MiB
    assert info.reserved_unallocated_bytes == 15 * GiB + 768 * MiB - round(15.45 * GiB)


def test_bare_wording_on_rocm_is_hip() -> None:
    message = (
        "Out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.98 GiB of "
        "which 512.00 MiB is free. Of the allocated memory 14.20 GiB is allocated by PyTorch, and "
        "96.00 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is "
        "large try setting PYTORCH_HIP_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )
    info = parse(message)
    assert info.backend == "hip"
    assert info.requested_bytes == 2 * GiB
    assert info.reserved_unallocated_bytes == 96 * MiB


# --- XPU


def test_xpu_wording() -> None:
    message = (
        "XPU out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 15.11 GiB "
        "of which 512.00 MiB is free. Of the allocated memory 13.00 GiB is allocated by PyTorch, "
        "and 1.50 GiB is reserved by PyTorch but unallocated. Please use `empty_cache` to release "
        "all unoccupied cached memory."
    )
    info = parse(message)
    assert info.backend == "xpu"
    assert info.requested_bytes == GiB
    assert info.free_bytes == 512 * MiB
    assert info.reserved_bytes == 14 * GiB + 512 * MiB


# --- Apple MPS (aten/src/ATen/mps/MPSAllocator.mm)


def test_mps_wording_real_message() -> None:
    # https://github.com/Comfy-Org/ComfyUI/issues/7440
    message = (
        "MPS backend out of memory (MPS allocated: 9.57 GiB, other allocations: 17.35 GiB, max "
        "allowed: 27.20 GiB). Tried to allocate 292.50 MiB on private pool. Use "
        "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may "
        "cause system failure)."
    )
    info = parse(message)
    assert info.backend == "mps"
    assert info.requested_bytes == round(292.5 * MiB)
    assert info.reserved_bytes == round(9.57 * GiB)  # the MPS heaps
    assert info.process_bytes == round(9.57 * GiB) + round(17.35 * GiB)
    assert info.total_bytes == round(27.20 * GiB)  # the watermark limit
    assert info.device_index is None
    assert info.free_bytes is None
    assert info.allocated_bytes is None


def test_mps_wording_with_gb_units_real_message() -> None:
    # https://github.com/Comfy-Org/ComfyUI/issues/7372 (older builds printed GB/MB for 1024-based)
    message = (
        "MPS backend out of memory (MPS allocated: 17.68 GB, other allocations: 3.95 MB, max "
        "allowed: 18.13 GB). Tried to allocate 1024.00 MB on private pool. Use "
        "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may "
        "cause system failure)."
    )
    info = parse(message)
    assert info.requested_bytes == GiB
    assert info.reserved_bytes == round(17.68 * GiB)
    assert info.process_bytes == round(17.68 * GiB) + round(3.95 * MiB)
    assert info.total_bytes == round(18.13 * GiB)


def test_mps_wording_shared_pool_in_bytes_real_message() -> None:
    # https://github.com/pinokiocomputer/pinokio/issues/941
    message = (
        "MPS backend out of memory (MPS allocated: 16.00 GB, other allocations: 3.31 GB, max "
        "allowed: 18.13 GB). Tried to allocate 256 bytes on shared pool. Use "
        "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may "
        "cause system failure)."
    )
    info = parse(message)
    assert info.requested_bytes == 256
    assert info.reserved_bytes == 16 * GiB


def test_mps_wording_without_watermark_limit() -> None:
    message = (
        "MPS backend out of memory (MPS allocated: 30.00 GiB, other allocations: 2.00 GiB). "
        "Tried to allocate 4.00 GiB on private pool."
    )
    info = parse(message)
    assert info.requested_bytes == 4 * GiB
    assert info.reserved_bytes == 30 * GiB
    assert info.process_bytes == 32 * GiB
    assert info.total_bytes is None


# --- edo-monitor's CPU-budget mode


def test_cpu_budget_wording() -> None:
    message = (
        "CPU-budget out of memory. Tried to allocate 96.00 MiB. Budget of 512.00 MiB of which "
        "40.50 MiB is free. 471.50 MiB is accounted to the watched model."
    )
    info = parse(message)
    assert info.backend == "cpu-budget"
    assert info.requested_bytes == 96 * MiB
    assert info.total_bytes == 512 * MiB
    assert info.free_bytes == 40 * MiB + 512 * KiB
    assert info.allocated_bytes == 471 * MiB + 512 * KiB
    assert info.device_index is None
    assert info.reserved_bytes is None


def test_cpu_budget_message_round_trips() -> None:
    message = format_cpu_budget_oom_message(
        requested_bytes=100_000_000,
        budget_bytes=512 * MiB,
        free_bytes=12_345,
        accounted_bytes=500 * MiB,
    )
    assert message == (
        "CPU-budget out of memory. Tried to allocate 95.37 MiB. Budget of 512.00 MiB of which "
        "12.06 KiB is free. 500.00 MiB is accounted to the watched model."
    )
    info = parse(message)
    assert info.backend == "cpu-budget"
    assert abs(info.requested_bytes - 100_000_000) <= 0.005 * MiB
    assert info.total_bytes == 512 * MiB
    assert abs(info.free_bytes - 12_345) <= 0.005 * KiB
    assert info.allocated_bytes == 500 * MiB


def test_cpu_budget_message_small_and_negative_sizes() -> None:
    message = format_cpu_budget_oom_message(1024, 2 * TiB, -5, 0)
    assert message == (
        "CPU-budget out of memory. Tried to allocate 1024 bytes. Budget of 2.00 TiB of which "
        "0 bytes is free. 0 bytes is accounted to the watched model."
    )
    info = parse(message)
    assert (info.requested_bytes, info.total_bytes, info.free_bytes, info.allocated_bytes) == (
        1024,
        2 * TiB,
        0,
        0,
    )
