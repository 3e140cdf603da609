"""parse_oom_message: one test per wording PyTorch has used on CUDA (the other backends and the
CPU-budget mode: ``test_oom_backends.py``), real messages from public issues, and text that is not
one.

Expected byte counts are written as ``round(printed value × unit)`` by hand from the message text.
"""

from __future__ import annotations

import random

import pytest
from oom_helpers import GiB, KiB, MiB, TiB, parse

from edo_monitor.measure.oom import OomInfo, parse_oom_message

# --- CUDA, PyTorch 1.4 – 2.0: "(GPU n; Y total capacity; Z already allocated; W free; V reserved)"


def test_old_reserved_wording_real_message() -> None:
    # https://github.com/pytorch/pytorch/issues/59778
    message = (
        "CUDA out of memory. Tried to allocate 2.26 GiB (GPU 0; 6.00 GiB total capacity; "
        "781.59 MiB already allocated; 3.03 GiB free; 1.24 GiB reserved in total by PyTorch)"
    )
    info = parse(message)
    assert info.backend == "cuda"
    assert info.requested_bytes == round(2.26 * GiB)
    assert info.device_index == 0
    assert info.total_bytes == 6 * GiB
    assert info.allocated_bytes == round(781.59 * MiB)
    assert info.free_bytes == round(3.03 * GiB)
    assert info.reserved_bytes == round(1.24 * GiB)
    assert info.reserved_unallocated_bytes == round(1.24 * GiB) - round(781.59 * MiB)
    assert info.process_bytes is None


def test_old_reserved_wording_with_advice_tail_real_message() -> None:
    # https://github.com/Strawberry-Eat-Mango/PCT_Pytorch/issues/27
    message = (
        "RuntimeError: CUDA out of memory. Tried to allocate 16.00 MiB (GPU 0; 3.94 GiB total "
        "capacity; 2.98 GiB already allocated; 14.25 MiB free; 3.00 GiB reserved in total by "
        "PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to avoid "
        "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
    )
    info = parse(message)
    assert info.requested_bytes == 16 * MiB
    assert info.total_bytes == round(3.94 * GiB)
    assert info.allocated_bytes == round(2.98 * GiB)
    assert info.free_bytes == round(14.25 * MiB)
    assert info.reserved_bytes == 3 * GiB
    assert info.reserved_unallocated_bytes == 3 * GiB - round(2.98 * GiB)


def test_old_wording_with_allowed_fraction_cap() -> None:
    message = (
        "CUDA out of memory. Tried to allocate 512.00 MiB (GPU 1; 8.00 GiB total capacity; "
        "1.50 GiB already allocated; 5.00 GiB free; 2.00 GiB allowed; 1.75 GiB reserved in total "
        "by PyTorch)"
    )
    info = parse(message)
    assert info.device_index == 1
    assert info.requested_bytes == 512 * MiB
    assert info.total_bytes == 8 * GiB
    assert info.allocated_bytes == 1536 * MiB
    assert info.free_bytes == 5 * GiB
    assert info.reserved_bytes == 1792 * MiB
    assert info.reserved_unallocated_bytes == 256 * MiB


# --- CUDA, PyTorch <= 1.3: "... W free; U cached)" with U = cached but unused


def test_older_cached_wording_real_message() -> None:
    # https://github.com/shllln/GenerativeGraph/issues/5
    message = (
        "RuntimeError: CUDA out of memory. Tried to allocate 1024.00 KiB (GPU 0; 11.17 GiB total "
        "capacity; 10.90 GiB already allocated; 576.00 KiB free; 30.96 MiB cached)"
    )
    info = parse(message)
    assert info.requested_bytes == 1 * MiB
    assert info.total_bytes == round(11.17 * GiB)
    assert info.allocated_bytes == round(10.90 * GiB)
    assert info.free_bytes == 576 * KiB
    assert info.reserved_unallocated_bytes == round(30.96 * MiB)
    assert info.reserved_bytes == round(10.90 * GiB) + round(30.96 * MiB)


def test_older_cached_wording_with_old_si_looking_units() -> None:
    # Very old builds printed KB/MB/GB, which meant powers of 1024.
    message = (
        "CUDA out of memory. Tried to allocate 12.50 MB (GPU 2; 4.00 GB total capacity; "
        "3.50 GB already allocated; 10.00 MB free; 256.00 KB cached)"
    )
    info = parse(message)
    assert info.device_index == 2
    assert info.requested_bytes == round(12.5 * MiB)
    assert info.total_bytes == 4 * GiB
    assert info.allocated_bytes == 3584 * MiB
    assert info.free_bytes == 10 * MiB
    assert info.reserved_unallocated_bytes == 256 * KiB
    assert info.reserved_bytes == 3584 * MiB + 256 * KiB


# --- CUDA, PyTorch >= 2.1: sentences, NVML process lines


def test_new_wording_this_process_real_message_with_capacty_typo() -> None:
    # https://github.com/Synthintel0/MyGirlGPT/issues/11 (PyTorch 2.1 spelled "capacty")
    message = (
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 32.00 MiB. GPU 0 has a "
        "total capacty of 4.00 GiB of which 41.56 MiB is free. Including non-PyTorch memory, this "
        "process has 3.44 GiB memory in use. Of the allocated memory 2.58 GiB is allocated by "
        "PyTorch, and 1.90 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
        "memory is large try setting max_split_size_mb to avoid fragmentation.  See documentation "
        "for Memory Management and PYTORCH_CUDA_ALLOC_CONF."
    )
    info = parse(message)
    assert info.backend == "cuda"
    assert info.requested_bytes == 32 * MiB
    assert info.device_index == 0
    assert info.total_bytes == 4 * GiB
    assert info.free_bytes == round(41.56 * MiB)
    assert info.process_bytes == round(3.44 * GiB)
    assert info.allocated_bytes == round(2.58 * GiB)
    assert info.reserved_unallocated_bytes == round(1.90 * MiB)
    assert info.reserved_bytes == round(2.58 * GiB) + round(1.90 * MiB)


def test_new_wording_several_processes_real_message() -> None:
    # https://github.com/awslabs/keys_values/issues/92
    message = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 572.00 MiB. GPU 0 has a "
        "total capacity of 39.49 GiB of which 321.31 MiB is free. Process 3721648 has 414.00 MiB "
        "memory in use. Including non-PyTorch memory, this process has 37.46 GiB memory in use. "
        "Process 1374765 has 414.00 MiB memory in use. Process 1374763 has 414.00 MiB memory in "
        "use. Process 1374764 has 414.00 MiB memory in use. Of the allocated memory 36.04 GiB is "
        "allocated by PyTorch, and 321.37 MiB is reserved by PyTorch but unallocated. If reserved "
        "but unallocated memory is large try setting PYTORCH_ALLOC_CONF=expandable_segments:True "
        "to avoid fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )
    # "this process" wins even when a pid sentence matches the given pid.
    info = parse(message, pid=3721648)
    assert info.requested_bytes == 572 * MiB
    assert info.total_bytes == round(39.49 * GiB)
    assert info.free_bytes == round(321.31 * MiB)
    assert info.process_bytes == round(37.46 * GiB)
    assert info.allocated_bytes == round(36.04 * GiB)
    assert info.reserved_unallocated_bytes == round(321.37 * MiB)
    assert info.reserved_bytes == round(36.04 * GiB) + round(321.37 * MiB)


def test_new_wording_process_pid_matches_given_pid_real_message() -> None:
    # https://github.com/FoundationVision/GenerateU/issues/10 (a container: NVML gives host pids)
    message = (
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 496.00 MiB. GPU 0 has "
        "a total capacty of 14.75 GiB of which 235.06 MiB is free. Process 20398 has 14.52 GiB "
        "memory in use. Of the allocated memory 14.06 GiB is allocated by PyTorch, and 330.42 MiB "
        "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
        "setting max_split_size_mb to avoid fragmentation.  See documentation for Memory "
        "Management and PYTORCH_CUDA_ALLOC_CONF"
    )
    mine = parse(message, pid=20398)
    assert mine.process_bytes == round(14.52 * GiB)
    assert mine.total_bytes == round(14.75 * GiB)
    assert mine.free_bytes == round(235.06 * MiB)
    assert mine.allocated_bytes == round(14.06 * GiB)
    assert mine.reserved_unallocated_bytes == round(330.42 * MiB)
    # the only process sentence, no "this process has": in a container's PID namespace NVML's
    # host pid is never ours, and the one process on the device that ran out of memory is us
    container = parse(message, pid=1)
    assert container.process_bytes == round(14.52 * GiB)
    assert container.allocated_bytes == round(14.06 * GiB)


def test_one_foreign_process_sentence_is_ours_in_a_container() -> None:
    message = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a "
        "total capacity of 11.00 GiB of which 512.00 MiB is free. Process 4242 has 9.50 GiB "
        "memory in use. Of the allocated memory 7.25 GiB is allocated by PyTorch, and 1.75 GiB "
        "is reserved by PyTorch but unallocated."
    )
    info = parse(message, pid=17)
    assert info.process_bytes == 9 * GiB + 512 * MiB  # 9.50 GiB
    assert info.requested_bytes == GiB
    assert info.total_bytes == 11 * GiB
    assert info.free_bytes == 512 * MiB
    assert info.allocated_bytes == 7 * GiB + 256 * MiB  # 7.25 GiB
    assert info.reserved_unallocated_bytes == GiB + 768 * MiB  # 1.75 GiB
    assert info.reserved_bytes == 9 * GiB


def test_several_foreign_process_sentences_are_not_guessed() -> None:
    message = (
        "CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 8.00 GiB "
        "of which 0 bytes is free. Process 11 has 3.00 GiB memory in use. Process 12 has 5.00 GiB "
        "memory in use. Of the allocated memory 2.50 GiB is allocated by PyTorch, and 0 bytes is "
        "reserved by PyTorch but unallocated."
    )
    assert parse(message, pid=17).process_bytes is None
    assert parse(message, pid=12).process_bytes == 5 * GiB


def test_rewrapped_message_with_cut_lead_in() -> None:
    # a log re-wrapped at another width, its "Of the allocated memory" lead-in cut off
    message = """torch.OutOfMemoryError: CUDA out of memory. Tried to allocate
1.00 GiB. GPU 0 has a total capacity of 11.00
GiB of which 512.00 MiB is free. Process 4242 has
9.50 GiB memory in use. ... 7.25 GiB is
allocated by PyTorch, and 1.75 GiB is reserved by
PyTorch but unallocated."""
    info = parse(message, pid=17)
    assert info.requested_bytes == GiB
    assert info.device_index == 0
    assert info.total_bytes == 11 * GiB
    assert info.free_bytes == 512 * MiB
    assert info.process_bytes == 9 * GiB + 512 * MiB
    assert info.allocated_bytes == 7 * GiB + 256 * MiB
    assert info.reserved_unallocated_bytes == GiB + 768 * MiB
    assert info.reserved_bytes == 9 * GiB


@pytest.mark.parametrize("width", [17, 23, 40, 61])
def test_any_wrapping_and_launcher_prefix_reads_the_same(width: int) -> None:
    import textwrap

    one_line = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 138.00 MiB. GPU 1 has a "
        "total capacity of 15.90 GiB of which 8.44 MiB is free. Including non-PyTorch memory, "
        "this process has 15.32 GiB memory in use. Of the allocated memory 14.12 GiB is "
        "allocated by PyTorch, and 410.41 MiB is reserved by PyTorch but unallocated."
    )
    lines = textwrap.wrap(one_line, width)
    for wrapped in ("\n".join(lines), "\n".join(f"[rank3]: {x}" for x in lines)):
        info = parse(wrapped)
        assert info.requested_bytes == 138 * MiB
        assert info.device_index == 1
        assert info.total_bytes == round(15.90 * GiB)
        assert info.free_bytes == round(8.44 * MiB)
        assert info.process_bytes == round(15.32 * GiB)
        assert info.allocated_bytes == round(14.12 * GiB)
        assert info.reserved_unallocated_bytes == round(410.41 * MiB)


@pytest.mark.parametrize(
    ("message", "backend"),
    [
        (
            "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
            "`cublasCreate(handle)`",
            "cuda",
        ),
        ("RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED", "cuda"),
        ("RuntimeError: CUDA error: CUSOLVER_STATUS_ALLOC_FAILED when calling X", "cuda"),
        ("RuntimeError: HIPBLAS_STATUS_ALLOC_FAILED when calling `hipblasCreate`", "hip"),
    ],
)
def test_cuda_library_allocation_failures_are_oom_without_numbers(
    message: str, backend: str
) -> None:
    info = parse(message)
    assert info.backend == backend
    assert info == OomInfo(backend=backend, raw=message)  # every number None


def test_new_wording_line_wrapped_real_message() -> None:
    # https://github.com/pytorch/pytorch/pull/99699 (the PR that introduced the wording)
    message = """torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 138.00 MiB.
GPU 0 has a total capacty of 15.90 GiB of which 8.44 MiB is free.
Process 1246069 has 577.00 MiB memory in use. Including non-PyTorch memory,
this process has 15.32 GiB memory in use. Of the allocated memory
14.12 GiB is allocated by PyTorch, and 410.41 MiB is reserved
by PyTorch but unallocated. If reserved but unallocated memory is large
try setting max_split_size_mb to avoid fragmentation."""
    info = parse(message, pid=1246069)
    assert info.requested_bytes == 138 * MiB
    assert info.total_bytes == round(15.90 * GiB)
    assert info.free_bytes == round(8.44 * MiB)
    assert info.process_bytes == round(15.32 * GiB)  # "this process" wins
    assert info.allocated_bytes == round(14.12 * GiB)
    assert info.reserved_unallocated_bytes == round(410.41 * MiB)


def test_new_wording_private_pools_and_allowed() -> None:
    # Shape of c10/cuda/CUDACachingAllocator.cpp since pytorch/pytorch#124673: A includes P.
    message = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 768.00 MiB. GPU 3 has a "
        "total capacity of 79.19 GiB of which 140.00 MiB is free. Including non-PyTorch memory, "
        "this process has 79.04 GiB memory in use. 75.00 GiB allowed; Of the allocated memory "
        "72.50 GiB is allocated by PyTorch, with 436.00 MiB allocated in private pools (e.g., CUDA "
        "Graphs), and 1.25 GiB is reserved by PyTorch but unallocated. If reserved but "
        "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
        "to avoid fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )
    info = parse(message)
    assert info.device_index == 3
    assert info.requested_bytes == 768 * MiB
    assert info.total_bytes == round(79.19 * GiB)
    assert info.free_bytes == 140 * MiB
    assert info.process_bytes == round(79.04 * GiB)
    assert info.allocated_bytes == 72 * GiB + 512 * MiB
    assert info.reserved_unallocated_bytes == GiB + 256 * MiB
    assert info.reserved_bytes == 73 * GiB + 768 * MiB


def test_new_wording_private_pools_without_unallocated_tail() -> None:
    # As quoted in public logs, cut after the private-pool clause.
    message = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 21.10 GiB. GPU 0 has a "
        "total capacity of 22.30 GiB of which 50.00 MiB is free. Process 189021 has 22.28 GiB "
        "memory in use. Of the allocated memory 20.94 GiB is allocated by PyTorch, with 22.00 MiB "
        "allocated in private pools (e.g., CUDA Graphs)."
    )
    info = parse(message, pid=189021)
    assert info.requested_bytes == round(21.10 * GiB)
    assert info.process_bytes == round(22.28 * GiB)
    assert info.allocated_bytes == round(20.94 * GiB)
    assert info.reserved_unallocated_bytes is None
    assert info.reserved_bytes is None


def test_unknown_placeholder_is_none_not_an_overflow() -> None:
    message = (
        "CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of "
        "17179869184.00 GiB of which 17179869184.00 GiB is free. Of the allocated memory 1.00 GiB "
        "is allocated by PyTorch, and 17179869184.00 GiB is reserved by PyTorch but unallocated."
    )
    info = parse(message)
    assert info.requested_bytes == 2 * MiB
    assert info.total_bytes is None
    assert info.free_bytes is None
    assert info.allocated_bytes == GiB
    assert info.reserved_unallocated_bytes is None
    assert info.reserved_bytes is None


def test_tib_and_plain_byte_units() -> None:
    message = (
        "CUDA out of memory. Tried to allocate 1.50 TiB. GPU 0 has a total capacity of 79.10 GiB "
        "of which 0 bytes is free. Of the allocated memory 512 bytes is allocated by PyTorch, and "
        "1.00 KiB is reserved by PyTorch but unallocated."
    )
    info = parse(message)
    assert info.requested_bytes == TiB + TiB // 2
    assert info.free_bytes == 0
    assert info.allocated_bytes == 512
    assert info.reserved_unallocated_bytes == 1024
    assert info.reserved_bytes == 1536


def test_bare_out_of_memory_wording_of_recent_builds() -> None:
    message = (
        "Out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total capacity of 23.52 GiB of "
        "which 9.75 MiB is free. Of the allocated memory 22.59 GiB is allocated by PyTorch, and "
        "352.99 MiB is reserved by PyTorch but unallocated."
    )
    info = parse(message)
    assert info.backend == "cuda"
    assert info.requested_bytes == 64 * MiB
    assert info.free_bytes == round(9.75 * MiB)


def test_message_inside_a_traceback() -> None:
    message = (
        'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n'
        "    loss.backward()\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
        "20.00 MiB. GPU 0 has a total capacity of 8.00 GiB of which 0 bytes is free. Of the "
        "allocated memory 7.51 GiB is allocated by PyTorch, and 15.90 MiB is reserved by PyTorch "
        "but unallocated.\n"
    )
    info = parse(message)
    assert info.requested_bytes == 20 * MiB
    assert info.total_bytes == 8 * GiB
    assert info.free_bytes == 0
    assert info.allocated_bytes == round(7.51 * GiB)
    assert info.reserved_unallocated_bytes == round(15.90 * MiB)


def test_cuda_driver_error_without_numbers() -> None:
    info = parse("RuntimeError: CUDA error: out of memory")
    assert info.backend == "cuda"
    assert (info.requested_bytes, info.total_bytes, info.allocated_bytes) == (None, None, None)


# --- not an out-of-memory message, and robustness


@pytest.mark.parametrize(
    "text",
    [
        "",
        "expected scalar type BFloat16 but found Float",
        "CUDA error: an illegal memory access was encountered",
        "the model ran out of patience",
        "Tried to allocate 2.00 GiB",
    ],
)
def test_non_oom_text_is_none(text: str) -> None:
    assert parse_oom_message(text) is None


def test_never_raises_on_odd_input() -> None:
    odd = [
        "CUDA out of memory. Tried to allocate 9" * 50,
        "CUDA out of memory. Tried to allocate 1e400 GiB (GPU 99999999999999999999; ;;; ))",
        "CUDA out of memory. (GPU x; total capacity)",
        "MPS backend out of memory (MPS allocated: , other allocations: )",
        "CUDA out of memory. Tried to allocate " + "9" * 400 + ".00 GiB.",
        "\x00CUDA out of memory\uffff",
    ]
    rng = random.Random(1234)
    alphabet = "CUDA HIP MPS out of memory. Tried to allocate 0123456789.,;() GiB MiB bytes GPU"
    odd += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200))) for _ in range(300)]
    for text in odd:
        info = parse_oom_message(text)
        assert info is None or info.raw == text
    huge = parse_oom_message("CUDA out of memory. Tried to allocate " + "9" * 400 + ".00 GiB.")
    assert huge is not None and huge.backend == "cuda"
    assert huge.requested_bytes is None
    assert parse_oom_message(None) is None  # type: ignore[arg-type]
