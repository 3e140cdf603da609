"""``edo-monitor export``: one run written out whole, as CSV (its samples), JSON (run, samples,
events and each module's latest row in one object) or JSON Lines (one typed object a line), to
standard output or to ``--out``: a temporary file beside the target renamed into place, never
over the history database or one of its companion files."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from edo_monitor.errors import ConfigError
from edo_monitor.surfaces.cli.common import (
    DbOpt,
    RunArg,
    _c,
    _handle_errors,
    _history,
    _info_dict,
    app,
    json_text,
)
from edo_monitor.surfaces.cli.output import open_output, output_target


@app.command("export")
@_handle_errors
def export_cmd(
    run: RunArg,
    db: DbOpt = None,
    fmt: Annotated[str, typer.Option("--format", help="csv, json or jsonl.")] = "csv",
    out_file: Annotated[  # the text as typed: a Path would make '' the folder '.'
        str | None,
        typer.Option("--out", help="Write here instead of standard output ('-': standard output)."),
    ] = None,
) -> None:
    """Export one run: csv = its samples; json = run, samples, events, modules (each module's
    latest figures) in one object; jsonl = one object per line, each with a "type" (run,
    sample, event, module)."""
    import dataclasses

    from edo_monitor.exporters.samples_file import sample_rows, write_samples_csv

    if fmt not in ("csv", "json", "jsonl"):
        raise ConfigError(f"--format {fmt!r} is not supported; expected csv, json or jsonl")
    if out_file == "-":  # the usual name of standard output
        out_file = None
    target = None if out_file is None else output_target(out_file, db, "--out")
    with _history(db) as h:
        info = h.run(run)

        def write(stream: Any) -> None:
            if fmt == "csv":
                write_samples_csv(h, info, stream)
            elif fmt == "jsonl":
                stream.write(json_text({"type": "run", **_info_dict(info)}) + "\n")
                for row in sample_rows(h, info):
                    stream.write(json_text({"type": "sample", **row}) + "\n")
                for e in h.events(info.id):
                    stream.write(json_text({"type": "event", **dataclasses.asdict(e)}) + "\n")
                for m in h.modules(info.id):
                    stream.write(json_text({"type": "module", **dataclasses.asdict(m)}) + "\n")
            else:
                doc = {
                    "run": _info_dict(info),
                    "samples": list(sample_rows(h, info)),
                    "events": [dataclasses.asdict(e) for e in h.events(info.id)],
                    "modules": [dataclasses.asdict(m) for m in h.modules(info.id)],
                }
                stream.write(json_text(doc, indent=2))
                stream.write("\n")

        if target is None:
            write(sys.stdout)
        else:
            with open_output(target) as stream:
                write(stream)
    if out_file is not None:
        _c.err.print(f"wrote run {info.id} as {fmt} to {out_file}")
