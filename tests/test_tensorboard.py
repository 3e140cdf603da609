"""watch(tensorboard=): real event files, read back with TensorBoard's own EventAccumulator and
compared with the real SQLite history of the same run."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("tensorboard", reason="needs tensorboard: pip install '.[tensorboard]'")

from readme_blocks import readme_python_blocks
from tensorboard.backend.event_processing.event_accumulator import (
    TENSORS,
    EventAccumulator,
)
from tensorboard.util import tensor_util
from torch.utils.tensorboard import SummaryWriter

import edo_monitor
from edo_monitor.errors import ConfigError
from edo_monitor.integrations.tensorboard import SCALAR_FIELDS

ROWS, DIM = 20_000, 32


def model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(ROWS, DIM), nn.Linear(DIM, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randint(0, ROWS, (64,), generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def read_events(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={TENSORS: 0})  # 0: keep every event
    acc.Reload()
    return acc


def series(acc: EventAccumulator, tag: str) -> list[tuple[int, Any]]:
    """(step, value) of every event of ``tag``, in the order written."""
    return [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]


def query(db: Path, sql: str) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_the_scalars_are_the_historys_samples_and_the_events_its_events(
    db_path: Path, tmp_path: Path
) -> None:
    model, opt = model_and_opt()
    # a budget the table (params, grads, Adam's two states: 10.24 MB) leaves < 20 % of: an action
    with edo_monitor.watch(
        model,
        db=db_path,
        budget=12_000_000,
        policy=edo_monitor.Policy(),
        interval_s=0.01,
        tensorboard=tmp_path / "tb",
    ) as monitor:
        train(model, opt, 30)
    assert monitor.summary().actions, monitor.summary()
    acc = read_events(tmp_path / "tb")
    tags = set(acc.Tags()["tensors"])
    for field in SCALAR_FIELDS:
        history = query(
            db_path, f"SELECT step, {field} FROM samples WHERE {field} IS NOT NULL ORDER BY id"
        )
        if not history:  # allocator and NVML fields: none in CPU-budget mode
            assert f"edo/{field}" not in tags
            continue
        # every reading, at its step, the value exactly (doubles: byte counts above 2**24 too)
        assert series(acc, f"edo/{field}") == [(step, float(v)) for step, v in history], field
    assert len(series(acc, "edo/in_use_bytes")) == monitor.summary().samples
    # each event as text at its step: the decision and the action among them
    events = query(db_path, "SELECT step, kind, message FROM events ORDER BY id")
    assert {"decision", "action"} <= {kind for _, kind, _ in events}
    for kind in {kind for _, kind, _ in events}:
        written = series(acc, f"edo/events/{kind}/text_summary")
        expected = [(s, f"`{m}`".encode()) for s, k, m in events if k == kind]
        assert written == expected, kind


def test_a_writer_passed_in_is_flushed_and_left_open(db_path: Path, tmp_path: Path) -> None:
    writer = SummaryWriter(log_dir=str(tmp_path / "mine"))
    model, opt = model_and_opt()
    with edo_monitor.watch(model, db=db_path, interval_s=0.05, tensorboard=writer) as monitor:
        train(model, opt, 3)
    # flushed at the run's end: readable now, before the writer is closed
    assert len(series(read_events(tmp_path / "mine"), "edo/params_bytes")) == (
        monitor.summary().samples
    )
    writer.add_scalar("user/loss", 1.0, 0)  # still the user's writer, still open
    writer.close()
    assert read_events(tmp_path / "mine").Scalars("user/loss")[0].value == 1.0


def test_a_log_dir_that_cannot_be_made_never_fails_training(db_path: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    model, opt = model_and_opt()
    with edo_monitor.watch(
        model, db=db_path, interval_s=0.02, tensorboard=blocker / "tb"
    ) as monitor:
        train(model, opt, 5)
    summary = monitor.summary()
    assert summary.status == "finished" and summary.steps == 5
    (where,) = summary.agent_errors
    assert where.startswith("tensorboard:")  # logged once, recorded as one event
    assert query(db_path, "SELECT count(*) FROM events WHERE kind = 'agent_error'") == [(1,)]


def test_bad_values_and_a_missing_package_are_config_errors(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = model_and_opt()
    with pytest.raises(ConfigError, match="tensorboard=42 is neither"):
        edo_monitor.watch(model, db=db_path, tensorboard=42)
    with pytest.raises(ConfigError, match="tensorboard='' is not a folder"):
        edo_monitor.watch(model, db=db_path, tensorboard="")
    # as if the package were not installed: the import fails
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"pip install 'edo-monitor\[tensorboard\]'"):
        edo_monitor.watch(model, db=db_path, tensorboard="runs")
    assert not db_path.exists()  # refused before anything started


def test_the_readme_tensorboard_section_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (code,) = readme_python_blocks("TensorBoard")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EDO_DB", raising=False)  # the README writes ./edo-history.db
    exec(compile(code, "README.md (TensorBoard)", "exec"), {"__name__": "readme"})
    acc = read_events(tmp_path / "runs" / "edo")
    steps = [step for step, _ in series(acc, "edo/in_use_bytes")]
    assert steps[-1] == 100 and steps == sorted(steps)
    (n,) = query(tmp_path / "edo-history.db", "SELECT count(*) FROM samples")[0]
    assert len(steps) == n
