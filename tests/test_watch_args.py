"""watch()'s arguments that are stored with the run or name its file: a bad one is a ConfigError
naming the value, raised by watch() itself (not a raw TypeError/ValueError from deep inside, not
a value that breaks a reader later)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner
from watch_helpers import agent_threads, make_model, run_row, train

import edo_monitor
from edo_monitor.errors import ConfigError
from edo_monitor.store.history import History
from edo_monitor.surfaces.cli import app


def test_tags_that_are_neither_a_string_nor_an_iterable_are_refused(db_path: Path) -> None:
    """``tags=5`` was ``TypeError: 'int' object is not iterable``."""
    with pytest.raises(ConfigError) as err:
        edo_monitor.watch(make_model(), db=db_path, tags=5)  # type: ignore[arg-type]
    assert str(err.value) == (
        "tags=5: expected a string (one tag), an iterable of strings, or None"
    )
    with edo_monitor.watch(db=db_path, tags=("nightly", 3)):  # items are made strings, as before
        pass
    assert json.loads(run_row(db_path)["tags"]) == ["nightly", "3"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strict": "no"}, "strict='no'; expected True or False"),
        ({"track_activations": "no"}, "track_activations='no'; expected True or False"),
        ({"enforce": "yes", "budget": "1GiB"}, "enforce='yes'; expected True or False"),
        ({"enforce": 1}, "enforce=1; expected True or False"),
        ({"run_name": 5}, "run_name=5; expected a non-empty string (or None: the model's)"),
        # an empty name silently became the model's class name
        ({"run_name": " "}, "run_name=' '; expected a non-empty string (or None: the model's)"),
        # PostgreSQL refused the row (value too long for varchar(200)); SQLite took it
        (
            {"run_name": "r" * 201},
            f"run_name is 201 characters ({'r' * 40!r}...); expected at most 200",
        ),
        ({"ahead": 0}, "ahead=0; expected an int >= 1"),
        ({"ahead": 1.5}, "ahead=1.5; expected an int >= 1"),
        ({"ahead": True}, "ahead=True; expected an int >= 1"),
        # a terminal escape in a stored name reached every reader's terminal (runs, show, TUI)
        (
            {"run_name": "\x1b[31mred"},
            "run_name '\\x1b[31mred' holds a control character; expected printable text",
        ),
        (
            {"tags": ["ok", "a\x07"]},
            "tags 'a\\x07' holds a control character; expected printable text",
        ),
        # a lone surrogate (bytes of argv that are not UTF-8) was a UnicodeEncodeError when
        # the run's row was written
        (
            {"run_name": "a\udcffb"},
            "run_name 'a\\udcffb' holds a lone surrogate; expected valid text",
        ),
    ],
)
def test_flags_names_and_ahead_are_checked_with_or_without_what_they_go_with(
    db_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    """Regression: ``strict="no"`` and ``track_activations="no"`` were read as True,
    ``enforce="yes"`` without a budget said "enforce=True needs a budget=", ``run_name=5`` was
    stored, and ``ahead=0`` passed unless ``loader=`` was given."""
    with pytest.raises(ConfigError) as err:
        edo_monitor.watch(make_model(), db=db_path, **kwargs)
    assert str(err.value) == message


_SECONDS = "expected a finite number of seconds > 0"
_TOO_LONG = (
    f"expected at most {threading.TIMEOUT_MAX:.4g} seconds (the longest wait a thread takes)"
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # a string or None was a raw TypeError ('>=' not supported between 'str' and 'int')
        (
            {"snapshot_interval_s": "5"},
            "snapshot_interval_s='5'; expected a finite number of seconds >= 0 (0: never)",
        ),
        (
            {"snapshot_interval_s": None},
            "snapshot_interval_s=None; expected a finite number of seconds >= 0 (0: never)",
        ),
        ({"profile_interval_s": "30"}, f"profile_interval_s='30'; {_SECONDS}"),
        ({"profile_interval_s": float("inf")}, f"profile_interval_s=inf; {_SECONDS}"),
        ({"profile_interval_s": 0}, f"profile_interval_s=0; {_SECONDS}"),
        ({"interval_s": True}, f"interval_s=True; {_SECONDS}"),
        ({"interval_s": float("nan")}, f"interval_s=nan; {_SECONDS}"),
        # accepted, it killed the sampler thread (OverflowError in Event.wait), no error counted
        ({"interval_s": 1e12}, f"interval_s=1000000000000.0; {_TOO_LONG}"),
        ({"snapshot_interval_s": 1e300}, f"snapshot_interval_s=1e+300; {_TOO_LONG}"),
    ],
)
def test_durations_are_finite_seconds_named_when_refused(
    db_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        edo_monitor.watch(make_model(), db=db_path, **kwargs)
    assert str(err.value) == message
    assert not db_path.exists()  # refused before anything was written


@pytest.mark.parametrize("db", ["x\0y.db", "sqlite:///x\0y.db"])
def test_a_db_path_with_a_nul_character_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, db: str
) -> None:
    """It was ``ValueError: embedded null byte`` from ``os.stat``."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        edo_monitor.watch(make_model(), db=db)
    assert str(err.value) == (
        f"db={db!r} holds a NUL character (\\0); expected a file path without one"
    )
    with pytest.raises(ConfigError, match="holds a NUL character"):
        History(db)  # a reader: the same check
    assert list(tmp_path.iterdir()) == [] and agent_threads() == []


@pytest.mark.parametrize("config", [[1], "lr=0.1", [("lr", 0.1)], 3])
def test_config_that_is_not_a_mapping_is_refused_by_name(db_path: Path, config: Any) -> None:
    """``config=[1]`` raised ``TypeError: cannot convert dictionary update sequence element #0``
    from inside watch(); a list of pairs was taken as a mapping."""
    with pytest.raises(ConfigError) as err:
        edo_monitor.watch(make_model(), db=db_path, config=config)
    assert str(err.value) == f"config={config!r}: expected a mapping of names to values, or None"
    assert not db_path.exists()


@pytest.mark.parametrize(
    ("config", "shown"),
    [
        ({"lr": float("nan")}, "{'lr': nan}"),
        ({"lr": float("inf")}, "{'lr': inf}"),
        ({"schedule": {"floor": [0.1, float("-inf")]}}, "{'schedule': {'floor': [0.1, -inf]}}"),
    ],
)
def test_config_without_a_strict_json_form_is_refused(
    db_path: Path, config: dict[str, Any], shown: str
) -> None:
    """NaN and infinities were accepted, and ``show --json`` then printed ``NaN``/``Infinity``,
    which is not JSON."""
    with pytest.raises(ConfigError) as err:
        edo_monitor.watch(make_model(), db=db_path, config=config)
    message = str(err.value)
    assert message.startswith(f"config={shown} cannot be stored: "), message
    assert "strict JSON has no NaN or Infinity" in message
    assert not db_path.exists()


def test_paths_in_the_config_are_stored_as_their_text(db_path: Path) -> None:
    """Regression: ``config=vars(args)`` of an argparse ``type=Path`` option refused the run
    ("Object of type PosixPath is not JSON serializable"). A path is stored as its text."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"data": Path("data") / "train", "extra": {"files": (Path("a.csv"), 3)}}
    with edo_monitor.watch(model, opt, db=db_path, config=config) as mon:
        train(model, opt, 2)
    with History(db_path) as h:
        stored = h.run(mon.run_id).config
    assert (stored["data"], stored["extra"]) == ("data/train", {"files": ["a.csv", 3]})


def test_a_finite_config_is_strict_json_in_show(db_path: Path) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with edo_monitor.watch(model, opt, db=db_path, config={"lr": 0.1, "ramp": [1, 2.5]}):
        train(model, opt, 3)
    res = CliRunner().invoke(app, ["show", "latest", "--json", "--db", str(db_path)])
    assert res.exit_code == 0, res.output

    def refuse(constant: str) -> None:
        raise AssertionError(f"not strict JSON: {constant}")

    data = json.loads(res.output, parse_constant=refuse)
    assert data["run"]["config"]["lr"] == 0.1 and data["run"]["config"]["ramp"] == [1, 2.5]
