"""replay: a recorded run's samples through the real Policy offline, each action's effect modelled
from the recorded attribution, beside what the run did. Reads only the database."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edo_monitor.decide.plans import Plan
from edo_monitor.errors import ConfigError
from edo_monitor.hindsight.recorded import (
    _activations_at,
    _load,
    _open,
    _tables_at,
    peak_batch_ids,
    refused_live,
)
from edo_monitor.hindsight.replay_model import MIN_RESIZE_BYTES as MIN_RESIZE_BYTES  # re-export
from edo_monitor.hindsight.replay_model import _Model

_POLICY_KEYS = {
    "min_free_fraction": float,
    "rearm_free_fraction": float,
    "cooldown_steps": int,
    "mode": str,
    "allow_lossy": bool,
    "ladder": tuple,
    "release_cache_min_bytes": str,
    "grow_margin_fraction": float,
    "grow_after_readings": int,
    "forecast_steps": int,
    "forecast_window_steps": int,
}


def parse_policy(text: str) -> dict[str, Any]:
    """Policy keyword arguments from ``"min_free_fraction=0.3,cooldown_steps=2,..."``.

    ``ladder`` takes action names joined by ``+`` (``ladder=offload_embedding+cache_embedding``);
    ``allow_lossy`` takes ``true``/``false``. Values are checked by :class:`Policy` itself.

    Raises:
        ConfigError: no setting at all (``""``: an empty shell variable; the default policy
            is no string), an unknown key, a missing ``=``, a key given twice, or a value of
            the wrong kind.
    """
    if not text.replace(",", "").strip():
        raise ConfigError(
            f"policy settings {text!r} give no setting; expected KEY=VALUE,... (without "
            "settings: the default policy)"
        )
    out: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep and key in _POLICY_KEYS:  # the setting is allowed: its value is missing
            raise ConfigError(f"policy setting {key!r} has no value; expected {key}=VALUE")
        if not sep or key not in _POLICY_KEYS:
            raise ConfigError(
                f"policy setting {part!r} is not allowed; expected KEY=VALUE with KEY one of "
                f"{', '.join(_POLICY_KEYS)}"
            )
        if key in out:
            raise ConfigError(
                f"policy setting {key} is given twice ({part!r}); give each setting once"
            )
        kind = _POLICY_KEYS[key]
        try:
            if kind is bool:
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                out[key] = value.lower() in ("true", "1", "yes")
            elif kind is tuple:
                out[key] = tuple(v.strip() for v in value.split("+") if v.strip())
            else:
                out[key] = kind(value)
        except ValueError:
            expected = {int: "an integer", float: "a number", bool: "true or false"}[kind]
            raise ConfigError(
                f"policy setting {key}={value!r} is not allowed; expected {expected}"
            ) from None
    return out


@dataclass(frozen=True)
class ReplayDecision:
    """A decision of the replayed policy (or, in ``recorded``, of the live run).

    Attributes:
        step, time_s: the reading it was decided on; in ``recorded``, where the run acted: the
            step and time of the action's outcome (applied, refused, failed, expired), else of
            the decision (pending, advised).
        action, target: what.
        saving_bytes: the modelled saving (replay: of the plan made again at the safe point
            that applies the decision; the decision's estimate when it was refused there or its
            safe point never came) or measured ``saved_bytes`` (live; ``None`` when the live
            decision was not applied).
        free_fraction: free fraction of the reading (modelled in a replay).
        status: ``"modelled"``, ``"refused"`` (planned again at the safe point that applies
            it, as the live agent does, the plan was refused there), ``"advised"`` (replay in
            advise mode); live: ``"applied"``,
            ``"refused"``, ``"failed"``, ``"expired"`` (the run ended first), ``"advised"`` or
            ``"pending"`` (no outcome recorded).
        reason: the decision's reason.
        expected_error: the plan's expected relative squared error (lossy actions; ``None``
            when lossless or not known, e.g. a run recorded before it was recorded).
        decided_step: in ``recorded``, the step of the run's own decision (``None``: an action
            with no decision on this run, e.g. one the ranks of a job agreed on that this rank's
            policy did not decide); ``None`` in a replay's decisions (``step`` is theirs).
    """

    step: int
    time_s: float
    action: str
    target: str
    saving_bytes: int | None
    free_fraction: float | None
    status: str
    reason: str
    expected_error: float | None = None
    decided_step: int | None = None


@dataclass(frozen=True)
class ReplayForecast:
    """A forecast of the replayed policy (``forecast_steps``) and its outcome.

    Attributes:
        step: the reading it was made on; ``predicted_step``: the crossing it predicted.
        free_fraction: modelled free fraction at ``step``.
        slope_bytes_per_step: the in-use trend (savings added back).
        came_true: ``True``/``False`` as :class:`edo_monitor.decide.policy.ForecastOutcome` judges
        it;
            ``None`` when the trace ended first.
        crossing_step: the step free memory (without the replayed actions taken since) was first
            below the floor, when it came true.
    """

    step: int
    predicted_step: int
    free_fraction: float
    slope_bytes_per_step: float
    came_true: bool | None
    crossing_step: int | None


@dataclass(frozen=True)
class ReplayResult:
    """:func:`replay`'s answer: the replayed decisions beside the recorded ones.

    Attributes:
        run_id, run_name: the run.
        policy: ``repr`` of the replayed policy.
        samples: samples replayed.
        decisions: the replayed policy's decisions, in order.
        refusals: for each ``no_action`` of the replay, ``(step, [(action, reason), ...])``.
        recorded: what the live run did: its decisions with their outcome, each at the step
            where the run acted, and any action with no decision of its own (:func:`_recorded`).
        crossings: the replay's threshold crossings ``(step, "below_floor" | "above_rearm",
            free_fraction)``.
        min_free_fraction: modelled minimum free fraction; ``recorded_min_free_fraction``: the
            live run's.
        oom_steps: steps of the live run's OOM events; ``oom_avoided``: for each, whether the
            modelled savings in force by then cover its shortfall.
        duration_s: wall time of the replay loop (reading the samples included).
        forecasts: the replayed policy's forecasts with their outcomes (``forecast_steps`` set).
    """

    run_id: int
    run_name: str
    policy: str
    samples: int
    decisions: tuple[ReplayDecision, ...]
    refusals: tuple[tuple[int, tuple[tuple[str, str], ...]], ...]
    recorded: tuple[ReplayDecision, ...]
    crossings: tuple[tuple[int, str, float], ...]
    min_free_fraction: float | None
    recorded_min_free_fraction: float | None
    oom_steps: tuple[int, ...]
    oom_avoided: tuple[bool, ...]
    duration_s: float
    forecasts: tuple[ReplayForecast, ...] = ()

    @property
    def samples_per_s(self) -> float | None:
        """Replay speed."""
        return self.samples / self.duration_s if self.duration_s > 0 else None

    def as_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready values (``samples_per_s`` included)."""
        d = dataclasses.asdict(self)
        d["samples_per_s"] = self.samples_per_s
        return d


#: The sample columns replay reads, in the order :func:`replay_samples` yields them.
REPLAY_COLUMNS = (
    "time_s",
    "step",
    "device_kind",
    "in_use_bytes",
    "budget_bytes",
    "free_fraction",
    "reserved_unallocated_bytes",
)


def replay_samples(conn: Any, run_id: int, chunk_rows: int = 65536) -> Iterator[list[Any]]:
    """A run's samples in time order (``ORDER BY time_s, id``), :data:`REPLAY_COLUMNS` only,
    as lists of plain tuples of up to ``chunk_rows``.

    Read through the DBAPI cursor of ``conn`` (an SQLAlchemy connection of a reader, in its
    snapshot): SQLAlchemy's result rows cost about a third of the read on a million samples, and
    replay needs nothing but the values.
    """
    mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    sql = (
        f"SELECT {', '.join(REPLAY_COLUMNS)} FROM samples WHERE run_id = {mark} ORDER BY time_s, id"
    )
    cur = conn.connection.dbapi_connection.cursor()
    try:
        cur.execute(sql, (run_id,))
        while chunk := cur.fetchmany(chunk_rows):
            yield chunk
    finally:
        cur.close()


def replay(db: Any, run: Any, policy: Any = None) -> ReplayResult:
    """Re-run a recorded run's samples through a real :class:`edo_monitor.decide.policy.Policy`.

    Args:
        db: a :class:`edo_monitor.History`, a path or an SQLAlchemy URL (read-only).
        run: run id, uuid prefix or ``"latest"``.
        policy: a :class:`Policy`, its keyword arguments (a mapping), a string for
            :func:`parse_policy`, or ``None`` (the default policy, ``mode="auto"``). A policy
            object is used as it is (its state changes).

    Returns:
        A :class:`ReplayResult` (see the module docstring for how each effect is modelled).

    Raises:
        RunNotFoundError: no such run. StoreError: no usable database. ConfigError: a bad policy.
    """
    from edo_monitor.decide.policy import Policy
    from edo_monitor.decide.policy_events import (
        Decision,
        Forecast,
        ForecastOutcome,
        NoActionAvailable,
        ThresholdCrossing,
    )
    from edo_monitor.probes.readings import Reading

    if policy is None:
        policy = Policy()
    elif isinstance(policy, str):
        policy = Policy(**parse_policy(policy))
    elif isinstance(policy, Mapping):
        policy = Policy(**policy)
    elif not isinstance(policy, Policy):
        raise ConfigError(
            f"policy={policy!r} is not allowed; expected a Policy, a mapping or a string"
        )
    history, owned = _open(db)
    try:
        t0 = time.perf_counter()
        info, module_rows, events = _load(history, run)
        live = [e for e in events if e.kind == "action"]
        cpu = info.device_kind != "cuda"
        # the tables as they were before the live run's first decision changed anything
        changed = [e.time_s for e in events if e.kind in ("decision", "action")]
        first_live = min(changed) if changed else None
        model = _Model(
            _tables_at(
                module_rows, first_live, before=True, counts_step=cpu, peaks=peak_batch_ids(events)
            ),
            _activations_at(module_rows, first_live),
            policy.rearm_free_fraction,
            policy.grow_margin_fraction,
        )
        model.refused = refused_live(events, model.tables)
        for t in model.tables.values():
            t.on_device = t.placement != "host"
        live_back = [(*_in_force_from(e), int(e.data.get("saved_bytes") or 0)) for e in live]
        # the safe point that closed each step, where the live run acted there: a replayed
        # decision applied at that safe point takes effect when the live action did
        done = {e.step: t for e in live if (t := _in_force_from(e)[1]) is not None}
        ooms = [e for e in events if e.kind == "oom"]
        oom_need = []
        for e in ooms:
            parsed = e.data.get("parsed") or {}
            req, free = parsed.get("requested_bytes"), parsed.get("free_bytes")
            oom_need.append((e.time_s, max(0, int(req or 0) - int(free or 0))))

        decisions: list[ReplayDecision] = []
        forecasts: list[ReplayForecast] = []
        open_forecast: dict[int, int] = {}  # forecast index -> its position in forecasts
        last_step, last_time = 0, 0.0
        refusals: list[tuple[int, tuple[tuple[str, str], ...]]] = []
        crossings: list[tuple[int, str, float]] = []
        # (step, time, its row in decisions, decision): in force from a later step's readings,
        # or from that time on; the policy is told it was applied then, as the live agent tells
        # it at the safe point (told at the decision, the readings between them, still without its
        # saving, filled the policy's recent in-use again: every grow_cache came 20 steps late)
        pending: list[tuple[int, float | None, int, Decision]] = []
        # the highest modelled in-use since the pending decision's reading: the live safe point
        # plans it again on its own accounting, the step's gradients alive (a step's peak)
        peak_since = 0
        applied = 0
        back = 0
        li = 0
        min_free: float | None = None
        min_rec: float | None = None
        saved_at_oom: list[int] = []
        oi = 0
        n = 0
        evaluate = policy.evaluate
        with history._read() as conn:
            for chunk in replay_samples(conn, info.id):
                for time_s, step, kind, in_use, budget, rec_free, slack in chunk:
                    n += 1
                    while li < len(live_back) and _in_force(live_back[li], step, time_s):
                        back += live_back[li][2]
                        li += 1
                    if pending:
                        for p in [p for p in pending if _in_force(p, step, time_s)]:
                            pending.remove(p)
                            plan = _apply_at_safe_point(model, p[3], peak_since)
                            decisions[p[2]] = _as_applied(decisions[p[2]], p[3], plan)
                            if plan is None:  # as the live agent's refusal at the safe point
                                policy.resolve(p[3], "refused")
                            else:
                                applied += plan.estimated_saving_bytes
                                policy.resolve(p[3], "applied")
                    while oi < len(oom_need) and oom_need[oi][0] <= time_s:
                        saved_at_oom.append(applied)
                        oi += 1
                    if rec_free is not None and (min_rec is None or rec_free < min_rec):
                        min_rec = rec_free
                    if in_use is None or not budget:
                        continue
                    now = in_use + back - applied
                    peak_since = max(peak_since, now)  # while a decision waits (reset at one)
                    free = (budget - now) / budget
                    if min_free is None or free < min_free:
                        min_free = free
                    model.in_use_bytes = now
                    model.budget_bytes = budget
                    reading = Reading.of(
                        time_s,
                        step,
                        kind,
                        reserved_unallocated_bytes=slack,
                        budget_bytes=budget,
                        in_use_bytes=now,
                        free_fraction=free,
                    )
                    last_step, last_time = step, time_s
                    for ev in evaluate(reading, model):
                        if isinstance(ev, Forecast):
                            open_forecast[ev.index] = len(forecasts)
                            forecasts.append(
                                ReplayForecast(
                                    ev.step,
                                    ev.predicted_step,
                                    ev.free_fraction,
                                    ev.slope_bytes_per_step,
                                    None,
                                    None,
                                )
                            )
                        elif isinstance(ev, ForecastOutcome):
                            _judge(forecasts, open_forecast, ev)
                        elif isinstance(ev, ThresholdCrossing):
                            crossings.append((ev.step, ev.kind, ev.free_fraction))
                        elif isinstance(ev, NoActionAvailable):
                            refusals.append(
                                (ev.step, tuple((r.action, r.reason) for r in ev.refusals))
                            )
                        elif isinstance(ev, Decision):
                            decisions.append(
                                ReplayDecision(
                                    ev.step,
                                    ev.time_s,
                                    ev.action,
                                    ev.target,
                                    ev.estimated_saving_bytes,
                                    ev.free_fraction,
                                    "advised" if ev.advisory else "modelled",
                                    ev.reason,
                                    ev.expected_error,
                                )
                            )
                            if not ev.advisory:
                                # applied at the safe point closing its step (the next
                                # one, when the live run's had already acted by then)
                                at = ev.step + int(ev.time_s >= done.get(ev.step, math.inf))
                                pending.append((at, done.get(at), len(decisions) - 1, ev))
                                peak_since = now
        while oi < len(oom_need):
            saved_at_oom.append(applied)
            oi += 1
        ended = policy.end_forecast(last_step, last_time)
        if ended is not None:
            _judge(forecasts, open_forecast, ended)
        duration = time.perf_counter() - t0
        return ReplayResult(
            info.id,
            info.name,
            repr(policy),
            n,
            tuple(decisions),
            tuple(refusals),
            tuple(_recorded(events)),
            tuple(crossings),
            min_free,
            min_rec,
            tuple(e.step for e in ooms),
            tuple(s >= need for s, (_, need) in zip(saved_at_oom, oom_need, strict=True)),
            duration,
            tuple(forecasts),
        )
    finally:
        if owned:
            history.close()


def _in_force_from(event: Any) -> tuple[int, float | None]:
    """When a live ``action`` event's effect is in the readings: from the next step's readings
    (the agent applies at the step boundary and counts the step after it), and from the moment
    it was done (its start, the event's time, plus its duration: the agent accounts the model
    again right then, so a reading of the same step after it sees it; ``None`` when the event
    has no duration). A reading of its step taken while it ran still sees the model before it."""
    duration = event.data.get("duration_s")
    return event.step, (event.time_s + float(duration) if duration is not None else None)


def _apply_at_safe_point(model: _Model, decision: Any, in_use_bytes: int) -> Any:
    """Apply ``decision`` to the modelled state as the live agent does at the safe point: planned
    again on ``in_use_bytes`` (the highest modelled in-use since the decision's reading: the
    live agent's context there is its accounting at the step boundary, the step's gradients
    alive) or the in-use it was planned for (``planning_in_use_bytes``), the higher. Returns
    the :class:`~edo_monitor.decide.plans.Plan` applied, or ``None`` when the plan is refused
    now (or is on another target): nothing changes, as a live refusal. ``decision``: a
    :class:`~edo_monitor.decide.policy_events.Decision`."""
    model.in_use_bytes = max(in_use_bytes, decision.planning_in_use_bytes or 0)
    plan = model(decision.action)
    if not isinstance(plan, Plan) or plan.target != decision.target:
        return None
    model.commit(plan)
    return plan


def _as_applied(row: ReplayDecision, decision: Any, plan: Any) -> ReplayDecision:
    """A replayed decision's row once its safe point came: ``refused`` without a ``plan``; else
    the applied plan's saving, and its reason after the decision's where it was planned
    otherwise there (the live run's action event says the same of its action)."""
    if plan is None:
        return dataclasses.replace(row, status="refused")
    reason = row.reason
    if plan.reason != decision.plan.reason:
        reason += f"; applied as: {plan.reason}"
    return dataclasses.replace(row, saving_bytes=plan.estimated_saving_bytes, reason=reason)


def _in_force(effect: tuple[Any, ...], step: int, time_s: float) -> bool:
    """Whether an action's ``(step, time, ...)`` is in force at a reading: a later step, or at
    or after its time."""
    return step > effect[0] or (effect[1] is not None and time_s >= effect[1])


def _judge(forecasts: list[ReplayForecast], open_: dict[int, int], outcome: Any) -> None:
    """Write a :class:`~edo_monitor.decide.policy.ForecastOutcome` into its forecast's row."""
    i = open_.pop(outcome.forecast.index, None)
    if i is not None:
        forecasts[i] = dataclasses.replace(
            forecasts[i], came_true=outcome.came_true, crossing_step=outcome.crossing_step
        )


def _recorded(events: Sequence[Any]) -> list[ReplayDecision]:
    """What the live run did: each of its decisions and each action outcome, in order.

    An outcome (``action``, ``action_refused``, ``action_failed``, ``decision_expired``) is paired
    with its own decision: the oldest open one of the same action, decided at the step the
    outcome says (``decided_at_step``) and on the same target where both say; the row is then at
    the step and time of the outcome (where it was applied), with the decision's free fraction
    and reason. An outcome with no decision of its own (on a rank of a job, one the ranks agreed
    on that this rank's policy did not decide) is a row of its own, its reason the event's. A
    decision with no outcome stays at its own step (``"pending"``, or ``"advised"``).
    """
    outcomes = {
        "action": "applied",
        "action_refused": "refused",
        "action_failed": "failed",
        "decision_expired": "expired",
    }
    out: list[ReplayDecision] = []
    open_: list[int] = []
    for e in events:
        if e.kind == "decision":
            mode = e.data.get("mode")
            status = "advised" if mode == "advise" else "pending"
            reason = str(e.data.get("reason") or "")
            out.append(_from_event(e, None, e.data.get("free_fraction"), status, reason, e.step))
            if mode != "advise":
                open_.append(len(out) - 1)
        elif e.kind in outcomes:
            saved = int(e.data.get("saved_bytes") or 0) if e.kind == "action" else None
            i = _own_decision(out, open_, e)
            if i is not None:
                open_.remove(i)
                out[i] = dataclasses.replace(
                    out[i],
                    step=e.step,
                    time_s=e.time_s,
                    status=outcomes[e.kind],
                    saving_bytes=saved,
                    target=str(e.data.get("target") or out[i].target),
                )
                continue
            out.append(_from_event(e, saved, None, outcomes[e.kind], _no_decision_reason(e)))
    return out


def _from_event(
    e: Any,
    saving_bytes: int | None,
    free_fraction: float | None,
    status: str,
    reason: str,
    decided_step: int | None = None,
) -> ReplayDecision:
    """A recorded decision or outcome event ``e`` as a :class:`ReplayDecision`: its step, time,
    action, target and expected error, with the rest given."""
    return ReplayDecision(
        e.step,
        e.time_s,
        str(e.data.get("action")),
        str(e.data.get("target") or ""),
        saving_bytes,
        free_fraction,
        status,
        reason,
        e.data.get("expected_error"),
        decided_step,
    )


def _own_decision(out: Sequence[ReplayDecision], open_: Sequence[int], e: Any) -> int | None:
    """The index in ``out`` of outcome event ``e``'s own open decision (see :func:`_recorded`),
    or ``None``."""
    action, target = e.data.get("action"), e.data.get("target")
    step = e.data.get("decided_at_step")
    for i in open_:
        d = out[i]
        if action is not None and d.action != action:
            continue
        if step is not None and d.decided_step != step:
            continue
        if target and d.target and d.target != target:
            continue
        return i
    return None


def _no_decision_reason(e: Any) -> str:
    """The reason of an outcome with no decision on its run."""
    if e.data.get("coordinated"):
        by = e.data.get("proposed_by_rank")
        agreed = "agreed by the ranks" + (f", proposed by rank {by}" if by is not None else "")
        why = str(e.data.get("reason") or "")
        return f"{agreed}: {why}" if why and e.kind != "action" else agreed
    return str(e.data.get("reason") or "no decision recorded on this run")
