"""Host probe: host memory as this process can use it, and the memory of its process tree.

Sources:

* ``psutil.virtual_memory()`` — the machine's total and available memory.
* The process's **cgroup** (a container, a systemd slice, a Slurm job): its memory limit and
  current use. In a container psutil reports the *machine's* memory, but the kernel's OOM killer
  acts at the cgroup's limit, so every host number uses the smaller of the two. The cgroup is
  found from ``/proc/self/cgroup``; cgroup v2 reads ``memory.max`` and ``memory.current``
  (unified hierarchy, the ``0::/path`` line), v1 ``memory.limit_in_bytes`` and
  ``memory.usage_in_bytes`` (the ``memory`` controller's line). The limit is the smallest one on
  the path from the process's cgroup up to the root (a parent's limit binds its children); the
  use is the process's cgroup's, less its reclaimable inactive page cache (``inactive_file``,
  v1 ``total_inactive_file`` in ``memory.stat``), as ``docker stats`` computes it. When the
  process's cgroup path is not under the mount (a cgroup namespace shows ``/``, or the path is
  the host's), the deepest existing folder on the path is used, down to the mount itself.
* The **process tree** (this process and its descendants: forking DataLoader workers): the sum
  of each process's PSS (proportional set size, ``psutil.Process.memory_full_info().pss``), so a
  page shared by several processes (copy-on-write after ``fork``) is counted once in all; USS
  (pages private to the process) where PSS is unavailable.

Reading PSS walks each process's page tables (tens of ms for a process with PyTorch loaded on
the development machine) and the cgroup files take a few ms, so both are read at most every
``slow_interval_s`` (2 s) and repeated in between; RSS and the machine's memory are read at every
sample. After :meth:`HostProbe.start` the slow reads run on their own thread (``edo-host``), so
the sampler never waits for them; without it, :meth:`HostProbe.read` does them on its schedule.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from edo_monitor.probes import EventCallback, ignore_event

__all__ = ["CgroupMemory", "HostProbe", "host_memory", "read_cgroup_memory"]

logger = logging.getLogger(__name__)

#: Where cgroup file systems are mounted (``/sys/fs/cgroup``; v1: one folder per controller).
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Limits at or above this are "no limit" (v1 writes ``PAGE_COUNTER_MAX`` pages, ~2**63 bytes).
_NO_LIMIT_BYTES = 2**62

_HOST_FIELDS = (
    "process_rss_bytes",
    "process_tree_bytes",
    "host_available_bytes",
    "host_limit_bytes",
)


@dataclass(frozen=True)
class CgroupMemory:
    """The memory limit and use of the cgroup a process runs in.

    Attributes:
        version: 1 or 2.
        path: the cgroup folder read (under the cgroup root).
        limit_bytes: the smallest limit from the process's cgroup up to the root (``None``: no
            limit).
        usage_bytes: the cgroup's memory use (``memory.current`` / ``memory.usage_in_bytes``)
            less its inactive page cache; ``None`` when unreadable.
    """

    version: int
    path: Path
    limit_bytes: int | None
    usage_bytes: int | None

    @property
    def available_bytes(self) -> int | None:
        """``limit − usage`` (not below 0); ``None`` without a limit or a usage."""
        if self.limit_bytes is None or self.usage_bytes is None:
            return None
        return max(0, self.limit_bytes - self.usage_bytes)


def _read_int(path: Path) -> int | None:
    """An integer file (``max`` / absent / unreadable: ``None``)."""
    try:
        text_ = path.read_text().strip()
    except OSError:
        return None
    if not text_ or text_ == "max":
        return None
    try:
        value = int(text_)
    except ValueError:
        return None
    return value if 0 <= value < _NO_LIMIT_BYTES else None


def _read_stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """``(v2 path, v1 memory path)`` from a ``/proc/<pid>/cgroup`` file."""
    v2 = v1 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _existing(base: Path, rel: str, probe_file: str) -> Path | None:
    """The deepest folder ``base/<prefix of rel>`` holding ``probe_file``, else ``None``."""
    parts = [p for p in rel.split("/") if p and p not in (".", "..")]
    for n in range(len(parts), -1, -1):
        folder = base.joinpath(*parts[:n])
        if (folder / probe_file).exists():
            return folder
    return None


def _min_limit(folder: Path, base: Path, limit_file: str) -> int | None:
    """The smallest limit from ``folder`` up to ``base`` (inclusive)."""
    limit: int | None = None
    current = folder
    while True:
        value = _read_int(current / limit_file)
        if value is not None:
            limit = value if limit is None else min(limit, value)
        if current == base or base not in current.parents:
            return limit
        current = current.parent


def read_cgroup_memory(
    root: str | os.PathLike[str] = CGROUP_ROOT,
    proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
) -> CgroupMemory | None:
    """The memory limit and use of the cgroup listed in ``proc_cgroup``, under ``root``.

    Args:
        root: where the cgroup file systems are mounted (``/sys/fs/cgroup``; v1 reads
            ``root/memory/…``). Tests pass a folder laid out the same way.
        proc_cgroup: the process's cgroup file (``/proc/self/cgroup``).

    Returns:
        A :class:`CgroupMemory` (v2 preferred when both are present), or ``None`` when there is
        no readable memory cgroup (not Linux, cgroups not mounted).

    Never raises.
    """
    try:
        base = Path(root)
        v2, v1 = _cgroup_paths(Path(proc_cgroup))
        if v2 is not None:
            folder = _existing(base, v2, "memory.current")
            if folder is not None:
                usage = _read_int(folder / "memory.current")
                if usage is not None:
                    usage = max(0, usage - _read_stat(folder / "memory.stat", "inactive_file"))
                return CgroupMemory(2, folder, _min_limit(folder, base, "memory.max"), usage)
        if v1 is not None:
            mount = base / "memory"
            folder = _existing(mount, v1, "memory.usage_in_bytes")
            if folder is not None:
                usage = _read_int(folder / "memory.usage_in_bytes")
                if usage is not None:
                    inactive = _read_stat(folder / "memory.stat", "total_inactive_file")
                    usage = max(0, usage - inactive)
                limit = _min_limit(folder, mount, "memory.limit_in_bytes")
                return CgroupMemory(1, folder, limit, usage)
    except Exception:  # a probe never raises
        logger.debug("reading the cgroup's memory failed", exc_info=True)
    return None


def host_memory(
    cgroup_root: str | os.PathLike[str] = CGROUP_ROOT,
    proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
) -> tuple[int, int]:
    """``(available_bytes, limit_bytes)`` of host memory for this process: the smaller of the
    machine's (``psutil.virtual_memory()``: ``available``, ``total``) and its cgroup's (limit −
    use, limit). What host-side actions check their headroom against.

    Raises:
        OSError: psutil cannot read the machine's memory.
    """
    return _combine(psutil.virtual_memory(), read_cgroup_memory(cgroup_root, proc_cgroup))


def _combine(vm: Any, cgroup: CgroupMemory | None) -> tuple[int, int]:
    """``(available, limit)``: the smaller of the machine's and the cgroup's."""
    available, limit = int(vm.available), int(vm.total)
    if cgroup is not None and cgroup.limit_bytes is not None:
        limit = min(limit, cgroup.limit_bytes)
        if cgroup.available_bytes is not None:
            available = min(available, cgroup.available_bytes)
    return available, limit


def _tree_bytes(process: psutil.Process) -> tuple[int, int]:
    """``(bytes, processes)``: PSS (USS where PSS is unavailable, RSS where neither is) summed
    over ``process`` and its descendants. Processes that end while being read are skipped."""
    total = count = 0
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.Error:
        members = [process]
    for proc in members:
        try:
            try:
                full = proc.memory_full_info()
                nbytes = getattr(full, "pss", None)
                if nbytes is None:
                    nbytes = full.uss
            except psutil.AccessDenied:
                if proc.pid != process.pid:
                    continue  # another user's child: nothing we may read
                nbytes = proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        total += int(nbytes)
        count += 1
    return total, count


class HostProbe:
    """Host memory for the sampler (field names as in ``docs/metrics.md``).

    * ``process_rss_bytes``: ``psutil.Process().memory_info().rss`` (this process only).
    * ``process_tree_bytes``: PSS of this process and its descendants (see the module docstring),
      read every ``slow_interval_s``.
    * ``host_limit_bytes``: the smaller of the machine's total memory and the cgroup's limit.
    * ``host_available_bytes``: the smaller of the machine's available memory and the cgroup's
      limit minus its use (the cgroup read every ``slow_interval_s``).

    Args:
        on_event: callback for ``probe_unavailable`` events.
        cgroup_root, proc_cgroup: see :func:`read_cgroup_memory` (tests pass a folder).
        slow_interval_s: seconds between process-tree and cgroup reads (``0``: every reading).
        pid: the process at the root of the tree (default: this one).
    """

    def __init__(
        self,
        *,
        on_event: EventCallback = ignore_event,
        cgroup_root: str | os.PathLike[str] = CGROUP_ROOT,
        proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
        slow_interval_s: float = 2.0,
        pid: int | None = None,
    ) -> None:
        self._process = psutil.Process(pid)
        self._on_event = on_event
        self._cgroup_root = cgroup_root
        self._proc_cgroup = proc_cgroup
        self.slow_interval_s = slow_interval_s
        self._failed: set[str] = set()
        self._slow_at_s = -float("inf")
        self._tree: int | None = None
        #: processes in the tree at the last tree read (this one included)
        self.tree_processes = 0
        #: the cgroup read at the last reading (``None``: none)
        self.cgroup: CgroupMemory | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        """Read the process tree and the cgroup every ``slow_interval_s`` on a daemon thread
        (``edo-host``) from now on; :meth:`read` then returns their latest values at once
        (``None`` until the thread's first read)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._slow_loop, name="edo-host", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread started by :meth:`start` (waits for it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _slow_loop(self) -> None:
        while True:
            self._slow_read()
            if self._stop.wait(self.slow_interval_s):
                return

    def _slow_read(self) -> None:
        """The cgroup and the process tree (never raises; failures reported once)."""
        if "cgroup" not in self._failed:
            try:
                self.cgroup = read_cgroup_memory(self._cgroup_root, self._proc_cgroup)
            except Exception as exc:  # read_cgroup_memory does not raise; belt and braces
                self._fail("cgroup", exc)
        if "tree" not in self._failed:
            try:
                self._tree, self.tree_processes = _tree_bytes(self._process)
            except Exception as exc:
                self._tree = None
                self._fail("tree", exc)

    def _fail(self, what: str, exc: BaseException) -> None:
        if what in self._failed:
            return
        self._failed.add(what)
        logger.warning("host probe: %s failed: %s", what, exc)
        self._on_event(
            "probe_unavailable", f"host: {what}: {exc}", {"source": "host", "field": what}
        )

    def read(self, *, now_s: float | None = None) -> dict[str, Any]:
        """One reading; ``None`` fields where a source fails (reported once). Never raises.

        Args:
            now_s: monotonic time for the slow reads' schedule (default ``time.monotonic()``).
        """
        out: dict[str, Any] = dict.fromkeys(_HOST_FIELDS)
        now = time.monotonic() if now_s is None else now_s
        if self._thread is None and now - self._slow_at_s >= self.slow_interval_s:
            self._slow_at_s = now
            self._slow_read()
        if "rss" not in self._failed:
            try:
                out["process_rss_bytes"] = int(self._process.memory_info().rss)
            except Exception as exc:
                self._fail("rss", exc)
        if "host" not in self._failed:
            try:
                available, limit = _combine(psutil.virtual_memory(), self.cgroup)
                out["host_available_bytes"] = available
                out["host_limit_bytes"] = limit
            except Exception as exc:
                self._fail("host", exc)
        out["process_tree_bytes"] = self._tree
        return out
