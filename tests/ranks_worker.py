"""One rank of a real multi-process ``torch.distributed`` job, for tests/test_ranks.py.

Run as ``python ranks_worker.py SCENARIO DB RANK WORLD_SIZE STORE_FILE [KEY=VALUE ...]``: it
joins a gloo process group through a FileStore (``file://STORE_FILE``, no network port), trains
a small embedding model under ``edo_monitor.watch(db=DB)`` and prints one JSON line: its
summary, its job and rank, and what the scenario measured.

Scenarios:

* ``jobs``: a plain training loop (the job and rank columns).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import edo_monitor


def _options(argv: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in argv)


def scenario_jobs(db: str, rank: int, opts: dict[str, str]) -> dict[str, Any]:
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Embedding(2_000, 16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = int(opts.get("steps", "10"))
    with edo_monitor.watch(model, db=db, interval_s=0.01, run_name="ranks-test", strict=True) as m:
        for _ in range(steps):
            x = torch.randint(0, 2_000, (64,))
            model(x).logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.002)
    s = m.summary()
    return {
        "run_id": s.run_id,
        "status": s.recorded_status,
        "steps": s.steps,
        "errors": s.agent_errors,
        "job_id": m.job_id,
        "rank": m.rank,
        "world_size": m.world_size,
        "local_rank": m.local_rank,
        "summary_job_id": s.job_id,
    }


SCENARIOS = {"jobs": scenario_jobs}


def main() -> None:
    scenario, db, rank, world, store = sys.argv[1:6]
    opts = _options(sys.argv[6:])
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=int(rank), world_size=int(world)
    )
    try:
        out = SCENARIOS[scenario](db, int(rank), opts)
    finally:
        dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
