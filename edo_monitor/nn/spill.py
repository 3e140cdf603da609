"""The disk tier: host tensors backed by one memory-mapped file per run (issue 24, item 4).

A :class:`SpillFile` holds every tensor a run spills (a row cache's host table and its optimizer
state) in ONE file ``edo-spill-<pid>-<token>.bin`` in a folder the user names
(``watch(spill_dir=...)``). Each :meth:`SpillFile.alloc` grows the file and maps
the new range (``numpy.memmap`` ``r+``, viewed through ``torch.from_numpy`` as the wanted dtype):
the tensor is an ordinary CPU tensor whose pages the kernel writes back to the file, so code that
works over host memory works over it unchanged. :meth:`SpillFile.remove` deletes the file (the
mappings stay valid until their tensors are freed: Linux keeps the inode). A process killed before
``remove`` leaves its named file; :func:`leftover_spill_files` lists those whose process is gone.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import secrets
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from edo_monitor.store.spill_files import (
    SPILL_PREFIX,
    doctor_spill_lines,
    leftover_spill_files,
    leftover_words,
    report_leftovers,
    resolve_spill_dir,
)

__all__ = [
    "SPILL_PREFIX",
    "SpillFile",
    "doctor_spill_lines",
    "leftover_spill_files",
    "leftover_words",
    "remove_run_spill_files",
    "report_leftovers",
    "resolve_spill_dir",
    "run_spill_file",
]

logger = logging.getLogger(__name__)

_ALIGN_BYTES = 4096  # each tensor starts on a page


class SpillFile:
    """One run's spill file in ``folder`` (made if missing).

    Raises:
        ValueError: ``folder`` exists and is not a folder, or cannot be made (naming it).
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"spill_dir={str(folder)!r} cannot be made: {exc}") from None
        if not self.folder.is_dir():
            raise ValueError(f"spill_dir={str(folder)!r} is not a folder")
        self.path = self.folder / f"{SPILL_PREFIX}{os.getpid()}-{secrets.token_hex(4)}.bin"
        self.path.touch()
        self.size_bytes = 0

    def alloc(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled CPU tensor of ``shape`` and ``dtype`` backed by a new range of the file.

        Raises:
            OSError: the folder's file system has no room for it (``ENOSPC``): the range is
                reserved on disk here (``posix_fallocate``), not at a later write through the
                mapping, which a full disk answers with ``SIGBUS``: the process died with no
                exception, no rollback and a ``crashed`` run.
        """
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        offset = -(-self.size_bytes // _ALIGN_BYTES) * _ALIGN_BYTES
        with open(self.path, "r+b") as f:
            f.truncate(offset + nbytes)
            if nbytes and hasattr(os, "posix_fallocate"):
                try:
                    os.posix_fallocate(f.fileno(), offset, nbytes)
                except OSError as exc:
                    f.truncate(self.size_bytes)  # the file as it was
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise OSError(
                            exc.errno,
                            f"no room for {nbytes} bytes in spill file {self.path}: {exc.strerror}",
                        ) from None
        self.size_bytes = offset + nbytes
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        arr = np.memmap(self.path, dtype=np.uint8, mode="r+", offset=offset, shape=(nbytes,))
        return torch.from_numpy(arr).view(dtype).view(tuple(int(s) for s in shape))

    def remove(self) -> None:
        """Delete the file (tensors already mapped stay readable until freed)."""
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            logger.warning("could not remove spill file %s", self.path, exc_info=True)


_RUN_FILES: dict[Path, SpillFile] = {}
_RUN_PID = os.getpid()  # the process whose files _RUN_FILES holds (a forked child has a copy)
_RUN_LOCK = threading.Lock()
_ATEXIT_REGISTERED = False


def run_spill_file(folder: str | os.PathLike[str]) -> SpillFile:
    """This process's spill file in ``folder``: made on first use (one file per run, every
    spilled table in it), removed by :func:`remove_run_spill_files` or, as a fallback, at exit.

    Raises:
        ValueError: ``folder`` is not a folder or cannot be made.
    """
    global _ATEXIT_REGISTERED, _RUN_PID
    key = Path(folder).resolve()
    with _RUN_LOCK:
        if os.getpid() != _RUN_PID:  # a forked child: its own files from here on
            _RUN_FILES.clear()
            _RUN_PID = os.getpid()
        sf = _RUN_FILES.get(key)
        if sf is None:
            sf = _RUN_FILES[key] = SpillFile(key)
            logger.info("disk tier: spill file %s", sf.path)
        if not _ATEXIT_REGISTERED:
            atexit.register(remove_run_spill_files)
            _ATEXIT_REGISTERED = True
        return sf


def remove_run_spill_files(folder: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove this process's spill files (those in ``folder``; all when ``None``): the run ended.
    Tensors already mapped stay readable; a later spill makes a new file. Returns the paths.
    A forked child removes none: they are its parent's (its exit ran this at ``atexit``)."""
    with _RUN_LOCK:
        if os.getpid() != _RUN_PID:
            return []
        keys = [k for k in _RUN_FILES if folder is None or k == Path(folder).resolve()]
        files = [_RUN_FILES.pop(k) for k in keys]
    for sf in files:
        sf.remove()
    return [sf.path for sf in files]
