"""The staged plan of ``explain`` (issue 24, item 5) on a real recorded run: a real watch() loop
on the CPU budget, a real SQLite file, the CLI through typer's runner; the dimension suggestion
against a table of known rank."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from sqlalchemy import text
from test_hindsight import DIM, ROWS, TABLE_BYTES, _train
from typer.testing import CliRunner

from edo_monitor.agent.spectrum import SPECTRUM_MAX_ROWS, table_spectrum
from edo_monitor.decide.estimate import estimate
from edo_monitor.errors import ConfigError
from edo_monitor.hindsight.explain import explain
from edo_monitor.hindsight.recorded import _tables_at
from edo_monitor.hindsight.staged import dimension_for_energy, staged_plan
from edo_monitor.store.history import History
from edo_monitor.surfaces.cli import app


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    db = tmp_path_factory.mktemp("staged") / "h.db"
    return db, _train(db, "observe", until="threshold_crossed")


def _smallest_ranks(sharded: int, shortfall: int) -> int:
    """By counting: the first N whose ``sharded * (N - 1) // N`` covers the shortfall."""
    n = 2
    while sharded * (n - 1) // n < shortfall:
        n += 1
    return n


def test_stage_bytes_from_the_recorded_attribution(observed: tuple[Path, int]) -> None:
    db, run = observed
    inc = explain(db, run).incidents[0]
    plan = inc.staged_plan
    with History(db) as h, h._read() as conn:
        sample = (
            conn.execute(
                text(
                    "SELECT * FROM samples WHERE run_id = :r AND time_s <= :t "
                    "ORDER BY time_s DESC, id DESC LIMIT 1"
                ),
                {"r": run, "t": inc.time_s},
            )
            .mappings()
            .one()
        )
        head_act = conn.execute(
            text(
                "SELECT activations_bytes FROM module_stats WHERE run_id = :r AND module = 'head' "
                "AND time_s <= :t ORDER BY time_s DESC, id DESC LIMIT 1"
            ),
            {"r": run, "t": inc.time_s},
        ).scalar()
    act, grads = int(sample["activations_bytes"] or 0), int(sample["grads_bytes"])
    params, state = int(sample["params_bytes"]), int(sample["optimizer_state_bytes"])
    assert params == sum(p.numel() * 4 for p in torch.nn.ModuleList([
        torch.nn.EmbeddingBag(ROWS, DIM), torch.nn.Linear(DIM, 8)]).parameters())  # fmt: skip
    by = {s.action: s for s in plan.stages}
    # stage 1: the one block (head) checkpointed, the rest of the activations halved; not the
    # gradients: bf16 autocast keeps parameters, and so gradients, float32 (they were halved)
    ckpt = min(act, int(head_act or 0))
    s1 = ckpt + (act - ckpt) // 2
    assert by["mixed_precision+checkpointing"].saving_bytes == s1
    # stage 2: the table (Adam, the step counter in the CPU budget) against each format's bytes
    assert by["quantize_bf16"].saving_bytes == ROWS * DIM * 4 * 2
    assert by["quantize_int8"].saving_bytes == TABLE_BYTES - (ROWS * DIM + ROWS * 4)
    # D = 32 in one group of 32 codes (16 bytes at int4, 8 at int2; the default group of 64 is
    # never wider than the row: it padded every row to 64 codes, int4 at int8's bytes) + a
    # float16 scale and zero-point; 2:8: 4 blocks of 8 at 10 bits (2 codes + 2 positions) + the
    # same 4 bytes
    assert by["quantize_int4"].saving_bytes == TABLE_BYTES - ROWS * (16 + 4)
    assert by["quantize_int2"].saving_bytes == TABLE_BYTES - ROWS * (8 + 4)
    assert by["quantize_2of8"].saving_bytes == TABLE_BYTES - ROWS * (4 * 10 // 8 + 4)
    assert by["quantize_int8"].cumulative_bytes == s1 + by["quantize_int8"].saving_bytes
    # stage 3: a one-rank run, N the smallest that covers the shortfall
    for action, sharded in (
        ("zero1", state),
        ("zero2", state + grads),
        ("zero3_fsdp", state + grads + params),
    ):
        n = _smallest_ranks(sharded, inc.shortfall_bytes)
        s = by[action]
        assert s.ranks == n and s.target == f"with {n} ranks" and s.enough
        assert s.saving_bytes == sharded * (n - 1) // n >= inc.shortfall_bytes
        assert sharded * (n - 2) // (n - 1) < inc.shortfall_bytes or n == 2
    assert [s.stage for s in plan.stages] == sorted(s.stage for s in plan.stages)


def test_the_run_records_each_tables_sampled_spectrum(observed: tuple[Path, int]) -> None:
    db, run = observed
    with History(db) as h:
        [event] = h.events(run, kind="table_spectrum")
    data = event.data
    assert data["table"] == "features" and data["rows_sampled"] == SPECTRUM_MAX_ROWS
    assert (data["num_embeddings"], data["embedding_dim"]) == (ROWS, DIM)
    values = data["singular_values"]
    assert len(values) == DIM and values == sorted(values, reverse=True)
    assert sum(v * v for v in values) == pytest.approx(data["total_energy"], rel=1e-5)
    dims = explain(db, run).incidents[0].staged_plan.dimensions
    assert {d.energy_fraction for d in dims} <= {0.9, 0.99} and all(
        d.table == "features" for d in dims
    )


def test_dimension_from_a_known_spectrum() -> None:
    """A rank-8 table of 10,000 x 64 plus tiny noise: the sampled spectrum keeps 99 % at 8."""
    n, d, r = 10_000, 64, 8
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, r, generator=g) @ torch.randn(r, d, generator=g)
    w += 1e-4 * torch.randn(n, d, generator=g)
    s = table_spectrum(w)
    assert s["rows_sampled"] == SPECTRUM_MAX_ROWS
    k, err = dimension_for_energy(s["singular_values"], s["total_energy"], 0.99)
    assert k == r and err < 1e-3
    # the error is the sample's rank-k residual relative to its norm
    values = s["singular_values"]
    assert err == pytest.approx(math.sqrt(sum(v * v for v in values[r:]) / s["total_energy"]))
    k90, _ = dimension_for_energy(values, s["total_energy"], 0.90)
    assert 1 <= k90 <= r
    with pytest.raises(ConfigError, match=r"share=1\.5"):
        dimension_for_energy(values, s["total_energy"], 1.5)
    with pytest.raises(ValueError, match="2-D"):
        table_spectrum(w[0])
    # in the plan: the saving is the recorded table bytes minus a (rows, k) table with Adam
    rows = [{
        "time_s": 1.0, "module": "emb", "kind": "Embedding", "num_embeddings": n,
        "embedding_dim": d, "dtype": "float32", "params_bytes": n * d * 4,
        "grads_bytes": n * d * 4, "optimizer_state_bytes": 2 * n * d * 4, "placement": "device",
    }]  # fmt: skip
    plan = staged_plan(1, None, _tables_at(rows, None), {}, spectra=[{"table": "emb", **s}])
    at99 = next(x for x in plan.dimensions if x.energy_fraction == 0.99)
    assert at99.dimension == r and at99.embedding_dim == d
    assert at99.saving_bytes == 4 * n * d * 4 - estimate(n, r, optimizer="adam").total_bytes


def test_cli_explain_prints_and_serialises_the_staged_plan(observed: tuple[Path, int]) -> None:
    db, run = observed
    runner = CliRunner()
    res = runner.invoke(app, ["explain", str(run), "--db", str(db)])
    assert res.exit_code == 0, res.output
    plan = explain(db, run).incidents[0].staged_plan
    assert "staged plan for a shortfall of" in res.stdout
    for s in plan.stages:
        assert s.action in res.stdout
    zero1 = next(s for s in plan.stages if s.action == "zero1")
    assert f"with {zero1.ranks} ranks" in res.stdout
    assert "dimension: features 32 ->" in res.stdout
    res = runner.invoke(app, ["explain", str(run), "--db", str(db), "--json"])
    data = json.loads(res.stdout)["incidents"][0]["staged_plan"]
    assert data["shortfall_bytes"] == plan.shortfall_bytes
    assert [s["saving_bytes"] for s in data["stages"]] == [s.saving_bytes for s in plan.stages]
    assert data["dimensions"][0]["dimension"] == plan.dimensions[0].dimension


def test_sharding_with_the_runs_ranks_and_when_no_rank_count_is_enough() -> None:
    sample = {"params_bytes": 4_000, "grads_bytes": 4_000, "optimizer_state_bytes": 8_000}
    # a four-rank run: N is its world size, the saving 3/4 of the sharded bytes
    by = {s.action: s for s in staged_plan(10_000, sample, {}, {}, world_size=4).stages}
    assert (by["zero1"].ranks, by["zero1"].saving_bytes, by["zero1"].enough) == (4, 6_000, False)
    assert (by["zero3_fsdp"].saving_bytes, by["zero3_fsdp"].enough) == (12_000, True)
    # one rank: the optimizer state (8,000 bytes) can never free 10,000; with the gradients
    # (12,000) N = 6 frees exactly 10,000 and N = 5 only 9,600; with the params (16,000) N = 3
    by = {s.action: s for s in staged_plan(10_000, sample, {}, {}).stages}
    assert by["zero1"].ranks is None and by["zero1"].target == "no rank count is enough"
    assert by["zero1"].saving_bytes == 0 and not by["zero1"].enough
    assert (by["zero2"].ranks, by["zero2"].saving_bytes, by["zero2"].enough) == (6, 10_000, True)
    assert (by["zero3_fsdp"].ranks, by["zero3_fsdp"].saving_bytes) == (3, 10_666)


def test_sharding_when_the_model_is_already_sharded() -> None:
    """An FSDP run recorded its rank's shard of params, gradients and state (16,000 bytes on 2
    ranks): ZeRO-1/2/3 against replicas would count savings it already has. One line: M ranks
    hold 2/M of it, and M = 6 is the first whose 16,000 * 4 // 6 = 10,666 covers 10,000."""
    sample = {"params_bytes": 4_000, "grads_bytes": 4_000, "optimizer_state_bytes": 8_000}
    plan = staged_plan(10_000, sample, {}, {}, world_size=2, sharded_by="FullyShardedDataParallel")
    (line,) = [s for s in plan.stages if s.stage == 3]
    assert (line.action, line.ranks, line.saving_bytes, line.enough) == (
        "zero3_fsdp",
        6,
        10_666,
        True,
    )
    assert line.target == "with 6 ranks (now 2)" and "already sharded" in line.detail
    assert 16_000 * 3 // 5 < 10_000  # M = 5 would not do
    # a shard that can never cover the shortfall, whatever the rank count
    plan = staged_plan(
        10_000, {"params_bytes": 9_000}, {}, {}, world_size=2, sharded_by="FSDPLinear"
    )
    (line,) = [s for s in plan.stages if s.stage == 3]
    assert (
        line.ranks is None and line.saving_bytes == 0 and line.target == "no rank count is enough"
    )


def test_low_bit_stages_name_the_group_width_the_tables_get() -> None:
    """A narrow table's groups are its row rounded up to 8 (estimate's and the module's rule):
    the int4 / int2 lines name the widths their estimate used, not always 64."""

    def table(name: str, dim: int) -> dict[str, object]:
        n = 10_000
        return {
            "time_s": 1.0, "module": name, "kind": "Embedding", "num_embeddings": n,
            "embedding_dim": dim, "dtype": "float32", "params_bytes": n * dim * 4,
            "grads_bytes": 0, "optimizer_state_bytes": 0, "placement": "device",
        }  # fmt: skip

    def notes(rows: list[dict[str, object]]) -> dict[str, str]:
        plan = staged_plan(1, None, _tables_at(rows, None), {})
        return {s.action: s.detail for s in plan.stages if s.stage == 2}

    narrow = notes([table("emb", 20)])
    assert narrow["quantize_int4"].startswith("int4, groups of 24 with")
    assert narrow["quantize_int2"].startswith("int2, groups of 24 with")
    both = notes([table("emb", 20), table("wide", 300)])
    assert both["quantize_int4"].startswith("int4, groups of 24 / 64 with")
    assert notes([table("wide", 300)])["quantize_int4"].startswith("int4, groups of 64 with")
