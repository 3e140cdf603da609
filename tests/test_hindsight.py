"""explain and replay (issue 14, items 3 and 4) on real recorded runs: real watch() loops on the
CPU budget, a real SQLite file, the real Policy, the CLI through typer's runner."""

from __future__ import annotations

import html
import json
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import edo_monitor
from edo_monitor.actions import ACTIONS, LOSSY_ACTIONS
from edo_monitor.decide.plans import ACTION_NAMES, LOSSY_ACTION_NAMES, rounding_expected_error
from edo_monitor.decide.policy import Policy
from edo_monitor.errors import ConfigError, EventNotFoundError
from edo_monitor.hindsight.explain import explain
from edo_monitor.hindsight.replay import parse_policy, replay
from edo_monitor.store.history import History
from edo_monitor.surfaces.cli import app

ROWS, DIM = 20_000, 32
# the table with Adam after one step: weight, gradient, exp_avg, exp_avg_sq (float32) and the
# 4-byte step counter, all in the CPU budget
TABLE_BYTES = ROWS * DIM * 4 * 4 + 4
BUDGET = 12_000_000


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.EmbeddingBag(ROWS, DIM, mode="mean")
        self.head = nn.Linear(DIM, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _train(db: Path, mode: str, *, until: str) -> int:
    """A real training loop under watch(); steps until the run recorded an event of kind
    ``until`` (and 5 steps more), with a hang guard. Returns the run id."""
    torch.manual_seed(0)
    model = TinyModel()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    policy = Policy(mode=mode, ladder=["offload_embedding"], cooldown_steps=3)
    gen = torch.Generator().manual_seed(1)
    with edo_monitor.watch(
        model, opt, db=str(db), budget=BUDGET, policy=policy, enforce=False, interval_s=0.01
    ) as monitor:
        deadline = time.monotonic() + 120  # hang guard only
        extra = None
        while time.monotonic() < deadline:
            x = torch.randint(0, ROWS, (64, 4), generator=gen)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            # readings every 10 ms, steps of 30 ms and more: the first reading after a step
            # boundary lands in the next step in both runs (with steps faster than the sampler
            # each run's crossing came at whichever step its first reading happened to see, and
            # the two runs' decision steps could differ by more than one)
            time.sleep(0.03)
            if extra is None and monitor.summary().events.get(until):
                extra = 5
            if extra is not None:
                extra -= 1
                if extra <= 0:
                    break
        assert extra is not None and extra <= 0, f"no {until} event before the hang guard"
        return monitor.run_id


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int]:
    db = tmp_path_factory.mktemp("hindsight") / "h.db"
    tuned = _train(db, "auto", until="action")
    observed = _train(db, "observe", until="threshold_crossed")
    return db, tuned, observed


def test_action_names_without_torch_match_the_registry() -> None:
    assert tuple(ACTIONS) == ACTION_NAMES
    assert LOSSY_ACTIONS == LOSSY_ACTION_NAMES


def test_replay_of_the_tuned_run_decides_as_it_did_and_models_the_measured_saving(
    runs: tuple[Path, int, int],
) -> None:
    db, tuned, _ = runs
    with History(db) as h:
        decision = h.events(tuned, kind="decision")[0]
        action = h.events(tuned, kind="action")[0]
    assert action.data["saved_bytes"] == TABLE_BYTES  # the live measurement, derived above
    result = replay(db, tuned, {"ladder": ("offload_embedding",), "cooldown_steps": 3})
    first = result.decisions[0]
    assert (first.action, first.target) == ("offload_embedding", "features")
    assert first.step == decision.step
    assert first.saving_bytes == TABLE_BYTES
    assert result.recorded[0].status == "applied"
    assert result.recorded[0].saving_bytes == TABLE_BYTES
    # the live action is taken out of the trace and the replayed one put in: the same minimum
    assert result.min_free_fraction == pytest.approx(result.recorded_min_free_fraction)


def test_replay_of_the_observed_run_acts_like_the_tuned_one(runs: tuple[Path, int, int]) -> None:
    db, tuned, observed = runs
    with History(db) as h:
        live = h.events(tuned, kind="decision")[0]
        crossing = h.events(observed, kind="threshold_crossed")[0]
        samples = list(
            h.samples(observed, columns=["step", "in_use_bytes"], max_points=None).rows()
        )
    result = replay(db, observed, "ladder=offload_embedding,cooldown_steps=3")
    first = result.decisions[0]
    assert first.action == live.data["action"] and abs(first.step - live.step) <= 1
    assert first.step == crossing.step
    assert first.saving_bytes == TABLE_BYTES
    assert result.recorded == ()  # observe mode decides nothing
    # the modelled offload takes TABLE_BYTES off every sample of a later step
    modelled = [r["in_use_bytes"] - (TABLE_BYTES if r["step"] > first.step else 0) for r in samples]
    assert result.min_free_fraction == pytest.approx((BUDGET - max(modelled)) / BUDGET)
    # a policy whose floor is never crossed does nothing
    calm = replay(db, observed, Policy(min_free_fraction=0.01, rearm_free_fraction=0.02))
    assert calm.decisions == () and calm.crossings == ()


def test_replay_ranks_lossy_plans_by_expected_error_where_the_trace_allows(
    runs: tuple[Path, int, int],
) -> None:
    """bf16 has an expected error offline (it needs no row values); low-rank does not (it needs
    the rows), so a bf16 plan outranks it whatever the ladder order. int8 is refused on this
    trainable table, as live."""
    db, _, observed = runs
    policy = {
        "allow_lossy": True,
        "ladder": ("compress_embedding_lowrank", "compress_embedding_bf16"),
    }
    first = replay(db, observed, policy).decisions[0]
    assert first.action == "compress_embedding_bf16"
    assert first.expected_error == rounding_expected_error("bf16")
    assert "runner-up compress_embedding_lowrank on features" in first.reason
    assert "at unknown" in first.reason  # low rank's error is not known offline
    policy["ladder"] = ("compress_embedding_int8", "compress_embedding_lowrank")
    first = replay(db, observed, policy).decisions[0]
    assert first.action == "compress_embedding_lowrank" and first.expected_error is None


def test_replay_refuses_the_frozen_only_compress_modes_and_says_what_it_cannot_model(
    runs: tuple[Path, int, int],
) -> None:
    """int8 and the low-bit modes store a frozen table: live refuses them on this trainable one,
    and so does the replay, with the live reason (it decided them, saving bytes the run could not
    save). Their savings on a frozen table: tests/test_replay_compress.py."""
    db, _, observed = runs
    for mode in ("int8", "int4", "int2", "2of8"):
        policy = {"allow_lossy": True, "ladder": (f"compress_embedding_{mode}",)}
        result = replay(db, observed, policy)
        assert result.decisions == ()
        reasons = {reason for _, refused in result.refusals for _, reason in refused}
        assert reasons == {f"features: {mode} is for frozen tables (requires_grad=False)"}
    # a rung replay cannot model says why (it repeated the name: "not modelled offline:
    # spill_embedding")
    result = replay(db, observed, {"ladder": ("spill_embedding",)})
    reasons = {reason for _, refused in result.refusals for _, reason in refused}
    assert reasons == {
        "not modelled offline: it applies only when host memory is too short for a row cache's "
        "host table, and the trace does not record the host's free memory"
    }


def test_explain_the_crossing(runs: tuple[Path, int, int]) -> None:
    db, _, observed = runs
    with History(db) as h:
        peak = h.peak(observed).value
        crossing = h.events(observed, kind="threshold_crossed")[0]
    result = explain(db, observed)
    inc = result.incidents[0]
    assert inc.kind == "below_floor" and inc.event_id == crossing.id
    # the whole episode lasts to the end of the run (observe mode never frees anything)
    assert inc.peak_in_use_bytes == peak
    assert inc.shortfall_bytes == -int(-(peak - 0.8 * BUDGET) // 1)
    by_action = {(r.action, r.target): r for r in inc.remedies}
    offload = by_action[("offload_embedding", "features")]
    assert offload.saving_bytes == TABLE_BYTES and offload.enough and not offload.lossy
    # Adam -> SGD frees all optimizer state: two tensors per element of every parameter and a
    # 4-byte step counter per parameter tensor (3 tensors)
    params = sum(p.numel() * 4 for p in TinyModel().parameters())
    sgd = by_action[("optimizer", "adam -> sgd")]
    assert sgd.saving_bytes == 2 * params + 3 * 4
    bf16 = by_action[("compress_embedding_bf16", "features")]
    assert bf16.saving_bytes == ROWS * DIM * 4 * 2  # four tensors, 2 bytes an element less
    assert inc.remedies[0].enough and not inc.remedies[0].lossy  # enough and lossless first
    with pytest.raises(EventNotFoundError, match=f"run {observed} has no event {10**9}; see"):
        explain(db, observed, event=10**9)  # it said "is not an OOM or a crossing"
    with History(db) as history:
        other = next(
            e for e in history.events(observed) if e.kind not in ("oom", "threshold_crossed")
        )
    with pytest.raises(EventNotFoundError, match="not an OOM or a crossing below the floor"):
        explain(db, observed, event=other.id)


def test_cli_explain_and_replay(runs: tuple[Path, int, int]) -> None:
    db, _, observed = runs
    runner = CliRunner()
    res = runner.invoke(app, ["explain", str(observed), "--db", str(db), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["incidents"][0]["kind"] == "below_floor"
    # the run's own figures with incidents too (they were null: a run without a budget?)
    con = sqlite3.connect(db)
    extremes = con.execute(
        "SELECT max(budget_bytes), max(in_use_bytes), min(free_fraction) FROM samples "
        "WHERE run_id = ?",
        (observed,),
    ).fetchone()
    con.close()
    assert extremes[0] > 0
    assert (data["budget_bytes"], data["peak_in_use_bytes"], data["min_free_fraction"]) == extremes
    res = runner.invoke(app, ["explain", str(observed), "--db", str(db)])
    assert res.exit_code == 0 and "offload_embedding" in res.stdout and "shortfall" in res.stdout
    res = runner.invoke(
        app, ["replay", str(observed), "--db", str(db), "--policy", "ladder=offload_embedding"]
    )
    assert res.exit_code == 0, res.output
    assert "replay" in res.stdout and "min free fraction" in res.stdout
    res = runner.invoke(
        app,
        [
            "replay",
            str(observed),
            "--db",
            str(db),
            "--policy",
            "ladder=offload_embedding",
            "--json",
        ],
    )
    assert json.loads(res.stdout)["decisions"][0]["saving_bytes"] == TABLE_BYTES
    bad = runner.invoke(app, ["replay", "1", "--db", str(db), "--policy", "floor=0.3"])
    assert bad.exit_code == 2 and "floor=0.3" in bad.stderr
    bad = runner.invoke(app, ["replay", "1", "--db", str(db), "--policy", "min_free_fraction=2"])
    assert bad.exit_code == 2 and "min_free_fraction=2.0" in bad.stderr
    bad = runner.invoke(app, ["replay", "1", "--db", str(db), "--policy", ""])
    assert bad.exit_code == 2 and "policy settings '' give no setting" in bad.stderr
    # an event the run does not have is missing data (1), as a missing run, not a usage error
    missing = runner.invoke(app, ["explain", str(observed), "--db", str(db), "--event", "999999"])
    assert missing.exit_code == 1 and "has no event 999999" in missing.stderr


def test_parse_policy() -> None:
    assert parse_policy("min_free_fraction=0.3, allow_lossy=true,ladder=a+b") == {
        "min_free_fraction": 0.3,
        "allow_lossy": True,
        "ladder": ("a", "b"),
    }
    # regression: an empty value (a shell variable not set) replayed the default policy silently
    for empty in ("", " ", " , "):
        with pytest.raises(ConfigError, match=r"^policy settings .* give no setting; expected"):
            parse_policy(empty)
    with pytest.raises(ConfigError, match="cooldown_steps='x'"):
        parse_policy("cooldown_steps=x")
    # the type in words ('expected a int' before)
    with pytest.raises(
        ConfigError, match=r"cooldown_steps='1\.5' is not allowed; expected an integer$"
    ):
        parse_policy("cooldown_steps=1.5")
    with pytest.raises(ConfigError, match=r"expected a number$"):
        parse_policy("min_free_fraction=half")
    with pytest.raises(ConfigError, match=r"expected true or false$"):
        parse_policy("allow_lossy=maybe")
    # regression: the last of a key given twice won, silently
    with pytest.raises(ConfigError, match=r"cooldown_steps is given twice \('cooldown_steps=9'\)"):
        parse_policy("cooldown_steps=2,cooldown_steps=9")
    # regression: a known setting without its value was "not allowed", naming every setting
    with pytest.raises(
        ConfigError,
        match=r"^policy setting 'min_free_fraction' has no value; "
        r"expected min_free_fraction=VALUE$",
    ):
        parse_policy("min_free_fraction")
    with pytest.raises(ConfigError, match="not allowed; expected KEY=VALUE with KEY one of"):
        parse_policy("nope")


def test_explain_and_replay_import_no_torch(runs: tuple[Path, int, int]) -> None:
    """A database copied to a machine without torch: both commands run on it."""
    db, _, observed = runs
    code = (
        "import sys\n"
        "from edo_monitor.surfaces.cli import app\n"
        "for argv in (['explain', sys.argv[2]], ['replay', sys.argv[2]]):\n"
        "    try:\n"
        "        app([*argv, '--db', sys.argv[1]])\n"
        "    except SystemExit as e:\n"
        "        assert not e.code, e.code\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(db), str(observed)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "[]"


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_embedding.py"


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two runs of the demo on a shared 2-core machine
def test_replay_of_the_pressure_demo_without_tuner_decides_as_the_tuned_demo(
    tmp_path: Path,
) -> None:
    """The pressure demo (real example, 30 steps) with and without the tuner; the default policy
    replayed on the --no-tune run decides the live run's first action within one step, with its
    estimate (the live run's own plan, made from the same kind of reading)."""
    db = tmp_path / "demo.db"
    base = [sys.executable, str(EXAMPLE), "--steps", "30", "--interval", "0.02", "--db", str(db)]
    for extra in ([], ["--no-tune"]):
        subprocess.run(
            # readings every 20 ms, several a step: each run records the crossing in the step it
            # happens (at the default 0.25 s a reading could come 2 steps later in one run than
            # in the other, and the live and replayed decisions were 2 steps apart)
            [*base, *extra],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
    with History(db) as h:
        tuned, untuned = sorted(r.id for r in h.runs())
        assert h.run(untuned).name == "train_embedding-no-tune"
        live = h.events(tuned, kind="decision")[0]
        applied = h.events(tuned, kind="action")
        assert h.events(untuned, kind="oom"), "the untuned demo must run out of memory"
    result = replay(db, untuned)
    first = result.decisions[0]
    assert first.action == live.data["action"] == "cache_embedding"
    assert abs(first.step - live.step) <= 1
    assert first.saving_bytes == live.data["estimated_saving_bytes"]
    if applied and applied[0].data["decided_at_step"] == live.step:
        assert first.saving_bytes == applied[0].data["saved_bytes"]
    text = explain(db, untuned).incidents
    assert {i.kind for i in text} == {"below_floor", "oom"}


def _explain_in_dashboard(db: Path, run: int, event_id: int) -> tuple[Any, str, bool]:
    """Open ``run`` in ``edo-tui``, select event ``event_id``, press ``x``: the explain screen's
    result, the words on the terminal, and whether Escape closed it."""
    import asyncio

    from textual.widgets import DataTable

    from edo_monitor.tui.app import EdoTui
    from edo_monitor.tui.modals import ExplainScreen

    async def drive() -> tuple[Any, str, bool]:
        app = EdoTui(db, run=str(run))
        async with app.run_test(size=(200, 80)) as pilot:
            screen = app.run_screen
            deadline = time.monotonic() + 60  # hang guard
            while not screen.loaded and time.monotonic() < deadline:
                await pilot.pause(0.02)
            row = next(i for i, e in enumerate(screen.event_rows) if e.id == event_id)
            screen.query_one("#events", DataTable).move_cursor(row=row)
            await pilot.press("x")
            explain_screen = app.screen
            assert isinstance(explain_screen, ExplainScreen)
            while explain_screen.result is None and time.monotonic() < deadline:
                await pilot.pause(0.02)
            await pilot.pause()
            # what the terminal shows: the screenshot's text, tags and entities removed
            svg = app.export_screenshot()
            text = html.unescape(re.sub(r"<[^>]+>", "", svg)).replace("\xa0", " ")
            await pilot.press("escape")
            await pilot.pause()
            return explain_screen.result, text, app.screen is screen

    return asyncio.run(drive())


def test_dashboard_explains_the_selected_crossing(runs: tuple[Path, int, int]) -> None:
    """``x`` in the run view shows what ``explain`` says of the selected incident: the shortfall
    and the remedies, as ``edo-monitor explain`` prints them; Escape closes it."""
    db, _, observed = runs
    with History(db) as h:
        crossing = h.events(observed, kind="threshold_crossed")[0]
    expected = explain(db, observed, event=crossing.id)
    inc = expected.incidents[0]
    assert inc.shortfall_bytes > 0 and inc.remedies[0].action == "offload_embedding"
    result, text, closed = _explain_in_dashboard(db, observed, crossing.id)
    assert result == expected
    assert f"event {crossing.id}  step {crossing.step}" in text
    assert f"({inc.shortfall_bytes:,} bytes)" in text
    assert "offload_embedding" in text and "features" in text
    zero1 = next(s for s in inc.staged_plan.stages if s.action == "zero1")  # the staged plan too
    assert "staged plan for a shortfall of" in text and f"with {zero1.ranks} ranks" in text
    assert closed


def test_dashboard_explains_every_incident_when_the_crossing_back_above_is_selected(
    runs: tuple[Path, int, int],
) -> None:
    """A crossing back above the re-arm level is no incident: ``x`` on it explains every
    incident of the run, as on any other event (it showed "event=N is not an OOM or a
    below-floor crossing" instead)."""
    db, tuned, _ = runs
    with History(db) as h:
        crossings = h.events(tuned, kind="threshold_crossed")
    above = next(e for e in crossings if e.data.get("direction") == "above")
    expected = explain(db, tuned)
    assert expected.incidents
    result, _, _ = _explain_in_dashboard(db, tuned, above.id)
    assert result == expected
