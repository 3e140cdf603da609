"""watch(optimizer=): an Optimizer, an iterable of them, or None; anything else a ConfigError
naming the value (real training loops, real SQLite files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from watch_helpers import make_model, run_row, train

import edo_monitor
from edo_monitor.errors import ConfigError

ALLOWED = "a torch.optim.Optimizer, an iterable of them, or None (found by its steps)"


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        (5, f"optimizer=5 is not {ALLOWED}"),  # was TypeError: 'int' object is not iterable
        (2.5, f"optimizer=2.5 is not {ALLOWED}"),
        ("adam", f"optimizer='adam' is not {ALLOWED}"),  # was "optimizer=str is not ..."
        (b"sgd", f"optimizer=b'sgd' is not {ALLOWED}"),
        ({"enc": 1}, f"optimizer={{'enc': 1}} is not {ALLOWED}"),  # keys were taken as items
        ([3], f"optimizer holds 3 (int); expected {ALLOWED}"),
        ((None,), f"optimizer holds None (NoneType); expected {ALLOWED}"),
    ],
)
def test_a_bad_optimizer_is_a_config_error_naming_it(
    db_path: Path, optimizer: Any, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        edo_monitor.watch(make_model(), optimizer, db=db_path)
    assert str(err.value) == message
    assert not db_path.exists()  # refused before anything was written


def test_a_list_holding_a_non_optimizer_names_it(db_path: Path) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"^optimizer holds 'adam' \(str\); expected a torch"):
        edo_monitor.watch(model, [opt, "adam"], db=db_path)


def _state_bytes(model: torch.nn.Module, optimizer: Any, db_path: Path) -> tuple[int, int]:
    """The optimizer-state bytes a run accounts, and its steps."""
    opt = torch.optim.Adam(model.parameters())
    given = optimizer(opt)
    with edo_monitor.watch(model, given, db=db_path) as mon:
        train(model, opt, 3)
    return mon.accounting.optimizer_state_bytes, int(run_row(db_path)["steps"])


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda opt: opt,
        lambda opt: [opt],
        lambda opt: (opt,),
        lambda opt: (o for o in [opt]),  # a generator: read once, kept
        lambda opt: {opt},
        lambda opt: [opt, opt],  # given twice: counted once, not its state twice
        lambda opt: None,
        lambda opt: [],  # empty: found as with None
    ],
    ids=["optimizer", "list", "tuple", "generator", "set", "twice", "none", "empty"],
)
def test_every_allowed_form_watches_the_optimizer_once(db_path: Path, optimizer: Any) -> None:
    """Adam's exp_avg and exp_avg_sq of every parameter, a float32 step per parameter."""
    model = make_model()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state, steps = _state_bytes(model, optimizer, db_path)
    assert (state, steps) == (2 * params + 3 * 4, 3)
