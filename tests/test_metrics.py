"""Prometheus metrics: watch(metrics_port=) and ``edo-monitor metrics``, scraped over real HTTP on
loopback (parsed with prometheus_client's own parser) and by a real Prometheus server."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client")
torch = pytest.importorskip("torch")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from torch import nn  # noqa: E402

import edo_monitor  # noqa: E402
from edo_monitor.errors import ConfigError  # noqa: E402
from edo_monitor.exporters.prometheus import per_rank_port, resolve_metrics_port  # noqa: E402
from edo_monitor.store.history import History  # noqa: E402

# nn.Linear(100, 50): 100 x 50 weights + 50 biases, float32
LINEAR_PARAMS_BYTES = (100 * 50 + 50) * 4
DEADLINE_S = 30.0

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """GET ``url`` and parse the exposition: (sample name, labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        body = resp.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def values(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def poll(fn: Any, what: str, deadline_s: float = DEADLINE_S) -> Any:
    """Call ``fn`` until it returns something truthy (or fail after the deadline)."""
    end = time.monotonic() + deadline_s
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}; last: {got!r}")
        threading.Event().wait(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def refused(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5)
    except urllib.error.URLError as exc:
        return isinstance(exc.reason, ConnectionRefusedError)
    return False


def edo_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("edo-")]


def linear_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(100, 50)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(8, 100, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


# -- configuration ----------------------------------------------------------------------------


def test_port_from_argument_or_environment(caplog: pytest.LogCaptureFixture) -> None:
    assert resolve_metrics_port(9400, {}) == 9400
    assert resolve_metrics_port(None, {}) is None
    assert resolve_metrics_port(None, {"EDO_METRICS_PORT": "9500"}) == 9500
    assert resolve_metrics_port(9400, {"EDO_METRICS_PORT": "9500"}) == 9400  # argument wins
    for bad in (-1, 65536, "9400", True, 1.5):
        with pytest.raises(ConfigError, match="metrics_port="):
            resolve_metrics_port(bad, {})  # type: ignore[arg-type]
    for ambient in ("nine", "70000"):  # the environment's: a warning, no endpoint
        with caplog.at_level(logging.WARNING):
            assert resolve_metrics_port(None, {"EDO_METRICS_PORT": ambient}) is None
        assert f"EDO_METRICS_PORT={ambient!r} is not a TCP port" in caplog.text
    with pytest.raises(ConfigError, match="metrics_port="):
        edo_monitor.watch(nn.Linear(2, 2), metrics_port=70000)


def test_per_rank_port_adds_the_local_rank() -> None:
    assert per_rank_port(9400, {}) == 9400
    assert per_rank_port(9400, {"LOCAL_RANK": "3"}) == 9403
    assert per_rank_port(0, {"LOCAL_RANK": "3"}) == 0  # any free port stays any
    with pytest.raises(ConfigError, match="LOCAL_RANK"):
        per_rank_port(65535, {"LOCAL_RANK": "1"})


def test_missing_prometheus_client_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import torch, edo_monitor\n"
        "try:\n"
        "    edo_monitor.watch(torch.nn.Linear(2, 2), metrics_port=9400)\n"
        "except edo_monitor.ConfigError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "pip install 'edo-monitor[prometheus]'" in out


def test_the_environments_port_without_the_extra_is_a_warning_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    """Regression: ``EDO_METRICS_PORT`` set (a cluster's, for every job) where the extra is not
    installed refused the run before its first step. It is a warning; the run trains."""
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import torch, edo_monitor\n"
        "model = torch.nn.Linear(2, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        f"with edo_monitor.watch(model, opt, db={str(tmp_path / 'h.db')!r}) as mon:\n"
        "    for _ in range(3):\n"
        "        model(torch.ones(1, 2)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "print(mon.steps, mon.metrics_server)\n"
    )
    env = {**os.environ, "EDO_METRICS_PORT": "9400"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "None"]
    assert "EDO_METRICS_PORT set, but no metrics endpoint" in done.stderr
    assert "pip install 'edo-monitor[prometheus]'" in done.stderr


# -- watch(metrics_port=) ---------------------------------------------------------------------


def test_watch_serves_the_latest_reading_and_stops_with_the_block(db_path: Path) -> None:
    model, opt = linear_and_opt()
    budget = 64 * 1024**2
    with edo_monitor.watch(
        model, opt, db=db_path, budget=budget, interval_s=0.01, metrics_port=0
    ) as mon:
        server = mon.metrics_server
        assert server is not None and server.host == "127.0.0.1" and server.port > 0
        assert "edo-metrics" in edo_threads()
        train(model, opt, 5)
        labels = frozenset({("job", mon.run_uuid), ("rank", "0"), ("device", "cpu")})
        got = poll(
            lambda: (
                (s := scrape(server.url)).get(("edo_params_bytes", labels)) is not None
                and s.get(("edo_steps_total", labels)) == 5
                and s
            ),
            "a reading with params",
        )
        url = server.url
    assert got[("edo_params_bytes", labels)] == LINEAR_PARAMS_BYTES
    assert got[("edo_budget_bytes", labels)] == budget
    used, free = got[("edo_in_use_bytes", labels)], got[("edo_free_ratio", labels)]
    assert 0 < free < 1 and free == pytest.approx((budget - used) / budget, abs=1e-9)
    assert got[("edo_ooms_total", labels)] == 0
    assert values(got, "edo_actions_total") == {}  # no action: no series
    assert got[("edo_reading_timestamp_seconds", labels)] > 0
    assert not edo_threads()  # the server thread is gone
    assert refused(url)
    assert mon.metrics_server is None  # "None otherwise": it was the closed server


def test_two_watches_in_one_process_have_their_own_registries(db_path: Path) -> None:
    (a, opt_a), (b, opt_b) = linear_and_opt(), linear_and_opt()
    with (
        edo_monitor.watch(a, opt_a, db=db_path, interval_s=0.01, metrics_port=0) as ma,
        edo_monitor.watch(b, opt_b, db=db_path, interval_s=0.01, metrics_port=0) as mb,
    ):
        train(a, opt_a, 2)
        train(b, opt_b, 3)
        for mon, steps in ((ma, 2), (mb, 3)):
            got = scrape(mon.metrics_server.url)
            assert {dict(k)["job"] for k in values(got, "edo_steps_total")} == {mon.run_uuid}
            assert list(values(got, "edo_steps_total").values()) == [steps]


def test_environment_port_plus_local_rank(db_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setenv("EDO_METRICS_PORT", str(port - 2))
    monkeypatch.setenv("LOCAL_RANK", "2")
    model, opt = linear_and_opt()
    with edo_monitor.watch(model, opt, db=db_path, interval_s=0.01) as mon:
        assert mon.metrics_server is not None and mon.metrics_server.port == port
        train(model, opt, 1)
        assert values(scrape(f"http://127.0.0.1:{port}/metrics"), "edo_steps_total")


def test_a_port_in_use_is_a_warning_and_training_goes_on(
    db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        model, opt = linear_and_opt()
        with edo_monitor.watch(model, opt, db=db_path, metrics_port=port) as mon:
            train(model, opt, 3)
    assert mon.metrics_server is None and mon.steps == 3 and mon.status == "finished"
    (warning,) = [r.getMessage() for r in caplog.records if "cannot serve" in r.getMessage()]
    assert warning == (  # the address once (it was said twice, with the errno between)
        f"edo-monitor: cannot serve metrics on 127.0.0.1:{port}: Address already in use; "
        "training goes on without them"
    )


def test_a_port_out_of_range_after_the_local_rank_is_a_warning_and_training_goes_on(
    db_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """65535 + LOCAL_RANK 1 cannot be served: it raised on entering, after the run's row was
    written, which then read ``running`` for ever; the README promises a warning instead."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    model, opt = linear_and_opt()
    with edo_monitor.watch(model, opt, db=db_path, metrics_port=65535) as mon:
        train(model, opt, 2)
    assert mon.metrics_server is None and mon.steps == 2 and mon.status == "finished"
    (warning,) = [r.getMessage() for r in caplog.records if "cannot serve" in r.getMessage()]
    assert warning == (
        "edo-monitor: cannot serve metrics on port 65535 + LOCAL_RANK 1 = 65536, above 65535; "
        "training goes on without them"
    )
    with History(db_path) as h:
        assert [(r.status, r.error, r.steps) for r in h.runs()] == [("finished", None, 2)]


@pytest.mark.parametrize("host", [123, "127.0.0.1\x00", None])
def test_a_metrics_host_that_is_no_address_is_refused_before_the_run_starts(
    db_path: Path, host: Any
) -> None:
    """A host that is not a string (or holds a NUL) raised a TypeError on entering, after the
    run's row was written (a ghost ``running`` run); now ``watch()`` refuses it, naming it."""
    model, _ = linear_and_opt()
    with pytest.raises(ConfigError, match=r"^metrics_host="):
        edo_monitor.watch(model, db=db_path, metrics_port=0, metrics_host=host)
    assert edo_monitor.watch(model, db=db_path, metrics_host="").metrics_host == ""  # every one
    if db_path.exists():
        with History(db_path) as h:
            assert h.runs() == []


ROWS, DIM = 20_000, 32
TABLE_BYTES = ROWS * DIM * 4
BUDGET = 12_000_000  # Adam on the table ~ 4 x 2.56 MB: below the 20 % floor after one step


def embedding_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(ROWS, DIM), nn.Linear(DIM, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train_ids(model: nn.Module, opt: torch.optim.Optimizer, steps: int, batch: int = 64) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randint(0, ROWS, (batch,), generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_actions_and_ooms_are_counters(db_path: Path) -> None:
    model, opt = embedding_and_opt()
    policy = edo_monitor.Policy(ladder=["release_cache", "offload_embedding"])
    with edo_monitor.watch(
        model, opt, db=db_path, budget=BUDGET, policy=policy, interval_s=0.01, metrics_port=0
    ) as mon:
        train_ids(model, opt, 40)
        got = scrape(mon.metrics_server.url)
    labels = frozenset(
        {("job", mon.run_uuid), ("rank", "0"), ("device", "cpu"), ("action", "offload_embedding")}
    )
    assert values(got, "edo_actions_total") == {labels: 1.0}
    assert [a["action"] for a in mon.summary().actions] == ["offload_embedding"]

    model, opt = embedding_and_opt()
    train_ids(model, opt, 1)  # Adam's state exists
    with edo_monitor.watch(
        model, opt, db=db_path, budget=BUDGET, enforce=True, metrics_port=0
    ) as mon:
        train_ids(model, opt, 2)  # small batches fit
        with pytest.raises(edo_monitor.BudgetOutOfMemoryError):
            model(torch.randint(0, ROWS, (20_000,))).pow(2).mean().backward()
            opt.step()
        opt.zero_grad()
        got = scrape(mon.metrics_server.url)
    assert list(values(got, "edo_ooms_total").values()) == [1.0]


# -- edo-monitor metrics --db ------------------------------------------------------------------


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "edo_monitor.surfaces.cli", *args]


def start_central(
    db_path: Path, preexec_fn: Callable[[], None] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """``edo-monitor metrics --db DB --port 0`` in a subprocess, and the URL it printed."""
    proc = subprocess.Popen(
        _cli("metrics", "--db", str(db_path), "--port", "0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=preexec_fn,
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("serving http://127.0.0.1:"):
        stop(proc)
        raise AssertionError(f"edo-monitor metrics printed {line!r}")
    return proc, line.split()[1]


def stop(proc: subprocess.Popen[str]) -> int:
    """Ctrl-C, then the exit code. A second Ctrl-C after 15 s, as a user would press it (once,
    in a full CI run on a loaded machine, the first was not acted on within 30 s; not
    reproduced since), then killed after 15 s more."""
    if proc.poll() is None:
        for _ in range(2):
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=15)
                break
            except subprocess.TimeoutExpired:
                continue
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    proc.stdout.close()  # type: ignore[union-attr]
    return proc.returncode


def test_central_metrics_serve_running_runs_from_the_database(db_path: Path) -> None:
    model, opt = linear_and_opt()
    # the user's own "job_id" and "rank" in config are not the run's labels (they were)
    config = {"job_id": "mine", "rank": 7}
    with edo_monitor.watch(
        model, opt, db=db_path, interval_s=0.01, config=config
    ) as mon:  # creates the file
        train(model, opt, 4)
        with History(db_path) as h:
            poll(lambda: h.samples_since(mon.run_id, columns=["params_bytes"]), "a stored sample")
        server, url = start_central(db_path)
        labels = frozenset(
            {
                ("job", mon.run_uuid),
                ("rank", "0"),
                ("device", "cpu"),
                ("run_id", str(mon.run_id)),
                ("run_name", "Linear"),
            }
        )
        try:
            got = scrape(url)
        except BaseException:
            stop(server)
            raise
    try:
        assert got[("edo_params_bytes", labels)] == LINEAR_PARAMS_BYTES
        assert got[("edo_ooms_total", labels)] == 0
        assert 0 < got[("edo_steps_total", labels)] <= 4
        # the run ended: the next scrapes leave it out
        poll(lambda: not values(scrape(url), "edo_params_bytes"), "the finished run to go")
    finally:
        assert stop(server) == 130  # the documented Ctrl-C exit code


def _ignore_and_block_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def test_central_metrics_stop_on_sigterm_and_on_ctrl_c_even_if_inherited_ignored(
    db_path: Path,
) -> None:
    """A service manager's SIGTERM stops ``edo-monitor metrics`` cleanly (exit 0); Ctrl-C gives
    130 even when the server was started with SIGINT ignored and blocked (both are inherited
    through exec, as from a shell's background job or a parent that blocked them)."""
    model, opt = linear_and_opt()
    with edo_monitor.watch(model, opt, db=db_path, interval_s=0.01):  # creates the file
        train(model, opt, 2)
    server, url = start_central(db_path)
    assert not values(scrape(url), "edo_params_bytes")  # no running run
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0
    server.stdout.close()  # type: ignore[union-attr]
    server, url = start_central(db_path, preexec_fn=_ignore_and_block_sigint)
    scrape(url)
    assert stop(server) == 130


def test_central_metrics_wait_for_a_database_the_runs_have_not_created_yet(
    tmp_path: Path,
) -> None:
    """Started before any run (a central scrape set up ahead of the jobs): it used to exit 1.
    It serves no runs, never creates the file, and serves the first run once it writes."""
    db_path = tmp_path / "later.db"
    server, url = start_central(db_path)
    try:
        assert not values(scrape(url), "edo_params_bytes")
        assert not db_path.exists()
        model, opt = linear_and_opt()
        with edo_monitor.watch(model, opt, db=db_path, interval_s=0.01) as mon:
            train(model, opt, 4)
            with History(db_path) as h:
                poll(lambda: h.samples_since(mon.run_id, columns=["step"]), "a stored sample")
            got = values(scrape(url), "edo_params_bytes")
        assert list(got.values()) == [LINEAR_PARAMS_BYTES]
    finally:
        assert stop(server) == 130


def test_central_metrics_errors_follow_the_exit_codes(tmp_path: Path) -> None:
    missing = subprocess.run(
        _cli("metrics", "--db", str(tmp_path / "no-folder" / "none.db"), "--port", "0"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1 and "no history database" in missing.stderr
    assert not (tmp_path / "no-folder").exists()
    bad = subprocess.run(
        _cli("metrics", "--port", "70000"), capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2


def test_central_metrics_import_no_torch() -> None:
    code = (
        "import sys, edo_monitor.surfaces.cli, edo_monitor.exporters.prometheus\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


# -- a real Prometheus server ------------------------------------------------------------------


def prometheus_binary() -> str | None:
    found = shutil.which("prometheus")
    if found:
        return found
    return "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Any]:
    """Start the real ``prometheus`` on loopback; ``start(targets)`` returns its base URL."""
    binary = prometheus_binary()
    if binary is None:
        pytest.skip(
            "no prometheus binary on PATH or at /usr/bin/prometheus (apt-get install prometheus)"
        )
    procs: list[subprocess.Popen[bytes]] = []

    def start(targets: list[str]) -> str:
        port = free_port()
        config = tmp_path / "prometheus.yml"
        # honor_labels: keep our job label (else Prometheus renames it exported_job)
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: edo\n    honor_labels: true\n"
            f"    static_configs:\n      - targets: {json.dumps(targets)}\n"
        )
        log = (tmp_path / "prometheus.log").open("wb")
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=5) as r:
                    return r.status == 200
            except (urllib.error.URLError, ConnectionError):
                return False

        poll(ready, "prometheus to be ready", 60)
        return base

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query(base: str, promql: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.prometheus
@pytest.mark.slow
def test_a_real_prometheus_scrapes_a_watch_and_the_central_endpoint(
    db_path: Path, prometheus: Any
) -> None:
    model, opt = linear_and_opt()
    with edo_monitor.watch(model, opt, db=db_path, interval_s=0.05, metrics_port=0) as mon:
        train(model, opt, 6)
        with History(db_path) as h:
            poll(lambda: h.samples_since(mon.run_id, columns=["params_bytes"]), "a stored sample")
        server, url = start_central(db_path)
        try:
            central_target = url.removeprefix("http://").removesuffix("/metrics")
            watch_target = f"127.0.0.1:{mon.metrics_server.port}"
            base = prometheus([watch_target, central_target])
            direct = poll(
                lambda: query(base, f'edo_params_bytes{{job="{mon.run_uuid}",run_id=""}}'),
                "prometheus to scrape the watch",
            )
            central = poll(
                lambda: query(base, f'edo_params_bytes{{run_id="{mon.run_id}"}}'),
                "prometheus to scrape the central endpoint",
            )
            steps = poll(
                lambda: query(base, f'edo_steps_total{{job="{mon.run_uuid}",run_id=""}}'),
                "the steps counter",
            )
        finally:
            stop(server)
    ((d,),) = [direct]
    assert d["metric"]["job"] == mon.run_uuid and d["metric"]["rank"] == "0"
    assert d["metric"]["device"] == "cpu" and d["metric"]["instance"] == watch_target
    assert float(d["value"][1]) == LINEAR_PARAMS_BYTES
    ((c,),) = [central]
    assert c["metric"]["job"] == mon.run_uuid and c["metric"]["run_name"] == "Linear"
    assert float(c["value"][1]) == LINEAR_PARAMS_BYTES
    assert [float(s["value"][1]) for s in steps] == [6.0]


def test_an_address_that_cannot_be_served_is_named() -> None:
    """A resolver error said only "Name or service not known"; the error names the address."""
    from edo_monitor.exporters.prometheus import MetricsServer

    class Empty:
        def collect(self) -> Iterator[Any]:
            return iter(())

    with pytest.raises(OSError, match=r"^\[Errno -?\d+\] cannot serve metrics on 256\.1\.1\.1:0: "):
        MetricsServer(Empty(), "256.1.1.1", 0)
    with (
        MetricsServer(Empty(), "127.0.0.1", 0) as taken,
        pytest.raises(OSError, match=rf"cannot serve metrics on 127\.0\.0\.1:{taken.port}: "),
    ):
        MetricsServer(Empty(), "127.0.0.1", taken.port)
