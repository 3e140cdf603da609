"""Start-up cost of ``edo-monitor`` commands, as ratios to importing its own libraries.

    .venv/bin/python benchmarks/startup.py [--repeats 15] [--runs 20]

Every variant is a fresh subprocess (``python -c …`` or the ``edo-monitor`` console script of
this interpreter's environment), timed from ``Popen`` to ``wait4`` with its peak RSS from
``wait4``'s rusage, and its CPU time (user + system, also from ``wait4``: less sensitive than wall
time to other jobs on a shared machine). The project's modules are byte-compiled first, as
``pip install`` leaves them. The variants run interleaved, ``--repeats`` rounds, so machine noise
hits them alike; the table shows medians and ratios to the baseline

    baseline = ``python -c "import sqlalchemy, typer, rich"``

(the libraries every history command needs). The "floor" is ``edo-monitor runs``'s job written
directly on the same libraries (:data:`DIRECT_RUNS`: a typer command that opens the same SQLite
file read-only with SQLAlchemy, selects the runs with their peaks and event counts and prints the
same 12-column rich table); the last two columns are each command's ratio to it by wall and CPU
time, and the lines under the table give the median and range of the per-round ratio of ``runs``
and ``show latest`` to the floor (each round runs them back to back, so a ratio of one round sees
one machine state). Goal: ``runs`` ≤ 1.10x the floor. ``import cost`` subtracts a bare
interpreter (``python -c pass``). The database is a temporary SQLite file with ``--runs``
finished runs of 100 samples each, written with the project's writer engine. ``--torch`` adds
``import torch`` and ``edo_monitor.watch`` (seconds each).
"""

from __future__ import annotations

import argparse
import compileall
import datetime
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path


def _seed(path: Path, runs: int) -> None:
    from sqlalchemy.orm import Session

    from edo_monitor.probes.readings import SAMPLE_FIELDS
    from edo_monitor.store.engine import open_engine, write_samples
    from edo_monitor.store.models import Run

    engine = open_engine(path)
    t0 = 1_700_000_000.0
    for k in range(runs):
        with Session(engine) as s, s.begin():
            run = Run(
                uuid=str(uuid.UUID(int=k + 1)),
                name=f"bench-{k}",
                host="bench",
                pid=1,
                status="finished",
                started_at_s=t0 + 1000 * k,
                ended_at_s=t0 + 1000 * k + 100,
                heartbeat_at_s=t0 + 1000 * k + 100,
                device_kind="cpu-budget",
                interval_s=1.0,
                torch_version="2.x",
                config={},
                steps=100,
                samples_dropped=0,
                tags=[],
            )
            s.add(run)
            s.flush()
            run_id = run.id
        rows = []
        for i in range(100):
            row = dict.fromkeys(SAMPLE_FIELDS)
            row.update(time_s=t0 + 1000 * k + i, step=i, device_kind="cpu-budget")
            row["in_use_bytes"] = 1_000_000 * (i + 1)
            rows.append(tuple(row[f] for f in SAMPLE_FIELDS))
        with engine.begin() as conn:
            write_samples(conn, run_id, rows)
    engine.dispose()


BASELINE = "import sqlalchemy, typer, rich"
WATCH = "import edo_monitor; edo_monitor.watch"
#: The floor: the job of ``edo-monitor runs`` written directly on the same libraries. A typer
#: command that parses ``--db``, opens the SQLite file read-only with SQLAlchemy, selects the
#: runs newest first with each run's peak in-use bytes and minimum free fraction (from
#: ``samples``) and its action and OOM counts (from ``events``), and prints them as a 12-column
#: rich table (the columns of ``runs``). What edo-monitor adds beyond this is its own cost.
DIRECT_RUNS = """\
import datetime, sys
import typer
from rich.console import Console
from rich.table import Table
from sqlalchemy import create_engine, text

app = typer.Typer(add_completion=False)

SQL = text(
    "SELECT r.id, r.uuid, r.name, r.status, r.started_at_s, "
    "coalesce(r.ended_at_s, r.heartbeat_at_s), r.steps, r.device_kind, "
    "(SELECT max(in_use_bytes) FROM samples s WHERE s.run_id = r.id), "
    "(SELECT min(free_fraction) FROM samples s WHERE s.run_id = r.id), "
    "(SELECT count(*) FROM events e WHERE e.run_id = r.id AND e.kind = 'action'), "
    "(SELECT count(*) FROM events e WHERE e.run_id = r.id AND e.kind = 'oom') "
    "FROM runs r ORDER BY r.started_at_s DESC, r.id DESC"
)


@app.command()
def runs(db: str = typer.Option(..., envvar="EDO_DB")) -> None:
    engine = create_engine(f"sqlite:///file:{db}?mode=ro&uri=true")
    with engine.connect() as conn:
        rows = conn.execute(SQL).all()
    engine.dispose()
    table = Table()
    for c in ("id", "uuid", "name", "status", "started (UTC)", "duration", "steps", "device",
              "peak in use", "min free", "actions", "OOMs"):
        table.add_column(c)
    for r in rows:
        start = datetime.datetime.fromtimestamp(r[4], tz=datetime.timezone.utc)
        table.add_row(
            str(r[0]), r[1][:13], r[2], r[3], f"{start:%Y-%m-%d %H:%M:%S}",
            f"{(r[5] or r[4]) - r[4]:.1f}s", str(r[6]), r[7],
            "-" if r[8] is None else f"{r[8] / 2**20:.2f} MiB",
            "-" if r[9] is None else f"{100 * r[9]:.1f}%", str(r[10]), str(r[11]),
        )
    Console(width=200 if not sys.stdout.isatty() else None).print(table)


app()
"""


def _time(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds (user + system), peak RSS in MiB) of one subprocess."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.stderr:
        proc.stderr.close()
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} exited {proc.returncode}: {err}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    """Run the variants interleaved and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument(
        "--torch", action="store_true", help="also time `import torch` and `edo_monitor.watch`"
    )
    ap.add_argument("--seed-only", metavar="PATH", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.seed_only:
        _seed(Path(args.seed_only), args.runs)
        return

    py = sys.executable
    exe = str(Path(py).with_name("edo-monitor"))
    if not Path(exe).exists():
        raise SystemExit(f"{exe} not found: install the project (pip install -e .)")
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "h.db"
        # seeded in a child: this process stays small, and a child's peak RSS (which Linux
        # counts from the fork, before its exec) is its own
        subprocess.run([py, __file__, "--runs", str(args.runs), "--seed-only", str(db)], check=True)
        env = {**os.environ, "EDO_DB": str(db), "COLUMNS": "200"}
        variants = [
            ("bare interpreter: python -c pass", [py, "-c", "pass"]),
            ("baseline: import sqlalchemy, typer, rich", [py, "-c", BASELINE]),
            ("floor: the same job written on typer + SQLAlchemy + rich", [py, "-c", DIRECT_RUNS]),
            ("import edo_monitor", [py, "-c", "import edo_monitor"]),
            ("import edo_monitor.surfaces.cli", [py, "-c", "import edo_monitor.surfaces.cli"]),
            ("edo-monitor --help", [exe, "--help"]),
            (f"edo-monitor runs ({args.runs} runs)", [exe, "runs"]),
            ("edo-monitor show latest", [exe, "show", "latest"]),
        ]
        if args.torch:
            variants += [
                ("import torch (what watch() needs)", [py, "-c", "import torch"]),
                ("import edo_monitor; edo_monitor.watch", [py, "-c", WATCH]),
            ]
        # bytecode for the project's own modules, as `pip install` writes it (an editable
        # install, or PYTHONDONTWRITEBYTECODE, would otherwise compile them in every run)
        for pkg in ("edo_monitor", "tui"):
            spec = importlib.util.find_spec(pkg)
            if spec is not None and spec.submodule_search_locations:
                for where in spec.submodule_search_locations:
                    compileall.compile_dir(where, quiet=1)
        for _, cmd in variants:  # warm the file cache once
            _time(cmd, env)
        walls: dict[str, list[float]] = {name: [] for name, _ in variants}
        cpus: dict[str, list[float]] = {name: [] for name, _ in variants}
        rss: dict[str, list[float]] = {name: [] for name, _ in variants}
        for _ in range(args.repeats):
            for name, cmd in variants:
                w, c, r = _time(cmd, env)
                walls[name].append(w)
                cpus[name].append(c)
                rss[name].append(r)
    med = {name: statistics.median(v) for name, v in walls.items()}
    cpu = {name: statistics.median(v) for name, v in cpus.items()}
    bare = med[variants[0][0]]
    base = med[variants[1][0]]
    base_cpu = cpu[variants[1][0]]
    floor = med[variants[2][0]]
    floor_cpu = cpu[variants[2][0]]
    print(
        f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}; "
        f"{args.repeats} interleaved rounds, medians"
    )
    print()
    print(
        "| command | wall | ratio to baseline | import cost | ratio (import cost) | CPU time "
        "| ratio (CPU) | peak RSS | ratio to floor | ratio to floor (CPU) |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for name, _ in variants:
        m = med[name]
        cost = m - bare
        ratio_cost = "-" if name == variants[0][0] else f"{cost / (base - bare):.2f}x"
        print(
            f"| {name} | {1000 * m:.0f} ms | {m / base:.2f}x | {1000 * cost:.0f} ms | "
            f"{ratio_cost} | {1000 * cpu[name]:.0f} ms | {cpu[name] / base_cpu:.2f}x | "
            f"{statistics.median(rss[name]):.0f} MiB | {m / floor:.2f}x | "
            f"{cpu[name] / floor_cpu:.2f}x |"
        )
    print()
    floor_name = variants[2][0]
    for name, _ in variants:
        if not name.startswith("edo-monitor ") or name == "edo-monitor --help":
            continue
        for what, series in (("wall", walls), ("CPU", cpus)):
            per_round = [a / b for a, b in zip(series[name], series[floor_name], strict=True)]
            mid = statistics.median(per_round)
            print(
                f"{name} / floor, {what} time, per round: median {mid:.3f}x "
                f"(range {min(per_round):.3f}-{max(per_round):.3f}x)"
            )


if __name__ == "__main__":
    main()
