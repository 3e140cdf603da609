"""What keeps the ranks of a job from acting apart (real two-rank gloo jobs, tests/ranks_worker.py):
a DDP wrapper around the watched module refuses table actions as one inside it does; a rank
watching without a policy refuses what the others agreed on, and records it; a process group
initialised after ``watch()`` began (no agreement) lets no rank change its parameters alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_ranks import _actions_by_rank, _events, run_ranks


@pytest.mark.slow
def test_ddp_around_the_watched_module_refuses_table_actions(tmp_path: Path) -> None:
    """Regression: ``watch(net)`` while the loop trains ``DistributedDataParallel(net)``: the
    ranks agreed on ``offload_embedding`` and DDP's next backward failed on both ("Expected to
    have finished reduction in the prior iteration")."""
    db = str(tmp_path / "history.db")
    results = run_ranks(
        "pressure",
        db,
        2,
        tmp_path,
        "ddp=1",
        "watch=inner",
        "model=plain",
        "ladder=offload_embedding",
    )
    assert results[0]["checksum"] == results[1]["checksum"]  # the replicas stayed equal
    for res in results:
        assert res["status"] == "finished" and res["errors"] == {} and res["steps"] == 40
    assert _actions_by_rank(db, results) == [[], []]
    (refused, *_) = _events(db, results[1]["run_id"], ("no_action",))
    assert "offload_embedding (model is wrapped in DistributedDataParallel" in refused.message


@pytest.mark.slow
def test_a_rank_without_a_policy_refuses_the_agreed_action_and_records_it(tmp_path: Path) -> None:
    """Regression: rank 0 watched with ``policy=None``; recording its refusal raised
    ``AssertionError`` in the agent, which switched its agreement off, and rank 1 waited out the
    agreement timeout at the next one (40 steps took 68 s, not 8)."""
    db = str(tmp_path / "history.db")
    results = run_ranks(
        "pressure",
        db,
        2,
        tmp_path,
        "ladder=offload_embedding",
        "nopolicy_rank=0",
        env={"EDO_AGREEMENT_TIMEOUT_S": "30"},
    )
    for res in results:
        assert res["status"] == "finished" and res["errors"] == {} and res["steps"] == 40
        assert res["sync"]["max_sync_s"] < 10  # no agreement waited for a rank gone quiet
    per_rank = _actions_by_rank(db, results)
    assert [[e.kind for e in a] for a in per_rank] == [["action_refused"]] * 2, per_rank
    assert "rank 0 cannot apply it" in per_rank[0][0].data["reason"]


@pytest.mark.slow
def test_ranks_without_an_agreement_change_no_parameter_alone(tmp_path: Path) -> None:
    """Regression: the process group was initialised inside the ``watch()`` block, so the ranks
    had no agreement, and the rank under pressure offloaded its table alone (under DDP its next
    backward failed, and the other rank's connection closed)."""
    db = str(tmp_path / "history.db")
    results = run_ranks("pressure", db, 2, tmp_path, "ladder=offload_embedding", "init=late")
    for res in results:
        assert res["status"] == "finished" and res["errors"] == {} and res["steps"] == 40
    assert results[0]["checksum"] != 0
    (refused,) = _events(db, results[1]["run_id"], ("action", "action_refused"))
    assert refused.kind == "action_refused"
    assert (
        "a process group of 2 ranks runs but the ranks' agreement does not"
        in (refused.data["reason"])
    )
