"""Foresight (issue 14, item 2): the per-step trend, the policy's forecast and its outcome on
hand-made readings; a real watch() loop that leaks memory step by step; replay with forecasting.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import edo_monitor
from edo_monitor.decide.plans import Plan, Refusal
from edo_monitor.decide.policy import Policy
from edo_monitor.decide.policy_events import (
    FORECAST_GRACE_STEPS,
    FORECAST_MIN_STEPS,
    Decision,
    Forecast,
    ForecastOutcome,
    NoActionAvailable,
    ThresholdCrossing,
)
from edo_monitor.decide.trend import StepSeries, fit_trend, student_t_tail
from edo_monitor.errors import ConfigError
from edo_monitor.hindsight.replay import parse_policy, replay
from edo_monitor.probes.readings import Reading
from edo_monitor.store.history import History
from edo_monitor.surfaces.cli import app

MiB = 1 << 20
BUDGET = 100 * MiB


def reading(step: int, in_use: float, *, t: float | None = None, **categories: int) -> Reading:
    in_use = int(in_use)
    return Reading(
        time_s=1000.0 + step if t is None else t,
        step=step,
        device_kind="cpu-budget",
        budget_bytes=BUDGET,
        in_use_bytes=in_use,
        free_fraction=(BUDGET - in_use) / BUDGET,
        **categories,
    )


def run(policy: Policy, readings: list[Reading], planner=None) -> list:
    return [e for r in readings for e in policy.evaluate(r, planner)]


def of(kind: type, events: list) -> list:
    return [e for e in events if isinstance(e, kind)]


def first_step_below_floor(readings: list[Reading], floor: float = 0.20) -> int:
    return next(r.step for r in readings if (r.free_fraction or 1.0) < floor)


# ---------------------------------------------------------------- the trend


def test_step_series_keeps_each_steps_highest_over_the_window() -> None:
    series = StepSeries(3)
    assert series.add(1, 10) and series.add(1, 30) and not series.add(1, 20)
    assert not series.add(0, 99)  # an older step changes nothing
    for step, value in ((2, 5), (4, 7), (5, 8)):
        series.add(step, value)
    # step 1 is more than 3 steps before step 5: dropped; the gap at step 3 stays a gap
    assert series.points() == [(2, 5), (4, 7), (5, 8)]
    with pytest.raises(ConfigError, match="window_steps=0"):
        StepSeries(0)


def test_fit_trend_of_a_line_a_level_shift_and_too_few_points() -> None:
    line = fit_trend([(s, 1000 + 250 * s) for s in range(5, 25)])
    assert line is not None
    assert line.slope_per_step == pytest.approx(250)
    assert line.at(40) == pytest.approx(11_000)
    assert line.t_statistic > 1e9 and line.line_sse < line.shift_sse
    assert line.first_step_above(11_000, 24) == 41  # 11,000 at step 40 is not above it
    assert line.is_growth(min_points=8, max_p_value=1e-6) and line.p_value == 0
    # a jump then flat: a level shift fits exactly, the line does not: not growth
    shift = fit_trend([(s, 1000 if s < 18 else 5000) for s in range(30)])
    # as a line, a "significant" slope: only the level-shift comparison turns it down
    assert shift is not None and shift.slope_per_step > 0 and shift.p_value < 1e-6
    assert shift.shift_sse == pytest.approx(0, abs=1e-6)
    assert shift.line_sse > 1e6
    assert not shift.is_growth(min_points=8, max_p_value=1e-6)
    assert fit_trend([(1, 5), (2, 6)]) is None
    assert fit_trend([]) is None


def test_student_t_tail_matches_closed_forms() -> None:
    for t in (0.3, 1.0, 2.5, 10.0, 100.0):
        # one degree of freedom: Cauchy; two: a closed form; many: the normal distribution
        assert student_t_tail(t, 1) == pytest.approx(0.5 - math.atan(t) / math.pi, rel=1e-12)
        assert student_t_tail(t, 2) == pytest.approx(0.5 * (1 - t / math.sqrt(2 + t * t)))
    assert student_t_tail(3.0, 10**6) == pytest.approx(0.5 * math.erfc(3 / math.sqrt(2)), 1e-4)
    assert student_t_tail(0.0, 7) == 0.5 and student_t_tail(-2.0, 7) > 0.5
    assert student_t_tail(math.inf, 7) == 0.0
    # the heavy tail of a short window: t >= 5 is 30 times likelier with 6 degrees than 19
    assert student_t_tail(5.0, 6) > 30 * student_t_tail(5.0, 19)


# ---------------------------------------------------------------- forecasting on readings


@pytest.mark.parametrize(
    ("start_mib", "slope_mib", "forecast_steps"),
    [(50, 1.0, 5), (30, 1.7, 10), (62, 0.37, 8), (10, 3.3, 3)],
)
def test_linear_growth_predicts_the_crossing_step(
    start_mib: float, slope_mib: float, forecast_steps: int
) -> None:
    readings = [reading(s, (start_mib + slope_mib * s) * MiB) for s in range(1, 200)]
    crossing = first_step_below_floor(readings)
    events = run(Policy(forecast_steps=forecast_steps, mode="observe"), readings)
    (forecast,) = of(Forecast, events)
    assert abs(forecast.predicted_step - crossing) <= 1
    assert forecast.slope_bytes_per_step == pytest.approx(slope_mib * MiB)
    # made as soon as the crossing was within forecast_steps and the window held enough steps
    assert forecast.step == max(FORECAST_MIN_STEPS, crossing - forecast_steps)
    assert forecast.free_fraction >= 0.20
    (outcome,) = of(ForecastOutcome, events)
    assert outcome.forecast == forecast
    assert outcome.came_true is True and outcome.crossing_step == crossing
    assert outcome.lead_steps == crossing - forecast.step
    # the outcome follows the crossing it predicted, in the same reading
    crossing_event = of(ThresholdCrossing, events)[0]
    assert events.index(outcome) == events.index(crossing_event) + 1


@pytest.mark.parametrize("seed", range(40))
def test_flat_and_noisy_flat_never_forecast(seed: int) -> None:
    rng = random.Random(seed)
    level = rng.uniform(0.70, 0.78) * BUDGET  # free 22 % .. 30 %: just above the floor
    noise = rng.uniform(0.001, 0.02) * BUDGET
    noisy = [reading(s, level + rng.uniform(-noise, noise)) for s in range(1, 400)]
    noisy = [r for r in noisy if (r.free_fraction or 0) >= 0.20]
    flat = [reading(s, level) for s in range(1, 400)]
    for readings in (flat, noisy):
        policy = Policy(forecast_steps=50, mode="observe")
        assert of(Forecast, run(policy, readings)) == []


def test_a_sawtooth_within_steps_does_not_fool_it() -> None:
    # ten readings a step: in-use climbs 40 % of the budget in forward and falls in backward
    def sawtooth(base):
        return [
            reading(s, base(s) + (0.4 * BUDGET) * min(i, 10 - i) / 5, t=1000 + s + i / 10)
            for s in range(1, 150)
            for i in range(10)
        ]

    steady = sawtooth(lambda s: 0.30 * BUDGET)  # the step's highest: 70 %, free 30 % every step
    assert of(Forecast, run(Policy(forecast_steps=20, mode="observe"), steady)) == []
    # the same sawtooth over a real trend: the forecast follows the steps' highest values
    growing = sawtooth(lambda s: 0.30 * BUDGET + s * 0.2 * MiB)
    crossing = first_step_below_floor(growing)  # the first step whose highest reading crosses
    forecast = of(Forecast, run(Policy(forecast_steps=10, mode="observe"), growing))[0]
    assert abs(forecast.predicted_step - crossing) <= 1
    assert forecast.step == crossing - 10
    assert forecast.slope_bytes_per_step == pytest.approx(0.2 * MiB)


def test_a_one_off_jump_near_the_floor_is_not_forecast() -> None:
    # flat at free 40 %, one jump to free 22 % at step 30 (a bigger batch bucket), flat again
    readings = [reading(s, (0.60 if s < 30 else 0.78) * BUDGET) for s in range(1, 120)]
    assert of(Forecast, run(Policy(forecast_steps=50, mode="observe"), readings)) == []


def test_no_forecast_before_enough_steps_nor_without_forecast_steps() -> None:
    steep = [reading(s, (40 + 5 * s) * MiB) for s in range(1, 12)]  # crosses at step 9
    (forecast,) = of(Forecast, run(Policy(forecast_steps=50, mode="observe"), steep))
    # within 50 steps from the start, but made once the window holds 8 steps, one step ahead
    assert (forecast.step, forecast.predicted_step) == (FORECAST_MIN_STEPS, 9)
    events = run(Policy(forecast_steps=50, mode="observe"), steep[: FORECAST_MIN_STEPS - 1])
    assert events == []
    # a trend fitted over 9 steps is not extrapolated 20 steps ahead
    slow = [reading(s, (60 + 0.5 * s) * MiB) for s in range(1, 60)]  # crosses at step 41
    (forecast,) = of(Forecast, run(Policy(forecast_steps=40, mode="observe"), slow))
    assert forecast.step == 21 and forecast.window_first_step == 1
    growing = [reading(s, (30 + 0.5 * s) * MiB) for s in range(1, 200)]
    default = run(Policy(), growing, {})
    assert of(Forecast, default) == [] and of(ForecastOutcome, default) == []
    assert [e.kind for e in of(ThresholdCrossing, default)] == ["below_floor"]


def test_step_values_between_sparse_readings_let_the_trend_forecast() -> None:
    """Steps faster than the sampling interval: a reading every 4th step only. The readings
    alone leave at most 6 points in the 20-step window (fewer than FORECAST_MIN_STEPS: never a
    forecast, the crossing comes unannounced); with each step's value observed at its boundary
    the trend is whole and the forecast comes at the first reading that sees the crossing
    within forecast_steps."""
    line = {s: (40 + 2 * s) * MiB for s in range(1, 40)}  # crosses the 20 % floor at step 21
    sparse = [reading(s, line[s]) for s in range(4, 40, 4)]
    assert first_step_below_floor(sparse) == 24  # the first reading below it
    alone = run(Policy(forecast_steps=10, mode="observe"), sparse)
    assert of(Forecast, alone) == []
    policy = Policy(forecast_steps=10, mode="observe")
    events = []
    for r in sparse:
        for s in range(r.step - 3, r.step + 1):
            policy.observe_step(s, line[s])
        events += policy.evaluate(r)
    (forecast,) = of(Forecast, events)
    assert (forecast.step, forecast.predicted_step) == (12, 21)
    assert forecast.slope_bytes_per_step == pytest.approx(2 * MiB)


def test_a_forecast_that_does_not_come_true_is_judged_false() -> None:
    # growth that levels off just above the floor
    readings = [reading(s, min(60 + 1.0 * s, 79.5) * MiB) for s in range(1, 80)]
    events = run(Policy(forecast_steps=5, mode="observe"), readings)
    (forecast,) = of(Forecast, events)
    assert forecast.predicted_step == 21  # 60 + 21 = 81 MiB: free 19 %
    (outcome,) = of(ForecastOutcome, events)
    assert outcome.came_true is False and outcome.crossing_step is None
    assert outcome.step == forecast.predicted_step + FORECAST_GRACE_STEPS + 1
    assert of(ThresholdCrossing, events) == []


class Planner:
    """A planner of one table: ``cache_embedding`` frees what gets back to the re-arm level at
    the in-use it is asked for (as the real action sizes itself); records what it was asked."""

    def __init__(self, in_use: int, asked: list[int]) -> None:
        self.in_use = in_use
        self.asked = asked

    def at_in_use(self, in_use_bytes: int) -> Planner:
        return Planner(in_use_bytes, self.asked)

    def __call__(self, name: str) -> Plan | Refusal:
        if name != "cache_embedding":
            return Refusal(name, "", "not this one")
        self.asked.append(self.in_use)
        need = math.ceil(self.in_use - 0.75 * BUDGET)
        if need <= 0:
            return Refusal(name, "emb", "nothing to free")
        return Plan(name, "emb", need, f"keep fewer rows (frees {need})")


def test_forecast_decides_ahead_sized_for_the_horizon_and_free_never_crosses() -> None:
    """Auto mode, a simulated run: each applied decision takes its saving off later readings."""
    policy = Policy(forecast_steps=10, cooldown_steps=3)
    asked: list[int] = []
    saved = 0
    events: list = []
    frees = []
    for step in range(1, 120):
        in_use = int((40 + 0.5 * step) * MiB) - saved
        r = reading(step, in_use)
        frees.append(r.free_fraction)
        new = policy.evaluate(r, Planner(in_use, asked))
        events += new
        for d in of(Decision, new):
            assert policy.resolve(d, "applied") is None
            saved += d.estimated_saving_bytes
    assert min(frees) >= 0.20
    assert of(ThresholdCrossing, events) == []
    forecasts = of(Forecast, events)
    decisions = of(Decision, events)
    assert forecasts and decisions
    first = decisions[0]
    assert first.forecast == forecasts[0] and first.step == forecasts[0].step
    assert first.reason.startswith("free ") and "predicted below the 20% floor in" in first.reason
    assert "+512 KiB/step" in first.reason
    # the plan was asked for the in-use predicted 10 steps ahead, and sized for it
    assert first.planning_in_use_bytes == forecasts[0].horizon_in_use_bytes == asked[0]
    assert asked[0] == int((40 + 0.5 * (first.step + 10)) * MiB)
    assert first.estimated_saving_bytes == math.ceil(asked[0] - 0.75 * BUDGET)
    # savings are added back: the trend stays the workload's, every forecast came true (judged
    # on in-use without the actions taken since), the last is still open
    outcomes = of(ForecastOutcome, events)
    assert [o.came_true for o in outcomes] == [True] * len(outcomes)
    assert all(f.slope_bytes_per_step == pytest.approx(0.5 * MiB) for f in forecasts)
    assert len(outcomes) == len(forecasts) - 1
    ended = policy.end_forecast(120, 2000.0)
    assert ended is not None and ended.came_true is None and ended.forecast == forecasts[-1]
    assert policy.end_forecast(120, 2000.0) is None


def test_forecast_in_advise_mode_and_without_an_action() -> None:
    readings = [reading(s, (40 + 0.5 * s) * MiB) for s in range(1, 90)]
    advise = run(Policy(forecast_steps=10, mode="advise"), readings, Planner(0, []))
    first = of(Decision, advise)[0]
    assert first.advisory and first.forecast is not None
    nothing = run(Policy(forecast_steps=10), readings, {})
    (none,) = [e for e in nothing if isinstance(e, NoActionAvailable) and e.forecast]
    assert none.step == of(Forecast, nothing)[0].step


def test_grow_is_held_back_while_a_crossing_is_forecast() -> None:
    """A cache shrunk ahead of the crossing is not grown back into it."""
    plans = {"cache_embedding": Plan("cache_embedding", "emb", 10 * MiB, "shrink")}
    plans["grow_cache"] = Plan("grow_cache", "emb", -5 * MiB, "grow")
    readings = [reading(s, (20 + 0.3 * s) * MiB) for s in range(1, 120)]
    without = run(Policy(grow_after_readings=1, cooldown_steps=0), readings, plans)
    assert [d.action for d in of(Decision, without)][:1] == ["grow_cache"]
    with_forecast = run(
        Policy(grow_after_readings=1, cooldown_steps=0, forecast_steps=30), readings[:60], plans
    )
    # free 58 % .. 40 %: calm, but 30 steps ahead the trend leaves less than re-arm + margin
    # only once in-use reaches 59 MiB (step 13 on): the grow decisions stop there
    grows = [d.step for d in of(Decision, with_forecast) if d.action == "grow_cache"]
    assert grows and max(grows) < 60 - 30


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"forecast_steps": 0}, r"forecast_steps=0; expected an int >= 1 or None"),
        ({"forecast_steps": -3}, r"forecast_steps=-3"),
        ({"forecast_steps": 2.5}, r"forecast_steps=2\.5"),
        ({"forecast_steps": True}, r"forecast_steps=True"),
        ({"forecast_steps": "5"}, r"forecast_steps='5'"),
        ({"forecast_window_steps": 7}, r"forecast_window_steps=7; expected an int >= 8"),
        ({"forecast_window_steps": None}, r"forecast_window_steps=None"),
    ],
)
def test_forecast_arguments_are_checked(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Policy(**kwargs)


def test_policy_strings_and_repr() -> None:
    assert parse_policy("forecast_steps=12,forecast_window_steps=30") == {
        "forecast_steps": 12,
        "forecast_window_steps": 30,
    }
    with pytest.raises(ConfigError, match=r"forecast_steps='soon'.*int"):
        parse_policy("forecast_steps=soon")
    assert "forecast" not in repr(Policy())
    assert repr(Policy(forecast_steps=12)).endswith("forecast_steps=12, forecast_window_steps=20)")


# ---------------------------------------------------------------- a real loop that leaks


ROWS, DIM = 20_000, 32
TABLE_BYTES = ROWS * DIM * 4 * 4 + 4  # weight, grad, Adam's two states, the step counter
LEAK_BUDGET = 15_000_000


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.EmbeddingBag(ROWS, DIM, mode="mean")
        self.head = nn.Linear(DIM, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def leaky_run(
    db: Path, policy: Policy, steps: int = 40, interval_s: float = 0.02, sleep_s: float = 0.03
) -> int:
    """A real loop that keeps every step's loss with its graph (its saved tensors stay alive:
    about 41 KB more in use per step), CPU budget; returns the run id. The defaults give a
    reading or two a step (the sampler runs every 20 ms, a step sleeps 30 ms)."""
    torch.manual_seed(0)
    model = TinyModel()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    kept = []
    with edo_monitor.watch(
        model, opt, db=str(db), budget=LEAK_BUDGET, policy=policy, interval_s=interval_s
    ) as monitor:
        for _ in range(steps):
            x = torch.randint(0, ROWS, (256, 4), generator=gen)
            loss = model(x).square().mean()
            loss.backward(retain_graph=True)
            kept.append(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            time.sleep(sleep_s)
    return monitor.run_id


@pytest.fixture(scope="module")
def leaky(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int]:
    db = tmp_path_factory.mktemp("forecast") / "f.db"
    ladder = ["offload_embedding"]
    forecast = leaky_run(db, Policy(ladder=ladder, forecast_steps=10))
    observed = leaky_run(db, Policy(ladder=ladder, mode="observe"))
    return db, forecast, observed


def test_a_real_leak_is_forecast_and_acted_on_before_the_crossing(
    leaky: tuple[Path, int, int],
) -> None:
    db, forecast_run, observed_run = leaky
    with History(db) as h:
        events = h.events(forecast_run)
        series = h.samples(forecast_run, columns=["step", "free_fraction"], max_points=None)
        samples = list(series.rows())
        crossing = h.events(observed_run, kind="threshold_crossed")[0]
    kinds = [e.kind for e in events]
    assert "threshold_crossed" not in kinds
    assert min(s["free_fraction"] for s in samples) >= 0.20
    forecast = next(e for e in events if e.kind == "forecast")
    decision = next(e for e in events if e.kind == "decision")
    action = next(e for e in events if e.kind == "action")
    outcome = next(e for e in events if e.kind == "forecast_outcome")
    # the same loop without the tuner crossed the floor at crossing.step; the forecast saw it
    # coming (the growth is the kept graphs: activations) and the action came before it
    assert forecast.data["forecast"] == 1 and forecast.step < crossing.step
    assert abs(forecast.data["predicted_step"] - crossing.step) <= 2
    assert forecast.data["category_slopes"]["activations_bytes"] == pytest.approx(
        forecast.data["slope_bytes_per_step"], rel=0.05
    )
    assert "mostly activations" in forecast.message
    assert (
        decision.data["forecast"] == 1
        and "predicted below the 20% floor" in decision.data["reason"]
    )
    assert action.data["action"] == "offload_embedding"
    assert action.data["saved_bytes"] == TABLE_BYTES and action.step < crossing.step
    # judged on in-use with the offload added back: it came true, about where the observed
    # run crossed
    assert outcome.data["forecast"] == 1 and outcome.data["came_true"] is True
    assert abs(outcome.data["crossing_step"] - crossing.step) <= 2
    assert outcome.data["lead_steps"] == outcome.data["crossing_step"] - forecast.step > 0
    assert outcome.data["saved_bytes"] == TABLE_BYTES


def test_steps_faster_than_the_sampling_interval_are_still_forecast(
    tmp_path: Path, leaky: tuple[Path, int, int]
) -> None:
    """A reading every 0.3 s and steps of at least 30 ms: up to 10 steps between readings. On a
    quiet machine the readings alone put 2 or 3 points in the 20-step window, and a forecast
    never came before the agent fed each step's peak to the policy at its boundary. The
    forecast must come before the crossing the same loop has without the tuner (the `leaky`
    fixture's observed run)."""
    db, _, observed_run = leaky
    with History(db) as h:
        crossing = h.events(observed_run, kind="threshold_crossed")[0]
    fast = tmp_path / "fast.db"
    run_id = leaky_run(
        fast,
        Policy(ladder=["offload_embedding"], forecast_steps=20),
        interval_s=0.3,
        sleep_s=0.03,
    )
    with History(fast) as h:
        kinds = [e.kind for e in h.events(run_id)]
        forecast = h.events(run_id, kind="forecast")[0]
        action = h.events(run_id, kind="action")[0]
    assert "threshold_crossed" not in kinds
    assert forecast.step < crossing.step and action.step < crossing.step
    assert action.data["saved_bytes"] == TABLE_BYTES


def test_replay_with_forecast_acts_before_the_crossing_the_run_had(
    leaky: tuple[Path, int, int],
) -> None:
    db, _, observed_run = leaky
    with History(db) as h:
        crossing = h.events(observed_run, kind="threshold_crossed")[0]
    plain = replay(db, observed_run, "ladder=offload_embedding")
    assert plain.decisions[0].step == crossing.step and plain.forecasts == ()
    ahead = replay(db, observed_run, "ladder=offload_embedding,forecast_steps=10")
    first = ahead.decisions[0]
    assert first.action == "offload_embedding" and first.step < crossing.step
    assert first.saving_bytes == TABLE_BYTES
    assert "predicted below the 20% floor" in first.reason
    assert ahead.crossings == () and ahead.min_free_fraction >= 0.20
    (forecast,) = ahead.forecasts
    assert forecast.step == first.step and forecast.came_true is True
    assert abs(forecast.crossing_step - crossing.step) <= 1
    # the CLI prints the forecast beside the decisions
    out = CliRunner().invoke(
        app,
        [
            "replay",
            str(observed_run),
            "--db",
            str(db),
            "--policy",
            "ladder=offload_embedding,forecast_steps=10",
        ],
    )
    assert out.exit_code == 0, out.output
    assert f"replay: forecast at step {forecast.step}" in out.output
    assert f"came true at step {forecast.crossing_step}" in out.output
