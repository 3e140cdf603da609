"""What both framework callbacks make of the framework's run name and of ``config=``
(``edo_monitor.integrations._common``), with no framework installed; the callbacks themselves
are run in real fits in test_integration_lightning.py and test_integration_transformers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import edo_monitor
from edo_monitor.errors import ConfigError
from edo_monitor.integrations._common import derived_run_name, run_config
from edo_monitor.store.schema import RUN_NAME_MAX_CHARS


@pytest.mark.parametrize(
    ("name", "made"),
    [
        ("exp 1\tlr=0.1", "exp 1 lr=0.1"),  # a tab (watch() refused it: the fit failed)
        ("a\r\nb\x1b[31m", "a  b [31m"),  # each control character one space, escapes too
        ("a\x85b\x7f", "a b "),  # C1 controls and DEL are control characters as well
        ("bad\udcffbytes", "bad bytes"),  # argv's undecodable byte: the history cannot store it
        ("ünïcode/version_0", "ünïcode/version_0"),  # printable text is kept as it is
        (7, "7"),  # not a string: its str()
    ],
)
def test_a_derived_name_is_made_printable(name: object, made: str) -> None:
    assert derived_run_name(name, "Model") == made


@pytest.mark.parametrize("name", [None, "", " ", "\t\n", "\x00"])
def test_a_derived_name_with_nothing_printable_is_the_fallback(name: object) -> None:
    """watch() refuses a blank run_name: the model's class name is used instead."""
    assert derived_run_name(name, "Model") == "Model"


def test_a_derived_name_is_shortened_to_what_the_history_stores() -> None:
    long = "/very/long/output/dir\t" * 20
    made = derived_run_name(long, "Model")
    assert len(made) == RUN_NAME_MAX_CHARS == 200
    assert made == long.replace("\t", " ")[:200]


def test_every_derived_name_is_one_watch_takes(db_path: Path) -> None:
    """The names above, and one of every control character, start a real run."""
    names = ["exp 1\tlr=0.1", "a\r\nb\x1b[31m", "bad\udcffbytes", "".join(map(chr, range(32)))]
    for name in [*names, "x" * 300]:
        with edo_monitor.watch(
            torch.nn.Linear(2, 2), db=db_path, run_name=derived_run_name(name, "Linear")
        ) as monitor:
            pass
        assert monitor.summary().status == "finished"


def test_the_users_config_is_recorded_over_the_callbacks_own() -> None:
    own = {"integration": "lightning", "max_steps": 5}
    assert run_config(own, None) == own
    assert run_config(own, {"lr": 0.1, "max_steps": 9}) == {
        "integration": "lightning",
        "max_steps": 9,
        "lr": 0.1,
    }


@pytest.mark.parametrize("config", [[("a", 1)], "abc", "", [], 3])
def test_a_config_that_is_not_a_mapping_is_refused_as_watch_refuses_it(
    config: object, db_path: Path
) -> None:
    """The callbacks' own ``**config`` raised a bare TypeError ('list' object is not a mapping),
    and let a falsy one ("", []) through, where watch() refuses each with a ConfigError."""
    with pytest.raises(ConfigError) as from_callback:
        run_config({"integration": "lightning"}, config)
    with (
        pytest.raises(ConfigError) as from_watch,
        edo_monitor.watch(torch.nn.Linear(2, 2), db=db_path, config=config),
    ):
        pass
    assert str(from_callback.value) == str(from_watch.value)
    assert str(from_callback.value).startswith(f"config={config!r}: expected a mapping")
