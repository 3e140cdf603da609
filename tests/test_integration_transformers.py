"""EdoMonitorCallback in real Hugging Face Trainer runs on a CPU (models built from tiny configs:
nothing downloaded), into real SQLite histories."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install '.[transformers]'"
)
pytest.importorskip(
    "accelerate", reason="the Trainer needs accelerate: pip install '.[transformers]'"
)

from readme_blocks import readme_python_blocks  # noqa: E402
from watch_helpers import count  # noqa: E402

from edo_monitor.errors import ConfigError  # noqa: E402
from edo_monitor.integrations.transformers import (  # noqa: E402
    EdoMonitorCallback,
    TrainingDidNotEnd,
)

VOCAB, SEQ = 1_000, 16


class TinyBert(transformers.BertForMaskedLM):
    """BertForMaskedLM that raises in its forward once ``fail_at_call`` forwards have run."""

    fail_at_call: int | None = None
    calls = 0

    def forward(self, input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        if self.fail_at_call is not None and self.calls == self.fail_at_call:
            raise RuntimeError(f"boom in forward {self.calls}")
        self.calls += 1
        return super().forward(input_ids=input_ids, labels=labels, **kwargs)


def tiny_bert() -> TinyBert:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
    )
    return TinyBert(config)


def dataset(n: int = 64) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=gen)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def make_trainer(
    model: Any, callback: EdoMonitorCallback, out: Path, max_steps: int, **args: Any
) -> Any:
    training_args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=8,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        **args,
    )
    return transformers.Trainer(
        model=model, args=training_args, train_dataset=dataset(), callbacks=[callback]
    )


def runs(db: Path) -> list[dict]:
    con = sqlite3.connect(db)
    con.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in con.execute("SELECT * FROM runs ORDER BY id")]
    finally:
        con.close()


def test_a_train_is_one_finished_run(db_path: Path, tmp_path: Path) -> None:
    callback = EdoMonitorCallback(db=db_path, interval_s=0.05)
    trainer = make_trainer(tiny_bert(), callback, tmp_path / "out", 4, run_name="tiny-bert")
    trainer.train()
    (run,) = runs(db_path)
    assert (run["name"], run["status"], run["error"]) == ("tiny-bert", "finished", None)
    assert run["steps"] == 4 == trainer.state.global_step  # optimizer steps
    assert '"integration": "transformers"' in run["config"]
    samples = count(db_path, "SELECT count(*) FROM samples")
    assert samples == callback.monitor.summary().samples >= 1
    assert count(db_path, "SELECT max(step) FROM samples") == 4  # the last reading, after step 4
    # accelerate wraps the optimizer: the monitor counts (and acts at) the AdamW inside
    (opt,) = callback.monitor.optimizers
    assert type(opt) is torch.optim.AdamW
    assert not [t for t in threading.enumerate() if t.name.startswith("edo-")]


def test_a_failed_train_is_recorded_by_the_next_one(
    db_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Trainer tells callbacks nothing when train() raises: the run stays open until the next
    train() (or the process's exit) ends it with the exception the interpreter reported."""
    model = tiny_bert()
    model.fail_at_call = 2
    callback = EdoMonitorCallback(db=db_path, interval_s=0.05)
    trainer = make_trainer(model, callback, tmp_path / "out", 4)
    with pytest.raises(RuntimeError, match="boom in forward 2") as raised:
        trainer.train()
    assert callback.monitor is not None and callback.monitor.status == "running"
    # what the interpreter does with an error it reports as uncaught (a notebook cell's)
    monkeypatch.setattr(sys, "last_value", raised.value, raising=False)
    monkeypatch.setattr(sys, "last_exc", raised.value, raising=False)
    model.fail_at_call = None
    trainer.train()
    first, second = runs(db_path)
    assert first["status"] == "failed" and first["error"] == "RuntimeError: boom in forward 2"
    assert first["steps"] == 2  # two forwards, two optimizer steps
    assert (second["status"], second["steps"]) == ("finished", 4)


def test_close_records_the_error_at_once(db_path: Path, tmp_path: Path) -> None:
    model = tiny_bert()
    model.fail_at_call = 1
    callback = EdoMonitorCallback(db=db_path, interval_s=0.05)
    try:
        make_trainer(model, callback, tmp_path / "out", 4).train()
    except RuntimeError as exc:
        callback.close(exc)
    (run,) = runs(db_path)
    assert (run["status"], run["error"], run["steps"]) == (
        "failed",
        "RuntimeError: boom in forward 1",
        1,
    )
    callback.close()  # nothing open: a no-op
    assert runs(db_path)[0]["status"] == "failed"


@pytest.mark.slow
def test_at_exit_an_open_run_fails_with_its_own_trainers_exception(tmp_path: Path) -> None:
    """A real interpreter exit: run 1's train() raised and the script caught it (TrainingDidNotEnd
    at exit); run 2's train() raised uncaught (failed with that exception, not run 1's)."""
    db = tmp_path / "history.db"
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_integration_transformers import EdoMonitorCallback, make_trainer, tiny_bert

        first = tiny_bert()
        first.fail_at_call = 1
        cb1 = EdoMonitorCallback(db={str(db)!r}, interval_s=0.05)
        try:
            make_trainer(first, cb1, {str(tmp_path / "o1")!r}, 3).train()
        except RuntimeError:
            pass  # caught, never closed
        second = tiny_bert()
        second.fail_at_call = 2
        cb2 = EdoMonitorCallback(db={str(db)!r}, interval_s=0.05)
        make_trainer(second, cb2, {str(tmp_path / "o2")!r}, 3).train()
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "boom in forward 2" in proc.stderr
    first, second = runs(db)
    assert first["status"] == "failed"
    assert first["error"].startswith(f"{TrainingDidNotEnd.__name__}: Trainer.train() did not")
    assert (second["status"], second["error"], second["steps"]) == (
        "failed",
        "RuntimeError: boom in forward 2",
        2,
    )


def test_an_option_watch_does_not_take_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"\(optimizer=\.\.\.\): not an option"):
        EdoMonitorCallback(optimizer=None)


@pytest.mark.parametrize(
    ("run_name", "recorded"),
    [
        ("exp 1\tlr=0.1", "exp 1 lr=0.1"),  # failed train(): watch() refuses a control character
        ("a\nb\r", "a b "),
        (" \n", "TinyBert"),  # nothing printable left: the model's class name
    ],
)
def test_a_run_name_from_the_args_is_made_printable(
    db_path: Path, tmp_path: Path, run_name: str, recorded: str
) -> None:
    callback = EdoMonitorCallback(db=db_path, interval_s=0.05)
    make_trainer(tiny_bert(), callback, tmp_path / "out", 2, run_name=run_name).train()
    (run,) = runs(db_path)
    assert (run["name"], run["status"], run["steps"]) == (recorded, "finished", 2)


def test_a_run_name_of_the_users_with_a_tab_is_refused_at_train(
    db_path: Path, tmp_path: Path
) -> None:
    """Only a name the callback takes from ``args`` is made printable: the user's own
    run_name= is checked as watch() checks it."""
    callback = EdoMonitorCallback(db=db_path, run_name="exp 1\tlr=0.1")
    trainer = make_trainer(tiny_bert(), callback, tmp_path / "out", 2)
    with pytest.raises(ConfigError, match=r"run_name 'exp 1\\tlr=0.1' holds a control character"):
        trainer.train()
    assert not db_path.exists() or runs(db_path) == []  # nothing started


@pytest.mark.parametrize("config", [[("a", 1)], "abc", ""])
def test_a_config_that_is_not_a_mapping_fails_train_at_its_start(
    db_path: Path, tmp_path: Path, config: Any
) -> None:
    """config=[...] raised a bare TypeError out of the callback's own ``**config`` (and a falsy
    one was let through): a ConfigError naming it, as watch(config=...) gives."""
    callback = EdoMonitorCallback(db=db_path, config=config)
    trainer = make_trainer(tiny_bert(), callback, tmp_path / "out", 2)
    message = f"config={config!r}: expected a mapping of names to values, or None"
    with pytest.raises(ConfigError, match=re.escape(message)):
        trainer.train()
    assert not db_path.exists() or runs(db_path) == []  # nothing started
    assert callback.monitor is None


def test_the_users_config_is_recorded_beside_the_callbacks(db_path: Path, tmp_path: Path) -> None:
    callback = EdoMonitorCallback(db=db_path, config={"lr": 0.01, "max_steps": 99})
    make_trainer(tiny_bert(), callback, tmp_path / "out", 2).train()
    config = json.loads(runs(db_path)[0]["config"])
    assert (config["integration"], config["lr"], config["max_steps"]) == ("transformers", 0.01, 99)


@pytest.mark.usefixtures("default_sigterm")
def test_a_sigterm_caught_around_train_is_recorded_by_the_next_one(
    db_path: Path, tmp_path: Path
) -> None:
    """SIGTERM raised Terminated (a SystemExit: Python reports none in sys.last_exc) out of
    train(): the run is interrupted with SIGTERM, as watch() and Lightning record it, not
    failed with TrainingDidNotEnd. A train() that ends leaves SIGTERM's default action."""

    class Terminate(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            if state.global_step == 2:
                assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
                os.kill(os.getpid(), signal.SIGTERM)

    callback = EdoMonitorCallback(db=db_path, interval_s=0.05)
    trainer = make_trainer(tiny_bert(), callback, tmp_path / "out", 4)
    trainer.add_callback(Terminate())
    with pytest.raises(SystemExit) as raised:
        trainer.train()
    assert raised.value.code == 143
    assert callback.monitor is not None and callback.monitor.status == "running"
    trainer.remove_callback(Terminate)
    trainer.train()
    first, second = runs(db_path)
    assert (first["status"], first["error"], first["steps"]) == ("interrupted", "SIGTERM", 2)
    assert (second["status"], second["error"], second["steps"]) == ("finished", None, 4)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.slow
def test_sigterm_to_a_process_mid_train_records_the_run_interrupted(tmp_path: Path) -> None:
    """A scheduler's SIGTERM to a real process mid-train: it exits 143 (as SIGTERM's default
    action reads), and the run ended at exit is interrupted with SIGTERM (it read failed with
    TrainingDidNotEnd, where Lightning and watch() read interrupted)."""
    db = tmp_path / "history.db"
    script = textwrap.dedent(
        f"""
        import signal, sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import transformers
        from test_integration_transformers import EdoMonitorCallback, make_trainer, tiny_bert

        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

        class Slow(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 3:
                    print("step 3", flush=True)
                time.sleep(0.05)

        callback = EdoMonitorCallback(db={str(db)!r}, interval_s=0.05)
        trainer = make_trainer(tiny_bert(), callback, {str(tmp_path / "out")!r}, 100_000)
        trainer.add_callback(Slow())
        try:
            trainer.train()
        finally:
            print("finally ran", flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.strip() == "step 3":
                break
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 143, err[-3000:]
    assert "finally ran" in out
    (run,) = runs(db)
    assert (run["status"], run["error"]) == ("interrupted", "SIGTERM")
    assert run["steps"] >= 3


def test_the_readme_trainer_section_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (code,) = readme_python_blocks("Hugging Face Trainer")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EDO_DB", raising=False)  # the README writes ./edo-history.db
    namespace: dict[str, Any] = {"__name__": "readme"}
    exec(compile(code, "README.md (Hugging Face Trainer)", "exec"), namespace)
    summary = namespace["callback"].monitor.summary()
    assert (summary.status, summary.steps) == ("finished", 8)
    assert summary.run_name == "BertForSequenceClassification"
    (run,) = runs(tmp_path / "edo-history.db")
    assert (run["status"], run["budget_bytes"]) == ("finished", 4_000_000)


class BagOfIds(torch.nn.Module):
    """A 20,000 x 32 table (with Adam: ~10.2 MB) and a head; the Trainer's loss in a dict."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20_000, 32)
        self.head = torch.nn.Linear(32, 2)

    def forward(self, input_ids: Any = None, labels: Any = None, **_: Any) -> dict[str, Any]:
        logits = self.head(self.emb(input_ids).mean(1))
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def ids_dataset(n: int = 512) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 20_000, (n, 8), generator=gen)
    labels = torch.randint(0, 2, (n,), generator=gen)
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


@pytest.mark.slow
def test_a_resumed_train_after_a_conversion_trains_as_its_twin_and_names_its_run(
    db_path: Path, tmp_path: Path
) -> None:
    """The policy caches the table in a first ``train()`` of 6 steps, checkpointed;
    ``train(resume_from_checkpoint=)`` to 12 loads it, trains equal to an untouched twin
    resumed from the same checkpoint, and is a new run naming the first one."""
    import edo_monitor
    from edo_monitor.store.history import History

    def train(callback: Any, steps: int, resume: str | None) -> Any:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"),
            max_steps=steps,
            per_device_train_batch_size=64,
            use_cpu=True,
            report_to=[],
            save_strategy="steps" if resume is None else "no",
            save_steps=6,
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_drop_last=True,
            optim="adamw_torch",  # the row cache refuses fused AdamW, the Trainer's default
        )
        model = BagOfIds()
        trainer = transformers.Trainer(
            model=model,
            args=args,
            train_dataset=ids_dataset(),
            callbacks=[callback] if callback else [],
        )
        trainer.train(resume_from_checkpoint=resume)
        return model

    def watched() -> EdoMonitorCallback:
        # a cooldown longer than the run: the only decision is the conversion (the cache frees
        # more than the re-arm level needs, so grow_cache may follow 5 steps later: a race)
        return EdoMonitorCallback(
            db=db_path,
            budget=12_000_000,
            policy=edo_monitor.Policy(cooldown_steps=100),
            interval_s=0.01,
        )

    first = watched()
    train(first, 6, None)
    assert [a["action"] for a in first.monitor.summary().actions] == ["cache_embedding"]
    ckpt = str(tmp_path / "out" / "checkpoint-6")
    resumed = watched()
    mine = train(resumed, 12, ckpt)
    twin = train(None, 12, ckpt)
    for (name, a), (_, b) in zip(
        mine.state_dict().items(), twin.state_dict().items(), strict=True
    ):  # the cache's host-side Adam differs from the eager one by ~5e-7 in 6 steps
        assert a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-5), name
    old_id, new_id = first.monitor.run_id, resumed.monitor.run_id
    assert new_id != old_id
    with History(db_path) as h:
        run = h.run(new_id)
        assert (run.status, run.steps) == ("finished", 6)
        origin = run.config["resumed_from"]
        assert origin == {
            "run_id": old_id,
            "run_uuid": first.monitor.run_uuid,
            "step": 6,
            "checkpoint": ckpt,
        }
        (event,) = h.events(new_id, kind="resumed_from")
        assert event.data == origin


def test_a_fused_optimizer_under_an_acting_policy_is_warned_about(
    db_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """transformers 5 defaults to ``optim="adamw_torch_fused"``, which every table action
    refuses: the run only recorded ``no_action`` reasons. The callback now says how to fix it."""
    import edo_monitor

    for optim, warned in (("adamw_torch_fused", True), ("adamw_torch", False)):
        caplog.clear()
        callback = EdoMonitorCallback(db=db_path, policy=edo_monitor.Policy(), interval_s=0.05)
        make_trainer(tiny_bert(), callback, tmp_path / optim, 1, optim=optim).train()
        fused = [r for r in caplog.records if "optim='adamw_torch'" in r.getMessage()]
        assert len(fused) == int(warned), optim


def test_a_resumed_train_writes_tensorboard_on_the_trainers_global_step(
    db_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train(resume_from_checkpoint=)`` from global step 6 into the Trainer's own TensorBoard
    folder: its ``train/loss`` is at steps 7-12, and edo's scalars and events were at 0-6, from
    the new run's own step count; they now start at the checkpoint's step. The history still
    counts the run's steps from 0."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        TENSORS,
        EventAccumulator,
    )

    from edo_monitor.store.history import History

    def train(steps: int, resume: str | None, log_dir: Path) -> EdoMonitorCallback:
        monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(log_dir))  # the Trainer's folder
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"),
            max_steps=steps,
            per_device_train_batch_size=64,
            use_cpu=True,
            report_to=["tensorboard"],
            save_strategy="steps" if resume is None else "no",
            save_steps=6,
            logging_steps=1,
            disable_tqdm=True,
            dataloader_drop_last=True,
        )
        callback = EdoMonitorCallback(db=db_path, interval_s=0.01, tensorboard=log_dir)
        trainer = transformers.Trainer(
            model=BagOfIds(), args=args, train_dataset=ids_dataset(), callbacks=[callback]
        )
        trainer.train(resume_from_checkpoint=resume)
        return callback

    def steps(log_dir: Path) -> dict[str, set[int]]:
        acc = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0, TENSORS: 0})
        acc.Reload()
        tags = acc.Tags()
        out = {t: {e.step for e in acc.Scalars(t)} for t in tags["scalars"]}
        out.update({t: {e.step for e in acc.Tensors(t)} for t in tags["tensors"]})
        return out

    train(6, None, tmp_path / "tb-first")
    first = steps(tmp_path / "tb-first")
    assert first["train/loss"] == set(range(1, 7)) and min(first["edo/in_use_bytes"]) == 0
    resumed = train(12, str(tmp_path / "out" / "checkpoint-6"), tmp_path / "tb-resumed")
    got = steps(tmp_path / "tb-resumed")
    assert got["train/loss"] == set(range(7, 13))
    assert min(got["edo/in_use_bytes"]) == 6 and max(got["edo/in_use_bytes"]) == 12
    assert got["edo/events/resumed_from/text_summary"] == {6}  # recorded at the run's step 0
    with History(db_path) as h:
        run = h.run(resumed.monitor.run_id)
        assert (run.status, run.steps) == ("finished", 6)
        assert [e.step for e in h.events(run.id, kind="resumed_from")] == [0]
    con = sqlite3.connect(db_path)
    try:
        span = con.execute(
            "SELECT MIN(step), MAX(step) FROM samples WHERE run_id = ?", (run.id,)
        ).fetchone()
    finally:
        con.close()
    assert span == (0, 6)
