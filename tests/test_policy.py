"""Policy: validation, hysteresis, ladder, cooldown, modes on hand-made readings; one real loop."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from edo_monitor.actions import ACTIONS, ActionContext, ActivationRecorder, Plan, Refusal
from edo_monitor.decide.policy import Policy
from edo_monitor.decide.policy_events import (
    GROW_LOOKBACK_STEPS,
    Decision,
    NoActionAvailable,
    ThresholdCrossing,
)
from edo_monitor.decide.ranking import (
    EXPECTED_ERROR_FLOOR,
    lossy_score,
    make_planner,
    rank_lossy_plans,
)
from edo_monitor.errors import ConfigError
from edo_monitor.measure.accounting import account
from edo_monitor.probes.readings import Reading

MiB = 1 << 20


def reading(step: int, free: float | None, kind: str = "cpu-budget", slack: int | None = None):
    return Reading(
        time_s=1000.0 + step,
        step=step,
        device_kind=kind,
        free_fraction=free,
        reserved_unallocated_bytes=slack,
    )


PLANS = {
    "release_cache": Plan("release_cache", "allocator", 300 * MiB, "slack"),
    "offload_embedding": Plan("offload_embedding", "emb", 100 * MiB, "largest table"),
    "checkpoint_activations": Plan("checkpoint_activations", "blocks.0", 10 * MiB, "blocks"),
    "compress_embedding": Plan("compress_embedding", "emb2", 50 * MiB, "bf16"),
}


def kinds(events):
    out = []
    for e in events:
        if isinstance(e, ThresholdCrossing):
            out.append(e.kind)
        elif isinstance(e, Decision):
            out.append(f"{e.mode}:{e.action}")
        else:
            out.append("none")
    return out


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_free_fraction": 0.0}, r"min_free_fraction=0\.0 .*\(0, 1\)"),
        ({"min_free_fraction": 1.0}, r"min_free_fraction=1\.0"),
        ({"min_free_fraction": True}, r"min_free_fraction=True"),
        ({"rearm_free_fraction": 1.5}, r"rearm_free_fraction=1\.5"),
        ({"min_free_fraction": 0.3, "rearm_free_fraction": 0.25}, r"above min_free_fraction=0\.3"),
        ({"rearm_free_fraction": 0.2}, r"rearm_free_fraction=0\.2"),
        ({"cooldown_steps": -1}, r"cooldown_steps=-1; expected an int >= 0"),
        ({"cooldown_steps": 1.5}, r"cooldown_steps=1\.5"),
        ({"mode": "yolo"}, r"mode='yolo' .*auto, advise, observe"),
        ({"ladder": ["offload_embedding", "teleport"]}, r"'teleport' is not known.*release_cache"),
        ({"ladder": "offload_embedding"}, r"ladder='offload_embedding'"),
        ({"ladder": ["release_cache", "release_cache"]}, r"twice"),
        ({"ladder": ["compress_embedding"]}, r"lossy; pass allow_lossy=True"),
        # a rung that uses memory was taken: a policy that never saved any
        ({"ladder": ["grow_cache"]}, r"'grow_cache' gives memory back .*: release_cache, cache_"),
        # an empty ladder was taken: a policy that never acts, silently
        ({"ladder": []}, r"ladder=\[\] holds no action; .*mode='observe'"),
        ({"ladder": ()}, r"ladder=\(\) holds no action"),
        ({"allow_lossy": "yes"}, r"allow_lossy='yes'"),
        ({"on_pressure": 3}, r"on_pressure=3"),
        ({"release_cache_min_bytes": "lots"}, r"release_cache_min_bytes='lots'"),
    ],
)
def test_invalid_arguments_raise_config_error_naming_the_value(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        Policy(**kwargs)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(("floor", "rearm"), [(0.2, 0.25), (0.3, 0.35), (0.5, 0.55), (0.97, 0.985)])
def test_the_default_rearm_level_follows_the_floor(floor: float, rearm: float) -> None:
    """Regression: ``Policy(min_free_fraction=0.3)`` was refused, naming a re-arm level of 0.25
    the user never gave (also ``replay --policy min_free_fraction=0.3``)."""
    policy = Policy(min_free_fraction=floor)
    assert policy.rearm_free_fraction == pytest.approx(rearm)


def test_default_ladders() -> None:
    assert Policy().ladder == (
        "release_cache",
        "cache_embedding",
        "spill_embedding",
        "offload_embedding",
        "checkpoint_activations",
    )
    assert Policy(allow_lossy=True).ladder[-2:] == ("compress_embedding", "share_embedding")
    assert Policy(release_cache_min_bytes="1MiB").release_cache_min_bytes == MiB
    assert all(name in ACTIONS for name in Policy(allow_lossy=True).ladder)


def test_the_docstring_names_the_default_ladders_in_order() -> None:
    """The ``ladder`` argument's text lists the default rungs as the code has them (it left out
    ``spill_embedding``)."""
    import re

    doc = (Policy.__doc__ or "") + (Policy.__init__.__doc__ or "")
    text = doc[doc.index("ladder: action names") :].split("on_pressure:")[0]
    named = [n for n in re.findall(r"``([a-z_]+)``", text) if n != "allow_lossy"]
    assert tuple(named) == Policy(allow_lossy=True).ladder
    assert "DEFAULT_LOSSLESS_LADDER" in text and "DEFAULT_LOSSY_LADDER" in text


# ---------------------------------------------------------------- hysteresis


def test_crossings_use_hysteresis() -> None:
    p = Policy(mode="observe")
    seq = [0.5, 0.19, 0.1, 0.22, 0.24, 0.19, 0.25, 0.3, 0.18, None, 0.5]
    got = [kinds(p.evaluate(reading(i, f), PLANS)) for i, f in enumerate(seq)]
    assert got == [
        [],
        ["below_floor"],
        [],
        [],  # between floor and rearm: still under pressure
        [],
        [],
        ["above_rearm"],  # rearm is inclusive
        [],
        ["below_floor"],
        [],  # no free_fraction: nothing
        ["above_rearm"],
    ]
    crossing = p.evaluate(reading(20, 0.05), PLANS)[0]
    assert crossing.threshold_fraction == 0.20 and crossing.free_fraction == 0.05
    assert crossing.step == 20 and crossing.time_s == 1020.0


# ---------------------------------------------------------------- decisions


def test_decides_at_the_crossing_reading_skipping_release_cache_in_cpu_budget_mode() -> None:
    p = Policy()
    events = p.evaluate(reading(7, 0.1), PLANS)
    assert kinds(events) == ["below_floor", "auto:offload_embedding"]
    d = events[1]
    assert (d.target, d.estimated_saving_bytes, d.step) == ("emb", 100 * MiB, 7)
    assert d.plan is PLANS["offload_embedding"] and "largest table" in d.reason
    assert p.pending is d
    # while pending: no second decision
    assert kinds(p.evaluate(reading(7, 0.1), PLANS)) == []
    assert kinds(p.evaluate(reading(8, 0.1), PLANS)) == []


def test_release_cache_on_cuda_only_when_slack_is_large() -> None:
    p = Policy(release_cache_min_bytes=64 * MiB)
    events = p.evaluate(reading(1, 0.1, "cuda", slack=500 * MiB), PLANS)
    assert kinds(events)[-1] == "auto:release_cache"
    p = Policy(release_cache_min_bytes=64 * MiB)
    events = p.evaluate(reading(1, 0.1, "cuda", slack=10 * MiB), PLANS)
    assert kinds(events)[-1] == "auto:offload_embedding"


def test_cooldown_then_next_rung_and_refusals_are_skipped() -> None:
    p = Policy(cooldown_steps=3)
    plans = dict(PLANS)
    d = p.evaluate(reading(10, 0.1), plans)[-1]
    p.resolve(d, "applied")
    # the table is gone now: offload refuses, checkpointing is next — after the cooldown
    plans["offload_embedding"] = Refusal("offload_embedding", "", "no embedding table left")
    assert kinds(p.evaluate(reading(11, 0.15), plans)) == []
    assert kinds(p.evaluate(reading(12, 0.15), plans)) == []
    assert kinds(p.evaluate(reading(13, 0.15), plans)) == ["auto:checkpoint_activations"]


def test_failed_action_is_not_retried_on_the_same_target_and_refused_costs_no_cooldown() -> None:
    p = Policy(cooldown_steps=100)
    d = p.evaluate(reading(1, 0.1), PLANS)[-1]
    p.resolve(d, "failed")
    d2 = p.evaluate(reading(2, 0.1), PLANS)[-1]
    assert d2.action == "checkpoint_activations"
    p.resolve(d2, "refused")
    d3 = p.evaluate(reading(3, 0.1), PLANS)[-1]
    assert d3.action == "checkpoint_activations"  # refused at apply time: may be tried again


def test_lossy_only_with_allow_lossy_and_after_lossless() -> None:
    refused = {
        "offload_embedding": Refusal("offload_embedding", "", "none left"),
        "checkpoint_activations": Refusal("checkpoint_activations", "", "no profile"),
        "compress_embedding": PLANS["compress_embedding"],
    }
    p = Policy()
    events = p.evaluate(reading(1, 0.1), refused)
    assert kinds(events) == ["below_floor", "none"]
    none = events[1]
    assert isinstance(none, NoActionAvailable)
    assert [r.action for r in none.refusals] == [
        "release_cache",
        "cache_embedding",
        "spill_embedding",
        "offload_embedding",
        "checkpoint_activations",
    ]
    assert "CPU-budget" in none.refusals[0].reason
    assert kinds(p.evaluate(reading(2, 0.1), refused)) == []  # reported once per episode
    p = Policy(allow_lossy=True)
    assert kinds(p.evaluate(reading(1, 0.1), refused))[-1] == "auto:compress_embedding"


def test_no_action_is_reported_again_when_its_reasons_change_not_their_figures() -> None:
    """Regression: a no-action was recorded once per episode, so a first, passing reason ("no
    activation profile yet") stayed the recorded one while the real one went unsaid."""

    def refused(why: str) -> dict[str, Refusal]:
        return {
            "offload_embedding": Refusal("offload_embedding", "", "none left"),
            "checkpoint_activations": Refusal("checkpoint_activations", "", why),
        }

    p = Policy()
    first = p.evaluate(reading(1, 0.1), refused("no activation profile yet"))
    assert kinds(first) == ["below_floor", "none"]
    assert kinds(p.evaluate(reading(2, 0.1), refused("no activation profile yet"))) == []
    (again,) = p.evaluate(reading(3, 0.1), refused("saves 1.5 MiB of 20 blocks, under 2 MiB"))
    assert isinstance(again, NoActionAvailable) and again.step == 3
    assert again.refusals[-1].reason == "saves 1.5 MiB of 20 blocks, under 2 MiB"
    # the same reason about other amounts is not news
    assert (
        kinds(p.evaluate(reading(4, 0.1), refused("saves 900 KiB of 8 blocks, under 2 MiB"))) == []
    )
    assert kinds(p.evaluate(reading(5, 0.1), refused("no activation profile yet"))) == ["none"]


# ---------------------------------------------------------------- ranking the lossy rungs

LOSSY_LADDER = [
    "offload_embedding",
    "compress_embedding_bf16",
    "compress_embedding_int8",
    "share_embedding",
]
NO_LOSSLESS = {"offload_embedding": Refusal("offload_embedding", "", "none left")}


def lossy(action: str, saving_mib: int, error: float | None, target: str = "emb") -> Plan:
    return Plan(action, target, saving_mib * MiB, f"{action} plan", expected_error=error)


def decide(plans: dict, ladder: list[str] | None = None, **kw: object) -> Decision:
    p = Policy(allow_lossy=True, ladder=ladder or LOSSY_LADDER, **kw)  # type: ignore[arg-type]
    event = p.evaluate(reading(1, 0.1), {**NO_LOSSLESS, **plans})[-1]
    assert isinstance(event, Decision), event
    return event


def test_a_smaller_saving_with_a_much_lower_error_wins_and_the_reverse() -> None:
    # bf16: 50 MiB at 2.3e-6 -> 2.3e13 bytes per unit of error; sharing: 400 MiB at 0.2 -> 2.1e9
    bf16 = lossy("compress_embedding_bf16", 50, 2.3e-6)
    noisy_share = lossy("share_embedding", 400, 0.2)
    d = decide({"compress_embedding_bf16": bf16, "share_embedding": noisy_share})
    assert d.plan is bf16 and d.expected_error == 2.3e-6
    assert "best of 2 lossy plans" in d.reason and "runner-up share_embedding on emb" in d.reason
    assert "50 MiB at 2.3e-06" in d.reason and "400 MiB at 0.2" in d.reason
    # sharing a table whose cold rows are nearly equal: 400 MiB at 1e-7 -> 4.2e15, it wins
    quiet_share = lossy("share_embedding", 400, 1e-7)
    d = decide({"compress_embedding_bf16": bf16, "share_embedding": quiet_share})
    assert d.plan is quiet_share and "runner-up compress_embedding_bf16" in d.reason
    # the ladder order does not matter when the scores differ
    d = decide(
        {"compress_embedding_bf16": bf16, "share_embedding": quiet_share},
        ladder=["share_embedding", "compress_embedding_bf16"],
    )
    assert d.plan is quiet_share


def test_ties_keep_ladder_order_and_zero_errors_use_the_floor() -> None:
    a = lossy("compress_embedding_bf16", 100, 0.01)
    b = lossy("share_embedding", 200, 0.02)  # the same bytes per unit of error
    assert lossy_score(a) == lossy_score(b)
    assert decide({"compress_embedding_bf16": a, "share_embedding": b}).plan is a
    assert (
        decide(
            {"compress_embedding_bf16": a, "share_embedding": b},
            ladder=["share_embedding", "compress_embedding_bf16"],
        ).plan
        is b
    )
    # an exact estimate divides by the floor, not by zero; two of them: the larger saving
    exact_small = lossy("compress_embedding_bf16", 10, 0.0)
    exact_big = lossy("share_embedding", 20, 0.0)
    assert lossy_score(exact_small) == 10 * MiB / EXPECTED_ERROR_FLOOR
    d = decide({"compress_embedding_bf16": exact_small, "share_embedding": exact_big})
    assert d.plan is exact_big
    # errors under the floor rank as the floor: saving alone decides
    tiny = lossy("compress_embedding_bf16", 10, 1e-15)
    assert lossy_score(tiny) == lossy_score(exact_small)


def test_plans_without_an_expected_error_rank_after_those_with_one_in_ladder_order() -> None:
    known = lossy("share_embedding", 1, 0.9)  # a poor score, but a score
    unknown_a = lossy("compress_embedding_bf16", 500, None)
    unknown_b = lossy("compress_embedding_int8", 900, None)
    plans = {
        "compress_embedding_bf16": unknown_a,
        "compress_embedding_int8": unknown_b,
        "share_embedding": known,
    }
    d = decide(plans)
    assert d.plan is known
    assert rank_lossy_plans([unknown_a, unknown_b, known]) == [known, unknown_a, unknown_b]
    assert rank_lossy_plans([unknown_b, unknown_a]) == [unknown_b, unknown_a]
    d = decide({k: v for k, v in plans.items() if v is not known})
    assert d.plan is unknown_a
    assert "500 MiB at unknown, runner-up compress_embedding_int8 on emb 900 MiB" in d.reason
    one = decide({"share_embedding": known})
    assert "the only lossy plan (expected error 0.9)" in one.reason


def test_lossless_rungs_still_go_first_and_the_filters_apply_to_lossy_plans() -> None:
    bf16 = lossy("compress_embedding_bf16", 50, 2.3e-6)
    share = lossy("share_embedding", 400, 0.2)
    plans = {
        "offload_embedding": PLANS["offload_embedding"],
        "compress_embedding_bf16": bf16,
        "share_embedding": share,
    }
    p = Policy(allow_lossy=True, ladder=LOSSY_LADDER, cooldown_steps=0)
    d = p.evaluate(reading(1, 0.1), plans)[-1]
    assert d.action == "offload_embedding" and d.expected_error is None
    # a lossy rung listed first is neither decided nor planned before a lossless one that applies
    planned: list[str] = []

    def planner(name: str) -> Plan | Refusal:
        planned.append(name)
        return plans.get(name, Refusal(name, "", "not planned"))

    first = Policy(allow_lossy=True, ladder=["share_embedding", "offload_embedding"])
    assert first.evaluate(reading(1, 0.1), planner)[-1].action == "offload_embedding"
    assert planned == ["offload_embedding"]
    p.resolve(d, "failed")
    d = p.evaluate(reading(2, 0.1), plans)[-1]  # offload failed on emb: the lossy rungs rank
    assert d.plan is bf16
    p.resolve(d, "failed")
    d = p.evaluate(reading(3, 0.1), plans)[-1]  # bf16 failed on emb: the runner-up
    assert d.plan is share and "the only lossy plan" in d.reason
    # advise mode: each lossy suggestion once per episode, best first
    p = Policy(allow_lossy=True, ladder=LOSSY_LADDER, mode="advise")
    lossy_only = {**NO_LOSSLESS, "compress_embedding_bf16": bf16, "share_embedding": share}
    assert kinds(p.evaluate(reading(1, 0.1), lossy_only)) == [
        "below_floor",
        "advise:compress_embedding_bf16",
    ]
    assert kinds(p.evaluate(reading(2, 0.1), lossy_only)) == ["advise:share_embedding"]
    assert kinds(p.evaluate(reading(3, 0.1), lossy_only)) == ["none"]


def test_every_lossy_rung_is_planned_once_and_ranking_is_deterministic() -> None:
    calls: list[str] = []
    plans = {
        "compress_embedding_bf16": lossy("compress_embedding_bf16", 50, 2.3e-6),
        "compress_embedding_int8": lossy("compress_embedding_int8", 70, 3.5e-5),
        "share_embedding": lossy("share_embedding", 400, 0.2),
    }

    def planner(name: str) -> Plan | Refusal:
        calls.append(name)
        return {**NO_LOSSLESS, **plans}.get(name, Refusal(name, "", "not planned"))

    decided = []
    for _ in range(3):
        p = Policy(allow_lossy=True, ladder=LOSSY_LADDER)
        decided.append(p.evaluate(reading(1, 0.1), planner)[-1].reason)
    assert calls == LOSSY_LADDER * 3
    assert len(set(decided)) == 1 and "compress_embedding_bf16 plan" in decided[0]


def test_advise_records_each_suggestion_once_per_episode_and_observe_only_crossings() -> None:
    p = Policy(mode="advise", cooldown_steps=0)
    e1 = p.evaluate(reading(1, 0.1), PLANS)
    assert kinds(e1) == ["below_floor", "advise:offload_embedding"]
    assert e1[1].advisory and p.pending is None
    assert kinds(p.evaluate(reading(2, 0.1), PLANS)) == ["advise:checkpoint_activations"]
    assert kinds(p.evaluate(reading(3, 0.1), PLANS)) == ["none"]
    assert kinds(p.evaluate(reading(4, 0.1), PLANS)) == []
    assert kinds(p.evaluate(reading(5, 0.3), PLANS)) == ["above_rearm"]
    assert kinds(p.evaluate(reading(6, 0.1), PLANS)) == ["below_floor", "advise:offload_embedding"]
    p = Policy(mode="observe")
    assert kinds(p.evaluate(reading(1, 0.1), PLANS)) == ["below_floor"]


def test_user_hooks_are_called_and_their_errors_contained() -> None:
    seen = []

    def bad(event):
        seen.append(event)
        raise RuntimeError("user bug")

    p = Policy(on_pressure=bad, on_action=seen.append)
    crossing = p.evaluate(reading(1, 0.1), PLANS)[0]
    exc = p.call_on_pressure(crossing)
    assert isinstance(exc, RuntimeError) and seen == [crossing]
    assert p.call_on_action("result") is None and seen[-1] == "result"


# ---------------------------------------------------------------- a real loop in CPU-budget mode


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4000, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x).mean(dim=1))


def test_loop_reacts_within_one_step_and_free_memory_returns_above_the_floor() -> None:
    """Free memory falls as Adam's state appears; the agent-like loop acts at the next boundary."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # params alone fit with room; params + grads + Adam state (4x) do not
    budget = int(account(model).total_bytes * 3.5)
    policy = Policy()
    # its boundary follows opt's step: the table's gradient is spent, not carried
    ctx = ActionContext(model=model, optimizers=[opt], cuda_mode=False, grad_spent=lambda p: True)
    planner = make_planner(ctx)
    g = torch.Generator().manual_seed(1)
    pending: Decision | None = None
    log: list[tuple[int, str]] = []
    frees = []
    for step in range(12):
        if pending is not None:  # safe point: step boundary, training thread
            result = ACTIONS[pending.action].apply(ctx, pending.plan)
            policy.resolve(pending, result.status)
            log.append((step, f"{result.action}:{result.status}"))
            assert result.saved_bytes == pending.estimated_saving_bytes
            pending = None
        x = torch.randint(0, 4000, (8, 5), generator=g)
        # like the agent, record the first step (table actions need to know the weights' uses)
        with ActivationRecorder(model) if step == 0 else contextlib.nullcontext() as rec:
            loss = F.cross_entropy(model(x), x[:, 0] % 4)
            loss.backward()
            opt.step()
        if step == 0:
            ctx.activation_profile = rec.profile()
        in_use = account(model, [opt]).total_bytes
        free = (budget - in_use) / budget
        frees.append(free)
        for e in policy.evaluate(
            Reading(time_s=0.0, step=step + 1, device_kind="cpu-budget", free_fraction=free),
            planner,
        ):
            if isinstance(e, ThresholdCrossing):
                log.append((step + 1, e.kind))
            elif isinstance(e, Decision):
                pending = e
    assert log[0] == (1, "below_floor")
    assert log[1] == (1, "cache_embedding:applied")  # applied at the very next boundary
    assert log[2] == (2, "above_rearm")
    assert min(frees[1:]) > 0.25
    assert isinstance(model.emb, nn.Module) and model.emb.edo_placement == "cached"


def test_reading_of_equals_the_constructor() -> None:
    """``Reading.of`` (replay's bulk constructor) builds the same value as ``Reading(...)``,
    defaults included, and refuses a name that is not a field."""
    from edo_monitor.probes.readings import SAMPLE_FIELDS

    fast = Reading.of(1.5, 7, "cuda", in_use_bytes=10, free_fraction=0.25, cache_rows=3)
    slow = Reading(1.5, 7, "cuda", in_use_bytes=10, free_fraction=0.25, cache_rows=3)
    assert fast == slow and fast.as_dict() == slow.as_dict() and hash(fast) == hash(slow)
    assert [f for f in SAMPLE_FIELDS if getattr(fast, f) is not None] == [
        "time_s",
        "step",
        "device_kind",
        "in_use_bytes",
        "free_fraction",
        "cache_rows",
    ]
    with pytest.raises(TypeError, match="in_use"):
        Reading.of(1.5, 7, "cuda", in_use=10)


def _at(step: int, in_use: int) -> Reading:
    """A CPU-budget reading at ``step`` of ``in_use`` bytes of a 100-byte budget."""
    return Reading(
        time_s=float(step),
        step=step,
        device_kind="cpu-budget",
        in_use_bytes=in_use,
        budget_bytes=100,
        free_fraction=(100 - in_use) / 100,
    )


def test_a_cache_grows_back_only_when_the_recent_steps_peak_leaves_room() -> None:
    """Regression: with batches alternating (5 small steps, 5 large), the cache grew back in
    each small phase into the next large one's crossing (7 round trips in 80 steps). Calm is now
    judged at the highest in-use of the last GROW_LOOKBACK_STEPS steps."""
    grow = Plan("grow_cache", "items", -10, "grow the row cache of items")
    policy = Policy(grow_after_readings=3, cooldown_steps=0)

    plans = {"grow_cache": grow}
    # large steps leave 28 % free: above re-arm (25 %), below re-arm + margin (30 %)
    phases = [72] * 5 + [40] * 5
    decided = [e for s in range(40) for e in policy.evaluate(_at(s, phases[s % 10]), plans)]
    assert decided == []  # before: a grow in each small phase
    # once the large steps are GROW_LOOKBACK_STEPS behind, the small ones are calm: it grows
    steps = [e.step for s in range(40, 80) for e in policy.evaluate(_at(s, 40), plans)]
    assert steps == [34 + GROW_LOOKBACK_STEPS + 2]  # the last large step is 34; 3 calm readings


def test_a_grow_undone_by_pressure_doubles_the_look_back() -> None:
    """Regression: a load whose phases outlast the 20-step look-back (30 light steps, 30 heavy)
    made the policy shrink in each heavy phase and grow back in each light one (11 actions in
    300 steps of a real run, benchmarks/policy_loads.py). A crossing soon after an applied grow
    doubles the look-back, so the light phase's calm no longer hides the heavy phase: one round
    trip, then the cache stays (heavy phases at 28 % free, above the floor)."""
    cached = False

    def plans(name: str) -> Plan | Refusal:
        if name == "cache_embedding" and not cached:
            return Plan(name, "items", 20, "cache the table of items")
        if name == "grow_cache" and cached:
            return Plan(name, "items", -20, "grow the row cache of items back to the table")
        return Refusal(name, "items", "not this one")

    policy = Policy(cooldown_steps=0)
    decided = []
    for step in range(300):
        heavy = (step // 30) % 2 == 1
        in_use = (62 if heavy else 30) + (10 if cached else 30)  # heavy and resident: 8 % free
        for event in policy.evaluate(_at(step, in_use), plans):
            if isinstance(event, Decision):
                decided.append((event.step, event.action))
                policy.resolve(event, "applied")  # at the step's safe point
                cached = event.action == "cache_embedding"
    assert decided == [(30, "cache_embedding"), (81, "grow_cache"), (90, "cache_embedding")]
    assert policy.grow_lookback_steps == 2 * GROW_LOOKBACK_STEPS


def test_a_grow_refused_at_its_safe_point_doubles_the_look_back() -> None:
    """Regression: a grow decided on the last calm reading before a heavy step was refused at the
    safe point (planned again there: no room), charged no cooldown and taught nothing, so the
    same grow was decided and refused in every period (6 refusals in 300 steps of 20-step
    phases, benchmarks/policy_loads.py with the look-back held). A refused grow now counts as
    one undone."""
    policy = Policy(cooldown_steps=0, grow_after_readings=1)
    plans = {"grow_cache": Plan("grow_cache", "items", -10, "grow the row cache of items")}
    decided = []
    for step in range(200):
        in_use = 72 if (step // 20) % 2 == 0 else 40  # heavy first: 28 % free, then 60 %
        for event in policy.evaluate(_at(step, in_use), plans):
            if isinstance(event, Decision):
                decided.append(event.step)
                policy.resolve(event, "refused")  # no room at the safe point
    # the last light step sees 20 calm steps: refused, the look-back doubles and the next light
    # phases never fill it (the held look-back decided at 39, 79, 119, 159 and 199)
    assert decided == [39]
    assert policy.grow_lookback_steps == 2 * GROW_LOOKBACK_STEPS
