"""Reading the numbers out of an out-of-memory error message.

PyTorch's allocators put what they knew at the moment of an out-of-memory error into the message
text only; :func:`parse_oom_message` turns that text back into bytes. Every wording PyTorch has used
is read (the allocator sources are ``c10/cuda/CUDACachingAllocator.cpp`` and
``aten/src/ATen/mps/MPSAllocator.mm``):

* **CUDA, PyTorch ≥ 2.1** — ``CUDA out of memory. Tried to allocate X. GPU n has a total capacity
  of Y of which W is free. [Process p has M memory in use. | Including non-PyTorch memory, this
  process has M memory in use. ]* [L allowed; ]Of the allocated memory A is allocated by PyTorch,
  [with P allocated in private pools (e.g., CUDA Graphs), ]and B is reserved by PyTorch but
  unallocated. <advice>``. Here A already includes P, and B = reserved − A, so
  ``reserved_bytes`` = A + B. PyTorch 2.1 spelled it "total capacty"; recent builds start with a
  bare ``Out of memory.``. The process sentences come from NVML, one per process on the device.
* **CUDA, PyTorch 1.4 – 2.0** — ``CUDA out of memory. Tried to allocate X (GPU n; Y total
  capacity; Z already allocated; W free; [L allowed; ]V reserved in total by PyTorch)``:
  ``reserved_bytes`` = V, ``reserved_unallocated_bytes`` = V − Z.
* **CUDA, PyTorch ≤ 1.3** — ``… W free; U cached)`` where U is cached-but-unused memory
  (the allocator printed ``cached − allocated``): ``reserved_unallocated_bytes`` = U and
  ``reserved_bytes`` = Z + U.
* **CUDA libraries** — ``CUBLAS_STATUS_ALLOC_FAILED``, ``CUDNN_STATUS_ALLOC_FAILED`` (and the
  cuSPARSE, cuSOLVER, cuFFT, hipBLAS, MIOpen equivalents): the library could not allocate its
  workspace or handle. These are out-of-memory errors without numbers (every field ``None``).
* **ROCm** — the same texts with ``HIP`` for ``CUDA`` (no process sentences: there is no NVML).
* **XPU** — ``XPU out of memory. …`` in the ≥ 2.1 shape (read as well; backend ``"xpu"``).
* **Apple MPS** — ``MPS backend out of memory (MPS allocated: R, other allocations: O[, max
  allowed: T]). Tried to allocate X on private|shared pool. …``: R is the memory of the MPS
  allocator's heaps (allocated and cached: ``reserved_bytes``), R + O is everything this process
  has allocated on the Metal device (``process_bytes``), T the high-watermark limit the request
  was refused against (``total_bytes``).
* **edo-monitor's CPU-budget mode** — ``CPU-budget out of memory. Tried to allocate X. Budget of Y
  of which W is free. Z is accounted to the watched model.`` (see
  :func:`format_cpu_budget_oom_message`): ``total_bytes`` = Y, ``free_bytes`` = W,
  ``allocated_bytes`` = Z.

Sizes are printed with two decimals in ``bytes``, ``KiB``, ``MiB``, ``GiB`` (older texts and MPS:
``KB``, ``MB``, ``GB``, which also meant powers of 1024); each is stored as
``round(value × unit)``. Line breaks, repeated spaces and per-line launcher prefixes
(``[rank0]:``, pytest's ``E   ``) are ignored, so a message re-wrapped over several lines reads as
the one-line original; "A is allocated by PyTorch" is read even when its "Of the allocated memory"
lead-in was cut. ``17179869184.00 GiB`` (2**64 bytes) is what PyTorch prints for an
unknown or underflowed ``size_t``: it, and anything of 2**63 bytes or more, becomes ``None``.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

__all__ = ["OomInfo", "format_cpu_budget_oom_message", "parse_oom_message"]

logger = logging.getLogger(__name__)

_KIB = 1024
_UNIT_BYTES: dict[str, int] = {
    "byte": 1,
    "bytes": 1,
    "b": 1,
    "kib": _KIB,
    "kb": _KIB,
    "mib": _KIB**2,
    "mb": _KIB**2,
    "gib": _KIB**3,
    "gb": _KIB**3,
    "tib": _KIB**4,
    "tb": _KIB**4,
}
# No real size reaches 2**63 bytes (8 EiB); PyTorch prints size_t(-1) and underflows as ~2**64.
_UNKNOWN_THRESHOLD_BYTES = 2**63

_SIZE = r"(\d+(?:\.\d+)?)\s*(bytes|byte|KiB|MiB|GiB|TiB|KB|MB|GB|TB|B)\b"

_HEADER = re.compile(
    r"(?P<backend>CUDA|HIP|XPU|MPS backend|CPU-budget)\s+out of memory"
    r"|(?P<bare>\bOut of memory\.\s+Tried to allocate)"
    r"|(?P<driver>\b(?:CUDA|HIP) (?:runtime )?error(?: \(2\))?\s*:\s*out of memory)"
    r"|(?P<library>\b(?:CUBLAS|CUDNN|CUSPARSE|CUSOLVER|CUFFT|CUBLASLT|HIPBLAS|HIPBLASLT|"
    r"HIPSPARSE|HIPSOLVER|HIPFFT|MIOPEN)_(?:STATUS_)?ALLOC_FAILED\b)",
    re.IGNORECASE,
)
_REQUESTED = re.compile(r"Tried to allocate\s+" + _SIZE, re.IGNORECASE)
# PyTorch >= 2.1 ("capacty" in 2.1 itself).
_NEW_TOTAL = re.compile(r"GPU\s+(\d+)\s+has a total capac\w*\s+of\s+" + _SIZE, re.IGNORECASE)
_NEW_FREE = re.compile(r"of which\s+" + _SIZE + r"\s+is free", re.IGNORECASE)
_PROCESS = re.compile(
    r"(this process|Process\s+(\d+))\s+has\s+" + _SIZE + r"\s+memory in use", re.IGNORECASE
)
# "Of the allocated memory" is not required: a re-wrapped log may have cut that lead-in off.
_NEW_ALLOCATED = re.compile(_SIZE + r"\s+is allocated by PyTorch", re.IGNORECASE)
# Per-line prefixes that launchers and log formatters put in front of every line of a wrapped
# message (torchrun's "[rank0]:", pytest's "E   "); removed before the lines are joined.
_LINE_PREFIX = re.compile(r"^[ \t]*(?:\[(?:rank|default)\d+\]:|E(?=[ \t]{2,}))", re.MULTILINE)
_NEW_RESERVED_UNALLOCATED = re.compile(
    _SIZE + r"\s+is reserved by PyTorch but unallocated", re.IGNORECASE
)
# PyTorch <= 2.0: "(GPU 0; 7.93 GiB total capacity; 130.35 MiB already allocated; ...)".
_OLD_GROUP = re.compile(r"\(\s*(?:GPU|NPU)\s+(\d+)\s*;([^)]*)\)", re.IGNORECASE)
_OLD_PART = re.compile(r"^\s*" + _SIZE + r"\s+(.*?)\s*$", re.IGNORECASE)
# MPS.
_MPS_ALLOCATED = re.compile(r"MPS allocated:\s*" + _SIZE, re.IGNORECASE)
_MPS_OTHER = re.compile(r"other allocations:\s*" + _SIZE, re.IGNORECASE)
_MPS_MAX = re.compile(r"max allowed:\s*" + _SIZE, re.IGNORECASE)
# CPU-budget (edo-monitor's own wording).
_BUDGET = re.compile(
    r"Budget of\s+" + _SIZE + r"\s+of which\s+" + _SIZE + r"\s+is free", re.IGNORECASE
)
_ACCOUNTED = re.compile(_SIZE + r"\s+is accounted to the watched model", re.IGNORECASE)


@dataclass(frozen=True)
class OomInfo:
    """The numbers an out-of-memory message states; ``None`` for each one it does not state.

    All byte counts are ints (``round(printed value × unit)``, so accurate to the printed two
    decimals of the unit). See the module docstring for which sentence fills which field.

    Attributes:
        requested_bytes: the allocation that failed ("Tried to allocate X").
        device_index: the GPU index the allocator named (``None`` for MPS and CPU-budget).
        total_bytes: device capacity ("total capacity"); for MPS the "max allowed" limit; for
            CPU-budget the budget.
        free_bytes: free device memory as the driver reported it ("W free" / "of which W is free").
        allocated_bytes: bytes PyTorch's allocator had handed to tensors (private CUDA-graph pools
            included, as PyTorch prints it); for CPU-budget the bytes accounted to the model.
        reserved_bytes: bytes the caching allocator held (allocated + cached).
        reserved_unallocated_bytes: reserved but not allocated: the allocator's cached slack.
        process_bytes: this process's whole use of the device, CUDA context included (the
            "this process has" sentence, or the "Process <pid>" sentence whose pid is ours);
            for MPS the MPS heaps plus other Metal allocations of the process.
        backend: ``"cuda"``, ``"hip"``, ``"xpu"``, ``"mps"`` or ``"cpu-budget"``.
        raw: the message exactly as given.
    """

    requested_bytes: int | None = None
    device_index: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    process_bytes: int | None = None
    backend: str = "cuda"
    raw: str = ""


def _to_bytes(value: str, unit: str) -> int | None:
    factor = _UNIT_BYTES.get(unit.lower())
    if factor is None:
        return None
    result = round(float(value) * factor)
    if result >= _UNKNOWN_THRESHOLD_BYTES:
        return None
    return result


def _size_at(match: re.Match[str] | None, group: int = 1) -> int | None:
    """Bytes of the size whose value is in ``group`` and whose unit is in ``group + 1``."""
    if match is None:
        return None
    return _to_bytes(match.group(group), match.group(group + 1))


def _sub(a: int | None, b: int | None) -> int | None:
    if a is None or b is None or a < b:
        return None
    return a - b


def _add(a: int | None, b: int | None) -> int | None:
    if a is None or b is None:
        return None
    return a + b


def _backend_of(header: re.Match[str], text: str) -> str:
    name = header.group("backend")
    if name:
        key = name.lower()
        if key.startswith("mps"):
            return "mps"
        return key
    driver = header.group("driver") or header.group("library")
    if driver:
        return "hip" if driver.lower().startswith(("hip", "miopen")) else "cuda"
    # Bare "Out of memory." (recent device-generic allocator): ROCm builds name their env var.
    return "hip" if "PYTORCH_HIP_ALLOC_CONF" in text else "cuda"


def parse_oom_message(message: str, *, pid: int | None = None) -> OomInfo | None:
    """Parse a PyTorch out-of-memory message (any wording, see the module docstring).

    Args:
        message: the text of the error (``str(exc)``), or a log or traceback that contains it;
            line breaks and repeated spaces inside it are ignored. Parsing starts at the first
            out-of-memory header.
        pid: the process id that counts as "this process" in ``Process <pid> has …`` sentences;
            ``None`` means ``os.getpid()``. An explicit ``this process has …`` sentence wins.

    Returns:
        An :class:`OomInfo` with the numbers found (``raw`` is ``message`` unchanged), or ``None``
        when the text is not a device out-of-memory message. A message that is recognised but does
        not parse gives an :class:`OomInfo` whose numbers are ``None``.

    Never raises, whatever the input.
    """
    try:
        if not isinstance(message, str):
            return None
        # one line, single spaces: a message wrapped over lines (by a logger, a launcher or by
        # hand) reads as the one-line text PyTorch produced
        text = " ".join(_LINE_PREFIX.sub("", message).split())
        header = _HEADER.search(text)
        if header is None:
            return None
        backend = _backend_of(header, text)
    except Exception:  # never fail the caller over a message
        logger.debug("could not classify an out-of-memory message", exc_info=True)
        return None
    try:
        return _parse(text[header.start() :], message, backend, pid)
    except Exception:
        logger.debug("could not parse the numbers of an out-of-memory message", exc_info=True)
        return OomInfo(backend=backend, raw=message)


def _parse(text: str, raw: str, backend: str, pid: int | None) -> OomInfo:
    requested = _size_at(_REQUESTED.search(text))
    if backend == "mps":
        return _parse_mps(text, raw, requested)
    if backend == "cpu-budget":
        budget = _BUDGET.search(text)
        return OomInfo(
            requested_bytes=requested,
            total_bytes=_size_at(budget, 1),
            free_bytes=_size_at(budget, 3),
            allocated_bytes=_size_at(_ACCOUNTED.search(text)),
            backend=backend,
            raw=raw,
        )
    old = _OLD_GROUP.search(text)
    if old is not None and "total capacity" in old.group(2).lower():
        return _parse_old(old, raw, backend, requested)
    return _parse_new(text, raw, backend, requested, pid)


def _parse_new(
    text: str, raw: str, backend: str, requested: int | None, pid: int | None
) -> OomInfo:
    total = _NEW_TOTAL.search(text)
    allocated = _size_at(_NEW_ALLOCATED.search(text))
    reserved_unallocated = _size_at(_NEW_RESERVED_UNALLOCATED.search(text))
    process_bytes = _own_process_bytes(text, os.getpid() if pid is None else pid)
    return OomInfo(
        requested_bytes=requested,
        device_index=int(total.group(1)) if total else None,
        total_bytes=_size_at(total, 2),
        free_bytes=_size_at(_NEW_FREE.search(text)),
        allocated_bytes=allocated,
        reserved_bytes=_add(allocated, reserved_unallocated),
        reserved_unallocated_bytes=reserved_unallocated,
        process_bytes=process_bytes,
        backend=backend,
        raw=raw,
    )


def _own_process_bytes(text: str, own_pid: int) -> int | None:
    """This process's bytes from the process sentences (NVML's list, one sentence a process).

    PyTorch writes "this process has" for the entry whose pid is its own and "Process p has" for
    the others. In a container's PID namespace NVML's host pid never equals ours, so our own
    entry reads "Process p has": when the message has exactly one process sentence and no
    "this process has", that one process is the one that ran out of memory — ours.
    """
    matches = list(_PROCESS.finditer(text))
    for match in matches:
        if match.group(2) is None:  # "this process has …"
            return _size_at(match, 3)
    for match in matches:
        if int(match.group(2)) == own_pid:
            return _size_at(match, 3)
    if len(matches) == 1:
        return _size_at(matches[0], 3)
    return None


def _parse_old(old: re.Match[str], raw: str, backend: str, requested: int | None) -> OomInfo:
    fields: dict[str, int | None] = {}
    for part in old.group(2).split(";"):
        match = _OLD_PART.match(part)
        if match is None:
            continue
        label = match.group(3).lower()
        size = _to_bytes(match.group(1), match.group(2))
        if label.startswith("total capacity"):
            fields["total"] = size
        elif label.startswith("already allocated"):
            fields["allocated"] = size
        elif label.startswith("free"):
            fields["free"] = size
        elif label.startswith("reserved in total"):
            fields["reserved"] = size
        elif label.startswith("cached"):
            fields["cached"] = size
    allocated = fields.get("allocated")
    if "reserved" in fields:
        reserved = fields["reserved"]
        reserved_unallocated = _sub(reserved, allocated)
    else:  # PyTorch <= 1.3: "U cached" is cached-but-unused memory
        reserved_unallocated = fields.get("cached")
        reserved = _add(allocated, reserved_unallocated)
    return OomInfo(
        requested_bytes=requested,
        device_index=int(old.group(1)),
        total_bytes=fields.get("total"),
        free_bytes=fields.get("free"),
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        reserved_unallocated_bytes=reserved_unallocated,
        backend=backend,
        raw=raw,
    )


def _parse_mps(text: str, raw: str, requested: int | None) -> OomInfo:
    heaps = _size_at(_MPS_ALLOCATED.search(text))
    other = _size_at(_MPS_OTHER.search(text))
    return OomInfo(
        requested_bytes=requested,
        total_bytes=_size_at(_MPS_MAX.search(text)),
        reserved_bytes=heaps,
        process_bytes=_add(heaps, other),
        backend="mps",
        raw=raw,
    )


def _format_size(size_bytes: int) -> str:
    """PyTorch's ``format_size``: ``N bytes`` up to 1 KiB, else two decimals of KiB … TiB."""
    size_bytes = max(0, int(size_bytes))
    if size_bytes <= _KIB:
        return f"{size_bytes} bytes"
    for unit, factor in (("KiB", _KIB), ("MiB", _KIB**2), ("GiB", _KIB**3)):
        if size_bytes <= factor * _KIB:
            return f"{size_bytes / factor:.2f} {unit}"
    return f"{size_bytes / _KIB**4:.2f} TiB"


def format_cpu_budget_oom_message(
    requested_bytes: int, budget_bytes: int, free_bytes: int, accounted_bytes: int
) -> str:
    """The message of CPU-budget mode's out-of-memory error, in PyTorch's style.

    ``CPU-budget out of memory. Tried to allocate X. Budget of Y of which W is free. Z is
    accounted to the watched model.`` Sizes use PyTorch's format (``N bytes`` up to 1 KiB, then two
    decimals of KiB, MiB, GiB, TiB), so :func:`parse_oom_message` reads them back to within half a
    hundredth of the unit printed. A negative ``free_bytes`` (over budget) is printed as
    ``0 bytes``, as are other negative inputs.

    Args:
        requested_bytes: bytes of the allocation that would exceed the budget.
        budget_bytes: the budget (``budget_bytes`` of the reading).
        free_bytes: budget minus what is in use at that moment.
        accounted_bytes: bytes accounted to the watched model (params, grads, optimizer state,
            activations on the device tier).
    """
    return (
        f"CPU-budget out of memory. Tried to allocate {_format_size(requested_bytes)}. "
        f"Budget of {_format_size(budget_bytes)} of which {_format_size(free_bytes)} is free. "
        f"{_format_size(accounted_bytes)} is accounted to the watched model."
    )
