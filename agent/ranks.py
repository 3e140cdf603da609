"""A run's place in a multi-rank job (``torch.distributed``): :func:`detect_ranks`.

Under an initialised default process group, each rank's ``watch()`` is one run of one job. The
job's id is the launcher's when ``torchrun`` gives one (``TORCHELASTIC_RUN_ID``; its default
``"none"``, used by every static-rendezvous job that gives no ``--rdzv-id``, is not an id), else
rank 0's UUID, agreed when ``watch()`` is entered through one small collective on the group: an
``all_gather`` of three int64 per rank (its UUID as two words, a hash of its host name), which
also gives the local rank (the rank's place among the ranks on its host) where the launcher set
no ``LOCAL_RANK``. Every rank must then enter ``watch()``, as with any collective.

Every collective of the agreements (this one and :class:`Coordinator`'s) waits at most
:func:`agreement_timeout_s` (``AGREEMENT_TIMEOUT_S``, 60 s; ``EDO_AGREEMENT_TIMEOUT_S``
overrides it) for the other ranks: it runs with ``async_op=True`` and ``Work.wait(timeout=)``,
because a rank that died or hangs before it may leave the others waiting for the group's own
timeout (30 min by default; gloo's lazy connect ignores even that). Past the bound the agreement
fails (:class:`AgreementTimeoutError`): no job id, or no coordination, and the training goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import socket
import time
import uuid as uuidlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

__all__ = [
    "AGREEMENT_TIMEOUT_S",
    "DDP_SAFE_ACTIONS",
    "DEFAULT_SYNC_EVERY_STEPS",
    "JOB_ID_MAX_CHARS",
    "AgreementTimeoutError",
    "Coordinator",
    "RankInfo",
    "agreement_timeout_s",
    "collective_device",
    "ddp_blocker",
    "detect_ranks",
]

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


#: seconds one collective of an agreement waits for the other ranks (see the module docstring)
AGREEMENT_TIMEOUT_S = 60.0


class AgreementTimeoutError(RuntimeError):
    """A collective of the ranks' agreement did not complete within :func:`agreement_timeout_s`
    (a rank died or hangs before it). An expected condition of a job: the agent logs it in one
    line, without a traceback (``one_line``)."""

    one_line = True


def agreement_timeout_s() -> float:
    """The bound on each agreement collective, in seconds: ``EDO_AGREEMENT_TIMEOUT_S`` when it
    is a positive number, else :data:`AGREEMENT_TIMEOUT_S` (a bad value is logged, not used)."""
    raw = os.environ.get("EDO_AGREEMENT_TIMEOUT_S")
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if value > 0 and value != float("inf"):
            return value
        logger.warning(
            "EDO_AGREEMENT_TIMEOUT_S=%r is not a positive number of seconds; using %.0f s",
            raw,
            AGREEMENT_TIMEOUT_S,
        )
    return AGREEMENT_TIMEOUT_S


#: the keys of :func:`_all_arrived` in the group's store (a counter and a decision per agreement)
_ARRIVAL_PREFIX = "edo-monitor/agreement/"
#: this process's agreements so far: every rank counts its agreements alike (the detection at
#: ``watch()``, then each collective of each sync), so the n-th of each rank meet at one key
_arrivals = itertools.count()


def _default_store(dist: Any) -> Any:
    """The default group's key-value store (``None`` where torch does not give it)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _all_arrived(dist: Any, bound_s: float) -> None:
    """Wait, through the group's store, until every rank has come to this agreement, and decide
    with them whether its collective runs: all ranks run it, or none does.

    A collective that one rank starts and the others never join stays queued on the user's
    group after its ``wait`` times out: the next collective of the user's training was paired
    with it (a hang, or gloo's "Received data size doesn't match expected size" abort) when a
    rank came late, did not watch, or stepped once fewer. Here each rank adds one to the
    agreement's counter; the first rank to see every rank counted sets its decision to ``go``,
    and a rank still waiting after ``bound_s`` sets it to ``fail`` (``compare_set``: the first
    setting holds); every rank acts on the one decision, and a rank arriving after ``fail``
    starts nothing. Then only a rank that dies between the decision and the collective can
    leave one queued. A ``go`` deletes the keys of the agreement before (every rank has left it).

    Raises:
        AgreementTimeoutError: the decision is ``fail``.
    """
    store = _default_store(dist)
    if store is None:
        return  # the collective alone, bounded by its own wait
    n = next(_arrivals)
    count_key, decision_key = f"{_ARRIVAL_PREFIX}{n}", f"{_ARRIVAL_PREFIX}{n}/decision"
    world = int(dist.get_world_size())
    deadline = time.monotonic() + bound_s
    arrived = int(store.add(count_key, 1))
    pause_s = 1e-4
    while True:
        if arrived >= world:
            decision = store.compare_set(decision_key, "", "go")
        elif store.check([decision_key]):
            decision = store.get(decision_key)
        elif time.monotonic() >= deadline:
            decision = store.compare_set(decision_key, "", "fail")
        else:
            time.sleep(pause_s)
            pause_s = min(pause_s * 2, 0.01)
            arrived = int(store.add(count_key, 0))
            continue
        break
    if decision != b"go":
        raise AgreementTimeoutError(
            f"the ranks' agreement waited {bound_s:g} s (EDO_AGREEMENT_TIMEOUT_S) for the other "
            f"ranks to come to it: a rank died, hangs, is late, did not enter watch() or took "
            "fewer steps; no collective was started"
        )
    if n > 0 and dist.get_rank() == 0:
        for key in (f"{_ARRIVAL_PREFIX}{n - 1}", f"{_ARRIVAL_PREFIX}{n - 1}/decision"):
            with contextlib.suppress(RuntimeError):  # a store without deleteKey keeps them
                store.delete_key(key)


def _all_gather(dist: Any, out: list[torch.Tensor], mine: torch.Tensor) -> None:
    """``dist.all_gather(out, mine)`` once every rank has come to it (:func:`_all_arrived`),
    waiting at most :func:`agreement_timeout_s` for each.

    Raises:
        AgreementTimeoutError: the other ranks did not all take part in time.
        RuntimeError: (and whatever the backend raises) the collective failed.
    """
    bound_s = agreement_timeout_s()
    _all_arrived(dist, bound_s)
    t0 = time.monotonic()
    work = dist.all_gather(out, mine, async_op=True)
    try:
        done = work.wait(timeout=timedelta(seconds=bound_s))
    except RuntimeError as exc:
        if time.monotonic() - t0 < bound_s * 0.99 and "timed out" not in str(exc).lower():
            raise
        done = False
    if done is False:
        raise AgreementTimeoutError(
            f"the ranks' agreement waited {bound_s:g} s (EDO_AGREEMENT_TIMEOUT_S) for the other "
            f"ranks' all_gather: a rank died or hangs"
        )


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
        AgreementTimeoutError: a rank did not take part within :func:`agreement_timeout_s`.
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
        _all_gather(dist, gathered, words)
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


# ---------------------------------------------------------------------------- coordination

#: Actions that keep every parameter DDP registered (its device, dtype and shape): the only ones
#: a ``DistributedDataParallel`` model may take. ``release_cache`` touches the allocator only;
#: ``checkpoint_activations`` wraps blocks' forwards (non-reentrant checkpoint, which DDP
#: supports); the table actions move, convert or resize a table's weight.
DDP_SAFE_ACTIONS = frozenset({"release_cache", "checkpoint_activations"})

#: ``sync_every_steps`` default: the ranks agree every this many steps.
DEFAULT_SYNC_EVERY_STEPS = 4

_NO_FREE = 10**9  # a rank without a reading yet: "all free" (parts per billion)
_PPB = 10**9


def _target_hash(target: str) -> int:
    return int.from_bytes(hashlib.sha1(target.encode()).digest()[:8], "big", signed=True)


def uncoordinated_blocker(action: str) -> str | None:
    """Why ``action`` must not run on this rank alone (``None``: it may): a rank applies a
    decision without the ranks' agreement (no :class:`Coordinator`) only where no process group
    of two ranks or more is running, or the action changes no parameter
    (:data:`DDP_SAFE_ACTIONS`). The group was initialised after ``watch()`` began, or finding the
    job failed: each rank acted on its own (a table cached on one rank, DDP's next backward
    failed on it and the other rank's connection closed)."""
    dist = _dist()
    if dist is None or action in DDP_SAFE_ACTIONS:
        return None
    world_size = int(dist.get_world_size())
    if world_size < 2:
        return None
    return (
        f"a process group of {world_size} ranks runs but the ranks' agreement does not (the "
        f"group was initialised after watch() began, or finding the job failed): {action} on "
        "this rank alone would make the ranks' models differ; initialise the group before "
        "watch()"
    )


def ddp_blocker(model: Any, action: str) -> str | None:
    """Why ``action`` must not run on ``model`` under DDP (``None``: it may).

    A ``DistributedDataParallel`` reducer holds each registered parameter's gradient hooks and
    buckets, sized by device, dtype and shape; an action that changes any of them leaves the
    reducer invalid (the next backward fails or silently reduces wrong tensors).
    """
    from edo_monitor.actions.base import find_wrapped_parallel

    wrapper = find_wrapped_parallel(model) if model is not None else None
    if wrapper is None or action in DDP_SAFE_ACTIONS:
        return None
    return (
        f"model is wrapped in {wrapper}: {action} would change a registered parameter's device, "
        f"dtype or shape, and {wrapper}'s reducer would be invalid"
    )


class Coordinator:
    """The ranks' agreement on one decision at a safe point, every ``sync_every_steps`` steps.

    At a sync every rank contributes its latest free fraction and its pending decision (action
    and a hash of its target) to one ``all_gather`` of four int64 per rank. The decision of the
    rank with the lowest free fraction among those proposing one (the worst rank; the lowest rank
    on a tie) is the job's. When there is one, every rank checks it can apply it — its own plan
    for that action picks the same target, and no DDP wrapper forbids it — and a second
    ``all_gather`` of that flag decides: all apply it at this step, or, when any rank cannot, all
    refuse it (the reasons of the ranks that cannot come through ``all_gather_object``, so every
    rank records them in its ``action_refused`` event).

    Args:
        monitor: the run (its tuner applies the decision).
        sync_every_steps: steps between agreements (every rank must count the same steps).

    Attributes:
        syncs: agreements run. collectives: collectives they used.
        sync_s: seconds each agreement took on this rank (its collectives and the local checks),
            the newest 10,000.
        disabled: why coordination stopped (a collective failed: no rank can know what the others
            did, so no action is applied for the rest of the run), else ``None``.
    """

    def __init__(self, monitor: Any, sync_every_steps: int) -> None:
        self.m = monitor
        self.sync_every_steps = sync_every_steps
        self.syncs = 0
        self.collectives = 0
        self.sync_s: list[float] = []
        self.disabled: str | None = None
        self._dist = _dist()
        self._device = collective_device(self._dist) if self._dist is not None else None
        from edo_monitor.actions.registry import ACTIONS

        self._names = sorted(ACTIONS)

    def due(self, closing_step: int) -> bool:
        """Whether the boundary closing step ``closing_step`` (1-based) is a sync."""
        return (
            self.disabled is None
            and self._dist is not None
            and closing_step % self.sync_every_steps == 0
        )

    def _gather(self, values: list[int]) -> list[list[int]]:
        dist = self._dist
        mine = torch.tensor(values, dtype=torch.int64, device=self._device)
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        _all_gather(dist, out, mine)
        self.collectives += 1
        return [[int(v) for v in t.cpu().tolist()] for t in out]

    def _gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's JSON-able ``obj``, by rank: its UTF-8 length, then the bytes padded to
        the longest (two bounded all_gathers; ``all_gather_object`` has no timeout)."""
        data = json.dumps(obj).encode()
        sizes = self._gather([len(data)])
        longest = max(size for (size,) in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8, device=self._device)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in sizes]
        _all_gather(self._dist, out, mine)
        self.collectives += 1
        return [
            json.loads(bytes(t.cpu().tolist()[:size]).decode())
            for t, (size,) in zip(out, sizes, strict=True)
        ]

    def sync(self) -> None:
        """Agree and apply (training thread, at the safe point; every rank calls it at the same
        step). A failing collective disables coordination: one ``agent_error``."""
        t0 = time.perf_counter()
        try:
            self._sync()
        except Exception as exc:
            self.disabled = f"{type(exc).__name__}: {exc}"
            self.m._agent_error("rank agreement", exc)
        finally:
            self.syncs += 1
            self.sync_s.append(time.perf_counter() - t0)
            if len(self.sync_s) > 10_000:
                del self.sync_s[:5_000]

    def _sync(self) -> None:
        m = self.m
        policy = m.policy
        latest = m.latest
        free = latest.free_fraction if latest is not None else None
        pending = policy.pending if policy is not None and m.model is not None else None
        if pending is not None and pending.advisory:
            pending = None
        mine = [
            _NO_FREE if free is None else round(free * _PPB),
            self._names.index(pending.action) if pending is not None else -1,
            _target_hash(pending.target) if pending is not None else 0,
            pending.step if pending is not None else -1,
        ]
        rows = self._gather(mine)
        proposals = [(r[0], rank) for rank, r in enumerate(rows) if r[1] >= 0]
        if not proposals:
            return
        worst_free, worst = min(proposals)
        action = self._names[rows[worst][1]]
        target_hash = rows[worst][2]
        decision = self._local_decision(pending, action, target_hash, rows[worst][3], worst_free)
        reason = decision[1]
        flags = self._gather([1 if reason is None else 0])
        agreed = {
            "coordinated": True,
            "proposed_by_rank": worst,
            "worst_free_fraction": worst_free / _PPB,
            "ranks_free_fraction": [r[0] / _PPB if r[0] != _NO_FREE else None for r in rows],
            "sync_every_steps": self.sync_every_steps,
        }
        local = decision[0]
        if all(f[0] == 1 for f in flags):
            assert local is not None
            m._tuner.apply_decision(local, extra=agreed)
            return
        own_target = pending.target if pending is not None and pending.action == action else None
        answers = self._gather_objects([reason, own_target])  # why not, the target it proposed
        refusals = [
            {"rank": rank, "reason": why}
            for rank, (why, _) in enumerate(answers)
            if why is not None
        ]
        text = "; ".join(f"rank {r['rank']} cannot apply it: {r['reason']}" for r in refusals)
        from edo_monitor.actions.base import ActionResult

        if local is None:  # this rank could not even plan it: a stand-in for the record
            local = self._stand_in(action, None, rows[worst][3], worst_free)
        if local.target != answers[worst][1] and answers[worst][1] is not None:
            local = dataclasses.replace(local, target=answers[worst][1])  # the proposer's
        refused = ActionResult(
            action,
            local.target,
            "refused",
            estimated_saving_bytes=local.estimated_saving_bytes,
            reason=f"the ranks did not all agree: {text}",
        )
        m._tuner.apply_decision(local, refused=refused, extra={**agreed, "refusals": refusals})

    def _local_decision(
        self,
        pending: Any,
        action: str,
        target_hash: int,
        decided_step: int,
        worst_free: int,
    ) -> tuple[Any, str | None]:
        """This rank's decision for the agreed ``action`` (its own pending one when it is that
        action on that target; else a fresh plan, sized as if this rank's free fraction were the
        worst rank's) and why it cannot apply it (``None``: it can).
        """
        from edo_monitor.actions.registry import ACTIONS
        from edo_monitor.decide.plans import Refusal

        m = self.m
        blocker = ddp_blocker(m.model, action)
        if (
            pending is not None
            and pending.action == action
            and _target_hash(pending.target) == target_hash
        ):
            return pending, blocker
        if m.model is None or m.policy is None:
            return None, "this rank watches no model with a policy"
        stand_in = self._stand_in(action, None, decided_step, worst_free)
        latest = m.latest
        budget = latest.budget_bytes if latest is not None else None
        if budget and worst_free != _NO_FREE:
            # planned as tight as the worst rank: an action sized by the pressure (a shrink of
            # the row cache) is one this rank sizes too, not refused for want of pressure here
            stand_in = dataclasses.replace(
                stand_in, planning_in_use_bytes=math.ceil(budget * (1 - worst_free / _PPB))
            )
        plan = ACTIONS[action].plan(m._tuner.decision_context(stand_in))
        if isinstance(plan, Refusal):
            return None, blocker or plan.reason
        if _target_hash(plan.target) != target_hash:
            return None, blocker or (
                f"its own plan for {action} is on {plan.target!r}, not the proposing rank's target"
            )
        return dataclasses.replace(
            stand_in,
            target=plan.target,
            estimated_saving_bytes=plan.estimated_saving_bytes,
            plan=plan,
        ), blocker

    def _stand_in(self, action: str, pending: Any, decided_step: int, worst_free: int) -> Any:
        """A :class:`Decision` for an agreed action this rank's policy did not decide."""
        from edo_monitor.decide.plans import Plan
        from edo_monitor.decide.policy_events import Decision

        return Decision(
            action=action,
            target=pending.target if pending is not None else "",
            estimated_saving_bytes=0,
            reason="agreed by the ranks (the worst rank's decision)",
            step=decided_step,
            time_s=time.time(),
            free_fraction=worst_free / _PPB,
            mode="auto",
            plan=Plan(
                action=action, target="", estimated_saving_bytes=0, reason="agreed by the ranks"
            ),
        )

    def stats(self) -> dict[str, Any]:
        """The agreement's cost on this rank: syncs, collectives, seconds per sync (mean,
        median, max)."""
        times = sorted(self.sync_s)
        n = len(times)
        return {
            "sync_every_steps": self.sync_every_steps,
            "syncs": self.syncs,
            "collectives": self.collectives,
            "mean_sync_s": sum(times) / n if n else None,
            "median_sync_s": times[n // 2] if n else None,
            "max_sync_s": times[-1] if n else None,
            "disabled": self.disabled,
        }
