"""The staged plan of :func:`edo_monitor.hindsight.explain`: for each incident, three stages of
advice with the bytes each would save, computed from the run's own recorded attribution (the
sample at the incident and the ``module_stats`` rows), and a smaller embedding dimension from a
table's recorded singular spectrum. Reads only the history; never imports torch.

* **stage 1** mixed precision + activation checkpointing: the ``MAX_CHECKPOINT_BLOCKS`` blocks
  with the most recorded activation bytes, none inside another, are freed
  (``ckpt = min(act, Σ top blocks)``), the other activations halved:
  ``ckpt + (act - ckpt) // 2``. Gradients are not: under bf16 autocast the parameters stay
  float32, and so do their gradients (it counted them halved);
* **stage 2** quantization of the resident tables on the device (a row cache is left out), one
  line per compress mode (``bf16``, ``int8``, ``int4``, ``int2``, ``2of8``; the integer ones
  make a table frozen), over the tables each saves bytes on:
  ``Σ (recorded table bytes - estimate(mode))`` with
  :func:`edo_monitor.decide.estimate.estimate` and the run's optimizer; its cumulative figure adds
  stage 1's;
* **stage 3** sharding across ``N`` ranks of the recorded optimizer state (ZeRO-1), + gradients
  (ZeRO-2), + parameters (ZeRO-3 / FSDP): ``X · (N - 1) / N`` of the sharded bytes ``X``. With
  a multi-rank run ``N`` is its world size; for a one-rank run ``N`` is the smallest that covers
  the shortfall alone, ``ceil(X / (X - shortfall))`` (none when ``X <= shortfall``). A run whose
  model was already sharded (FSDP: the run's ``parallel_wrapper``) recorded its rank's shard
  ``X`` of all three: one line, the smallest ``M`` ranks above its ``N`` whose shard
  ``X · N / M`` covers the shortfall (saving ``X · (M - N) / M``).
* **dimension**: from a ``table_spectrum`` event (:mod:`edo_monitor.agent.spectrum`: singular
  values of a random sample of rows), the smallest ``k`` whose top ``k`` squared singular
  values keep ``share`` of the sample's energy, for each share of ``ENERGY_SHARES``, with
  the relative reconstruction error of the rank-``k`` approximation, ``sqrt(1 - kept)`` (Frobenius,
  on the sample), and the bytes a ``(rows, k)`` table would save.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edo_monitor.decide.estimate import _LOWBIT_DEFAULT_GROUP, _stored_group
from edo_monitor.errors import ConfigError
from edo_monitor.measure.module_tree import MODEL_MODULE, largest_disjoint
from edo_monitor.units import format_bytes

__all__ = [
    "ENERGY_SHARES",
    "QUANTIZATION_MODES",
    "DimensionSuggestion",
    "Stage",
    "StagedPlan",
    "dimension_for_energy",
    "plan_for_incident",
    "staged_plan",
]

#: Shares of a table's energy the suggested dimensions keep.
ENERGY_SHARES = (0.90, 0.99)
#: Stage 2's compress modes (:func:`edo_monitor.decide.estimate.estimate` spellings) and what they
#: are.
QUANTIZATION_MODES = (
    ("bf16", "bf16 table, grads and state"),
    ("int8", "int8 rows + a scale a row; frozen"),
    ("int4", "int4, groups of {group} with scale and zero-point; frozen"),
    ("int2", "int2, groups of {group} with scale and zero-point; frozen"),
    ("2of8", "2 of 8 kept at 2 bits + positions; frozen"),
)
#: Ranks stage 3 proposes at most for a one-rank run.
MAX_RANKS = 4096


@dataclass(frozen=True)
class Stage:
    """One line of the staged plan.

    Attributes:
        stage: 1, 2 or 3.
        action: ``mixed_precision+checkpointing``, ``quantize_bf16`` / ``_int8`` / ``_int4`` /
            ``_int2`` / ``_2of8``, ``zero1``, ``zero2``, ``zero3_fsdp``.
        target: what changes (modules, ``"with 4 ranks"``).
        saving_bytes: bytes this line alone frees at the incident.
        cumulative_bytes: with the earlier stages (stage 2 after stage 1; stage 3 alone).
        enough: ``cumulative_bytes >= shortfall``.
        lossy: changes the numerics.
        ranks: stage 3's ``N`` (``None`` elsewhere, or when no ``N`` is enough).
        detail: where the number comes from.
    """

    stage: int
    action: str
    target: str
    saving_bytes: int
    cumulative_bytes: int
    enough: bool
    lossy: bool
    ranks: int | None
    detail: str


@dataclass(frozen=True)
class DimensionSuggestion:
    """A smaller embedding dimension from a table's recorded singular spectrum.

    Attributes:
        table: the module. embedding_dim: its dimension now.
        energy_fraction: the share of the sample's energy kept (0.9, 0.99).
        dimension: the smallest ``k`` keeping it.
        relative_error: ``sqrt(1 - kept_energy / total_energy)``, the rank-``k`` reconstruction
            error of the sample relative to its Frobenius norm.
        rows_sampled: rows the spectrum came from.
        saving_bytes: recorded table bytes minus the estimate at ``(rows, k)`` (``None`` when the
            table has no ``module_stats`` row at the incident).
        enough: ``saving_bytes >= shortfall``.
    """

    table: str
    embedding_dim: int
    energy_fraction: float
    dimension: int
    relative_error: float
    rows_sampled: int
    saving_bytes: int | None
    enough: bool


@dataclass(frozen=True)
class StagedPlan:
    """The stages in order and the dimension suggestions of one incident."""

    shortfall_bytes: int
    stages: tuple[Stage, ...]
    dimensions: tuple[DimensionSuggestion, ...] = ()


def dimension_for_energy(
    singular_values: Sequence[float], total_energy: float, share: float
) -> tuple[int, float] | None:
    """The smallest ``k`` with ``Σ_{i<k} s_i² >= share · total_energy`` and its relative error
    ``sqrt(1 - Σ_{i<k} s_i² / total_energy)``; ``None`` when the recorded (largest) values do not
    reach the share, or there is no energy.

    Raises:
        ConfigError: ``share`` not in ``(0, 1]``.
    """
    if not 0 < share <= 1:
        raise ConfigError(f"share={share!r} is not allowed; expected 0 < share <= 1")
    if total_energy <= 0:
        return None
    kept = 0.0
    for k, s in enumerate(singular_values, start=1):
        kept += float(s) ** 2
        if kept >= share * total_energy * (1 - 1e-12):
            return k, math.sqrt(max(0.0, 1.0 - kept / total_energy))
    return None


def _device_tables(tables: Mapping[str, Any]) -> list[Any]:
    return [
        t for t in tables.values() if t.on_device and t.placement != "host" and t.total_bytes > 0
    ]


def staged_plan(
    shortfall: int,
    sample: Mapping[str, Any] | None,
    tables: Mapping[str, Any],
    activations: Mapping[str, int],
    *,
    in_use_bytes: int | None = None,
    world_size: int | None = None,
    sharded_by: str | None = None,
    spectra: Sequence[Mapping[str, Any]] = (),
) -> StagedPlan:
    """The staged plan at one incident (see the module docstring for each figure).

    Args:
        shortfall: the incident's shortfall in bytes.
        sample: the sample at the incident (``params_bytes``, ``grads_bytes``,
            ``optimizer_state_bytes``, ``activations_bytes``), or ``None``.
        tables: :func:`edo_monitor.hindsight.explain._tables_at`'s tables (recorded bytes per
        table). activations: recorded activation bytes per module.
        in_use_bytes: an OOM's in-use with the failing request (CPU runs: what is not static is
            an activation, as :func:`edo_monitor.hindsight.explain` counts it).
        world_size: the run's ranks (``None`` or 1: a one-rank run).
        sharded_by: the wrapper that already shards parameters, gradients and optimizer state
            (``"FullyShardedDataParallel"``, ``"FSDPModule"``), or ``None`` (replicas).
        spectra: ``table_spectrum`` event data, latest last.
    """
    from edo_monitor.hindsight.recorded import MAX_CHECKPOINT_BLOCKS, _est

    sample = sample or {}
    params = int(sample.get("params_bytes") or 0)
    grads = int(sample.get("grads_bytes") or 0)
    state = int(sample.get("optimizer_state_bytes") or 0)
    act = int(sample.get("activations_bytes") or 0)
    if in_use_bytes is not None and sample.get("device_kind") != "cuda":
        act = max(act, in_use_bytes - params - grads - state)
    stages: list[Stage] = []

    def add(
        stage: int,
        action: str,
        target: str,
        saving: int,
        cumulative: int,
        lossy: bool,
        ranks: int | None,
        detail: str,
    ) -> None:
        stages.append(
            Stage(
                stage,
                action,
                target,
                int(saving),
                int(cumulative),
                cumulative >= shortfall,
                lossy,
                ranks,
                detail,
            )
        )

    # stage 1
    blocks = {
        m: b for m, b in activations.items() if m not in (MODEL_MODULE, "") and m not in tables
    }
    top = largest_disjoint(blocks, MAX_CHECKPOINT_BLOCKS)  # a block holds its layers'
    ckpt = min(act, sum(b for _, b in top))
    stage1 = ckpt + (act - ckpt) // 2
    add(
        1,
        "mixed_precision+checkpointing",
        "bf16 autocast" + ("; checkpoint " + ", ".join(m for m, _ in top) if top else ""),
        stage1,
        stage1,
        True,
        None,
        (f"{format_bytes(ckpt)} checkpointed; " if top else "no block recorded; ")
        + f"activations {format_bytes(act - ckpt)} halved (float32 parameters and gradients)",
    )
    # stage 2
    # resident tables only (a row cache's bytes are its cached rows'); the integer modes are
    # advice for a table that could be frozen (their notes say so), the live actions refuse
    # them for a trainable one
    on_device = [t for t in _device_tables(tables) if t.placement != "cached"]
    for mode, note in QUANTIZATION_MODES:
        saving = after = 0
        groups: set[int] = set()  # a narrow table's groups are its row (estimate's rule)
        counted = []
        for t in on_device:
            try:
                est = _est(t, mode)
            except ConfigError:
                continue
            if t.total_bytes - est <= 0:
                continue
            saving, after = saving + t.total_bytes - est, after + est
            groups.add(_stored_group(t.embedding_dim, _LOWBIT_DEFAULT_GROUP))
            counted.append(t.module)
        if saving <= 0:
            continue
        add(
            2,
            f"quantize_{mode}",
            ", ".join(counted),
            saving,
            stage1 + saving,
            True,
            None,
            f"{note.format(group=' / '.join(map(str, sorted(groups))))}: estimate "
            f"{format_bytes(after)}",
        )
    # stage 3
    ranks_now = world_size if world_size and world_size > 1 else None
    if sharded_by:
        x, now = state + grads + params, world_size or 1
        m = now + 1
        while m <= MAX_RANKS and x * (m - now) // m < shortfall:
            m += 1
        found = m <= MAX_RANKS and x > 0
        saving = x * (m - now) // m if found else 0
        add(
            3,
            "zero3_fsdp",
            f"with {m} ranks (now {now})" if found else "no rank count is enough",
            saving,
            saving,
            False,
            m if found else None,
            f"already sharded by {sharded_by}: this rank's shard of state + gradients + params "
            f"{format_bytes(x)}, {now}/M of it a rank",
        )
    replicated = (
        ("zero1", "optimizer state", state),
        ("zero2", "state + gradients", state + grads),
        ("zero3_fsdp", "state + gradients + params", state + grads + params),
    )
    for action, what, sharded in () if sharded_by else replicated:
        if sharded <= 0:
            continue
        n = ranks_now
        if n is None and sharded > shortfall:
            n = max(2, math.ceil(sharded / (sharded - shortfall)))
            # integer bytes: the smallest N whose saving really covers the shortfall
            while n <= MAX_RANKS and sharded * (n - 1) // n < shortfall:
                n += 1
            n = n if n <= MAX_RANKS else None
        saving = sharded * (n - 1) // n if n else 0
        target = f"with {n} ranks" if n else "no rank count is enough"
        add(
            3,
            action,
            target,
            saving,
            saving,
            False,
            n,
            f"{what} {format_bytes(sharded)}, 1/N a rank (activations are not split)",
        )
    # dimension
    dims: list[DimensionSuggestion] = []
    latest = {s.get("table"): s for s in spectra if s.get("table")}
    from edo_monitor.decide.estimate import estimate

    for name, s in latest.items():
        d = int(s.get("embedding_dim") or 0)
        for share in ENERGY_SHARES:
            found = dimension_for_energy(
                s.get("singular_values") or (), float(s.get("total_energy") or 0), share
            )
            if found is None or found[0] >= d:
                continue
            k, err = found
            t = tables.get(name)
            saving = None
            if t is not None:
                dtype = (
                    t.dtype
                    if t.dtype in ("float32", "float16", "bfloat16", "float64")
                    else ("float32")
                )
                est = estimate(t.num_embeddings, k, dtype=dtype, optimizer=t.optimizer)
                after = est.total_with_step_bytes if t.counts_step else est.total_bytes
                saving = max(0, t.total_bytes - after)
            dims.append(
                DimensionSuggestion(
                    name,
                    d,
                    share,
                    k,
                    err,
                    int(s.get("rows_sampled") or 0),
                    saving,
                    saving is not None and saving >= shortfall,
                )
            )
    return StagedPlan(int(shortfall), tuple(stages), tuple(dims))


def plan_for_incident(
    history: Any,
    info: Any,
    module_rows: Sequence[Mapping[str, Any]],
    events: Sequence[Any],
    incident: Any,
) -> StagedPlan:
    """:func:`staged_plan` for one :class:`edo_monitor.hindsight.explain.Incident` of a recorded
    run: its sample (an OOM's, as its remedies read it: :func:`~edo_monitor.hindsight.explain.
    oom_sample`; else the sample at the incident), its tables and
    activations, the run's world size and its ``table_spectrum`` events."""
    from edo_monitor.hindsight.explain import oom_sample
    from edo_monitor.hindsight.recorded import (
        _activations_at,
        _sample_at,
        peak_batch_ids,
        tables_at_incident,
    )

    e = next((e for e in events if e.id == incident.event_id), None)
    sample, alive = None, None
    if e is not None and e.kind == "oom":
        sample, alive = oom_sample(history, info.id, e)
    if sample is None:
        sample = _sample_at(history, info.id, incident.time_s)
    cpu = info.device_kind != "cuda"
    return staged_plan(
        incident.shortfall_bytes,
        sample,
        tables_at_incident(
            history,
            info.id,
            incident.event_id,
            module_rows,
            incident.time_s,
            counts_step=cpu,
            peaks=peak_batch_ids(events),
        ),
        _activations_at(module_rows, incident.time_s),
        # what was alive is known by category: the request is not taken for activations
        in_use_bytes=incident.in_use_bytes if incident.kind == "oom" and not alive else None,
        world_size=getattr(info, "world_size", None),
        sharded_by=_sharding_wrapper((getattr(info, "config", None) or {}).get("parallel_wrapper")),
        spectra=[e.data for e in events if e.kind == "table_spectrum"],
    )


def _sharding_wrapper(wrapper: Any) -> str | None:
    """The recorded wrapper's name when it shards parameters (FSDP), else ``None``."""
    name = str(wrapper or "")
    return name if "FullyShard" in name or "FSDP" in name else None
