"""Four writer processes and a reader on one SQLite file: no "database is locked", no lost rows.

The file does not exist when the writers start, so they also race to create it (and the schema
migration must run once).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from edo_monitor.store.history import History

WRITERS = 4
BATCHES = 60
BATCH = 50

CHILD = textwrap.dedent(
    """
    import socket, sys, time, uuid
    from sqlalchemy import insert
    from sqlalchemy.orm import Session
    from edo_monitor.readings import Reading
    from edo_monitor.store.engine import open_engine
    from edo_monitor.store.schema import Event, Run, Sample

    path, k, batches, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    engine = open_engine(path)
    with Session(engine) as s, s.begin():
        run = Run(uuid=str(uuid.uuid4()), name=f"w{k}", host=socket.gethostname(), pid=0,
                  started_at_s=time.time(), status="running", device_kind="cpu-budget",
                  interval_s=0.01, torch_version="x", config={}, tags=[], steps=0,
                  samples_dropped=0)
        s.add(run)
        s.flush()
        run_id = run.id
    t = time.time()
    for b in range(batches):
        rows = []
        for i in range(batch):
            r = Reading(time_s=t + (b * batch + i) * 0.01, step=b, device_kind="cpu-budget",
                        in_use_bytes=k * 10**6 + b * batch + i, free_fraction=0.5)
            rows.append({**r.as_dict(), "run_id": run_id})
        with engine.begin() as conn:
            conn.execute(insert(Sample), rows)
            conn.execute(insert(Event), [{"run_id": run_id, "time_s": t, "step": b,
                                          "kind": "decision", "message": "m", "data": {}}])
    with engine.begin() as conn:
        from sqlalchemy import update
        conn.execute(update(Run).where(Run.id == run_id).values(status="finished",
                                                                 ended_at_s=time.time()))
    engine.dispose()
    print("done", run_id)
    """
)


@pytest.mark.slow
def test_four_writers_and_a_reader(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(path), str(k), str(BATCHES), str(BATCH)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(WRITERS)
    ]
    reads, errors = 0, []
    while any(p.poll() is None for p in procs):
        if path.exists():
            try:
                with History(path) as h:
                    for r in h.runs():
                        h.samples(r.id, columns=["in_use_bytes"], max_points=50)
                        h.samples_since(r.id, 0, limit=100)
                        h.events(r.id)
                    reads += 1
            except Exception as exc:  # every failure is a finding
                if "no history database" not in str(exc):
                    errors.append(repr(exc))
        time.sleep(0.01)
    outputs = [p.communicate() for p in procs]
    for p, (_out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
        assert "locked" not in err
    assert errors == []
    assert reads > 0
    with History(path) as h:
        runs = h.runs()
        assert sorted(r.name for r in runs) == [f"w{k}" for k in range(WRITERS)]
        for r in runs:
            assert r.status == "finished"
            assert r.sample_count == BATCHES * BATCH
            assert r.event_count == BATCHES
            k = int(r.name[1:])
            assert r.peak_in_use_bytes == k * 10**6 + BATCHES * BATCH - 1
            s = h.samples(r.id, columns=["in_use_bytes"], max_points=None)
            assert s.min["in_use_bytes"] == list(range(k * 10**6, k * 10**6 + BATCHES * BATCH))
