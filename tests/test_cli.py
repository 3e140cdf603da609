"""The ``edo-monitor`` CLI on a seeded database (typer's CliRunner, plus one real subprocess)."""

from __future__ import annotations

import csv
import io
import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_history import N_SAMPLES, seed
from typer.testing import CliRunner

from edo_monitor.cli import app
from edo_monitor.store.schema import SCHEMA_VERSION

runner = CliRunner()


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "h.db"
    seed(path)
    return path


def run(*args: str, db: Path | None = None, env: dict[str, str] | None = None) -> Any:
    argv = [*args] + (["--db", str(db)] if db is not None else [])
    return runner.invoke(app, argv, env=env)


def test_runs_table_and_json(db: Path) -> None:
    res = run("runs", db=db)
    assert res.exit_code == 0, res.output
    for word in ("embed-big", "finished", "failed", "interrupted", "crashed"):
        assert word in res.output
    data = json.loads(run("runs", "--json", db=db).stdout)
    assert len(data) == 5 and {"status", "peak_in_use_bytes", "steps_per_s"} <= set(data[0])
    crashed = json.loads(run("runs", "--json", "--status", "crashed", db=db).stdout)
    assert [r["name"] for r in crashed] == ["dead"]


def test_db_from_env_and_global_option(db: Path) -> None:
    res = runner.invoke(app, ["runs", "--json"], env={"EDO_DB": str(db)})
    assert res.exit_code == 0 and len(json.loads(res.stdout)) == 5
    res = runner.invoke(app, ["--db", str(db), "runs", "--json"])
    assert res.exit_code == 0 and len(json.loads(res.stdout)) == 5


def test_show_events_compare(db: Path) -> None:
    res = run("show", "1", db=db)
    assert res.exit_code == 0
    for word in ("embed-big", "peaks", "threshold_crossed", "modules", "emb", "head"):
        assert word in res.output
    mods = run("show", "1", "--modules", db=db)
    assert mods.exit_code == 0
    assert mods.output.index("emb ") < mods.output.index("head")  # top consumer first
    assert "threshold_crossed" not in mods.output
    shown = json.loads(run("show", "latest", "--json", db=db).stdout)
    assert shown["run"]["name"] in {"live", "dead"}
    ev = json.loads(run("events", "1", "--kind", "action", "--json", db=db).stdout)
    assert [e["kind"] for e in ev] == ["action"]
    cmp_ = run("compare", "1", "2", db=db)
    assert cmp_.exit_code == 0 and "peak_in_use_bytes" in cmp_.output and "offload" in cmp_.output
    metrics = json.loads(run("compare", "1", "2", "--json", db=db).stdout)["metrics"]
    assert {m["name"] for m in metrics} >= {"peak_in_use_bytes", "min_free_fraction", "steps_per_s"}


def test_export_formats(db: Path, tmp_path: Path) -> None:
    res = run("export", "1", "--format", "csv", db=db)
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert len(rows) == N_SAMPLES and "in_use_bytes" in rows[0]
    assert {r["device_kind"] for r in rows} == {"cpu-budget"}  # what each reading measured
    out = tmp_path / "r.json"
    assert run("export", "1", "--format", "json", "--out", str(out), db=db).exit_code == 0
    doc = json.loads(out.read_text())
    assert len(doc["samples"]) == N_SAMPLES and len(doc["events"]) == 4
    lines = run("export", "1", "--format", "jsonl", db=db).stdout.splitlines()
    kinds = [json.loads(line)["type"] for line in lines]
    assert kinds.count("sample") == N_SAMPLES and kinds[0] == "run" and "module" in kinds
    bad = run("export", "1", "--format", "xml", db=db)
    assert bad.exit_code == 2 and "csv, json or jsonl" in bad.stderr


def test_sql_reads_and_refuses_writes(db: Path) -> None:
    res = run("sql", "SELECT count(*) AS n FROM samples", "--json", db=db)
    assert res.exit_code == 0 and json.loads(res.stdout) == [{"n": N_SAMPLES + 300}]
    before = db.read_bytes()
    for stmt in (
        "INSERT INTO meta VALUES ('x', 'y')",
        "UPDATE runs SET name = 'x'",
        "DELETE FROM samples",
        "DROP TABLE samples",
        "ATTACH DATABASE 'other.db' AS o",
        "PRAGMA journal_mode = DELETE",
        "PRAGMA user_version = 5",
        "CREATE TABLE t (x)",
        "VACUUM",
    ):
        res = run("sql", stmt, db=db)
        assert res.exit_code == 1, stmt
        assert "read-only" in res.stderr and "Traceback" not in res.output, stmt
    assert db.read_bytes() == before
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM samples").fetchone()[0] == N_SAMPLES + 300
    assert run("sql", "PRAGMA table_info(runs)", db=db).exit_code == 0
    bad = run("sql", "SELEC 1", db=db)
    assert bad.exit_code == 2 and "syntax error" in bad.stderr


def test_errors_are_one_line_with_exit_codes(db: Path, tmp_path: Path) -> None:
    res = run("show", "99", db=db)
    assert res.exit_code == 1 and res.stderr.count("\n") == 1 and "99" in res.stderr
    res = run("runs", db=tmp_path / "missing.db")
    assert res.exit_code == 1 and "no history database" in res.stderr
    junk = tmp_path / "junk.db"
    junk.write_text("this is not a database at all" * 100)
    res = run("runs", db=junk)
    assert res.exit_code == 1 and "not an SQLite database" in res.stderr
    res = run("runs", db=tmp_path)  # a directory
    assert res.exit_code == 2 and "directory" in res.stderr
    assert run("runs", "--since", "soon", db=db).exit_code == 2
    assert run("prune", db=db).exit_code == 2
    assert run("runs", "--no-such-option").exit_code == 2


def test_doctor(db: Path, tmp_path: Path) -> None:
    data = json.loads(run("doctor", "--json", db=db).stdout)
    assert data["ok"] and data["schema_version"] == SCHEMA_VERSION == 3
    assert data["quick_check"] == ["ok"]
    assert data["rows"]["samples"] == N_SAMPLES + 300 and data["bytes_per_sample"] > 0
    assert run("doctor", "--full", db=db).exit_code == 0


def test_prune_cli(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    seed(path)
    res = run("prune", "--keep-last", "2", "--dry-run", "--json", db=path)
    assert json.loads(res.stdout)["runs_deleted"] == 3
    assert len(json.loads(run("runs", "--json", db=path).stdout)) == 5
    before = json.loads(run("show", "1", "--json", db=path).stdout)["run"]
    res = run("prune", "--downsample-older-than", "1d", "--bucket", "5m", db=path)
    assert res.exit_code == 0, res.output
    after = json.loads(run("show", "1", "--json", db=path).stdout)["run"]
    assert after["sample_count"] < before["sample_count"]
    assert after["peak_in_use_bytes"] == before["peak_in_use_bytes"]
    assert after["min_free_fraction"] == pytest.approx(before["min_free_fraction"])
    res = run("prune", "--keep-last", "2", "--vacuum", db=path)
    assert res.exit_code == 0
    names = [r["name"] for r in json.loads(run("runs", "--json", db=path).stdout)]
    assert len(names) == 2


def test_estimate() -> None:
    res = run("estimate", "--num-embeddings", "50000", "--embedding-dim", "64", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["params_bytes"] == 50000 * 64 * 4
    bad = run("estimate", "--num-embeddings", "10", "--embedding-dim", "4", "--dtype", "foo")
    assert bad.exit_code == 2 and "foo" in bad.stderr


def test_console_script_subprocess(db: Path) -> None:
    exe = Path(sys.executable).with_name("edo-monitor")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "edo_monitor.cli"]
    res = subprocess.run([*cmd, "show", "nope", "--db", str(db)], capture_output=True, text=True)
    assert res.returncode == 1 and res.stderr.startswith("edo-monitor: error:")
    assert "Traceback" not in res.stderr


def test_cli_on_runs_recorded_by_the_agent(tmp_path: Path) -> None:
    """Regression: ``compare`` read ``bytes_saved`` where the agent writes ``saved_bytes``, and
    ``export --out`` could overwrite the history database itself."""
    import torch
    from torch import nn

    import edo_monitor

    path = tmp_path / "agent.db"
    for policy in (edo_monitor.Policy(), edo_monitor.Policy(mode="observe")):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(20_000, 32), nn.Linear(32, 4))
        opt = torch.optim.Adam(model.parameters())
        with edo_monitor.watch(model, db=path, budget=12_000_000, policy=policy, interval_s=0.01):
            for _ in range(30):
                model(torch.randint(0, 20_000, (64,))).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    res = run("compare", "1", "2", db=path)
    assert res.exit_code == 0, res.output
    assert "offload_embedding" in res.output and "9.77 MiB" in res.output  # 4 x 2.56 MB
    before = path.read_bytes()
    refused = run("export", "1", "--out", str(path), db=path)
    assert refused.exit_code == 2 and "history database itself" in refused.stderr
    assert path.read_bytes() == before
    assert run("runs", "--limit", "-1", db=path).exit_code == 2


def test_history_commands_import_no_torch(db: Path) -> None:
    """Start-up: ``import edo_monitor`` and the history commands never import torch (it costs
    seconds); ``edo_monitor.watch`` still works, importing it on first use (PEP 562)."""
    code = (
        "import json, sys\n"
        "import edo_monitor\n"
        "from edo_monitor.cli import app\n"
        "for argv in (['runs'], ['show', '1'], ['events', '1'], ['compare', '1', '2'],\n"
        "             ['export', '1'], ['sql', 'SELECT 1'], ['doctor'], ['--help']):\n"
        "    try:\n"
        "        app([*argv, *(['--db', sys.argv[1]] if argv != ['--help'] else [])])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))\n"
        "watch = edo_monitor.watch\n"
        "print(json.dumps([heavy, watch.__module__, 'torch' in sys.modules]))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(db)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    heavy, watch_module, torch_after = json.loads(res.stdout.splitlines()[-1])
    assert heavy == []
    assert watch_module == "edo_monitor.agent.monitor" and torch_after is True
