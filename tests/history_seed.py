"""The seeded history the store's tests read: five runs (finished, failed, interrupted, running,
crashed), 6,000 samples of the finished one, its events and module rows.
"""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sqlalchemy import insert, update
from sqlalchemy.orm import Session

from edo_monitor.probes.readings import SAMPLE_FIELDS
from edo_monitor.store.dialect import is_postgres
from edo_monitor.store.engine import open_engine
from edo_monitor.store.models import Event, ModuleStat, Run, Sample
from edo_monitor.store.rollups import roll_up
from edo_monitor.store.schema import jobs_table, runs_table

T0 = 1_700_000_000.25  # run start (Unix seconds)
#: Fixed run uuids (ids 1-5): the first two have an all-digit 8-character prefix and share their
#: first 15 characters; the third and fourth share their first two.
UUIDS = (
    "90455722-7c1e-4c59-9d2a-1f0c3b7e8a01",
    "90455722-7c1e-4000-8000-000000000002",
    "a3c2f1e0-0000-4000-8000-000000000003",
    "a3d00000-0000-4000-8000-000000000004",
    "0e0e0e0e-0000-4000-8000-000000000005",
)
N_SAMPLES = 6000
INTERVAL = 0.5


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def sample_row(run_id: int, i: int, rng: random.Random) -> dict[str, Any]:
    """Sample ``i`` of run ``run_id``: in use 100-900 MB of a 1 GB budget, some gaps (None)."""
    row: dict[str, Any] = dict.fromkeys(SAMPLE_FIELDS)
    in_use = rng.randint(100, 900) * 1_000_000
    row.update(
        run_id=run_id,
        time_s=T0 + i * INTERVAL + rng.random() * 0.01,
        step=i // 2,
        device_kind="cpu-budget",
        budget_bytes=1_000_000_000,
        in_use_bytes=in_use if i % 97 else None,  # some gaps: None is not zero
        free_fraction=(1_000_000_000 - in_use) / 1_000_000_000,
        params_bytes=400_000_000,
        process_rss_bytes=rng.randint(1, 5) * 10**9,
    )
    return row


def seed(path: Path | str) -> dict[str, Any]:
    """Five runs (finished, failed, interrupted, running, crashed) and samples, events, modules
    for the finished one. Returns facts the tests check against."""
    engine = open_engine(path)
    host = socket.gethostname()
    now = time.time()
    uuids = list(UUIDS)
    specs = [
        dict(name="embed-big", status="finished", ended_at_s=T0 + N_SAMPLES * INTERVAL, tags=["a"]),
        dict(name="embed-small", status="failed", ended_at_s=T0 + 200, error="RuntimeError: x"),
        dict(name="rec", status="interrupted", ended_at_s=T0 + 300, tags=["b"]),
        dict(name="live", status="running", pid_alive=True),
        dict(name="dead", status="running", pid_alive=False),
    ]
    with Session(engine) as s, s.begin():
        for k, spec in enumerate(specs):
            alive = spec.pop("pid_alive", None)
            s.add(
                Run(
                    uuid=uuids[k],
                    host=host,
                    pid=(__import__("os").getpid() if alive else _dead_pid()),
                    started_at_s=T0 + 10 * k if alive is None else now - 60,
                    heartbeat_at_s=now if alive else (now - 3600 if alive is False else None),
                    device_kind="cpu-budget",
                    interval_s=INTERVAL,
                    torch_version="2.x",
                    config={},
                    steps=N_SAMPLES // 2 if k == 0 else 10,
                    samples_dropped=0,
                    budget_bytes=1_000_000_000,
                    tags=spec.pop("tags", []),
                    **spec,
                )
            )
    rng = random.Random(7)
    rows = [sample_row(1, i, rng) for i in range(N_SAMPLES)]
    # two batches of the second run interleaved, so ids of runs interleave
    other = [sample_row(2, i, rng) for i in range(300)]
    for k in range(0, N_SAMPLES, 500):
        with engine.begin() as conn:
            conn.execute(insert(Sample), rows[k : k + 500])
            if k < 1000:
                conn.execute(insert(Sample), other[k // 500 * 150 : k // 500 * 150 + 150])
    if is_postgres(engine):  # no insert hook there: fold the Core inserts in, as writers do
        with engine.begin() as conn:
            assert roll_up(conn) == N_SAMPLES + 300
    with Session(engine) as s, s.begin():
        s.add_all(
            [
                Event(
                    run_id=1,
                    time_s=T0 + 100,
                    step=50,
                    kind="threshold_crossed",
                    message="free below floor",
                    data={"direction": "below", "free_fraction": 0.1, "floor": 0.2},
                ),
                Event(
                    run_id=1, time_s=T0 + 101, step=50, kind="decision", message="offload", data={}
                ),
                Event(
                    run_id=1,
                    time_s=T0 + 102,
                    step=51,
                    kind="action",
                    message="offloaded",
                    data={"action": "offload", "target": "emb", "bytes_saved": 123456},
                ),
                Event(run_id=1, time_s=T0 + 200, step=100, kind="oom", message="OOM", data={}),
                Event(
                    run_id=2,
                    time_s=T0 + 5,
                    step=1,
                    kind="action",
                    message="released",
                    data={"action": "release_cache", "target": "allocator", "bytes_saved": 7},
                ),
            ]
        )
        for t, params in ((T0 + 1, 400), (T0 + 500, 200)):
            s.add(
                ModuleStat(
                    run_id=1,
                    time_s=t,
                    step=0,
                    module="emb",
                    kind="Embedding",
                    num_embeddings=50_000,
                    embedding_dim=8,
                    dtype="float32",
                    device="cpu",
                    placement="device",
                    params_bytes=params,
                    grads_bytes=params,
                    optimizer_state_bytes=2 * params,
                    activations_bytes=0,
                )
            )
        s.add(
            ModuleStat(
                run_id=1,
                time_s=T0 + 1,
                step=0,
                module="head",
                kind="Linear",
                params_bytes=10,
                grads_bytes=10,
                optimizer_state_bytes=20,
                activations_bytes=5,
            )
        )
    engine.dispose()
    in_use = [r["in_use_bytes"] for r in rows if r["in_use_bytes"] is not None]
    return {
        "rows": rows,
        "uuids": uuids,
        "peak": max(in_use),
        "min_free": min(r["free_fraction"] for r in rows),
    }


#: job ids as the recorder writes them: rank 0's uuid (a process group) and torchrun's run id
JOB_IDS = ("70be85fc-2a7b-4c2d-a9e1-5f3b2c1d0e9f", "torchelastic-run-7f3a2b1c")


def seed_with_jobs(path: Path | str) -> None:
    """:func:`seed`, then runs 1-2 the ranks of job ``JOB_IDS[0]`` and 3-4 of ``JOB_IDS[1]``."""
    seed(path)
    engine = open_engine(path)
    with engine.begin() as conn:
        for n, job_id in enumerate(JOB_IDS):
            conn.execute(
                insert(jobs_table).values(
                    id=job_id,
                    name=f"pretrain-{n}",
                    world_size=2,
                    backend="nccl",
                    id_source="process_group" if n == 0 else "torchelastic",
                    created_at_s=T0 + n,
                )
            )
            for rank, run_id in enumerate((2 * n + 1, 2 * n + 2)):
                conn.execute(
                    update(runs_table)
                    .where(runs_table.c.id == run_id)
                    .values(job_id=job_id, rank=rank, world_size=2, local_rank=rank)
                )
    engine.dispose()
