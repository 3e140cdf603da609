"""``edo-monitor daemon`` on the fake NVML (pynvml's own error classes): every GPU and process
into the history, every NVML fault the agent's probe survives, GPUs appearing and lost, links to
watched runs, and the real command in a subprocess stopped by SIGTERM / SIGINT with nothing lost.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pynvml
import pytest
import torch
from fakes.nvml import FakeGpu, FakeNvml
from sqlalchemy import text

import edo_monitor
from edo_monitor.errors import ConfigError, NvmlUnavailableError
from edo_monitor.store.engine import open_engine
from edo_monitor.surfaces.daemon import Daemon, run_daemon

U0 = "GPU-11111111-aaaa-bbbb-cccc-000000000000"
U1 = "GPU-22222222-aaaa-bbbb-cccc-000000000001"
U2 = "GPU-33333333-aaaa-bbbb-cccc-000000000002"
ME = os.getpid()
HOST = socket.gethostname()
LAUNCHER = Path(__file__).resolve().parent / "fakes" / "daemon_main.py"


def absent_pid() -> int:
    """A PID no process has here (as a host PID seen from a container)."""
    pid = 4_000_000
    while psutil.pid_exists(pid):
        pid += 1
    return pid


GHOST = absent_pid()


def two_gpus() -> list[FakeGpu]:
    return [
        FakeGpu(U0, used=1_000, reserved=10, processes=[(ME, 700), (GHOST, 200)]),
        FakeGpu(
            U1,
            name="NVIDIA A100",
            total=80_000,
            used=2_000,
            reserved=0,
            processes=[(GHOST, 900)],
            graphics_processes=[(GHOST, 950), (GHOST + 1, None)],
            utilization=(99, 7),
        ),
    ]


def rows(db: str | Path, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    engine = open_engine(db, readonly=True)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql), params)]
    finally:
        engine.dispose()


def events(db: str | Path) -> list[tuple[Any, ...]]:
    return rows(db, "SELECT kind, device_uuid, message FROM device_events ORDER BY id")


def daemon(db: str | Path, nvml: FakeNvml, **kw: Any) -> Daemon:
    d = Daemon(db, nvml=nvml, interval_s=0.01, **kw)
    d.start()
    return d


def test_every_gpu_and_process_is_recorded(history_db: str) -> None:
    nvml = FakeNvml(two_gpus())
    d = daemon(history_db, nvml)
    for _ in range(3):
        assert d.sample() == 2 + 2 + 2  # two device rows, two processes on each
    result = d.close()
    assert result.samples == 3 and result.not_written == dict.fromkeys(result.written, 0)
    assert (
        result.written
        == result.queued
        == {
            "device_samples": 6,
            "process_samples": 12,
            "device_events": 4,  # started, two GPUs found, stopped
        }
    )
    devices = rows(
        history_db,
        "SELECT host, device_index, device_uuid, device_name, device_total_bytes, "
        "device_used_bytes, device_free_bytes, nvml_memory_info_version, "
        "utilization_gpu_fraction, utilization_memory_fraction, process_count "
        "FROM device_samples ORDER BY id",
    )
    free0 = 150_000_000_000 - 1_010  # total - used - reserved
    assert devices[:2] == [
        (HOST, 0, U0, "NVIDIA H200", 150_000_000_000, 1_000, free0, 2, 0.5, 0.2, 2),
        (HOST, 1, U1, "NVIDIA A100", 80_000, 2_000, 78_000, 2, 0.99, 0.07, 2),
    ]
    assert devices[2:] == devices[:2] * 2
    times = rows(history_db, "SELECT DISTINCT time_s FROM device_samples ORDER BY time_s")
    assert len(times) == 3  # every row of a sample shares its time
    procs = rows(
        history_db,
        "SELECT device_index, pid, process_name, kind, process_device_bytes, run_id "
        "FROM process_samples WHERE time_s = :t ORDER BY device_index, pid",
        t=times[0][0],
    )
    me = psutil.Process().name()
    assert procs == [
        (0, ME, me, "compute", 700, None),  # no watched run has this PID now
        (0, GHOST, None, "compute", 200, None),  # not visible here: no name
        (1, GHOST, None, "compute+graphics", 950, None),  # both lists: the larger count
        (1, GHOST + 1, None, "graphics", None, None),  # the driver's N/A
    ]
    assert [e[0] for e in events(history_db)] == [
        "daemon_started",
        "device_appeared",
        "device_appeared",
        "daemon_stopped",
    ]


def test_processes_of_watched_runs_carry_the_run_id(history_db: str) -> None:
    nvml = FakeNvml(two_gpus())
    d = daemon(history_db, nvml)
    model = torch.nn.Embedding(100, 4)
    with edo_monitor.watch(model, db=history_db, interval_s=0.05, run_name="watched") as mon:
        time.sleep(0.1)
        d.sample()
    d.sample()  # the run has ended: no longer linked
    d.close()
    linked = rows(
        history_db,
        "SELECT p.time_s, p.device_index, p.run_id, r.name FROM process_samples p "
        "LEFT JOIN runs r ON r.id = p.run_id WHERE p.pid = :pid ORDER BY p.id",
        pid=ME,
    )
    assert [(i, run, name) for _, i, run, name in linked] == [
        (0, mon.run_id, "watched"),
        (0, None, None),
    ]
    assert rows(history_db, "SELECT count(*) FROM process_samples WHERE run_id IS NOT NULL") == [
        (1,)
    ]  # the other PIDs are not runs


def test_a_crashed_runs_pid_is_not_linked(db_path: Path) -> None:
    """A run left ``running`` by a dead process, with a stale heartbeat, whose PID is now another
    process's; and a run of another host with the same PID: neither is linked."""
    engine = open_engine(db_path)
    now = time.time()
    with engine.begin() as conn:
        for host, heartbeat in ((HOST, now - 3600), ("elsewhere", now)):
            conn.execute(
                text(
                    "INSERT INTO runs (uuid, name, host, pid, started_at_s, heartbeat_at_s, "
                    "status, device_kind, interval_s, torch_version, config, tags, steps, "
                    "samples_dropped) VALUES (:u, 'old', :h, :pid, :s, :hb, 'running', 'cuda', "
                    "1.0, '2', '{}', '[]', 0, 0)"
                ),
                {"u": host, "h": host, "pid": ME, "s": now - 7200, "hb": heartbeat},
            )
    engine.dispose()
    d = daemon(db_path, FakeNvml(two_gpus()))
    d.sample()
    d.close()
    assert rows(db_path, "SELECT count(*) FROM process_samples WHERE run_id IS NOT NULL") == [(0,)]


# -- faults: each one the agent's probe survives, and what the daemon does with it ------------


def fault_case(name: str) -> tuple[FakeNvml, Any]:
    """A fake NVML with one fault, and a check of the rows written through it."""
    gpus = two_gpus()
    nvml_kw: dict[str, Any] = {}
    if name == "no v2":
        nvml_kw["has_v2"] = False
    elif name == "v2 binding error":
        nvml_kw["v2_binding_error"] = True
    elif name == "memory not supported":
        gpus[0].memory_not_supported = True
    elif name == "mig":
        gpus[0].mig = True
    elif name == "impossible values":
        gpus[0].total = 2**64 - 1
        gpus[0].processes = [(ME, 2**63)]
    elif name == "undecodable name":
        gpus[0].name = b"NVIDIA \xff H200"
    elif name == "process list fails":
        gpus[0].process_error = pynvml.NVML_ERROR_NO_PERMISSION
    elif name == "utilization fails":
        gpus[0].utilization_error = pynvml.NVML_ERROR_UNKNOWN
    return FakeNvml(gpus, **nvml_kw), name


EXPECTED: dict[str, tuple[tuple[Any, ...], str]] = {
    # GPU 0's row: (total, used, free, version, util gpu, util memory, process count), and the
    # words of its one probe_unavailable event
    "no v2": ((150_000_000_000, 1_000, 150_000_000_000 - 1_000, 1, 0.5, 0.2, 2), "v2"),
    "v2 binding error": ((150_000_000_000, 1_000, 150_000_000_000 - 1_000, 1, 0.5, 0.2, 2), "v2"),
    "memory not supported": ((None, None, None, None, 0.5, 0.2, 2), "memory info not supported"),
    "mig": ((150_000_000_000, 1_000, 150_000_000_000 - 1_010, 2, None, None, None), "unavailable"),
    "impossible values": ((None, 1_000, None, 2, 0.5, 0.2, 1), "recorded as unknown"),
    "undecodable name": ((150_000_000_000, 1_000, 150_000_000_000 - 1_010, 2, 0.5, 0.2, 2), "name"),
    "process list fails": (
        (150_000_000_000, 1_000, 150_000_000_000 - 1_010, 2, 0.5, 0.2, None),
        "process list unavailable",
    ),
    "utilization fails": (
        (150_000_000_000, 1_000, 150_000_000_000 - 1_010, 2, None, None, 2),
        "utilization unavailable",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_device_faults_keep_the_daemon_going(db_path: Path, case: str) -> None:
    nvml, _ = fault_case(case)
    d = daemon(db_path, nvml)
    for _ in range(4):
        d.sample()
    result = d.close()
    assert result.samples == 4 and sum(result.not_written.values()) == 0
    row, words = EXPECTED[case]
    got = rows(
        db_path,
        "SELECT device_total_bytes, device_used_bytes, device_free_bytes, "
        "nvml_memory_info_version, utilization_gpu_fraction, utilization_memory_fraction, "
        "process_count FROM device_samples WHERE device_index = 0",
    )
    assert got == [row] * 4
    # the other GPU is untouched
    assert rows(db_path, "SELECT count(*) FROM device_samples WHERE device_index = 1") == [(4,)]
    reported = [e for e in events(db_path) if e[0] == "probe_unavailable" and e[1] == U0]
    assert reported and words in reported[0][2]
    # each fault is reported once, however many samples meet it
    assert len({e[2] for e in reported}) == len(reported)
    if case == "impossible values":  # total unknown, and the process's 2**63 bytes with it
        assert (
            rows(db_path, "SELECT process_device_bytes FROM process_samples WHERE pid = :p", p=ME)
            == [(None,)] * 4
        )
    if case == "undecodable name":
        assert rows(db_path, "SELECT DISTINCT device_name FROM device_samples ORDER BY 1") == [
            (None,),
            ("NVIDIA A100",),
        ]


def test_a_failing_process_list_is_asked_again_and_recovers(db_path: Path) -> None:
    gpus = two_gpus()
    gpus[0].process_error = pynvml.NVML_ERROR_UNKNOWN
    d = daemon(db_path, FakeNvml(gpus))
    d.sample()
    d.sample()
    gpus[0].process_error = None
    d.sample()
    d.close()
    assert rows(
        db_path, "SELECT process_count FROM device_samples WHERE device_index = 0 ORDER BY id"
    ) == [(None,), (None,), (2,)]
    assert rows(
        db_path,
        "SELECT count(*) FROM process_samples WHERE device_index = 0 AND time_s = "
        "(SELECT max(time_s) FROM device_samples)",
    ) == [(2,)]
    reported = [e[2] for e in events(db_path) if e[0] == "probe_unavailable"]
    assert [m.split(" (")[0] for m in reported] == [
        "NVML: process list unavailable",
        "NVML: graphics process list unavailable",
    ]  # once each


def test_a_gpu_lost_mid_run(db_path: Path) -> None:
    gpus = two_gpus()
    gpus[1].lost_after_reads = 2
    d = daemon(db_path, FakeNvml(gpus))
    for _ in range(5):
        d.sample()
    result = d.close()
    assert rows(
        db_path, "SELECT device_index, count(*) FROM device_samples GROUP BY device_index"
    ) == [(0, 5), (1, 2)]
    lost = [e for e in events(db_path) if e[0] == "device_lost"]
    assert len(lost) == 1 and lost[0][1] == U1 and "lost" in lost[0][2]
    assert result.devices == [U0]


def test_gpus_appearing_gone_from_the_list_and_back(db_path: Path) -> None:
    g0, g1 = two_gpus()
    nvml = FakeNvml([g0, g1])
    d = daemon(db_path, nvml, rescan_interval_s=1e-9)  # read the device list at every sample
    d.sample()
    nvml.gpus.append(FakeGpu(U2, processes=[(GHOST, 5)]))  # hot-plugged, or a MIG instance made
    d.sample()
    nvml.gpus.remove(g0)  # no longer enumerated
    d.sample()
    g1.lost_after_reads = g1.reads  # falls off the bus: even its handle is not found now
    d.sample()
    d.sample()
    g1.lost_after_reads = None  # answers again (reset)
    nvml.gpus.insert(0, g0)
    d.sample()
    d.close()
    kinds = [(e[0], e[1]) for e in events(db_path)][1:-1]
    assert kinds == [
        ("device_appeared", U0),
        ("device_appeared", U1),
        ("device_appeared", U2),
        ("device_lost", U0),
        ("device_lost", U1),
        ("device_appeared", U0),
        ("device_appeared", U1),
    ]
    per_sample = rows(
        db_path,
        "SELECT group_concat(device_uuid, ' ') FROM (SELECT time_s, device_uuid FROM "
        "device_samples ORDER BY time_s, device_index) GROUP BY time_s ORDER BY time_s",
    )
    assert per_sample == [
        (f"{U0} {U1}",),
        (f"{U0} {U1} {U2}",),
        (f"{U1} {U2}",),
        (U2,),
        (U2,),
        (f"{U0} {U1} {U2}",),
    ]
    # the new GPU's index follows NVML's list
    indexes = rows(
        db_path, "SELECT device_index FROM device_samples WHERE device_uuid = :u ORDER BY id", u=U2
    )
    assert [i for (i,) in indexes] == [2, 1, 1, 1, 2]  # the lost GPU still holds index 0


@pytest.mark.parametrize("after", [0, 3])
def test_driver_mismatch_mid_run_is_reported_and_sampling_goes_on(
    db_path: Path, after: int
) -> None:
    """The driver replaced under the running daemon (an upgrade without a reboot): each device
    and then the device list stop answering; the daemon records why, once, and keeps going."""
    nvml = FakeNvml(two_gpus(), mismatch_after_reads=after)
    d = daemon(db_path, nvml, rescan_interval_s=1e-9)
    for _ in range(4):
        d.sample()
    result = d.close()
    assert result.samples == 4
    kinds = [e[0] for e in events(db_path)]
    # after=0: the device list fails at start; after=3: GPU 0's third query and GPU 1's second
    # memory read fail, then the device list
    assert kinds.count("device_unavailable") == (0 if after == 0 else 2)
    assert kinds.count("nvml_unavailable") == 1
    messages = [e[2] for e in events(db_path) if e[0].endswith("unavailable")]
    assert all("versions do not match" in m for m in messages)
    assert rows(db_path, "SELECT count(*) FROM device_samples") == [(0 if after == 0 else 3,)]


@pytest.mark.parametrize(
    ("nvml_kw", "words"),
    [
        ({"library_missing": True}, "NVML library was not found"),
        ({"driver_mismatch": True}, "versions do not match"),
    ],
)
def test_no_nvml_is_an_error_and_nothing_is_created(
    db_path: Path, nvml_kw: dict[str, Any], words: str
) -> None:
    with pytest.raises(NvmlUnavailableError, match=words):
        run_daemon(db_path, nvml=FakeNvml(two_gpus(), **nvml_kw))
    assert not db_path.exists()


def test_bad_values_are_refused(db_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"^interval_s=0; expected a finite number of seconds > 0$"
    ):
        Daemon(db_path, interval_s=0)
    with pytest.raises(ConfigError, match="in-memory"):
        Daemon("sqlite://", nvml=FakeNvml(two_gpus())).start()


# -- the real command in a subprocess ---------------------------------------------------------


def _spec(gpus: list[dict[str, Any]], **kw: Any) -> str:
    return json.dumps({"gpus": gpus, **kw})


def _start(db: Path, spec: str, *args: str) -> subprocess.Popen[str]:
    """The real command in a subprocess (the fake NVML of ``spec`` in place)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("EDO_DB", None)
    return subprocess.Popen(
        [sys.executable, str(LAUNCHER), spec, "daemon", "--db", str(db), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.fixture
def start() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """:func:`_start`, and what a failed test left running killed at its end (a leftover child
    is counted in later tests' process trees)."""
    procs: list[subprocess.Popen[str]] = []

    def started(db: Path, spec: str, *args: str) -> subprocess.Popen[str]:
        procs.append(_start(db, spec, *args))
        return procs[-1]

    yield started
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _wait_rows(db: Path, n: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if db.exists():
            try:
                con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
                got = con.execute("SELECT count(*) FROM device_samples").fetchone()[0]
                con.close()
                if got >= n:
                    return
            except sqlite3.OperationalError:  # not created yet
                pass
        time.sleep(0.05)
    raise AssertionError("the daemon wrote no rows in 90 s")


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_command_stops_on_a_signal_with_every_sample_written(
    db_path: Path, start: Callable[..., subprocess.Popen[str]], signum: int, code: int
) -> None:
    gpus = [
        {"uuid": U0, "processes": [[ME, 700], [GHOST, 200]]},
        {"uuid": U1, "processes": [[GHOST, 900]], "graphics_processes": [[GHOST + 1, 3]]},
        {"uuid": U2},
    ]
    proc = start(db_path, _spec(gpus), "--interval", "0.02")
    _wait_rows(db_path, 30, proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert "recording 3 GPU(s)" in err
    last = [line for line in err.splitlines() if "stopped;" in line][-1]
    # "… stopped; N sample(s) of 3 GPU(s); written: D device row(s), P process row(s), E event(s);
    # not written: 0"
    numbers = [int(w) for w in last.replace("(s)", "").replace(",", " ").split() if w.isdigit()]
    samples, _, devices, processes, n_events, lost = numbers
    con = sqlite3.connect(db_path)
    assert lost == 0 and devices == 3 * samples and processes == 4 * samples
    assert con.execute("SELECT count(*) FROM device_samples").fetchone()[0] == devices
    assert con.execute("SELECT count(DISTINCT time_s) FROM device_samples").fetchone()[0] == samples
    assert con.execute("SELECT count(*) FROM process_samples").fetchone()[0] == processes
    kinds = [k for (k,) in con.execute("SELECT kind FROM device_events ORDER BY id")]
    assert len(kinds) == n_events and kinds[0] == "daemon_started" and kinds[-1] == "daemon_stopped"
    con.close()
    if code == 130:
        assert "interrupted" in err


def test_command_without_nvml_prints_one_line_and_exits_1(
    db_path: Path, start: Callable[..., subprocess.Popen[str]]
) -> None:
    proc = start(db_path, _spec([], library_missing=True))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert err.splitlines() == [
        "edo-monitor: error: NVML is not available (the NVML library was not found: NVML Shared "
        "Library Not Found (NVMLError_LibraryNotFound)); the daemon reads GPUs through the "
        "NVIDIA driver's NVML library"
    ]
    assert out == "" and not db_path.exists()


def test_command_on_this_machine_without_a_driver(db_path: Path) -> None:
    """The real pynvml, where no NVIDIA driver is installed (skipped where NVML answers)."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("NVML answers on this machine")
    cli = Path(sys.executable).with_name("edo-monitor")
    done = subprocess.run(
        [str(cli), "daemon", "--db", str(db_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1
    assert "NVML is not available" in done.stderr and not db_path.exists()


# -- the README's section, as written ----------------------------------------------------------


def _readme_daemon_command() -> list[str]:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Every GPU of the machine: `edo-monitor daemon`") :]
    line = next(ln for ln in section.splitlines() if "edo-monitor daemon --db" in ln)
    args = line.split("#")[0].split()
    assert args[0] == ".venv/bin/edo-monitor"
    return args[1:]


@pytest.mark.slow
def test_readme_section_runs_as_written(tmp_path: Path) -> None:
    """The README's command (the fake NVML for the hardware), stopped by SIGTERM, then its
    Python block over what it wrote."""
    from readme_blocks import readme_python_blocks

    args = _readme_daemon_command()
    assert args[:3] == ["daemon", "--db", "edo-history.db"]
    spec = _spec([{"uuid": U0, "processes": [[ME, 700]]}, {"uuid": U1, "name": "NVIDIA A100"}])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("EDO_DB", None)
    proc = subprocess.Popen(
        [sys.executable, str(LAUNCHER), spec, *args],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    _wait_rows(tmp_path / "edo-history.db", 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    (block,) = readme_python_blocks("Every GPU of the machine: `edo-monitor daemon`")
    done = subprocess.run(
        [sys.executable, "-c", block],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    assert done.stdout.splitlines() == [
        "0 NVIDIA H200 10000000000 150000000000",
        f"   {ME} {psutil.Process().name()} 700 None",
        "1 NVIDIA A100 10000000000 150000000000",
    ]
