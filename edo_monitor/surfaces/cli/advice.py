"""The commands that advise: explain (what would have saved a run), replay (a policy over the
recorded samples), estimate (what a table would take)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from edo_monitor.errors import (
    ConfigError,
)
from edo_monitor.list_table import Col, ListTable
from edo_monitor.surfaces.cli.common import (
    DbOpt,
    JsonOpt,
    RunArg,
    _bytes,
    _c,
    _handle_errors,
    _history,
    _pct,
    _print_json,
    _require_database,
    app,
)
from edo_monitor.surfaces.cli.options import Number, int64


@app.command("explain")
@_handle_errors
def explain_cmd(
    run: RunArg,
    db: DbOpt = None,
    event: Annotated[
        int | None,
        typer.Option(
            "--event",
            help="Only the incident of this event id.",
            parser=int64(),
        ),
    ] = None,
    top: Annotated[
        int, typer.Option(help="Remedies shown per incident.", parser=Number(int, 1, 10_000))
    ] = 12,
    as_json: JsonOpt = False,
) -> None:
    """What would have avoided each OOM and pressure crossing: shortfall and ranked remedies."""
    from edo_monitor.hindsight.explain import explain

    _require_database(db)
    with _history(db) as h:
        result = explain(h, run, event=event)
    if as_json:
        _print_json(result.as_dict())
        return
    from edo_monitor.hindsight.view import explain_renderables

    for renderable in explain_renderables(result, top=top):
        _c.out.print(renderable)


@app.command("snapshot")
@_handle_errors
def snapshot_cmd(
    run: RunArg,
    db: DbOpt = None,
    event: Annotated[
        int | None,
        typer.Option(
            "--event", help="The event id (default: the latest snapshot).", parser=int64()
        ),
    ] = None,
    out: Annotated[  # the text as typed: a Path would make '' the folder '.'
        str | None, typer.Option("--out", help="Write the pickle PyTorch's memory viewer opens.")
    ] = None,
    html: Annotated[
        str | None, typer.Option("--html", help="Write torch.cuda._memory_viz's page.")
    ] = None,
    html_kind: Annotated[str, typer.Option(help="trace (trace_plot) or segments.")] = "trace",
    top: Annotated[
        int | None,
        typer.Option(help="Print the K largest live blocks by frame (module).", parser=int64()),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """An incident's memory snapshot (OOM, crossing, action) for PyTorch's memory viewer."""
    from edo_monitor.surfaces.cli.output import output_target
    from edo_monitor.surfaces.cli.snapshot import snapshot_command

    out_file = None if out is None else output_target(out, db, "--out")
    html_file = None if html is None else output_target(html, db, "--html")
    _require_database(db)
    with _history(db) as h:
        printed = snapshot_command(
            h, run, event=event, out=out_file, html=html_file, html_kind=html_kind, top=top,
            as_json=as_json,
        )  # fmt: skip
    for renderable in printed:
        _c.out.print(renderable)


def _signed_bytes(value: int | None) -> str:
    """``-14.75 MiB`` for a negative count (a cache growing back uses bytes)."""
    if value is not None and value < 0:
        return "-" + _bytes(-value)
    return _bytes(value)


@app.command("replay")
@_handle_errors
def replay_cmd(
    run: RunArg,
    db: DbOpt = None,
    policy: Annotated[
        str | None,
        typer.Option(
            help="Policy settings KEY=VALUE,... (min_free_fraction, rearm_free_fraction, "
            "cooldown_steps, mode, allow_lossy, ladder=a+b, release_cache_min_bytes, "
            "grow_margin_fraction, grow_after_readings, forecast_steps, "
            "forecast_window_steps); default: the default policy."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-run a recorded run through a policy offline: when it would have acted, what, and the
    resulting minimum free fraction, beside what happened."""
    from edo_monitor.hindsight.replay import parse_policy, replay

    settings = {} if policy is None else parse_policy(policy)  # before anything is opened
    from edo_monitor.decide.policy import Policy

    pol = Policy(**settings)
    _require_database(db)
    with _history(db) as h:
        result = replay(h, run, pol)
    if as_json:
        _print_json(result.as_dict())
        return
    _c.out.print(f"run {result.run_id} {result.run_name}: {result.samples:,} samples through")
    _c.out.print(f"  {result.policy}")
    table = ListTable(  # the action and its target name the row: never cut (ListTable)
        Col(""),
        Col("step", "right"),
        Col("action", key=True),
        Col("target", key=True),
        Col("saving", "right"),
        Col("free at decision", "right"),
        Col("status"),
        show_edge=False,
    )
    for label, rows in (("replay", result.decisions), ("recorded", result.recorded)):
        for d in rows:
            table.add_row(
                label,
                str(d.step),
                str(d.action),  # a recorded event's own (None where it named none)
                d.target or "-",
                _signed_bytes(d.saving_bytes),
                _pct(d.free_fraction),
                d.status,
            )
        if not rows:
            table.add_row(label, "-", "(no decision)", "", "", "", "")
    _c.out.print(table)
    for f in result.forecasts:
        verdict = {
            True: f"came true at step {f.crossing_step}",
            False: "did not come true",
            None: "not judged (the run ended first)",
        }[f.came_true]
        _c.out.print(
            f"replay: forecast at step {f.step} (free {_pct(f.free_fraction)}, "
            f"+{_bytes(round(f.slope_bytes_per_step))}/step): below the floor at step "
            f"{f.predicted_step}; {verdict}"
        )
    for step, refused in result.refusals:
        _c.out.print(f"replay: step {step}: no action applies")
        for action, reason in refused:
            _c.out.print(f"  {action}: {reason}")
    _c.out.print(
        f"min free fraction: replay {_pct(result.min_free_fraction)}, "
        f"recorded {_pct(result.recorded_min_free_fraction)}"
    )
    if result.samples and result.recorded_min_free_fraction is None:
        _c.out.print(
            f"run {result.run_id} recorded no free memory (no budget): a policy has nothing to "
            "act on (watch(budget=...) or a GPU gives one)"
        )
    for step, avoided in zip(result.oom_steps, result.oom_avoided, strict=True):
        _c.out.print(
            f"recorded OOM at step {step}: "
            + ("the replayed actions free more than its shortfall" if avoided else "not avoided")
        )


@app.command("estimate")
@_handle_errors
def estimate_cmd(
    num_embeddings: Annotated[
        int, typer.Option(help="Rows of the embedding table.", parser=int64())
    ],
    embedding_dim: Annotated[
        int,
        typer.Option(help="Columns of the embedding table.", parser=int64()),
    ],
    dtype: Annotated[str, typer.Option(help="Parameter dtype (float32, float16, bfloat16 …).")] = (
        "float32"
    ),
    optimizer: Annotated[
        str, typer.Option(help="sgd, sgd-momentum, adam, adamw, adagrad, rmsprop")
    ] = "adam",
    compression: Annotated[
        str | None,
        typer.Option(
            help="fp16, bf16, int8, int4[:G], int2[:G], 2of8[:G] (2 of 8 kept at 2 bits), "
            "perrow:K[:BITS] (K full rows, the rest int4/int2), lowrank:R, hash:B, hash2:B, "
            "qr:R, hybrid:K:B (G: group size, default 64)"
        ),
    ] = None,
    master_weights: Annotated[
        bool, typer.Option(help="Keep fp32 master weights for a low-precision table.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Estimate the training memory of one embedding table (no database needed)."""
    from edo_monitor.surfaces.cli.estimate_text import estimate_command

    try:
        text_ = estimate_command(
            num_embeddings, embedding_dim, dtype, optimizer, compression, master_weights, as_json
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    sys.stdout.write(text_ + "\n")
