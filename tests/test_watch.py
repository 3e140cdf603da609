"""watch() lifecycle on real CPU training loops and real SQLite files."""

from __future__ import annotations

import copy
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from watch_helpers import agent_threads, count, make_model, run_row, train, wait_for

import edo_monitor
from edo_monitor.errors import AlreadyWatchedError, ConfigError
from edo_monitor.store.history import History
from edo_monitor.store.status import effective_status

# make_model() under Adam: the table (5,000 x 16) and the Linear(16, 4) weight and bias, as float32
PARAMS_BYTES = (5_000 * 16 + 16 * 4 + 4) * 4
# Adam: exp_avg and exp_avg_sq of every parameter, and a float32 `step` scalar for each of the 3
ADAM_STATE_BYTES = 2 * PARAMS_BYTES + 3 * 4
# saved for backward by one step of train() (batch 32): the embedding's int64 indices [32], the
# Linear's input [32, 16], logsumexp's input [32, 4] and result [32] (float32)
STEP_ACTIVATIONS_BYTES = 32 * 8 + 32 * 16 * 4 + 32 * 4 * 4 + 32 * 4


def test_finished_run_records_steps_samples_and_tables(db_path: Path) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    with edo_monitor.watch(model, db=db_path, interval_s=0.05, budget="64MiB") as mon:
        train(model, opt, 40, sleep_s=0.01)
    assert agent_threads() == []
    run = run_row(db_path)
    assert run["status"] == "finished"
    assert run["steps"] == 40 == mon.steps
    assert run["device_kind"] == "cpu-budget"
    assert run["budget_bytes"] == 64 * 1024 * 1024
    # every reading the agent took is in the file, the last one taken after the last step
    samples = count(db_path, "SELECT count(*) FROM samples")
    assert samples == mon.summary().samples
    assert count(db_path, "SELECT step FROM samples ORDER BY id DESC LIMIT 1") == 40
    # the embedding table: rows x dim x element size, Adam's two states + its step scalar
    con = sqlite3.connect(db_path)
    module, rows, dim, params, grads, optim = con.execute(
        "SELECT module, num_embeddings, embedding_dim, params_bytes, grads_bytes,"
        " optimizer_state_bytes FROM module_stats WHERE kind = 'Embedding'"
        " ORDER BY id DESC LIMIT 1"
    ).fetchone()
    assert (module, rows, dim) == ("0", 5_000, 16)
    assert params == 5_000 * 16 * 4
    assert grads == 5_000 * 16 * 4
    assert optim == 2 * 5_000 * 16 * 4 + 4
    summary = mon.summary()
    assert summary.status == "finished" and summary.steps == 40
    # the peak: weights, gradients and Adam's state at the step boundary plus one step's
    # activations (the last reading, after the last step, sees all of them)
    peak = PARAMS_BYTES + PARAMS_BYTES + ADAM_STATE_BYTES + STEP_ACTIVATIONS_BYTES
    assert summary.peak_in_use_bytes == peak == 1_284_044
    assert summary.peak_activations_bytes == STEP_ACTIVATIONS_BYTES
    # before the first step only the weights are in use: the least free memory is at the peak
    assert summary.min_free_fraction == pytest.approx((64 * 2**20 - peak) / (64 * 2**20))


def test_exception_marks_failed_and_propagates(db_path: Path) -> None:
    model = make_model()
    with pytest.raises(ZeroDivisionError), edo_monitor.watch(model, db=db_path, interval_s=0.05):
        _ = 1 / 0
    assert agent_threads() == []
    run = run_row(db_path)
    assert run["status"] == "failed"
    assert run["error"].startswith("ZeroDivisionError")


def test_keyboard_interrupt_marks_interrupted(db_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt), edo_monitor.watch(make_model(), db=db_path):
        raise KeyboardInterrupt
    assert agent_threads() == []
    assert run_row(db_path)["status"] == "interrupted"


def test_killed_process_reads_as_crashed(db_path: Path, tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import time, torch, edo_monitor
            m = torch.nn.Linear(4, 4)
            with edo_monitor.watch(m, db={str(db_path)!r}, interval_s=0.05):
                print("started", flush=True)
                time.sleep(60)
            """
        )
    )
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "started"
        # the child's writer has committed a heartbeat and a sample: its run is recorded, live
        wait_for(lambda: count(db_path, "SELECT count(*) FROM samples") > 0, "a written sample")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    run = run_row(db_path)
    assert run["status"] == "running"  # nothing could write the end
    status = effective_status(
        run["status"],
        host=run["host"],
        pid=run["pid"],
        heartbeat_at_s=run["heartbeat_at_s"],
        interval_s=run["interval_s"],
    )
    assert status == "crashed"
    # and a live run on another host with a stale heartbeat reads as crashed too
    assert (
        effective_status(
            "running", host="elsewhere", pid=1, heartbeat_at_s=time.time() - 3600, interval_s=0.5
        )
        == "crashed"
    )
    assert (
        effective_status(
            "running", host="elsewhere", pid=1, heartbeat_at_s=time.time(), interval_s=1
        )
        == "running"
    )


def test_sigterm_ends_the_run_interrupted_with_the_exit_status_of_sigterm(
    db_path: Path, tmp_path: Path
) -> None:
    """A scheduler's (or timeout's, or torchrun's) SIGTERM killed the process without running any
    Python: exit 143, no summary, and the run read "crashed" like a kill -9. While the block runs
    SIGTERM now raises Terminated: the block records the run interrupted, "finally" runs, and the
    process still exits 143."""
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import signal, time, torch, edo_monitor
            m = torch.nn.Linear(4, 4)
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
            try:
                with edo_monitor.watch(m, db={str(db_path)!r}, interval_s=0.05):
                    print("started", flush=True)
                    time.sleep(60)
            finally:
                print("finally ran", flush=True)
            """
        )
    )
    child = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "started"
        wait_for(lambda: count(db_path, "SELECT count(*) FROM samples") > 0, "a written sample")
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 143, err
    assert out.strip() == "finally ran"
    run = run_row(db_path)
    assert (run["status"], run["error"]) == ("interrupted", "SIGTERM")


def test_a_sigterm_handler_of_the_users_is_left_alone(db_path: Path) -> None:
    def mine(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with edo_monitor.watch(make_model(), db=db_path):
            assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGTERM) is mine
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with edo_monitor.watch(make_model(), db=db_path):  # the default action: replaced ...
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # ... and put back
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_watching_a_watched_model_is_an_error(db_path: Path) -> None:
    model = make_model()
    with (
        edo_monitor.watch(model, db=db_path),
        pytest.raises(AlreadyWatchedError, match="already watched"),
        edo_monitor.watch(model, db=db_path),
    ):
        pass
    with edo_monitor.watch(model, db=db_path):  # free again after the block
        pass
    assert agent_threads() == []


def test_optimizer_found_automatically_and_other_optimizers_ignored(db_path: Path) -> None:
    model = make_model()
    other = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with edo_monitor.watch(model, db=db_path) as mon:
        for _ in range(5):
            train(model, opt, 1)
            other(torch.ones(3)).sum().backward()
            other_opt.step()
    assert mon.steps == 5
    assert mon.optimizers == [opt]


def test_step_without_optimizer_and_process_only(db_path: Path) -> None:
    with edo_monitor.watch(db=db_path, interval_s=0.05) as mon:
        for _ in range(7):
            mon.step()
    assert mon.steps == 7
    run = run_row(db_path)
    assert run["steps"] == 7 and run["name"] == "process"
    # no model: every reading is the host's alone (at least the one taken at the end)
    samples = mon.summary().samples
    assert samples >= 1 and count(db_path, "SELECT count(*) FROM samples") == samples
    host_only = (
        "SELECT count(*) FROM samples WHERE process_rss_bytes > 0 AND host_available_bytes > 0"
        " AND params_bytes = 0 AND activations_bytes IS NULL"
    )
    assert count(db_path, host_only) == samples


def test_a_loop_with_no_step_under_an_acting_policy_is_warned_about(
    db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop that updates the parameters by hand gives the policy no step boundary: the run
    read "steps 0" and nothing said why the policy never acted."""
    model = nn.Linear(4, 1)
    for by_hand_step in (False, True):
        caplog.clear()
        with edo_monitor.watch(model, db=db_path, policy=edo_monitor.Policy()) as mon:
            for _ in range(3):
                model(torch.randn(8, 4)).pow(2).mean().backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad
                        p.grad = None
                if by_hand_step:
                    mon.step()
        warned = [r for r in caplog.records if "saw no optimizer step" in r.getMessage()]
        assert (mon.steps, len(warned)) == ((3, 0) if by_hand_step else (0, 1))


def test_step_is_not_double_counted_with_an_optimizer(db_path: Path) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with edo_monitor.watch(model, opt, db=db_path) as mon:
        for _ in range(3):
            train(model, opt, 1)
            mon.step()
    assert mon.steps == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval_s": 0}, "interval_s=0"),
        ({"interval_s": -1.5}, "interval_s=-1.5"),
        ({"budget": "12 apples"}, "budget='12 apples'"),
        ({"db": "nosuchscheme://host/db"}, "nosuchscheme://host/db"),
        ({"queue_size": 0}, "queue_size=0"),
    ],
)
def test_bad_arguments_are_clear_value_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("?", r"\?")):
        edo_monitor.watch(make_model(), **kwargs)


class _Words(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i % 50, (i * 7) % 50])


def test_forking_dataloader_with_two_workers(db_path: Path) -> None:
    model = nn.Sequential(nn.EmbeddingBag(50, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(
        _Words(), batch_size=8, num_workers=2, multiprocessing_context="fork"
    )
    with edo_monitor.watch(model, db=db_path, interval_s=0.01) as mon:
        for _epoch in range(2):
            for batch in loader:
                model(batch).sum().backward()
                opt.step()
                opt.zero_grad()
    assert mon.steps == 16
    assert run_row(db_path)["status"] == "finished"
    assert agent_threads() == []


class BrokenPolicy(edo_monitor.Policy):
    """A policy (public class, public method) that fails on every reading the sampler hands it:
    a failure inside the agent's sampler thread, caused without touching the agent."""

    def evaluate(self, reading: object, planner: object = None) -> list:
        raise RuntimeError("policy on fire")


def test_agent_failure_never_fails_training(
    db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin = make_model()
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    with edo_monitor.watch(model, db=db_path, interval_s=0.01, policy=BrokenPolicy()) as mon:
        torch.manual_seed(5)
        train(model, opt, 10)
        # and on, until the sampler has failed several times (once per reading)
        wait_for(lambda: mon.summary().samples >= 3, "three failed readings")
        train(model, opt, 10)
    torch.manual_seed(5)
    train(twin, twin_opt, 20)
    pairs = zip(model.parameters(), twin.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)  # training went on, untouched
    assert run_row(db_path)["status"] == "finished" and mon.steps == 20
    # every reading failed in the policy, after it was queued: the failure is recorded once
    assert mon.summary().events.get("agent_error") == 1
    assert count(db_path, "SELECT count(*) FROM events WHERE kind='agent_error'") == 1
    logged = [r for r in caplog.records if "policy on fire" in (r.exc_text or r.getMessage())]
    assert len(logged) == 1 and "sampler failed (training goes on)" in logged[0].getMessage()


def test_strict_reraises_agent_failures(db_path: Path) -> None:
    with (
        pytest.raises(RuntimeError, match="policy on fire"),
        edo_monitor.watch(db=db_path, interval_s=0.01, strict=True, policy=BrokenPolicy()) as mon,
    ):
        wait_for(lambda: mon.summary().events.get("agent_error") == 1, "the agent's error")
    assert agent_threads() == []


def test_pid_is_recorded(db_path: Path) -> None:
    with edo_monitor.watch(db=db_path):
        pass
    assert run_row(db_path)["pid"] == os.getpid()


def test_import_from_the_checkout_root_maps_agent_and_tui() -> None:
    """Regression: from the repository root the checkout's edo_monitor/ shadows the installed
    package, which had no edo_monitor.agent there (agent/ and tui/ are mapped at install)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "agent" / "monitor.py").is_file():
        pytest.skip("not running from a checkout")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import edo_monitor, edo_monitor.tui.app; from edo_monitor import History, watch; "
            "print(edo_monitor.agent.__file__); print(edo_monitor.tui.__file__)",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    agent_file, tui_file = done.stdout.split()
    assert Path(agent_file) == root / "agent" / "__init__.py"
    assert Path(tui_file) == root / "tui" / "__init__.py"


def test_tags_and_config_are_checked(db_path: Path) -> None:
    with edo_monitor.watch(db=db_path, tags="nightly") as mon:
        pass
    con = sqlite3.connect(db_path)
    assert con.execute("SELECT tags FROM runs WHERE id=?", (mon.run_id,)).fetchone()[0] == (
        '["nightly"]'
    )
    with pytest.raises(ConfigError, match="config="):
        edo_monitor.watch(db=db_path, config={"x": object()})


def test_step_on_a_monitor_never_entered_counts_nothing() -> None:
    mon = edo_monitor.watch(make_model())
    mon.step()
    assert mon.steps == 0 and mon.status == "created"


def test_summary_prints_readably(db_path: Path) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with edo_monitor.watch(model, db=db_path, budget="64MiB") as mon:
        train(model, opt, 3)
    text = str(mon.summary())
    assert (
        text.splitlines()[0]
        == f"run {mon.run_id} (Sequential): finished, cpu-budget, budget 64 MiB"
    )
    assert "steps 3, samples" in text and text.endswith(f"\ndatabase {db_path}")


def test_the_summary_names_a_history_file_by_its_path(tmp_path: Path) -> None:
    """The summary's URL of an SQLite file left spaces as they are and percent-encoded other
    characters (``dir with spaces/%C3%BCn%C3%AF/my history %E2%98%83.db``)."""
    path = tmp_path / "dir with spaces" / "ünï" / "my history ☃.db"
    path.parent.mkdir(parents=True)
    with edo_monitor.watch(nn.Linear(2, 1), db=path) as mon:
        pass
    assert str(mon.summary()).endswith(f"\ndatabase {path}")


@pytest.mark.parametrize(("interval_s", "stale_s"), [(0.5, 30.0), (2.0, 30.0), (10.0, 100.0)])
def test_running_run_reads_as_crashed_at_the_heartbeat_edge(
    db_path: Path, interval_s: float, stale_s: float
) -> None:
    """A ``running`` run of a live process reads as crashed once its heartbeat is older than
    max(30 s, 10 x interval): ``stale_s`` written out by hand for each interval."""
    with edo_monitor.watch(db=db_path, interval_s=interval_s) as mon:
        pass

    def status_with_heartbeat_age(age_s: float) -> str:
        con = sqlite3.connect(db_path)
        con.execute(
            "UPDATE runs SET status = 'running', ended_at_s = NULL, heartbeat_at_s = ? "
            "WHERE id = ?",
            (time.time() - age_s, mon.run_id),
        )
        con.commit()
        con.close()
        with History(db_path) as history:
            return history.run(mon.run_id).status

    # this process is alive: only the heartbeat's age decides (5 s either side of the edge)
    assert status_with_heartbeat_age(stale_s - 5) == "running"
    assert status_with_heartbeat_age(stale_s + 5) == "crashed"
    # to the millisecond, with the row as stored in the file
    run = run_row(db_path)
    fields = {k: run[k] for k in ("host", "pid", "heartbeat_at_s", "interval_s")}
    edge = run["heartbeat_at_s"] + stale_s
    assert effective_status("running", **fields, now_s=edge - 0.001) == "running"
    assert effective_status("running", **fields, now_s=edge + 0.001) == "crashed"


def _small_watched_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1_000, 8), nn.Flatten(), nn.Linear(32, 1))
    return model, torch.optim.Adam(model.parameters())


def _small_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randint(0, 1_000, (16, 4))).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


# saved by _small_step: the embedding's int64 ids [16, 4], the Linear's input [16, 32] and pow's
# input [16, 1] (float32); the loss's saved tensors are the watched model's step's too
SMALL_STEP_ACTIVATIONS_BYTES = 16 * 4 * 8 + 16 * 32 * 4 + 16 * 4


def test_another_models_activations_between_steps_are_not_the_watched_models(
    db_path: Path,
) -> None:
    model, opt = _small_watched_model()
    other = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 1))
    other_opt = torch.optim.SGD(other.parameters(), lr=0.01)
    # a 1 MiB budget the watched model fits (~128 KiB) and the other's 4 MiB forward does not
    with edo_monitor.watch(model, db=db_path, budget="1MiB", enforce=True) as mon:
        for _ in range(5):
            _small_step(model, opt)
            other(torch.randn(512, 256)).pow(2).mean().backward()
            other_opt.step()
            other_opt.zero_grad()
    summary = mon.summary()
    assert summary.status == "finished"
    assert summary.peak_activations_bytes == SMALL_STEP_ACTIVATIONS_BYTES


def test_an_inner_watch_of_another_model_is_not_charged_to_the_outer(db_path: Path) -> None:
    model, opt = _small_watched_model()
    inner = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1))
    inner_opt = torch.optim.SGD(inner.parameters(), lr=0.01)
    with edo_monitor.watch(model, db=db_path, budget="200KiB", enforce=True) as mon:
        with edo_monitor.watch(inner, db=db_path) as inner_mon:
            for _ in range(3):
                inner(torch.randn(128, 256)).pow(2).mean().backward()
                inner_opt.step()
                inner_opt.zero_grad()
        for _ in range(3):
            _small_step(model, opt)
    assert mon.summary().peak_activations_bytes == SMALL_STEP_ACTIVATIONS_BYTES
    # the inner run's: the first Linear's input [128, 256], ReLU's result [128, 64] (the second
    # Linear's input: one storage, counted once) and pow's input [128, 1], float32
    assert inner_mon.summary().peak_activations_bytes == 4 * 128 * (256 + 64 + 1)


class _CallsItsParts(nn.Module):
    """A LightningModule's way: the step calls the children, never the module itself; or a
    grandchild directly (``self.body[0]``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Embedding(1_000, 8), nn.Flatten(), nn.Linear(32, 1))

    def step_through_children(self, ids: torch.Tensor) -> torch.Tensor:
        return self.body(ids)

    def step_through_a_grandchild(self, ids: torch.Tensor) -> torch.Tensor:
        return self.body[2](self.body[1](self.body[0](ids)))


@pytest.mark.parametrize("way", ["step_through_children", "step_through_a_grandchild"])
def test_a_step_that_calls_the_models_parts_counts_their_activations(
    db_path: Path, way: str
) -> None:
    """The window opened only at the watched model's own forward: a step that calls its children
    (Lightning's training_step) read 0 bytes of activations, and the policy planned without
    them. The first saved parameter opens it (what was saved before it is missed: the ids the
    embedding saved, the Linear's input saved before its weight); from the next step on, the
    children's forwards open it: the peak is the whole step's. A grandchild called directly
    keeps opening it at its parameter: pow's input only."""
    model = _CallsItsParts()
    opt = torch.optim.Adam(model.parameters())
    with edo_monitor.watch(model, db=db_path) as mon:
        for _ in range(3):
            getattr(model, way)(torch.randint(0, 1_000, (16, 4))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    seen = mon.summary().peak_activations_bytes
    if way == "step_through_children":
        assert seen == SMALL_STEP_ACTIVATIONS_BYTES
    else:
        assert seen == 16 * 4


def test_the_watched_model_copies_and_saves_while_watched(db_path: Path, tmp_path: Path) -> None:
    """The hooks the agent puts on the model (the activations' step window, the tables' lookup
    counting) were torch's own: ``copy.deepcopy(model)``, ``torch.save(model)`` and
    ``AveragedModel(model)`` copied the tracker behind them and raised ``TypeError: cannot
    pickle '_thread.lock' object``. The copies train and count nothing of the watched run."""
    model, opt = _small_watched_model()
    with edo_monitor.watch(model, db=db_path) as mon:
        for _ in range(3):
            _small_step(model, opt)
            mon.step()
        ema = torch.optim.swa_utils.AveragedModel(model)
        copied = copy.deepcopy(model)
        torch.save(model, tmp_path / "model.pt")
        loaded = torch.load(tmp_path / "model.pt", weights_only=False)
        ids = torch.randint(0, 1_000, (16, 4))
        copied(ids).pow(2).mean().backward()  # another model's step: not the watched run's
        with torch.no_grad():
            for other in (ema, copied, loaded):
                assert torch.equal(other(ids), model(ids))
    assert mon.summary().peak_activations_bytes == SMALL_STEP_ACTIVATIONS_BYTES


def test_a_policy_with_nothing_to_measure_free_memory_is_warned_about(
    db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On a CPU without ``budget=`` no reading has a free fraction, so a policy can never act;
    the run ended with no event and nothing said why (``explain`` only, afterwards)."""
    model = nn.Linear(4, 1)
    for budget, mode, expected in ((None, "auto", 1), ("1GiB", "auto", 0), (None, "observe", 0)):
        caplog.clear()
        with edo_monitor.watch(
            model, db=db_path, budget=budget, policy=edo_monitor.Policy(mode=mode)
        ):
            model(torch.randn(8, 4)).sum().backward()
        warned = [r for r in caplog.records if "the policy cannot act here" in r.getMessage()]
        assert len(warned) == expected, (budget, mode)
