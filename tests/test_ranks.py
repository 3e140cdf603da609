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
from edo_monitor.store.history import History
from edo_monitor.store.prune import prune

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


def test_a_job_with_a_crashed_rank_ends_at_its_last_heartbeat(
    db_path: Path, gloo_group: None
) -> None:
    """A rank killed outright writes no end: the job had no end either, and its duration (what
    `jobs` shows) grew with the clock. It ends where the crashed run's own duration ends: its
    last heartbeat."""
    mon = _train_watched(db_path, run_name="killed")
    con = sqlite3.connect(db_path)
    started = time.time() - 3600
    heartbeat = started + 12.5  # as a kill -9 leaves it: running, no end, an old heartbeat
    con.execute(
        "UPDATE runs SET status = 'running', started_at_s = ?, ended_at_s = NULL, "
        "heartbeat_at_s = ?, host = 'elsewhere' WHERE id = ?",
        (started, heartbeat, mon.run_id),
    )
    con.commit()
    con.close()
    with History(db_path) as h:
        [job] = h.jobs()
        assert job.status == "crashed"
        assert job.ended_at_s == pytest.approx(heartbeat)
        assert job.ended_at_s - job.started_at_s == pytest.approx(h.run(mon.run_id).duration_s)


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

    from edo_monitor.store.migrate import alembic_config

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
    dying: int | None = None,
) -> list[dict[str, Any]]:
    """Start ``world_size`` ranks of tests/ranks_worker.py (gloo over a FileStore in
    ``folder``) and return each rank's JSON line, by rank (for rank ``dying``, which is to die,
    its exit status instead: ``{"returncode": N}``)."""
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
    if any(p.returncode != 0 for r, p in enumerate(procs) if r != dying):  # each rank's error
        pytest.fail(
            "\n".join(
                f"rank {r} exited {p.returncode}; its stderr ends:\n{err[-2500:]}"
                for r, (p, (_, err)) in enumerate(zip(procs, outs, strict=True))
            ),
            pytrace=False,
        )
    return [
        {"returncode": p.returncode} if r == dying else json.loads(out.strip().splitlines()[-1])
        for r, (p, (out, _)) in enumerate(zip(procs, outs, strict=True))
    ]


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
    tb = tmp_path / "tb"
    _check_two_rank_job(db, run_ranks("jobs", db, 2, tmp_path, f"tensorboard={tb}"))
    # each rank's scalars in a folder of its own: one folder for all was one TensorBoard run
    # whose series zig-zagged between the ranks
    assert sorted(p.name for p in tb.iterdir()) == ["rank0", "rank1"]
    assert all(any(p.glob("events.out.tfevents.*")) for p in tb.iterdir())


@pytest.mark.slow
@pytest.mark.postgres
def test_two_ranks_are_one_job_in_postgres(pg_url: str, tmp_path: Path) -> None:
    _check_two_rank_job(pg_url, run_ranks("jobs", pg_url, 2, tmp_path))


# -- coordinated actions (issue 13, item 2) -----------------------------------------------------


def _events(db: str, run_id: int, kinds: tuple[str, ...]) -> list[Any]:
    with History(db) as h:
        return [e for e in h.events(run_id) if e.kind in kinds]


def test_ddp_allows_only_actions_that_keep_its_parameters(gloo_group: None) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from edo_monitor.agent.ranks import DDP_SAFE_ACTIONS, ddp_blocker

    plain = make_model()
    ddp = DistributedDataParallel(make_model())
    assert {"release_cache", "checkpoint_activations"} == DDP_SAFE_ACTIONS
    for action in ("release_cache", "checkpoint_activations"):
        assert ddp_blocker(ddp, action) is None
    for action in ("offload_embedding", "cache_embedding", "compress_embedding"):
        assert ddp_blocker(plain, action) is None
        why = ddp_blocker(ddp, action)
        assert why is not None and "registered parameter's device, dtype or shape" in why
        assert "DistributedDataParallel's reducer would be invalid" in why


def test_one_rank_applies_its_decision_only_at_a_sync_step(db_path: Path, gloo_group: None) -> None:
    """World size 1: the decision waits for the next step that is a multiple of
    sync_every_steps, and its event says it was agreed."""
    model = torch.nn.Sequential(torch.nn.Embedding(20_000, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    policy = edo_monitor.Policy(ladder=["offload_embedding"])
    with edo_monitor.watch(
        model, db=db_path, budget=12_000_000, policy=policy, interval_s=0.005, sync_every_steps=5
    ) as mon:
        for _ in range(20):
            model(torch.randint(0, 20_000, (64,))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.01)
    [action] = _events(str(db_path), mon.run_id, ("action",))
    assert action.step % 5 == 4  # recorded before the step it closes is counted
    assert action.data["coordinated"] is True and action.data["proposed_by_rank"] == 0
    assert action.data["action"] == "offload_embedding" and action.data["saved_bytes"] > 0
    stats = mon.sync_stats()
    assert stats is not None and stats["syncs"] == 4 and stats["collectives"] == 4 + 1
    [sync] = _events(str(db_path), mon.run_id, ("rank_sync",))
    assert sync.data["syncs"] == 4 and sync.data["mean_sync_s"] > 0


def _actions_by_rank(db: str, results: list[dict[str, Any]]) -> list[list[Any]]:
    return [
        _events(db, res["run_id"], ("action", "action_refused", "action_failed")) for res in results
    ]


@pytest.mark.slow
def test_every_rank_applies_the_worst_ranks_decision_at_the_same_step(tmp_path: Path) -> None:
    """Only rank 1 (larger batches) falls below the floor; both ranks move the table to the
    host at the same step."""
    db = str(tmp_path / "history.db")
    results = run_ranks("pressure", db, 2, tmp_path, "ladder=offload_embedding", "sync=4")
    assert results[0]["min_free_fraction"] > 0.2 > results[1]["min_free_fraction"]
    assert results[0]["events"].get("decision") is None  # rank 0 decided nothing itself
    per_rank = _actions_by_rank(db, results)
    assert [len(a) for a in per_rank] == [1, 1], per_rank
    (a0,), (a1,) = per_rank
    assert a0.kind == a1.kind == "action" and a0.step == a1.step and a0.step % 4 == 3
    for e in (a0, a1):
        assert (e.data["action"], e.data["target"], e.data["proposed_by_rank"]) == (
            "offload_embedding",
            "emb",
            1,
        )
        assert e.data["saved_bytes"] == 4 * 20_000 * 32 * 4 + 4  # weight, grad, Adam's states
        assert e.data["ranks_free_fraction"][0] > 0.2 > e.data["ranks_free_fraction"][1]
    for res in results:
        assert res["status"] == "finished" and res["errors"] == {} and res["steps"] == 40
        assert res["sync"]["syncs"] == 10 and res["sync"]["collectives"] == 11


@pytest.mark.slow
def test_a_rank_that_cannot_apply_makes_every_rank_refuse(tmp_path: Path) -> None:
    """Rank 0's table is tied to another layer: it cannot offload it, so neither rank does,
    and both record why."""
    db = str(tmp_path / "history.db")
    results = run_ranks(
        "pressure", db, 2, tmp_path, "ladder=offload_embedding", "tie_rank=0", "sync=4"
    )
    per_rank = _actions_by_rank(db, results)
    assert [len(a) for a in per_rank] == [1, 1], per_rank
    (r0,), (r1,) = per_rank
    assert r0.kind == r1.kind == "action_refused" and r0.step == r1.step
    for e in (r0, r1):
        assert (e.data["action"], e.data["target"], e.data["status"]) == (
            "offload_embedding",
            "emb",
            "refused",
        )
        assert e.data["refusals"] == [{"rank": 0, "reason": "emb: weight is tied to tied (Linear)"}]
        assert "rank 0 cannot apply it: emb: weight is tied to tied (Linear)" in e.data["reason"]
    for res in results:  # nothing was offloaded: the job went on without it
        assert res["status"] == "finished" and res["errors"] == {}
        # one agreement with a decision; the refusals' reasons: their lengths, then the bytes
        assert res["sync"]["collectives"] == 10 + 1 + 2


@pytest.mark.slow
def test_a_shrink_of_the_row_cache_proposed_by_one_rank_is_applied_by_every_rank(
    tmp_path: Path,
) -> None:
    """Both ranks cache their table at the same step (both under pressure) and grow it back;
    from step 10 only rank 1's batches are heavy and it proposes shrinking its cache. Rank 0,
    30 % free itself, plans the shrink as tight as rank 1 (before, it planned at its own free
    fraction, found nothing to shrink and refused: "no embedding table left on the device tier
    to cache", and rank 1 stayed below the floor for the rest of the run)."""
    tried = []
    for attempt in range(3):  # three runs at most: see the end
        db = str(tmp_path / f"history-{attempt}.db")
        results = run_ranks(
            "pressure",
            db,
            2,
            tmp_path,
            "model=plain",
            f"budget={10 * 2**20}",
            "light_batch=16",
            "heavy_batch=256",
            "heavy_width=40",
            "heavy_from=10",
            "sync=4",
        )
        for res in results:
            assert res["status"] == "finished" and res["errors"] == {} and res["steps"] == 40
        per_rank = _actions_by_rank(db, results)
        shrinks = [
            [e for e in events if e.data.get("details", {}).get("resize") == "shrink"]
            for events in per_rank
        ]
        # every shrink, in every attempt, on both ranks at one step, proposed by the same rank
        assert len(shrinks[0]) == len(shrinks[1]), per_rank
        for s0, s1 in zip(*shrinks, strict=True):
            assert s0.kind == s1.kind == "action" and s0.step == s1.step
            assert s0.data["proposed_by_rank"] == s1.data["proposed_by_rank"]
            assert s0.data["target"] == s1.data["target"] == "0"
        heavy = [s.data["proposed_by_rank"] for s in shrinks[1] if s.step >= 10]
        if heavy:
            # the heavy phase's, proposed by rank 1 alone under pressure
            assert set(heavy) == {1}, per_rank
            return
        tried.append([[(e.step, e.kind, e.data.get("action")) for e in a] for a in per_rank])
    # a loaded machine's sampler (every 5 ms, beside two ranks on two cores) can miss the light
    # phase's peaks: the cache made late and never grown fits the heavy phase, and no rank
    # needs a shrink; three such runs in a row are a fault
    raise AssertionError(f"no shrink in the heavy phase in 3 runs: {tried}")


@pytest.mark.slow
def test_checkpoint_activations_under_ddp_on_every_rank(tmp_path: Path) -> None:
    """A real two-rank gloo DDP job: the table actions refuse (DDP), checkpointing applies on
    both ranks at the same step, and the replicas stay identical."""
    db = str(tmp_path / "history.db")
    results = run_ranks("pressure", db, 2, tmp_path, "ddp=1", "sync=4")
    per_rank = _actions_by_rank(db, results)
    assert [len(a) for a in per_rank] == [1, 1], per_rank
    (a0,), (a1,) = per_rank
    assert a0.kind == a1.kind == "action" and a0.step == a1.step
    assert a0.data["action"] == a1.data["action"] == "checkpoint_activations"
    assert a0.data["target"] == a1.data["target"] == "module.head.0,module.head.1"
    assert a0.data["proposed_by_rank"] == a1.data["proposed_by_rank"] == 1
    assert results[0]["checksum"] == results[1]["checksum"]  # DDP kept the replicas equal
    *_, no_action = _events(db, results[1]["run_id"], ("no_action",))  # the settled reasons
    refusals = {r["action"]: r["reason"] for r in no_action.data["refusals"]}
    assert "DistributedDataParallel" in refusals["offload_embedding"]
    assert "DistributedDataParallel" in refusals["cache_embedding"]
    assert "CPU-budget" in refusals["release_cache"]  # refused for the CPU, not for DDP
    for res in results:
        assert res["status"] == "finished" and res["errors"] == {} and res["steps"] == 40


@pytest.mark.slow
@pytest.mark.parametrize("hang_s", [0, 20], ids=["exits", "hangs"])
def test_a_rank_gone_before_the_first_agreement_leaves_the_others_training(
    tmp_path: Path, hang_s: int
) -> None:
    """Rank 1 ends with ``os._exit`` right after joining the group (or first sleeps 20 s, alive
    but never taking part): rank 0's agreement at ``watch()`` ends within the agreement bound
    (``EDO_AGREEMENT_TIMEOUT_S``, 3 s here) and it trains every step; nothing hangs (rank 0
    waited for the group's own 30-minute timeout)."""
    db = str(tmp_path / "history.db")
    started = time.monotonic()
    results = run_ranks(
        "jobs",
        db,
        2,
        tmp_path,
        "die_rank=1",
        f"hang_s={hang_s}",
        "strict=0",
        env={"EDO_AGREEMENT_TIMEOUT_S": "3"},
        timeout_s=150,
        dying=1,
    )
    rank0, gone = results
    assert gone == {"returncode": 3}
    assert rank0["enter_s"] < 3 + 12  # the bound and a loaded machine's slack (not the 20 s hang)
    assert rank0["status"] == "finished" and rank0["steps"] == 10
    assert rank0["job_id"] is None  # no agreement, so no job: a plain run
    assert time.monotonic() - started < 150


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        ["short_rank=1", "steps=8", "allreduce=after"],
        ["late_rank=1", "late_s=6", "allreduce=step"],
    ],
    ids=["a-rank-steps-once-fewer", "a-rank-enters-late"],
)
def test_an_agreement_a_rank_misses_starts_no_collective(
    tmp_path: Path, options: list[str]
) -> None:
    """Rank 1 takes one step fewer (rank 0 alone at the sync of step 8) or enters ``watch()``
    6 s late (past the 3 s bound of the agreement at its start): the agreement fails on the
    ranks that waited and starts no collective, so the training's own collectives pair as they
    should. The agreement's ``all_gather`` was started on one rank and stayed queued on the
    group: the training's next collective was paired with it (gloo aborted the process,
    "Received data size doesn't match expected size", or both ranks hung)."""
    db = str(tmp_path / "history.db")
    env = {"EDO_AGREEMENT_TIMEOUT_S": "3"}
    results = run_ranks("jobs", db, 2, tmp_path, "strict=0", *options, env=env, timeout_s=150)
    for res in results:
        assert res["status"] == "finished", res
        assert res["after_block_sum"] == 2.0  # the training's collective paired
    expected_steps = [8, 7] if "short_rank=1" in options else [10, 10]
    assert [r["steps"] for r in results] == expected_steps
    errors = {k for r in results for k in r["errors"]}
    assert errors <= {
        "rank agreement:AgreementTimeoutError",
        "rank detection:AgreementTimeoutError",
    }
    assert errors  # the agreement failed, in one line (not a hang)
