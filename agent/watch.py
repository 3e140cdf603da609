"""watch(): the one line users write, a Monitor entered as a context manager."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from edo_monitor.agent.monitor import DEFAULT_INTERVAL_S, Monitor
from edo_monitor.agent.ranks import (
    DEFAULT_SYNC_EVERY_STEPS,
)
from edo_monitor.agent.snapshots import DEFAULT_CAP_BYTES
from edo_monitor.exporters.prometheus import (
    DEFAULT_METRICS_HOST,
)


def watch(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    *,
    db: str | os.PathLike[str] | None = None,
    interval_s: float = DEFAULT_INTERVAL_S,
    budget: int | str | None = None,
    run_name: str | None = None,
    tags: Iterable[str] | None = None,
    strict: bool = False,
    policy: Any = None,
    enforce: bool = False,
    track_activations: bool = True,
    snapshot_interval_s: float = 5.0,
    queue_size: int = 10_000,
    config: Mapping[str, Any] | None = None,
    profile_interval_s: float = 30.0,
    metrics_port: int | None = None,
    metrics_host: str = DEFAULT_METRICS_HOST,
    tensorboard: Any = None,
    sync_every_steps: int = DEFAULT_SYNC_EVERY_STEPS,
    snapshots: bool | None = None,
    snapshot_cap: int | str = DEFAULT_CAP_BYTES,
    loader: Iterable[Any] | None = None,
    ahead: int = 8,
    loader_ids: Callable[[Any], Any] | None = None,
    spill_dir: str | os.PathLike[str] | None = None,
) -> Monitor:
    """Watch a training run; use as ``with edo_monitor.watch(model) as monitor:``.

    Args:
        model: the model to watch; ``None`` monitors the process only.
        optimizer: the optimizer stepping the model, or an iterable of them (a list, a tuple; a
            generator is read once; one given twice counts once); ``None`` (default) or an empty
            one: found through PyTorch's global optimizer step hooks (the first one that steps a
            parameter of ``model``). Anything else (``5``, ``"adam"``, a dict) is a
            ``ConfigError`` naming it.
        db: history database: file path or SQLAlchemy URL; default ``$EDO_DB`` or
            ``./edo-history.db``.
        interval_s: seconds between samples (> 0).
        budget: memory budget in bytes or as a string (``"512MiB"``, ``"2GB"``). On CUDA it is
            enforced with ``torch.cuda.set_per_process_memory_fraction``; on a CPU it is the
            capacity the accounted bytes are measured against (CPU-budget mode).
        run_name: a name for the run (default: the model's class name).
        tags: labels for queries (a string is one tag).
        strict: re-raise failures inside the agent (for tests) instead of logging them.
        policy: an :class:`edo_monitor.Policy` (the auto-tuner): evaluated on each reading, its
            decisions applied at the next step boundary; ``None`` records only.
        enforce: CPU-budget mode: raise :class:`edo_monitor.BudgetOutOfMemoryError` (a
            ``torch.OutOfMemoryError``) when the accounted bytes exceed the budget (needs
            ``budget``): during forward, from the saved-tensor hook, when the activations would
            overflow it (before the optimizer step, as a GPU would); right after each of the
            model's optimizers' steps when gradients or new optimizer state did (that step has
            run; with several optimizers, each one's step is checked). Ignored on CUDA,
            where the allocator enforces the budget. Each one is recorded as an ``oom`` event.
        track_activations: measure bytes saved for backward with saved-tensor hooks.
        snapshot_interval_s: seconds between allocator snapshots for fragmentation (0 = never).
        queue_size: capacity of the history queue (items beyond it are dropped and counted).
        config: extra key/values recorded with the run (a key that names one the agent
            records, such as ``"floor"`` or ``"policy"``, is kept as ``"user.<key>"``, with one
            warning).
        profile_interval_s: seconds between per-module activation profiles (one step's forward
            is recorded with module hooks; needs ``track_activations``).
        metrics_port: serve Prometheus metrics on ``/metrics`` at this port + ``$LOCAL_RANK``
            (default ``$EDO_METRICS_PORT``, else no endpoint; 0 = any free port, see
            ``monitor.metrics_server.port``); needs the ``[prometheus]`` extra. Names:
            ``docs/metrics.md``. A port that cannot be bound (in use, or above 65535 once
            ``$LOCAL_RANK`` is added) is a warning, not an error.
        metrics_host: the address the endpoint binds (default ``127.0.0.1``, loopback only; a
            string: anything else is a ``ConfigError``).
        tensorboard: a ``torch.utils.tensorboard.SummaryWriter``, or a log folder (str or path)
            to open one in: each reading's main numbers become scalars ``edo/<column>`` at the
            reading's step, each event (decision, action, crossing, OOM ...) text
            ``edo/events/<kind>/text_summary``; written by the sampler thread, flushed when the
            run ends (a writer made from a folder is closed, one passed in is not). Needs the
            ``[tensorboard]`` extra. A failing write is an ``agent_error``, never the training's.
        sync_every_steps: in a multi-rank job (an initialised ``torch.distributed`` process
            group), the ranks agree on one decision every this many optimizer steps (one small
            collective; a second when a decision is taken), and every rank applies it at that
            step, or none does (default 4). Every rank must step the same number of times.
        snapshots: a memory snapshot in the format of ``torch.cuda.memory._snapshot()`` at each
            incident (OOM, crossing below the floor, before/after an action), stored linked to
            its event (``edo-monitor snapshot``). ``None`` (default): at incidents only, nothing
            runs before one (on CUDA the allocator's snapshot, its blocks without frames; in
            CPU-budget mode one built from the accounting). ``True``: on CUDA also record the
            allocator's history (Python frames of every block, the last 20,000 allocator actions;
            costs a stack capture per allocation). ``False``: none.
        snapshot_cap: compressed snapshot bytes stored per run (bytes or ``"64MiB"``); beyond
            it snapshots are dropped and one ``snapshot_cap_reached`` event says so.
        loader: the training loader: ``monitor.loader`` is then an
            :class:`edo_monitor.nn.LookAhead` over it (iterate that instead): it reads ``ahead``
            batches in advance and, for every row-cached table of ``model`` (those the agent
            converts later too), prefetches the next batch's rows and evicts by next use in the
            window. Without it the cache evicts by its own policy (LFU).
        ahead: the look-ahead window in batches (an int >= 1).
        loader_ids: ``loader_ids(batch)``: the ids the batch looks up (a tensor, or a mapping from
            table module or name to tensor); default: each table's found from its own lookups
            (:class:`edo_monitor.nn.LookAhead`'s ``ids``).
        spill_dir: folder of the disk tier's file (``spill_embedding``, when the host cannot
            hold a row cache's table): default ``<history file>.spill`` beside an SQLite
            history, else ``<temp dir>/edo-spill``; the file is removed when the run ends.

    Leaving the block records how the run ended (``monitor.status``, ``edo-monitor runs``):
    ``finished`` when the block ends, or when ``sys.exit()`` / ``sys.exit(0)`` (a clean early
    stop) leaves it; ``interrupted`` for Ctrl-C (error ``KeyboardInterrupt``) and for SIGTERM
    (error ``SIGTERM``); ``failed`` for any other exception (error ``"<type>: <message>"``), a
    ``sys.exit`` with another exit status among them (``sys.exit(2)``: error ``SystemExit: exit
    code 2``; ``sys.exit("message")``: ``SystemExit: exit code 1: message``). The steps are
    counted in every case, and the exception goes on as it came.

    Returns:
        A :class:`Monitor` (entering it starts the run).

    Raises:
        ConfigError: (a ``ValueError``) for a bad argument, naming the value; ``tensorboard``
            without the ``tensorboard`` package; on entering, ``enforce=True`` with a CPU budget
            below the bytes the model already holds (naming both).
        AlreadyWatchedError: on entering, when ``model`` is already watched.
        StoreError: on entering, when the database cannot be opened.

        An error on entering after the run's row was written (a Ctrl-C among them) records the
        run ``failed`` with that error (``interrupted`` for Ctrl-C or SIGTERM), not ``running``.
    """
    return Monitor(
        model,
        optimizer,
        db=db,
        interval_s=interval_s,
        budget=budget,
        run_name=run_name,
        tags=tags,
        strict=strict,
        policy=policy,
        enforce=enforce,
        track_activations=track_activations,
        snapshot_interval_s=snapshot_interval_s,
        queue_size=queue_size,
        config=config,
        profile_interval_s=profile_interval_s,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        tensorboard=tensorboard,
        sync_every_steps=sync_every_steps,
        snapshots=snapshots,
        snapshot_cap=snapshot_cap,
        loader=loader,
        ahead=ahead,
        loader_ids=loader_ids,
        spill_dir=spill_dir,
    )
