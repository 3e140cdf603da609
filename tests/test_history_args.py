"""The History API's numeric arguments, on a real history (a watched training loop): a value that
is not an int of the allowed range is a ConfigError naming it, never an SQL error from a value
pasted into the query text (``max_points=nan`` was ``no such column: nan``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import edo_monitor
from edo_monitor.errors import ConfigError
from edo_monitor.store.history import History


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished run with a few dozen samples."""
    db = tmp_path_factory.mktemp("h") / "h.db"
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with edo_monitor.watch(model, opt, db=db, interval_s=0.01) as mon:
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            model(torch.randn(16, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    return db


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (float("nan"), "nan"),  # was sqlite3.OperationalError: no such column: nan
        (float("inf"), "inf"),
        (2.5, "2.5"),  # was sqlite3.IntegrityError: datatype mismatch
        ("5", "'5'"),  # was a TypeError
        (True, "True"),  # was taken as 1
        (0, "0"),
    ],
)
def test_max_points_must_be_an_int_of_at_least_1(history: Path, value: Any, shown: str) -> None:
    with History(history) as h, pytest.raises(ConfigError) as err:
        h.samples("latest", max_points=value)
    assert str(err.value) == f"max_points={shown}; expected an int >= 1 or None"


def test_a_huge_max_points_is_every_sample(history: Path) -> None:
    """``10**30`` was ``sqlite3.IntegrityError: datatype mismatch``; it is an int >= 1."""
    with History(history) as h:
        every = h.samples("latest", columns=["step"], max_points=None)
        huge = h.samples("latest", columns=["step"], max_points=10**30)
        few = h.samples("latest", columns=["step"], max_points=2)
    assert len(every) > 2 and not huge.downsampled
    assert huge.time_s == every.time_s and len(few) <= 2


CALLS: list[tuple[str, Callable[[History], Any], str]] = [
    ("runs limit", lambda h: h.runs(limit=-1), "limit=-1; expected an int >= 0 or None"),
    ("runs limit", lambda h: h.runs(limit=1.5), "limit=1.5; expected an int >= 0 or None"),
    ("jobs limit", lambda h: h.jobs(limit="3"), "limit='3'; expected an int >= 0 or None"),
    (
        "samples_since after_id",
        lambda h: h.samples_since("latest", float("nan")),
        "after_id=nan; expected an int >= 0",
    ),
    (
        "samples_since limit",
        lambda h: h.samples_since("latest", 0, limit=float("nan")),
        "limit=nan; expected an int >= 0 or None",
    ),
    (
        "events_since after_id",
        lambda h: h.events_since("latest", None),
        "after_id=None; expected an int >= 0",
    ),
    (
        "device_events limit",
        lambda h: h.device_events(limit=2.5),
        "limit=2.5; expected an int >= 0 or None",
    ),
    (
        "devices within_s",
        lambda h: h.devices(within_s=float("nan")),
        "within_s=nan: expected a number of seconds >= 0",
    ),
    (
        "samples start",
        lambda h: h.samples("latest", start=float("nan")),
        "start=nan is not a time; expected Unix seconds or a datetime",
    ),
]


@pytest.mark.parametrize(("what", "call", "message"), CALLS, ids=[c[0] for c in CALLS])
def test_the_other_numeric_arguments_are_checked_the_same_way(
    history: Path, what: str, call: Callable[[History], Any], message: str
) -> None:
    """``runs(limit=-1)`` dropped the last run; nan ``after_id``/``start`` matched nothing."""
    with History(history) as h, pytest.raises(ConfigError) as err:
        call(h)
    assert str(err.value) == message


def test_good_counts_still_work(history: Path) -> None:
    with History(history) as h:
        assert len(h.runs(limit=1)) == 1 and h.runs(limit=0) == []
        rows = h.samples_since("latest", 0, limit=3)
        assert len(rows) == 3
        assert [r.id for r in h.samples_since("latest", rows[0].id, limit=2)] == [
            r.id for r in rows[1:]
        ]
        assert h.events_since("latest", 0) == h.events("latest")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda h: h.events(1, kind=5), "kind=5; expected an event kind (a string)"),
        (lambda h: h.events(1, kind=["action", 3]), "kind=['action', 3]; expected an event kind"),
        (lambda h: h.runs(status=5), "status=5; expected a run status (a string)"),
        (lambda h: h.jobs(status=5), "status=5; expected a job status (a string)"),
    ],
    ids=["events kind int", "events kind list", "runs status", "jobs status"],
)
def test_a_filter_that_is_not_names_is_refused(
    history: Path, call: Callable[[History], Any], message: str
) -> None:
    """``kind=5`` / ``status=5`` were a raw ``TypeError: 'int' object is not iterable``."""
    with History(history) as h, pytest.raises(ConfigError) as err:
        call(h)
    assert str(err.value).startswith(message)
    assert str(err.value).endswith("several (an iterable of strings) or None (any)")


def test_kinds_filter_as_one_name_or_several(tmp_path: Path) -> None:
    from history_seed import seed

    seed(tmp_path / "seeded.db")  # runs with events of several kinds
    with History(tmp_path / "seeded.db") as h:
        every = h.events(1)
        kinds = {e.kind for e in every}
        assert len(kinds) > 1 and h.events(1, kind=None) == every
        for kind in kinds:
            assert h.events(1, kind=kind) == [e for e in every if e.kind == kind]
        assert h.events(1, kind=tuple(kinds)) == every
        assert h.events(1, kind="actoin") == []  # no such event in the run: none
