"""EdoMonitorCallback in real Lightning fits on a CPU, into real SQLite histories."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch", reason="needs lightning: pip install '.[lightning]'")
loggers = pytest.importorskip("lightning.pytorch.loggers")

from readme_blocks import readme_python_blocks  # noqa: E402
from watch_helpers import wait_for  # noqa: E402

import edo_monitor  # noqa: E402
from edo_monitor.errors import ConfigError  # noqa: E402
from edo_monitor.integrations.lightning import EdoMonitorCallback  # noqa: E402
from edo_monitor.nn import CachedTable  # noqa: E402
from edo_monitor.store.history import History  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers:UserWarning",  # Lightning's advice on DataLoaders
    "ignore:.*smaller than the logging interval:UserWarning",
    "ignore:.*LeafSpec",  # Lightning 2.6 on torch 2.13's pytree
)

ROWS, DIM, BATCH = 20_000, 32, 64


class BagOfWords(pl.LightningModule):
    """A bag-of-words classifier whose embedding table (20,000 x 32) dominates memory."""

    def __init__(self, fail_at_batch: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(ROWS, DIM)
        self.head = nn.Linear(DIM, 2)
        self.fail_at_batch = fail_at_batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at_batch:
            raise RuntimeError(f"boom at batch {batch_idx}")
        ids, labels = batch
        return nn.functional.cross_entropy(self.head(self.emb(ids).mean(1)), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def loader(batches: int = 40) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ROWS, (batches * BATCH, 8), generator=gen)
    labels = torch.randint(0, 2, (batches * BATCH,), generator=gen)
    data = torch.utils.data.TensorDataset(ids, labels)
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def trainer(callback: EdoMonitorCallback, max_steps: int, logger: Any) -> Any:
    return pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=logger,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


class WaitForDecision(pl.Callback):
    """Holds the fit at its first batch's end until the watching callback's policy has a
    decision recorded (applied at the next step boundary) or an action applied: a short fit then
    applies it however slow the sampler thread is."""

    def __init__(self, watching: EdoMonitorCallback) -> None:
        self.watching, self.waited = watching, False

    def on_train_batch_end(self, *args: Any) -> None:
        if self.waited:
            return
        self.waited = True
        mon = self.watching.monitor
        wait_for(
            lambda: (
                mon.summary().actions
                or (mon.policy.pending is not None and mon.policy.pending is mon._tuner._announced)
            ),
            "the policy's decision",
        )


def rows(db: Path, sql: str) -> list[dict]:
    con = sqlite3.connect(db)
    con.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in con.execute(sql)]
    finally:
        con.close()


def runs(db: Path) -> list[dict]:
    return rows(db, "SELECT * FROM runs ORDER BY id")


def agent_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("edo-")]


def test_a_fit_is_one_run_named_after_the_logger(db_path: Path, tmp_path: Path) -> None:
    callback = EdoMonitorCallback(db=db_path, interval_s=0.02)
    t = trainer(callback, 6, loggers.CSVLogger(tmp_path / "logs", name="csv"))
    t.fit(BagOfWords(), loader())
    (run,) = runs(db_path)
    assert run["name"] == "csv/version_0"  # the logger's name and version, as its folder
    assert run["status"] == "finished" and run["error"] is None
    assert run["steps"] == 6 == t.global_step  # one per optimizer step
    assert run["device_kind"] == "cpu-budget"
    with History(db_path) as h:
        config = h.run(run["id"]).config
    steps = [r["step"] for r in rows(db_path, "SELECT step FROM samples ORDER BY id")]
    assert config["integration"] == "lightning" and config["max_steps"] == 6
    # the last reading is taken after the last step; every one is in the history
    assert steps[-1] == 6 and len(steps) == callback.monitor.summary().samples >= 2
    assert callback.monitor.summary().status == "finished"
    assert agent_threads() == []  # the sampler, writer and host threads are gone


def test_without_a_logger_the_run_is_named_after_the_module(db_path: Path) -> None:
    callback = EdoMonitorCallback(db=db_path, interval_s=0.05)
    trainer(callback, 2, False).fit(BagOfWords(), loader(2))
    (run,) = runs(db_path)
    assert (run["name"], run["status"], run["steps"]) == ("BagOfWords", "finished", 2)


def test_an_exception_in_training_step_fails_the_run(db_path: Path) -> None:
    callback = EdoMonitorCallback(db=db_path, interval_s=0.02)
    with pytest.raises(RuntimeError, match="boom at batch 3"):
        trainer(callback, 10, False).fit(BagOfWords(fail_at_batch=3), loader())
    (run,) = runs(db_path)
    assert run["status"] == "failed"
    assert run["error"] == "RuntimeError: boom at batch 3"
    assert run["steps"] == 3  # batches 0-2 stepped the optimizer
    assert agent_threads() == []
    # the model is no longer watched: watching it again works
    model = BagOfWords()
    with edo_monitor.watch(model, db=db_path, interval_s=1):
        pass


def test_the_policy_acts_inside_lightnings_optimizer_step(db_path: Path, tmp_path: Path) -> None:
    """With a budget the table does not fit in, the policy's action is applied on the training
    thread inside LightningOptimizer.step (after the step's closure), and the fit completes;
    tensorboard=True puts the readings into the TensorBoardLogger's own run."""
    seen: list[tuple[str, list[str]]] = []

    def on_action(result: Any) -> None:
        files = [f.filename.replace("\\", "/") for f in traceback.extract_stack()]
        seen.append((threading.current_thread().name, files))

    # params + grads + Adam's two states of the table: 4 x 2.56 MB = 10.24 MB of a 12 MB budget
    # leaves ~15 % free after the first step, below the 20 % floor
    policy = edo_monitor.Policy(on_action=on_action)
    callback = EdoMonitorCallback(
        db=db_path, budget=12_000_000, policy=policy, interval_s=0.01, tensorboard=True
    )
    tb_logger = loggers.TensorBoardLogger(tmp_path / "tb", name="tiny")
    t = trainer(callback, 30, tb_logger)
    t.fit(BagOfWords(), loader())
    (run,) = runs(db_path)
    assert (run["name"], run["status"], run["steps"]) == ("tiny/version_0", "finished", 30)
    actions = callback.monitor.summary().actions
    assert actions and actions[0]["status"] == "applied", callback.monitor.summary()
    assert actions[0]["action"] == "cache_embedding" and actions[0]["target"] == "emb"
    thread, files = seen[0]
    assert thread == threading.main_thread().name
    assert any(f.endswith("lightning/pytorch/core/optimizer.py") for f in files)  # .step()
    assert any(f.endswith("torch/optim/optimizer.py") for f in files)  # its post-hook
    assert not any("training_step" in f for f in files)  # not inside the closure's forward
    # the TensorBoard event files are in the logger's folder, beside Lightning's own
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator

    acc = EventAccumulator(tb_logger.log_dir, size_guidance={TENSORS: 0})
    acc.Reload()
    assert "edo/in_use_bytes" in acc.Tags()["tensors"]
    assert "edo/events/action/text_summary" in acc.Tags()["tensors"]


@pytest.mark.slow
def test_an_epoch_shorter_than_the_accumulation_steps_once_at_its_end(db_path: Path) -> None:
    """``limit_train_batches=3, accumulate_grad_batches=4``: Lightning 2.6 steps the optimizer
    at each epoch's last batch (3 of the 4 accumulated), once per epoch. The run's steps, its
    safe points (where the policy's action lands) and the optimizer steps that really happen are
    the same: 4 in 4 epochs, the action inside one of them."""
    stepped: list[int] = []
    acted: list[tuple[int, int, list[str]]] = []

    class Counted(BagOfWords):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            time.sleep(0.02)  # the sampler reads the pressure between batches
            return super().training_step(batch, batch_idx)

        def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            stepped.append(self.trainer.global_step)
            super().optimizer_step(*args, **kwargs)

    def on_action(result: Any) -> None:
        files = [f.filename.replace("\\", "/") for f in traceback.extract_stack()]
        acted.append((callback.monitor.steps, len(stepped), files))

    callback = EdoMonitorCallback(
        db=db_path,
        budget=12_000_000,
        policy=edo_monitor.Policy(on_action=on_action),
        interval_s=0.005,
    )
    t = pl.Trainer(
        max_epochs=4,
        limit_train_batches=3,
        accumulate_grad_batches=4,
        accelerator="cpu",
        logger=False,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t.fit(Counted(), loader(3))
    assert stepped == [0, 1, 2, 3] and t.global_step == 4
    (run,) = runs(db_path)
    assert (run["status"], run["steps"]) == ("finished", 4)
    assert callback.monitor.summary().steps == 4
    assert acted, callback.monitor.summary()  # the table does not fit: the policy acts
    steps_then, optimizer_steps_then, files = acted[0]
    assert steps_then == optimizer_steps_then - 1  # inside the step being taken, not a batch's
    assert any(f.endswith("torch/optim/optimizer.py") for f in files)  # its post-hook


@pytest.mark.slow
def test_a_fit_resumed_after_a_conversion_trains_as_its_twin_and_names_its_run(
    db_path: Path, tmp_path: Path
) -> None:
    """The policy caches the table in a first fit of 6 steps, saved; ``fit(ckpt_path=)`` to 12
    steps loads it, trains equal to an untouched twin resumed from the same checkpoint (the
    agent caches the table again), and is a new run that names the first one
    (``config["resumed_from"]``, from the callback's checkpoint state, and a ``resumed_from``
    event). Each watched fit waits at its first batch for the policy's decision
    (:class:`WaitForDecision`): six steps are then enough on a slow machine."""

    def fit(callback: Any, steps: int, ckpt: Path | None, save: Path | None) -> BagOfWords:
        t = pl.Trainer(
            max_steps=steps,
            accelerator="cpu",
            logger=False,
            callbacks=[callback, WaitForDecision(callback)] if callback else [],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        module = BagOfWords()
        t.fit(module, loader(), ckpt_path=str(ckpt) if ckpt else None)
        if save is not None:
            t.save_checkpoint(save)
        return module

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
    fit(first, 6, None, tmp_path / "watched.ckpt")
    assert [a["action"] for a in first.monitor.summary().actions] == ["cache_embedding"]
    resumed = watched()
    mine = fit(resumed, 12, tmp_path / "watched.ckpt", None)
    assert [a["action"] for a in resumed.monitor.summary().actions] == ["cache_embedding"]
    twin = fit(None, 12, tmp_path / "watched.ckpt", None)  # the same checkpoint, no agent
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
        assert (origin["run_id"], origin["run_uuid"]) == (old_id, first.monitor.run_uuid)
        assert origin["step"] == 6 and origin["checkpoint"].endswith("watched.ckpt")
        (event,) = h.events(new_id, kind="resumed_from")
        assert event.data == origin


def test_the_same_module_cached_in_one_fit_resumes_from_a_checkpoint_in_the_next(
    db_path: Path, tmp_path: Path
) -> None:
    """Regression: after a fit that cached the table, ``fit(module, ckpt_path=)`` on the same
    module object (a notebook's second cell) failed in Lightning's restore of the optimizer:
    ``configure_optimizers()`` over ``self.parameters()`` holds the cache's row buffer, and torch
    refused the checkpoint ("doesn't match the size of optimizer's group"). The callback now
    attaches cached tables to the new optimizers first; the fit trains as an untouched twin
    resumed from the same checkpoint."""
    callback = EdoMonitorCallback(
        db=db_path, budget=12_000_000, policy=edo_monitor.Policy(), interval_s=0.01
    )
    module = BagOfWords()
    first = trainer(callback, 6, logger=False)
    first.fit(module, loader())
    first.save_checkpoint(tmp_path / "cached.ckpt")
    assert isinstance(module.emb, CachedTable)
    trainer(callback, 12, logger=False).fit(module, loader(), ckpt_path=tmp_path / "cached.ckpt")
    twin = BagOfWords()
    trainer_twin = pl.Trainer(
        max_steps=12,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer_twin.fit(twin, loader(), ckpt_path=tmp_path / "cached.ckpt")
    assert callback.monitor is not None and callback.monitor.steps == 6
    for (name, a), (_, b) in zip(
        module.state_dict().items(), twin.state_dict().items(), strict=True
    ):  # the cache's host-side Adam differs from the eager one by ~5e-7 in 6 steps
        assert a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-5), name


class LoggedBagOfWords(BagOfWords):
    """BagOfWords that logs its loss at every step (Lightning's own scalar, on its step axis)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, labels = batch
        self.log("val_loss", nn.functional.cross_entropy(self.head(self.emb(ids).mean(1)), labels))


class _FailingValidation(LoggedBagOfWords):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        raise RuntimeError("validation broke")


def tb_trainer(callback: Any, tmp_path: Path, version: str, steps: int) -> tuple[Any, Any]:
    """A trainer of ``steps`` steps with ``callback`` and a ``TensorBoardLogger`` (its run
    ``version`` under ``tmp_path/tb``) written at every step, and that logger."""
    tb_logger = loggers.TensorBoardLogger(tmp_path / "tb", name="x", version=version)
    t = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=tb_logger,
        callbacks=[callback],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return t, tb_logger


def tensorboard_steps(log_dir: str) -> dict[str, set[int]]:
    """Tag -> the steps it was written at, scalars and tensors (edo's float32 scalars) alike."""
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        TENSORS,
        EventAccumulator,
    )

    acc = EventAccumulator(log_dir, size_guidance={SCALARS: 0, TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()
    out = {t: {e.step for e in acc.Scalars(t)} for t in tags["scalars"]}
    out.update({t: {e.step for e in acc.Tensors(t)} for t in tags["tensors"]})
    return out


def test_a_resumed_fit_writes_tensorboard_on_the_trainers_global_step(
    db_path: Path, tmp_path: Path
) -> None:
    """``fit(ckpt_path=)`` from global step 5: Lightning's ``train_loss`` is at steps 5-9 of the
    resumed run's TensorBoard folder, and edo's scalars and events were at 0-5, from the new
    run's own step count; they now start at the checkpoint's global step. The history still
    counts the run's steps from 0."""

    def fit(steps: int, version: str, ckpt: Path | None) -> Any:
        callback = EdoMonitorCallback(db=db_path, interval_s=0.01, tensorboard=True)
        t, tb_logger = tb_trainer(callback, tmp_path, version, steps)
        t.fit(LoggedBagOfWords(), loader(5), ckpt_path=ckpt)  # saved at an epoch's end
        if ckpt is None:
            t.save_checkpoint(tmp_path / "first.ckpt")
        return callback, tb_logger.log_dir

    _, first_dir = fit(5, "a", None)
    got = tensorboard_steps(first_dir)
    assert got["train_loss"] == set(range(5)) and min(got["edo/in_use_bytes"]) == 0
    resumed, log_dir = fit(10, "b", tmp_path / "first.ckpt")
    got = tensorboard_steps(log_dir)
    assert got["train_loss"] == set(range(5, 10))
    assert min(got["edo/in_use_bytes"]) == 5 and max(got["edo/in_use_bytes"]) == 10
    assert got["edo/events/resumed_from/text_summary"] == {5}  # recorded at the run's step 0
    with History(db_path) as h:
        run = h.run(resumed.monitor.run_id)
        assert (run.status, run.steps) == ("finished", 5)
        assert [e.step for e in h.events(run.id, kind="resumed_from")] == [0]
    (span,) = rows(db_path, f"SELECT MIN(step) lo, MAX(step) hi FROM samples WHERE run_id={run.id}")
    assert (span["lo"], span["hi"]) == (0, 5)


def test_a_checkpoint_loaded_to_validate_does_not_resume_the_next_fit(
    db_path: Path, tmp_path: Path
) -> None:
    """``validate(ckpt_path=)`` loads the checkpoint into the callback; a fresh ``fit()`` after
    it with the same callback is no resumed fit: its TensorBoard steps start at 0 (they started
    at the checkpoint's step 5) and it names no run it resumes."""
    callback = EdoMonitorCallback(db=db_path, interval_s=0.01, tensorboard=True)

    def make(version: str, steps: int) -> tuple[Any, Any]:
        return tb_trainer(callback, tmp_path, version, steps)

    first, _ = make("a", 5)
    first.fit(LoggedBagOfWords(), loader(5))
    first.save_checkpoint(tmp_path / "first.ckpt")
    checker, _ = make("v", 5)
    checker.validate(LoggedBagOfWords(), loader(2), ckpt_path=tmp_path / "first.ckpt")
    # regression: a validate that raised is torn down by no callback hook: the checkpoint it
    # loaded stayed, and the next fit was recorded as resumed from it
    failing, _ = make("w", 5)
    with pytest.raises(RuntimeError, match="validation broke"):
        failing.validate(_FailingValidation(), loader(2), ckpt_path=tmp_path / "first.ckpt")
    fresh, tb_logger = make("b", 3)
    fresh.fit(LoggedBagOfWords(), loader(3))
    got = tensorboard_steps(tb_logger.log_dir)
    assert min(got["edo/in_use_bytes"]) == 0 and got["train_loss"] == {0, 1, 2}
    assert "edo/events/resumed_from/text_summary" not in got
    with History(db_path) as h:
        run = h.run(callback.monitor.run_id)
        assert "resumed_from" not in run.config
        assert h.events(run.id, kind="resumed_from") == []


def test_an_option_watch_does_not_take_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"\(intervl_s=\.\.\.\): not an option"):
        EdoMonitorCallback(intervl_s=0.1)
    with pytest.raises(ConfigError, match=r"\(model=\.\.\.\): not an option"):
        EdoMonitorCallback(model=nn.Linear(1, 1))


def test_a_logger_name_with_control_characters_names_the_run_with_spaces(
    db_path: Path, tmp_path: Path
) -> None:
    """A logger named with a tab failed the fit (watch() refuses a control character in a
    run_name), where the fit works without the callback: the name taken from the logger has
    each control character as a space."""
    callback = EdoMonitorCallback(db=db_path, interval_s=0.05)
    logger = loggers.CSVLogger(tmp_path / "logs", name="exp 1\tlr=0.1\n")
    trainer(callback, 2, logger).fit(BagOfWords(), loader(2))
    (run,) = runs(db_path)
    assert (run["name"], run["status"], run["steps"]) == ("exp 1 lr=0.1 /version_0", "finished", 2)


def test_a_run_name_of_the_users_with_a_tab_is_refused_at_fit_start(db_path: Path) -> None:
    """Only a name the callback takes from the framework is made printable: the user's own
    run_name= is checked as watch() checks it."""
    callback = EdoMonitorCallback(db=db_path, run_name="exp 1\tlr=0.1")
    with pytest.raises(ConfigError, match=r"run_name 'exp 1\\tlr=0.1' holds a control character"):
        trainer(callback, 2, False).fit(BagOfWords(), loader(2))
    assert not db_path.exists() or runs(db_path) == []  # nothing started


@pytest.mark.parametrize("config", [[("a", 1)], "abc", ""])
def test_a_config_that_is_not_a_mapping_fails_the_fit_at_start(db_path: Path, config: Any) -> None:
    """config=[...] raised a bare TypeError out of the callback's own ``**config`` (and a falsy
    one was let through): a ConfigError naming it, as watch(config=...) gives."""
    callback = EdoMonitorCallback(db=db_path, config=config)
    message = f"config={config!r}: expected a mapping of names to values, or None"
    with pytest.raises(ConfigError, match=re.escape(message)):
        trainer(callback, 2, False).fit(BagOfWords(), loader(2))
    assert not db_path.exists() or runs(db_path) == []  # nothing started


def test_the_users_config_is_recorded_beside_the_callbacks(db_path: Path) -> None:
    callback = EdoMonitorCallback(db=db_path, config={"lr": 0.01, "max_steps": 99})
    trainer(callback, 2, False).fit(BagOfWords(), loader(2))
    with History(db_path) as h:
        config = h.run(callback.monitor.run_id).config
    assert (config["integration"], config["lr"], config["max_steps"]) == ("lightning", 0.01, 99)


@pytest.mark.usefixtures("default_sigterm")
def test_sigterm_during_a_fit_ends_the_run_interrupted(db_path: Path) -> None:
    """A scheduler's SIGTERM mid-fit: the monitor's handler (which Lightning's own calls) raises
    Terminated, and on_exception records the run interrupted with SIGTERM (the Hugging Face
    callback records the same: test_integration_transformers.py)."""

    class Terminate(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step == 3:
                assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
                os.kill(os.getpid(), signal.SIGTERM)

    callback = EdoMonitorCallback(db=db_path, interval_s=0.05)
    t = trainer(callback, 10, False)
    t.callbacks.append(Terminate())
    with pytest.raises(SystemExit) as raised:
        t.fit(BagOfWords(), loader())
    assert raised.value.code == 143  # the exit status of a process SIGTERM ended
    (run,) = runs(db_path)
    assert (run["status"], run["error"], run["steps"]) == ("interrupted", "SIGTERM", 3)
    assert agent_threads() == []


@pytest.mark.usefixtures("default_sigterm")
def test_a_fit_leaves_sigterms_action_as_it_found_it(db_path: Path) -> None:
    """Lightning's signal connector saved the monitor's SIGTERM handler at the fit's start and put
    it back at its end, after the monitor's stop(): SIGTERM kept raising Terminated after every
    fit. The callback's teardown puts the default action back; after a failed fit (no callback
    hook comes after Lightning puts the handler back) the next fit does."""
    callback = EdoMonitorCallback(db=db_path, interval_s=0.05)
    trainer(callback, 2, False).fit(BagOfWords(), loader(2))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with pytest.raises(RuntimeError, match="boom at batch 1"):
        trainer(callback, 2, False).fit(BagOfWords(fail_at_batch=1), loader(2))
    trainer(callback, 2, False).fit(BagOfWords(), loader(2))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert [r["status"] for r in runs(db_path)] == ["finished", "failed", "finished"]


def test_tensorboard_true_without_a_tensorboard_logger_fails_the_fit_at_start(
    db_path: Path, tmp_path: Path
) -> None:
    callback = EdoMonitorCallback(db=db_path, tensorboard=True)
    with pytest.raises(ConfigError, match="needs a TensorBoardLogger"):
        trainer(callback, 2, loggers.CSVLogger(tmp_path)).fit(BagOfWords(), loader(2))
    assert not db_path.exists() or runs(db_path) == []  # nothing started


@pytest.mark.slow
def test_the_pytorch_lightning_package_takes_its_own_flavour(db_path: Path) -> None:
    ptl = pytest.importorskip("pytorch_lightning", reason="needs the pytorch_lightning package")
    from edo_monitor.integrations.pytorch_lightning import EdoMonitorCallback as PtlCallback

    class Module(ptl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(100, 4)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.emb(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randint(0, 100, (32, 3)))
    callback = PtlCallback(db=db_path, interval_s=0.05)
    assert isinstance(callback, ptl.Callback)
    t = ptl.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t.fit(Module(), torch.utils.data.DataLoader(data, batch_size=8))
    (run,) = runs(db_path)
    assert (run["name"], run["status"], run["steps"]) == ("Module", "finished", 3)
    assert run["config"] and '"lightning_package": "pytorch_lightning"' in run["config"]


def test_the_readme_lightning_section_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (code,) = readme_python_blocks("Lightning")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EDO_DB", raising=False)  # the README writes ./edo-history.db
    namespace: dict[str, Any] = {"__name__": "readme"}
    exec(compile(code, "README.md (Lightning)", "exec"), namespace)
    summary = namespace["callback"].monitor.summary()
    assert summary.status == "finished" and summary.steps == 30
    assert summary.run_name == "lightning_logs/version_0"
    assert [a["action"] for a in summary.actions][:1] == ["cache_embedding"], summary
    # training_step calls the module's children, never the module: its activations read 0
    # (the README printed 13 KiB before, and the policy planned without them)
    assert summary.peak_activations_bytes >= 64 * 8 * 8, summary  # a batch's ids, at least
    (run,) = runs(tmp_path / "edo-history.db")
    assert run["status"] == "finished"
