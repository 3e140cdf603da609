"""Multi-rank jobs (issue 13, item 1): under a real ``torch.distributed`` process group each
rank's run records its rank, world size, local rank, host and the job id its ranks share, and
the history groups the runs into a ``jobs`` row.

Real process groups only: gloo in this process (world size 1, FileStore), and jobs of two ranks
started as subprocesses (tests/ranks_worker.py) writing into one SQLite file and into PostgreSQL.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_watch import make_model, train

import edo_monitor
from edo_monitor.errors import JobNotFoundError
from edo_monitor.store.history import History, prune

WORKER = Path(__file__).with_name("ranks_worker.py")


@pytest.fixture
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No torchrun variables inherited from whoever runs the tests."""
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def gloo_group(tmp_path: Path, no_launcher_env: None) -> Iterator[None]:
    """A real gloo process group of world size 1 in this process (FileStore), destroyed after."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _train_watched(db: Path | str, **kwargs: Any) -> edo_monitor.Monitor:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with edo_monitor.watch(model, db=db, interval_s=0.02, strict=True, **kwargs) as mon:
        train(model, opt, 5)
    return mon


def test_a_run_outside_a_process_group_is_no_jobs(db_path: Path, no_launcher_env: None) -> None:
    mon = _train_watched(db_path)
    assert (mon.job_id, mon.rank, mon.world_size, mon.local_rank) == (None, None, None, None)
    with History(db_path) as h:
        r = h.run(mon.run_id)
        assert (r.job_id, r.rank, r.world_size, r.local_rank) == (None, None, None, None)
        assert h.jobs() == []


def test_single_process_gloo_records_rank_and_a_job(db_path: Path, gloo_group: None) -> None:
    mon = _train_watched(db_path, run_name="one-rank")
    assert str(uuid.UUID(mon.job_id)) == mon.job_id  # rank 0's UUID, through the group
    assert (mon.rank, mon.world_size, mon.local_rank) == (0, 1, 0)
    summary = mon.summary()
    assert (summary.job_id, summary.rank, summary.world_size) == (mon.job_id, 0, 1)
    assert f"rank 0 of 1 in job {mon.job_id}" in str(summary)
    with History(db_path) as h:
        r = h.run(mon.run_id)
        assert (r.job_id, r.rank, r.world_size, r.local_rank) == (mon.job_id, 0, 1, 0)
        assert r.host == socket.gethostname()
        [job] = h.jobs()
        assert (job.id, job.name, job.world_size, job.backend, job.id_source) == (
            mon.job_id,
            "one-rank",
            1,
            "gloo",
            "process_group",
        )
        assert (job.run_count, job.ranks, job.hosts, job.status, job.min_steps) == (
            1,
            (0,),
            (socket.gethostname(),),
            "finished",
            5,
        )
        assert job.ended_at_s == r.ended_at_s and job.started_at_s == r.started_at_s
        assert h.job(mon.job_id[:8]) == job == h.job("latest")
        [run] = h.job_runs(mon.job_id)
        assert run.id == mon.run_id and run.sample_count == r.sample_count > 0
        assert h.jobs(status="running") == [] and h.jobs(status="finished") == [job]
        with pytest.raises(JobNotFoundError, match="no job with id or id prefix 'nope'"):
            h.job("nope")


def test_torchrun_run_id_is_the_job_id(
    db_path: Path, gloo_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "train-42")
    monkeypatch.setenv("LOCAL_RANK", "0")
    first = _train_watched(db_path)
    second = _train_watched(db_path)  # an elastic restart: same job, one more run
    assert first.job_id == second.job_id == "train-42"
    with History(db_path) as h:
        job = h.job("train-42")
        assert (job.id_source, job.run_count, job.ranks) == ("torchelastic", 2, (0, 0))
        assert [r.id for r in h.job_runs("train-42")] == [first.run_id, second.run_id]


def test_torchruns_default_run_id_none_is_not_a_job_id(
    db_path: Path, gloo_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torchrun`` without ``--rdzv-id`` sets TORCHELASTIC_RUN_ID=none for every job."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("LOCAL_RANK", "0")
    a, b = _train_watched(db_path), _train_watched(db_path)
    assert a.job_id != b.job_id and "none" not in (a.job_id, b.job_id)
    with History(db_path) as h:
        assert {j.id_source for j in h.jobs()} == {"process_group"} and len(h.jobs()) == 2


def test_prune_deletes_a_job_with_its_last_run(db_path: Path, gloo_group: None) -> None:
    mon = _train_watched(db_path)
    with History(db_path, readonly=False) as h:
        report = prune(h, keep_last=0)
        assert report["run_ids_deleted"] == [mon.run_id]
        assert h.jobs() == []


def test_a_reader_of_a_schema_4_file_sees_no_jobs(tmp_path: Path) -> None:
    """Readers leave older files alone: the rank columns read None, jobs() is empty."""
    from alembic import command

    from edo_monitor.store.engine import alembic_config

    path = tmp_path / "v4.db"
    command.upgrade(alembic_config(f"sqlite:///{path}"), "0004")
    conn = sqlite3.connect(path)
    conn.execute(
        "INSERT INTO runs (id, uuid, name, host, pid, started_at_s, status, device_kind, "
        "interval_s, torch_version, config, tags, steps, samples_dropped) VALUES "
        "(1, 'abc', 'old', 'h', 1, 1.7e9, 'finished', 'cpu-budget', 1.0, '2', '{}', '[]', 5, 0)"
    )
    conn.commit()
    conn.close()
    with History(path) as h:
        assert h.schema_version == 4
        r = h.run(1)
        assert (r.job_id, r.rank, r.world_size, r.local_rank) == (None, None, None, None)
        assert h.jobs() == [] and h.runs()[0].id == 1
        with pytest.raises(JobNotFoundError, match="has no jobs"):
            h.job_runs("latest")


# -- real jobs of several processes -------------------------------------------------------------


def run_ranks(
    scenario: str,
    db: str,
    world_size: int,
    folder: Path,
    *options: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 240,
) -> list[dict[str, Any]]:
    """Start ``world_size`` ranks of tests/ranks_worker.py (gloo over a FileStore in
    ``folder``) and return each rank's JSON line, by rank."""
    store = folder / f"store-{uuid.uuid4().hex[:8]}"
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    }
    base.update({"PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"})
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                scenario,
                db,
                str(r),
                str(world_size),
                str(store),
                *options,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**base, **(env or {})},
        )
        for r in range(world_size)
    ]
    try:
        deadline = time.monotonic() + timeout_s
        outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * world_size, [e[-3000:] for _, e in outs]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def _check_two_rank_job(db: str, results: list[dict[str, Any]]) -> None:
    job_id = results[0]["job_id"]
    assert str(uuid.UUID(job_id)) == job_id
    for rank, res in enumerate(results):
        assert res["job_id"] == res["summary_job_id"] == job_id
        assert (res["rank"], res["world_size"], res["local_rank"]) == (rank, 2, rank)
        assert res["status"] == "finished" and res["errors"] == {} and res["steps"] == 10
    with History(db) as h:
        [job] = h.jobs()
        assert (job.id, job.world_size, job.backend, job.id_source) == (
            job_id,
            2,
            "gloo",
            "process_group",
        )
        assert (job.run_count, job.ranks, job.status, job.min_steps) == (
            2,
            (0, 1),
            "finished",
            10,
        )
        runs = h.job_runs(job_id)
        assert [(r.id, r.rank, r.world_size, r.local_rank) for r in runs] == [
            (res["run_id"], rank, 2, rank) for rank, res in enumerate(results)
        ]
        assert all(r.sample_count > 0 and r.host == socket.gethostname() for r in runs)


@pytest.mark.slow
def test_two_ranks_are_one_job_in_one_sqlite_file(tmp_path: Path) -> None:
    db = str(tmp_path / "history.db")
    _check_two_rank_job(db, run_ranks("jobs", db, 2, tmp_path))


@pytest.mark.slow
@pytest.mark.postgres
def test_two_ranks_are_one_job_in_postgres(pg_url: str, tmp_path: Path) -> None:
    _check_two_rank_job(pg_url, run_ranks("jobs", pg_url, 2, tmp_path))
