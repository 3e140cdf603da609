"""A run's place in a multi-rank job (``torch.distributed``): :func:`detect_ranks`.

Under an initialised default process group, each rank's ``watch()`` is one run of one job. The
job's id is the launcher's when ``torchrun`` gives one (``TORCHELASTIC_RUN_ID``; its default
``"none"``, used by every static-rendezvous job that gives no ``--rdzv-id``, is not an id), else
rank 0's UUID, agreed when ``watch()`` is entered through one small collective on the group: an
``all_gather`` of three int64 per rank (its UUID as two words, a hash of its host name), which
also gives the local rank (the rank's place among the ranks on its host) where the launcher set
no ``LOCAL_RANK``. Every rank must then enter ``watch()``, as with any collective.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import uuid as uuidlib
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["JOB_ID_MAX_CHARS", "RankInfo", "collective_device", "detect_ranks"]

logger = logging.getLogger(__name__)

#: ``jobs.id`` holds this many characters; a longer launcher id is replaced by its UUID-5.
JOB_ID_MAX_CHARS = 100


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands in its job.

    Attributes:
        job_id: shared by every rank of the job (``TORCHELASTIC_RUN_ID`` or rank 0's UUID).
        id_source: ``"torchelastic"`` or ``"process_group"`` (where ``job_id`` came from).
        rank: ``torch.distributed.get_rank()``. world_size: ``get_world_size()``.
        local_rank: ``LOCAL_RANK`` when the launcher set it, else the number of lower ranks on
            the same host.
        host: ``socket.gethostname()``.
        backend: ``torch.distributed.get_backend()`` (``"gloo"``, ``"nccl"`` ...).
    """

    job_id: str
    id_source: str
    rank: int
    world_size: int
    local_rank: int
    host: str
    backend: str | None


def _dist() -> Any:
    """``torch.distributed`` when it is usable and its default group is initialised."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def collective_device(dist: Any, group: Any = None) -> torch.device:
    """Where the group's collectives take their tensors: the current CUDA device for NCCL, the
    CPU for gloo and the others (a ``cpu:gloo,cuda:nccl`` group takes CPU tensors)."""
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _signed64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _host_hash(host: str) -> int:
    return int.from_bytes(hashlib.sha1(host.encode()).digest()[:8], "big", signed=True)


def _launcher_job_id() -> str | None:
    run_id = (os.environ.get("TORCHELASTIC_RUN_ID") or "").strip()
    if not run_id or run_id.lower() == "none":
        return None
    if len(run_id) > JOB_ID_MAX_CHARS:
        return str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"torchelastic:{run_id}"))
    return run_id


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def detect_ranks() -> RankInfo | None:
    """This process's rank, world size, local rank, host and job id (``None`` when no default
    process group is initialised, or torch was built without ``torch.distributed``).

    Without a usable ``TORCHELASTIC_RUN_ID`` and ``LOCAL_RANK``, it runs one ``all_gather`` on
    the default group (every rank must call it).

    Raises:
        RuntimeError: (and whatever the backend raises) when the collective fails.
    """
    dist = _dist()
    if dist is None:
        return None
    rank = int(dist.get_rank())
    world_size = int(dist.get_world_size())
    backend = str(dist.get_backend())
    host = socket.gethostname()
    job_id = _launcher_job_id()
    local_rank = _env_int("LOCAL_RANK")
    id_source = "torchelastic"
    if job_id is None or local_rank is None:
        mine = uuidlib.uuid4().int
        device = collective_device(dist)
        words = torch.tensor(
            [_signed64(mine >> 64), _signed64(mine), _host_hash(host)],
            dtype=torch.int64,
            device=device,
        )
        gathered = [torch.empty_like(words) for _ in range(world_size)]
        dist.all_gather(gathered, words)
        rows = [[int(v) for v in t.cpu().tolist()] for t in gathered]
        if job_id is None:
            hi, lo = rows[0][0] & ((1 << 64) - 1), rows[0][1] & ((1 << 64) - 1)
            job_id = str(uuidlib.UUID(int=(hi << 64) | lo))
            id_source = "process_group"
        if local_rank is None:
            local_rank = sum(1 for r in rows[:rank] if r[2] == rows[rank][2])
    return RankInfo(
        job_id=job_id,
        id_source=id_source,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        host=host,
        backend=backend,
    )
