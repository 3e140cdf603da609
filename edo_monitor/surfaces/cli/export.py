"""``edo-monitor export``: one run written out whole, as CSV (its samples), JSON (run, samples,
events and modules in one object) or JSON Lines (one typed object a line), to standard output or
to ``--out``: a temporary file beside the target renamed into place, never over the history
database or one of its companion files."""

from __future__ import annotations

import csv
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
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
    _json_default,
    app,
)


@app.command("export")
@_handle_errors
def export_cmd(
    run: RunArg,
    db: DbOpt = None,
    fmt: Annotated[str, typer.Option("--format", help="csv, json or jsonl.")] = "csv",
    out_file: Annotated[
        Path | None, typer.Option("--out", help="Write here instead of standard output.")
    ] = None,
) -> None:
    """Export one run: csv = its samples; json = run, samples, events, modules in one object;
    jsonl = one object per line, each with a "type" (run, sample, event, module)."""
    import dataclasses

    from edo_monitor.store.queries import NUMERIC_SAMPLE_COLUMNS

    if fmt not in ("csv", "json", "jsonl"):
        raise ConfigError(f"--format {fmt!r} is not supported; expected csv, json or jsonl")
    target = None if out_file is None else _export_target(out_file, db)
    columns = ["id", "time_s", "device_kind", *NUMERIC_SAMPLE_COLUMNS]
    with _history(db) as h:
        info = h.run(run)
        kind = info.device_kind

        def samples() -> Iterator[dict[str, Any]]:
            after = 0
            while True:
                page = h.samples_since(info.id, after, limit=10_000)
                if not page:
                    return
                for s in page:  # a run's samples all have the run's device kind
                    yield {"id": s.id, "time_s": s.time_s, "device_kind": kind, **s.values}
                after = page[-1].id

        tmp: Path | None = None
        if target is not None:  # a temporary file beside the target, renamed into place
            import tempfile

            fd, tmp_name = tempfile.mkstemp(
                dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
            )
            tmp = Path(tmp_name)
            stream: Any = os.fdopen(fd, "w", newline="", encoding="utf-8")
        else:
            stream = sys.stdout
        done = False
        try:
            if fmt == "csv":
                writer = csv.DictWriter(stream, fieldnames=columns, extrasaction="ignore")
                writer.writeheader()
                for row in samples():
                    writer.writerow(row)
            elif fmt == "jsonl":
                stream.write(json.dumps({"type": "run", **_info_dict(info)}) + "\n")
                for row in samples():
                    stream.write(json.dumps({"type": "sample", **row}) + "\n")
                for e in h.events(info.id):
                    stream.write(json.dumps({"type": "event", **dataclasses.asdict(e)}) + "\n")
                for m in h.modules(info.id):
                    stream.write(json.dumps({"type": "module", **dataclasses.asdict(m)}) + "\n")
            else:
                doc = {
                    "run": _info_dict(info),
                    "samples": list(samples()),
                    "events": [dataclasses.asdict(e) for e in h.events(info.id)],
                    "modules": [dataclasses.asdict(m) for m in h.modules(info.id)],
                }
                json.dump(doc, stream, indent=2, default=_json_default)
                stream.write("\n")
            done = True
        finally:
            if tmp is not None and target is not None:
                stream.close()
                if done:
                    _publish(tmp, target)
                else:
                    tmp.unlink(missing_ok=True)
    if out_file is not None:
        _c.err.print(f"wrote run {info.id} as {fmt} to {out_file}")


def _export_target(out_file: Path, db: str | None) -> Path:
    """The file ``--out`` names, links resolved; refused when it is the history database or one
    of its companion files (``-wal``, ``-shm``, ``-journal``: overwriting the ``-wal`` of a
    database whose last transactions are still in it loses them), a folder, or in a missing
    folder."""
    from edo_monitor.store.paths import resolve_db_url

    target = Path(os.path.realpath(out_file))
    shown = str(out_file)
    if target.is_dir():
        raise ConfigError(f"--out {shown!r} is a directory; expected a file path")
    if not target.parent.is_dir():
        raise ConfigError(f"--out {shown!r}: folder {str(target.parent)!r} does not exist")
    url = resolve_db_url(db, readonly=True)
    database = url.database if url.get_backend_name() == "sqlite" else None
    if database and database != ":memory:":
        base = os.path.realpath(database)
        for suffix in ("", "-wal", "-shm", "-journal"):
            protected = base + suffix
            same = str(target) == protected
            if not same and target.exists() and os.path.exists(protected):
                same = os.path.samefile(target, protected)  # hard links
            if same:
                what = " itself" if not suffix else f"'s {suffix} file"
                raise ConfigError(
                    f"--out {shown!r} is the history database{what} ({protected}); choose "
                    "another file"
                )
    return target


def _publish(tmp: Path, target: Path) -> None:
    """Give the finished temporary file the mode a new file would have and rename it over
    ``target`` (atomic: a reader sees the old file or the whole new one)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)
    os.replace(tmp, target)
