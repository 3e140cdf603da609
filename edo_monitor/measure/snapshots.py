"""Memory snapshots in the format PyTorch's memory viewer reads (no torch import here).

A snapshot is the dict ``torch.cuda.memory._snapshot()`` returns: ``segments`` (the allocator's
segments, each with its ``blocks``: ``size``, ``requested_size``, ``state`` —
``"active_allocated"``, ``"active_pending_free"`` or ``"inactive"`` — and the ``frames`` of the
call that allocated it) and ``device_traces`` (per device, the allocator's recent actions:
``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``, ``oom`` …). The functions
of ``torch.cuda._memory_viz`` (``segments``, ``memory``, ``trace_plot``, ``segment_plot``) and
the page at https://pytorch.org/memory_viz open it.

On CUDA the agent stores the allocator's own snapshot (:mod:`edo_monitor.agent.snapshots`); in
CPU-budget mode it builds one here (:func:`build_cpu_snapshot`) from what it accounts: one
segment the size of the budget, one block per module and category (parameters, gradients,
optimizer state, saved activations), whose frame is ``{"filename": module, "name": category}``.

Stored in the history as the pickle compressed with zlib (:data:`ENCODING`); :func:`decode`
refuses a blob that does not decompress, does not unpickle without globals (a snapshot holds
only dicts, lists, tuples, strings and numbers, so nothing else is ever loaded) or is not a
snapshot, naming the event.
"""

from __future__ import annotations

import io
import pickle
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edo_monitor.errors import EdoMonitorError

__all__ = [
    "CPU_BASE_ADDRESS",
    "ENCODING",
    "FrameRow",
    "SnapshotError",
    "SnapshotTotals",
    "block_frame",
    "build_cpu_snapshot",
    "decode",
    "encode",
    "fragmentation",
    "top_by_frame",
    "totals",
]

#: how ``snapshots.blob`` is encoded: ``pickle.dumps`` (protocol 4), then ``zlib.compress``
ENCODING = "pickle+zlib"
#: where the built CPU-budget segment starts (any address: the viewer shows offsets in it)
CPU_BASE_ADDRESS = 0x7F00_0000_0000
_ACTIVE = ("active_allocated", "active_pending_free")


class SnapshotError(EdoMonitorError):
    """A stored snapshot that cannot be read (damaged blob, unknown encoding), or none stored."""


def encode(snapshot: Mapping[str, Any]) -> tuple[bytes, int]:
    """The blob stored for ``snapshot`` and the size of its pickle: ``(blob, raw_bytes)``."""
    raw = pickle.dumps(dict(snapshot), protocol=4)
    return zlib.compress(raw, 6), len(raw)


class _NoGlobals(pickle.Unpickler):
    """An unpickler that loads no class or function: a snapshot needs none."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a snapshot holds no objects of {module}.{name}")


def decode(blob: bytes, encoding: str = ENCODING, *, event: object = None) -> dict[str, Any]:
    """The snapshot dict stored in ``blob``.

    Args:
        blob: ``snapshots.blob``.
        encoding: ``snapshots.encoding`` (only :data:`ENCODING` is known).
        event: the event the snapshot belongs to (its id), for the error message.

    Raises:
        SnapshotError: an unknown encoding, a blob that does not decompress or unpickle, or a
            value that is not a snapshot (a dict with a ``segments`` list); the message names
            ``event``.
    """
    where = f"the snapshot of event {event}" if event is not None else "the snapshot"
    if encoding != ENCODING:
        raise SnapshotError(
            f"{where} has encoding {encoding!r}; this edo-monitor reads {ENCODING!r}"
        )
    try:
        value = _NoGlobals(io.BytesIO(zlib.decompress(bytes(blob)))).load()
    except Exception as exc:  # zlib.error, UnpicklingError, EOFError, …: all "damaged"
        raise SnapshotError(
            f"{where} is damaged ({type(exc).__name__}: {exc}); it is not shown"
        ) from None
    if not isinstance(value, dict) or not isinstance(value.get("segments"), list):
        raise SnapshotError(
            f"{where} is damaged: it holds a {type(value).__name__}, not a memory snapshot (a "
            "dict with 'segments')"
        )
    value.setdefault("device_traces", [])
    return value


@dataclass(frozen=True)
class SnapshotTotals:
    """Totals of one snapshot (all devices).

    Attributes:
        allocated_bytes: bytes of the active blocks (``active_allocated`` and
            ``active_pending_free``): what the tensors hold, as ``memory_allocated`` counts.
        reserved_bytes: bytes of every segment (``total_size``): what the allocator holds.
        free_bytes: reserved minus allocated (the inactive blocks).
        largest_free_block_bytes: the largest inactive block (0 when none).
        blocks: active blocks. segments: segments.
    """

    allocated_bytes: int
    reserved_bytes: int
    free_bytes: int
    largest_free_block_bytes: int
    blocks: int
    segments: int


def totals(snapshot: Mapping[str, Any]) -> SnapshotTotals:
    """Allocated, reserved and free bytes of ``snapshot``, from its segments' blocks."""
    allocated = reserved = largest = blocks = 0
    segments = snapshot.get("segments") or []
    for seg in segments:
        reserved += int(seg.get("total_size", 0))
        for b in seg.get("blocks") or []:
            size = int(b.get("size", 0))
            if b.get("state") in _ACTIVE:
                allocated += size
                blocks += 1
            elif size > largest:
                largest = size
    return SnapshotTotals(allocated, reserved, reserved - allocated, largest, blocks, len(segments))


def _frame_label(frame: Mapping[str, Any]) -> str:
    line = int(frame.get("line") or 0)
    name = str(frame.get("name", "?"))
    filename = str(frame.get("filename", "?"))
    if line <= 0:  # a built frame: module and category
        return f"{filename} ({name})"
    return f"{filename.rsplit('/', 1)[-1]}:{line}:{name}"


def block_frame(block: Mapping[str, Any]) -> str:
    """The frame a block is grouped by: its innermost Python frame outside torch's own files
    (the user's line that allocated it), else its innermost frame; ``"<no frames>"`` when the
    allocator recorded none (history off, or a block allocated before it started)."""
    frames: Sequence[Mapping[str, Any]] = block.get("frames") or []
    if not frames and block.get("history"):  # the format of torch < 2.1
        frames = block["history"][0].get("frames") or []
    if not frames:
        return "<no frames>"
    for f in frames:
        filename = str(f.get("filename", ""))
        if filename.endswith(".py") and "/torch/" not in filename:
            return _frame_label(f)
    for f in frames:
        if int(f.get("line") or 0) <= 0 and not str(f.get("filename", "")).startswith("/"):
            return _frame_label(f)  # built frames
    return _frame_label(frames[0])


@dataclass(frozen=True)
class FrameRow:
    """The live blocks allocated at one frame: ``frame``, ``blocks``, ``bytes`` (their sizes),
    ``largest_bytes`` (the largest one)."""

    frame: str
    blocks: int
    bytes: int
    largest_bytes: int

    def as_dict(self) -> dict[str, Any]:
        """The row as a plain dict (for ``--json`` and events)."""
        return {
            "frame": self.frame,
            "blocks": self.blocks,
            "bytes": self.bytes,
            "largest_bytes": self.largest_bytes,
        }


def top_by_frame(snapshot: Mapping[str, Any], k: int = 10) -> list[FrameRow]:
    """The ``k`` frames holding the most live (active) bytes, largest first."""
    groups: dict[str, list[int]] = {}
    for seg in snapshot.get("segments") or []:
        for b in seg.get("blocks") or []:
            if b.get("state") in _ACTIVE:
                groups.setdefault(block_frame(b), []).append(int(b.get("size", 0)))
    rows = [FrameRow(f, len(s), sum(s), max(s)) for f, s in groups.items()]
    rows.sort(key=lambda r: (-r.bytes, r.frame))
    return rows[: max(0, k)]


def fragmentation(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """Free memory at the snapshot's moment against the failed request, where one is recorded.

    Returns:
        ``free_bytes`` (reserved minus allocated), ``largest_free_block_bytes``,
        ``request_bytes`` (the last ``oom`` trace entry's ``size``, else ``None``),
        ``device_free_bytes`` (what CUDA had free outside the allocator at that OOM, else
        ``None``), and ``fits_in_largest_free_block`` (``None`` without a request): whether the
        request would fit in the largest free block — ``False`` with ``free_bytes`` above the
        request means the allocator's free memory was split into pieces too small for it.
    """
    t = totals(snapshot)
    request = device_free = None
    for trace in snapshot.get("device_traces") or []:
        for entry in trace or []:
            if entry.get("action") == "oom":
                request = int(entry.get("size", 0))
                device_free = entry.get("device_free")
    return {
        "free_bytes": t.free_bytes,
        "largest_free_block_bytes": t.largest_free_block_bytes,
        "request_bytes": request,
        "device_free_bytes": None if device_free is None else int(device_free),
        "fits_in_largest_free_block": (
            None if request is None else request <= t.largest_free_block_bytes
        ),
    }


def build_cpu_snapshot(
    blocks: Iterable[tuple[str, str, int]],
    *,
    budget_bytes: int | None,
    time_us: int = 0,
    request_bytes: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A snapshot in ``torch.cuda.memory._snapshot()``'s format from accounted bytes.

    Args:
        blocks: ``(module, category, bytes)`` per accounted piece (``category``: ``params``,
            ``grads``, ``optimizer_state``, ``activations`` …); pieces of 0 bytes are left out.
            Each becomes one ``active_allocated`` block whose frame is ``{"filename": module,
            "name": category, "line": 0}``.
        budget_bytes: the capacity: the one segment is this large (at least the blocks' sum),
            its rest one ``inactive`` block; ``None``: the blocks' sum.
        time_us: the trace entries' time (microseconds since the epoch).
        request_bytes: an allocation that failed (an enforced budget exceeded): recorded as a
            trace entry ``{"action": "oom", "size": request_bytes, "device_free": free}``.
        extra: what to keep beside the format under the key ``"edo"`` (ignored by the viewer).

    Returns:
        The snapshot dict: ``segments`` (one), ``device_traces`` (one device: one ``alloc`` per
        block, then the ``oom`` when given), ``edo``. Its :func:`totals` ``allocated_bytes`` is
        the blocks' sum.
    """
    addr = CPU_BASE_ADDRESS
    out_blocks: list[dict[str, Any]] = []
    trace: list[dict[str, Any]] = []
    for module, category, nbytes in blocks:
        size = int(nbytes)
        if size <= 0:
            continue
        frames = [{"filename": str(module), "name": str(category), "line": 0}]
        out_blocks.append(
            {
                "address": addr,
                "size": size,
                "requested_size": size,
                "state": "active_allocated",
                "frames": frames,
            }
        )
        trace.append(
            {
                "action": "alloc",
                "addr": addr,
                "size": size,
                "stream": 0,
                "time_us": time_us,
                "frames": frames,
            }
        )
        addr += size
    used = addr - CPU_BASE_ADDRESS
    total = max(used, int(budget_bytes or 0))
    if total > used:
        out_blocks.append(
            {
                "address": addr,
                "size": total - used,
                "requested_size": 0,
                "state": "inactive",
                "frames": [],
            }
        )
    if request_bytes is not None:
        trace.append(
            {
                "action": "oom",
                "addr": 0,
                "size": int(request_bytes),
                "stream": 0,
                "time_us": time_us,
                "frames": [],
                "device_free": total - used,
            }
        )
    segment = {
        "device": 0,
        "address": CPU_BASE_ADDRESS,
        "total_size": total,
        "allocated_size": used,
        "active_size": used,
        "requested_size": used,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": out_blocks,
    }
    return {
        "segments": [segment] if total else [],
        "device_traces": [trace],
        "edo": dict(extra or {}),
    }
