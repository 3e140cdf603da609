"""watch(tensorboard=): real event files, read back with TensorBoard's own EventAccumulator and
compared with the real SQLite history of the same run."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("tensorboard", reason="needs tensorboard: pip install '.[tensorboard]'")

from readme_blocks import readme_python_blocks
from tensorboard.backend.event_processing.event_accumulator import (
    TENSORS,
    EventAccumulator,
)
from tensorboard.compat.proto import types_pb2
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


def assert_fast_loader_reads(acc: EventAccumulator, tag: str) -> None:
    """Every event of ``tag`` is a scalar in the form tensorboard-data-server (the default
    ``--load_fast`` loader) reads: a rank-0 ``DT_FLOAT`` tensor with one ``float_val`` (or 4 bytes
    of ``tensor_content``); its ``data_compat.rs`` drops any other dtype, ``DT_DOUBLE`` too."""
    events = acc.Tensors(tag)
    assert events, tag
    for e in events:
        proto = e.tensor_proto
        assert proto.dtype == types_pb2.DT_FLOAT, (tag, e.step, proto.dtype)
        assert not proto.tensor_shape.dim, (tag, e.step)
        assert len(proto.float_val) == 1 or len(proto.tensor_content) == 4, (tag, e.step)
    metadata = acc.SummaryMetadata(tag)
    assert metadata.plugin_data.plugin_name == "scalars", tag


def float32(value: float) -> float:
    """``value`` as TensorBoard stores it: rounded to the nearest float32."""
    return float(np.float32(value))


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
        # every reading, at its step, as float32 (the fast loader reads no doubles): exact up to
        # 2**24, the nearest float32 above
        assert_fast_loader_reads(acc, f"edo/{field}")
        assert series(acc, f"edo/{field}") == [(step, float32(v)) for step, v in history], field
    assert len(series(acc, "edo/in_use_bytes")) == monitor.summary().samples
    # each event as text at its step: the decision and the action among them
    events = query(db_path, "SELECT step, kind, message FROM events ORDER BY id")
    assert {"decision", "action"} <= {kind for _, kind, _ in events}
    for kind in {kind for _, kind, _ in events}:
        written = series(acc, f"edo/events/{kind}/text_summary")
        expected = [(s, f"`{m}`".encode()) for s, k, m in events if k == kind]
        assert written == expected, kind


def test_a_folder_under_the_home_is_the_homes(
    db_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tensorboard="~/tb"`` was checked under the home folder and written to ``./~/tb``."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    model, opt = model_and_opt()
    with edo_monitor.watch(model, db=db_path, interval_s=0.05, tensorboard="~/tb") as monitor:
        train(model, opt, 3)
    assert len(series(read_events(home / "tb"), "edo/params_bytes")) == monitor.summary().samples
    assert list(work.iterdir()) == []


def test_a_writer_passed_in_is_flushed_and_left_open(db_path: Path, tmp_path: Path) -> None:
    writer = SummaryWriter(log_dir=str(tmp_path / "mine"))
    model, opt = model_and_opt()
    budget_bytes = 1_000_000_007  # above 2**24: float32 keeps 1,000,000,000 (a multiple of 64)
    with edo_monitor.watch(
        model, db=db_path, budget=budget_bytes, interval_s=0.05, tensorboard=writer
    ) as monitor:
        train(model, opt, 3)
    # flushed at the run's end: readable now, before the writer is closed
    acc = read_events(tmp_path / "mine")
    assert len(series(acc, "edo/params_bytes")) == monitor.summary().samples
    # a byte count above 2**24 comes back as the nearest float32: within a relative 2**-24
    assert_fast_loader_reads(acc, "edo/budget_bytes")
    budgets = {value for _, value in series(acc, "edo/budget_bytes")}
    assert budgets == {1_000_000_000.0}
    assert abs(1_000_000_000 - budget_bytes) / budget_bytes <= 2**-24
    writer.add_scalar("user/loss", 1.0, 0)  # still the user's writer, still open
    writer.close()
    assert read_events(tmp_path / "mine").Scalars("user/loss")[0].value == 1.0


def test_a_log_dir_that_cannot_be_made_never_fails_training(db_path: Path, tmp_path: Path) -> None:
    """A folder that became impossible between watch() and the start (checked at watch(): see
    the next test): the run goes on without TensorBoard, one agent error."""
    blocker = tmp_path / "a-file"
    model, opt = model_and_opt()
    monitor = edo_monitor.watch(model, db=db_path, interval_s=0.02, tensorboard=blocker / "tb")
    blocker.write_text("not a folder")
    with monitor:
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
    # a folder under a file: refused before the run (it failed at the start with a traceback
    # from inside TensorBoard), nothing created
    blocker = db_path.parent / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(
        ConfigError,
        match=rf"^tensorboard='{re.escape(str(blocker))}/tb/x' cannot be a log folder: "
        rf"'{re.escape(str(blocker))}' is a file",
    ):
        edo_monitor.watch(model, db=db_path, tensorboard=str(blocker / "tb" / "x"))
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


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


@pytest.mark.slow
def test_tensorboards_default_fast_loader_shows_the_scalars(db_path: Path, tmp_path: Path) -> None:
    """The real ``tensorboard --load_fast=true`` (tensorboard-data-server, TensorBoard's default
    loader) on a free loopback port: the scalars plugin lists every ``edo/*`` scalar of the run
    and returns the history's values (as float32)."""
    pytest.importorskip(
        "tensorboard_data_server", reason="needs tensorboard-data-server (the fast loader)"
    )
    model, opt = model_and_opt()
    with edo_monitor.watch(
        model, db=db_path, budget=12_000_000, interval_s=0.02, tensorboard=tmp_path / "runs" / "edo"
    ):
        train(model, opt, 10)
    history = {
        field: query(
            db_path, f"SELECT step, {field} FROM samples WHERE {field} IS NOT NULL ORDER BY id"
        )
        for field in SCALAR_FIELDS
    }
    expected = {f"edo/{field}" for field, rows in history.items() if rows}
    port = free_loopback_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(tmp_path / "runs"),
            "--load_fast=true",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--reload_interval",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        tags: dict[str, Any] = {}
        deadline = time.monotonic() + 120
        while not expected <= set(tags.get("edo", {})) and time.monotonic() < deadline:
            assert server.poll() is None, server.communicate()[0]
            with contextlib.suppress(urllib.error.URLError, ConnectionError):  # not serving yet
                tags = get_json(f"http://127.0.0.1:{port}/data/plugin/scalars/tags")
            time.sleep(0.5)
        assert expected <= set(tags.get("edo", {})), tags
        rows = get_json(
            f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run=edo&tag=edo/in_use_bytes"
        )  # [[wall_time, step, value], ...]
        # the data server keeps one value a step (a record at a step it has seen replaces what it
        # holds from that step on): the last reading of each step
        last_of_step = {step: float32(v) for step, v in history["in_use_bytes"]}
        assert [(step, value) for _, step, value in rows] == sorted(last_of_step.items())
    finally:
        server.terminate()
        try:
            server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()
