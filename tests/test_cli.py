"""The ``edo-monitor`` CLI on a seeded database (typer's CliRunner, plus one real subprocess)."""

from __future__ import annotations

import csv
import io
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_runner import runner
from history_seed import N_SAMPLES, seed

from edo_monitor.store.schema import SCHEMA_VERSION
from edo_monitor.surfaces.cli import app


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
    # filters that leave none say so, not "no runs recorded" (it read as an empty database)
    res = run("runs", "--name", "zzz", "--tag", "a", db=db)
    assert res.exit_code == 0
    assert (
        res.output.strip() == "no runs match --name 'zzz', --tag 'a' (the database holds 5 run(s))"
    )


def test_db_from_env_and_global_option(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    res = runner.invoke(app, ["runs", "--json"], env={"EDO_DB": str(db)})
    assert res.exit_code == 0 and len(json.loads(res.stdout)) == 5
    monkeypatch.delenv("EDO_DB", raising=False)
    res = runner.invoke(app, ["--db", str(db), "runs", "--json"])
    assert res.exit_code == 0 and len(json.loads(res.stdout)) == 5
    # the global option is for that command only: the caller's environment is left as it was
    # (it leaked into every later in-process watch() of the test session)
    assert "EDO_DB" not in os.environ
    monkeypatch.setenv("EDO_DB", "elsewhere.db")
    res = runner.invoke(app, ["--db", str(db), "runs", "--json"])
    assert res.exit_code == 0 and len(json.loads(res.stdout)) == 5
    assert os.environ["EDO_DB"] == "elsewhere.db"


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
    none = run("events", "1", "--kind", "bogus", db=db)  # said only "no events"
    kinds = sorted({e["kind"] for e in json.loads(run("events", "1", "--json", db=db).stdout)})
    assert none.exit_code == 0 and none.stdout.strip() == (
        f"run 1: no events of kind 'bogus' (its events are of kind {', '.join(kinds)})"
    )
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


def test_export_out_dash_is_standard_output(
    db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--out -`` wrote a file named ``-`` in the current folder."""
    monkeypatch.chdir(tmp_path)
    res = run("export", "1", "--format", "jsonl", "--out", "-", db=db)
    assert res.exit_code == 0, res.stderr
    assert res.stdout == run("export", "1", "--format", "jsonl", db=db).stdout
    assert json.loads(res.stdout.splitlines()[0])["type"] == "run"
    assert not (tmp_path / "-").exists() and res.stderr == ""


def test_json_output_is_strict_json(db: Path) -> None:
    """Regression: ``sql --json`` wrote ``Infinity`` and ``NaN``, which JSON has not (``jq`` and
    strict parsers refused the output); a non-finite number is ``null`` in every JSON output."""
    res = run("sql", "SELECT 1e308 * 10 AS inf, -1e308 * 10 AS ninf, 0.5 AS half", "--json", db=db)
    assert res.exit_code == 0
    strict = json.loads(res.stdout, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert strict == [{"inf": None, "ninf": None, "half": 0.5}]


def test_errors_are_one_line_with_exit_codes(db: Path, tmp_path: Path) -> None:
    res = run("show", "99", db=db)
    assert res.exit_code == 1 and res.stderr.count("\n") == 1 and "99" in res.stderr
    res = run("runs", db=tmp_path / "missing.db")
    assert res.exit_code == 1 and "no history database" in res.stderr
    res = run("runs", db=tmp_path / "no-such-folder" / "missing.db")  # the same code
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
    assert data["ok"] and data["schema_version"] == SCHEMA_VERSION == 8
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
    pytest.importorskip("torch")  # estimate sizes dtypes with torch
    res = run("estimate", "--num-embeddings", "50000", "--embedding-dim", "64", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["params_bytes"] == 50000 * 64 * 4
    bad = run("estimate", "--num-embeddings", "10", "--embedding-dim", "4", "--dtype", "foo")
    assert bad.exit_code == 2 and "foo" in bad.stderr
    # fp16 with master weights beside the float32 table it compresses: the table's figures, as
    # --json and the API give them (the float32 baseline was sized with master weights too and
    # refused: exit 2, "compression=None")
    args = ("estimate", "--num-embeddings", "100", "--embedding-dim", "64")
    for compression in ("fp16", "bf16"):
        text = run(*args, "--compression", compression, "--master-weights")
        assert text.exit_code == 0, text.output
        as_json = json.loads(
            run(*args, "--compression", compression, "--master-weights", "--json").stdout
        )
        assert f"total            {as_json['total_bytes']:,} bytes" in text.stdout


def test_console_script_subprocess(db: Path) -> None:
    exe = Path(sys.executable).with_name("edo-monitor")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "edo_monitor.surfaces.cli"]
    res = subprocess.run([*cmd, "show", "nope", "--db", str(db)], capture_output=True, text=True)
    assert res.returncode == 1 and res.stderr.startswith("edo-monitor: error:")
    assert "Traceback" not in res.stderr


def test_cli_on_runs_recorded_by_the_agent(tmp_path: Path) -> None:
    """Regression: ``compare`` read ``bytes_saved`` where the agent writes ``saved_bytes``, and
    ``export --out`` could overwrite the history database itself."""
    torch = pytest.importorskip("torch")  # absent in .ci/lowest-deps' environment
    from torch import nn

    import edo_monitor

    path = tmp_path / "agent.db"
    # offload's saving is the number checked below (the default ladder would cache the table first)
    offload = edo_monitor.Policy(ladder=["release_cache", "offload_embedding"])
    for policy in (offload, edo_monitor.Policy(mode="observe")):
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
    seconds) nor SQLAlchemy's ORM (readers use Core tables; the ORM and its mapped classes cost
    about 0.4 s); ``edo_monitor.watch`` still works, importing it on first use (PEP 562)."""
    code = (
        "import json, sys\n"
        "import edo_monitor\n"
        "from edo_monitor.surfaces.cli import app\n"
        "for argv in (['runs'], ['show', '1'], ['events', '1'], ['compare', '1', '2'],\n"
        "             ['export', '1'], ['sql', 'SELECT 1'], ['doctor'], ['explain', '1'],\n"
        "             ['replay', '1'], ['snapshot', '1'], ['--help']):\n"
        "    try:\n"
        "        app([*argv, *(['--db', sys.argv[1]] if argv != ['--help'] else [])])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')\n"
        "               or m.startswith('sqlalchemy.orm') or m == 'edo_monitor.store.models')\n"
        "import importlib.util\n"
        "has_torch = importlib.util.find_spec('torch') is not None\n"
        "watch = edo_monitor.watch.__module__ if has_torch else 'edo_monitor.agent.watch'\n"
        "print(json.dumps([heavy, watch, 'torch' in sys.modules or not has_torch]))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(db)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    heavy, watch_module, torch_after = json.loads(res.stdout.splitlines()[-1])
    assert heavy == []
    assert watch_module == "edo_monitor.agent.watch" and torch_after is True


# -- issue 10 -----------------------------------------------------------------------------------

DB_COMMANDS: list[tuple[list[str], list[str], list[str]]] = [
    # (arguments that work on the seeded database, bad arguments (usage), arguments that fail
    # at run time on the seeded database)
    (["runs"], ["runs", "--status", "exploded"], []),
    (["show", "1"], ["show", "1", "--max-events", "-1"], ["show", "99"]),
    (["events", "1"], ["events"], ["events", "99"]),
    (["compare", "1", "2"], ["compare", "1"], ["compare", "1", "99"]),
    (["export", "1"], ["export", "1", "--format", "xml"], ["export", "99"]),
    (["sql", "SELECT 1"], ["sql", "SELECT 1", "--timeout", "-1"], ["sql", "DELETE FROM runs"]),
    (["prune", "--keep-last", "9", "--dry-run"], ["prune", "--older-than", "banana"], []),
    (["doctor"], ["doctor", "--full", "maybe"], []),
    (["explain", "1"], ["explain", "1", "--top", "0"], ["explain", "99"]),
    (["replay", "1"], ["replay", "1", "--policy", "bogus=1"], ["replay", "99"]),
]


@pytest.mark.parametrize("ok, bad, failing", DB_COMMANDS, ids=[c[0][0] for c in DB_COMMANDS])
def test_exit_codes_for_each_command(
    db: Path, tmp_path: Path, ok: list[str], bad: list[str], failing: list[str]
) -> None:
    """One scheme: 0 ok, 1 runtime/data error (a missing file and a missing folder alike), 2
    usage (checked before anything is opened). No command creates a file it fails on."""
    assert run(*ok, db=db).exit_code == 0
    res = run(*bad, db=db)
    assert res.exit_code == 2, res.output
    if failing:
        res = run(*failing, db=db)
        assert res.exit_code == 1 and res.stderr.startswith("edo-monitor: error:"), res.output
    empty = tmp_path / "empty"
    empty.mkdir()
    for missing in (empty / "new.db", empty / "no-folder" / "new.db"):
        res = run(*ok, db=missing)
        assert res.exit_code == 1 and "no history database" in res.stderr, res.output
        assert run(*bad, db=missing).exit_code == 2
    assert list(empty.iterdir()) == []  # nothing created, by a reader or by a failing command


def test_help_lists_the_exit_codes() -> None:
    res = run("--help")
    assert res.exit_code == 0
    text = " ".join(res.stdout.split())
    for code in ("0 ok", "1 runtime or data error", "2 usage error", "3 internal error", "130"):
        assert code in text


def test_usage_errors_are_found_before_opening(tmp_path: Path) -> None:
    """Regression: ``prune --older-than banana --db new.db`` created a 76 KiB database."""
    for argv in (
        ["prune", "--older-than", "banana"],
        ["prune", "--keep-last", "1", "--bucket", "0s"],
        ["prune"],
        ["runs", "--status", "exploded"],
        ["runs", "--since", "soon"],
        ["export", "1", "--format", "xml"],
        ["export", "1", "--out", str(tmp_path / "no-folder" / "x.csv")],
        ["sql", "SELECT 1", "--timeout", "-1"],
        ["sql", "SELECT 1", "--json", "--csv"],
    ):
        res = run(*argv, db=tmp_path / "new.db")
        assert res.exit_code == 2, (argv, res.output)
    res = run("prune", "--keep-last", "1", db=tmp_path / "new.db")  # prune never creates one
    assert res.exit_code == 1 and "no history database" in res.stderr
    assert list(tmp_path.iterdir()) == []


def _wal_db(tmp_path: Path) -> tuple[Path, sqlite3.Connection]:
    """A seeded database with one more run whose insert is still only in the -wal file (the
    connection that wrote it stays open and never checkpoints, as a killed run leaves it)."""
    path = tmp_path / "k.db"
    seed(path)
    con = sqlite3.connect(path)
    con.execute("PRAGMA wal_autocheckpoint = 0")
    con.execute(
        "INSERT INTO runs (uuid, name, host, pid, started_at_s, status, device_kind, "
        "interval_s, torch_version, config, tags, steps, samples_dropped) VALUES "
        "('ffffffff-0000-4000-8000-000000000006', 'in-wal', 'h', 1, 1.0, 'finished', "
        "'cpu-budget', 1.0, '2.x', '{}', '[]', 0, 0)"
    )
    con.commit()
    assert Path(f"{path}-wal").stat().st_size > 0
    return path, con


@pytest.mark.parametrize(
    "command", [["export", "1", "--out"], ["snapshot", "1", "--out"], ["snapshot", "1", "--html"]]
)
def test_every_output_option_refuses_the_database_and_its_companion_files(
    tmp_path: Path, command: list[str]
) -> None:
    """Regression: ``export 1 --out k.db-wal`` on a database whose data was still in its WAL
    wiped every run; ``snapshot 1 --out k.db`` (and ``--html``) overwrote the database itself
    (one check for every file the CLI writes where the user says, before anything is read)."""
    import os

    path, con = _wal_db(tmp_path)
    try:
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
        (tmp_path / "link-to-wal").symlink_to(f"{path}-wal")
        (tmp_path / "link-to-db").symlink_to(path)
        os.link(path, tmp_path / "hard-link.db")
        for out in (
            "k.db",
            "k.db-wal",
            "k.db-shm",
            "k.db-journal",
            "link-to-wal",
            "link-to-db",
            "hard-link.db",
            "./sub/../k.db-wal",
        ):
            (tmp_path / "sub").mkdir(exist_ok=True)
            res = run(*command, str(tmp_path / out), db=path)
            assert res.exit_code == 2 and "is the history database" in res.stderr, out
            assert f"{command[-1]} {str(tmp_path / out)!r}" in res.stderr, out
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name in before} == before
        names = [r["name"] for r in json.loads(run("runs", "--json", db=path).stdout)]
        assert "in-wal" in names and len(names) == 6
    finally:
        con.close()


def test_export_writes_a_temporary_file_renamed_into_place(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.csv"
    out.write_text("previous export\n")
    res = run("export", "99", "--out", str(out), db=db)  # fails: the old file is untouched
    assert res.exit_code == 1 and out.read_text() == "previous export\n"
    assert run("export", "1", "--out", str(out), db=db).exit_code == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert len(rows) == N_SAMPLES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.csv"]  # no temporary file left
    assert out.stat().st_mode & 0o777 == 0o666 & ~_umask()


def test_an_output_that_cannot_be_written_is_one_line_naming_it(db: Path) -> None:
    """Regression: a folder that cannot be written gave ``OSError: [Errno 30] Read-only file
    system: '.../.x.csv.1sk7hp7a.tmp'``, naming a temporary file the user never typed (the
    snapshot's ``--out`` and ``--html`` write through the same ``open_output``). ``/proc``
    refuses new files even to root, whom a read-only folder does not stop."""
    target = "/proc/edo-monitor-test-output"
    res = run("export", "1", "--out", target, db=db)
    assert res.exit_code == 1, res.output
    assert res.stderr.startswith(f"edo-monitor: error: cannot write {target!r}: "), res.stderr
    assert ".tmp" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


INFINITE = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "


def test_sql_streams_rows_and_stops_on_ctrl_c(db: Path) -> None:
    """Regression: ``sql`` ignored Ctrl-C and fetched every row before printing any."""
    import signal
    import time

    code = (
        "import sys; from edo_monitor.surfaces.cli import main; sys.argv[0] = 'edo-monitor'; main()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "sql", INFINITE + "SELECT x FROM c", "--csv", "--db", str(db)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "x\n"
        first = [proc.stdout.readline() for _ in range(3)]
        assert first == ["1\n", "2\n", "3\n"]  # rows arrive while the statement runs on
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            proc.stdout.read(1 << 16)  # keep the pipe drained
        _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    # Ctrl-C is how a long query (or metrics, daemon) is stopped: said, not called an error
    assert err.strip().endswith("\nedo-monitor: interrupted") or err.strip() == (
        "edo-monitor: interrupted"
    )


def test_sql_time_limit_and_table_cap(db: Path) -> None:
    res = run("sql", INFINITE + "SELECT count(*) FROM c", "--timeout", "0.2", db=db)
    assert res.exit_code == 1 and "--timeout 0.2 s" in res.stderr
    assert "a write" not in res.stderr
    res = run("sql", INFINITE + "SELECT x FROM c", db=db)  # a table shows the first rows only
    assert res.exit_code == 0 and "first 1000 rows shown" in res.stdout
    assert "│ 1000 │" in res.stdout and "│ 1001 │" not in res.stdout
    res = run("sql", INFINITE + "SELECT x FROM c LIMIT 3", "--json", db=db)
    assert json.loads(res.stdout) == [{"x": 1}, {"x": 2}, {"x": 3}]
    res = run("sql", "SELECT 1 AS a WHERE 0", "--json", db=db)
    assert res.exit_code == 0 and json.loads(res.stdout) == []


def test_every_printed_run_reference_opens_its_run(db: Path) -> None:
    """Regression: ``runs`` printed 8-character uuid prefixes; an all-digit one (about 1 in 43)
    was read as a run id. The seed's first two uuids start ``90455722-7c1e-4``."""
    lines = [ln for ln in run("runs", db=db).stdout.splitlines() if ln.startswith("│")]
    printed = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("│").split("│")]
        printed[int(cells[0])] = cells[1]
    assert printed[1] == "90455722-7c1e-4c" and printed[2] == "90455722-7c1e-40"
    assert len(printed) == 5
    for run_id, ref in printed.items():
        for shown in (ref, str(run_id)):
            res = run("show", shown, "--json", db=db)
            assert res.exit_code == 0 and json.loads(res.stdout)["run"]["id"] == run_id


def test_user_strings_are_printed_as_they_are(tmp_path: Path) -> None:
    """Regression: a run named ``bert[lr=1e-4]`` was titled ``bert`` by ``show`` and
    ``sweep[/bs64]`` made ``runs`` exit 3 (parsed as markup)."""
    from sqlalchemy.orm import Session

    from edo_monitor.store.engine import open_engine
    from edo_monitor.store.models import Event, ModuleStat, Run

    path = tmp_path / "m.db"
    engine = open_engine(path)
    with Session(engine) as s, s.begin():
        for k, name in enumerate(("bert[lr=1e-4]", "sweep[/bs64]")):
            s.add(
                Run(
                    uuid=f"0000000{k}-0000-4000-8000-000000000000",
                    name=name,
                    host="[b]host",
                    pid=1,
                    status="finished",
                    started_at_s=1.0 + k,
                    ended_at_s=2.0 + k,
                    device_kind="cpu-budget",
                    device_name="cpu [x]",
                    interval_s=1.0,
                    torch_version="2.x",
                    config={},
                    tags=["[red]tag", ":fire:"],
                )
            )
        s.flush()
        s.add(
            Event(
                run_id=1,
                time_s=1.5,
                step=1,
                kind="action",
                message="[bold]boom[/] :fire:",
                data={"action": "[i]x", "target": "emb[0]"},
            )
        )
        s.add(
            ModuleStat(
                run_id=1,
                time_s=1.5,
                step=1,
                module="layers[0].emb[/x]",
                kind="Embedding",
                params_bytes=1,
                grads_bytes=0,
                optimizer_state_bytes=0,
                activations_bytes=0,
            )
        )
    engine.dispose()
    res = run("runs", db=path)
    assert res.exit_code == 0 and "bert[lr=1e-4]" in res.stdout and "sweep[/bs64]" in res.stdout
    res = run("show", "1", db=path)
    assert res.exit_code == 0, res.output
    for text in (
        "run 1  bert[lr=1e-4]",
        "[red]tag, :fire:",
        "[b]host",
        "[bold]boom[/] :fire:",
        "layers[0].emb[/x]",
        "cpu [x]",
    ):
        assert text in res.stdout, text
    res = run("events", "1", db=path)
    assert res.exit_code == 0 and "[bold]boom[/] :fire:" in res.stdout
    res = run("compare", "1", "2", db=path)
    assert res.exit_code == 0 and "sweep[/bs64]" in res.stdout and "emb[0]" in res.stdout
    res = run("show", "[b]", db=path)
    assert res.exit_code == 1 and "'[b]'" in res.stderr


@pytest.mark.parametrize("args", [("runs",), ("show", "1"), ("events", "1"), ("export", "1")])
def test_a_reader_that_goes_away_is_exit_0(db: Path, args: tuple[str, ...]) -> None:
    """``edo-monitor show 1 | head -2``: the reader closes the pipe before the command writes;
    every command exits 0 without a word (``show`` exited 1 through Rich's broken-pipe handler,
    ``runs`` 0 through ours, whichever wrote when the pipe closed)."""
    exe = Path(sys.executable).with_name("edo-monitor")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "edo_monitor.surfaces.cli"]
    proc = subprocess.Popen(
        [*cmd, *args, "--db", str(db)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first write
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0, err
    assert err == b""
