"""The shared count check (``edo_monitor.checks.whole_number``) and the arguments that go through
it: NumPy's ints are ints (a size computed with NumPy was refused: ``cache_rows=np.int64(64)``,
``max_points=np.int64(5)``), bools and floats are not, and every refusal names the value."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from edo_monitor.actions.compress_embedding import CompressEmbedding
from edo_monitor.checks import whole_number, whole_number_or_none
from edo_monitor.decide.estimate import estimate
from edo_monitor.decide.policy import Policy
from edo_monitor.errors import ConfigError
from edo_monitor.nn import CachedEmbedding, EmbeddingOptions, LookAhead, hash_ids
from edo_monitor.nn.lowbit import GroupwiseEmbedding


@pytest.mark.parametrize("value", [5, np.int64(5), np.int32(5), np.uint8(5)])
def test_ints_and_numpy_ints_are_taken_as_python_ints(value: Any) -> None:
    got = whole_number(value, "n", 1, 10)
    assert got == 5 and type(got) is int


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (True, "True"),
        (np.True_, "np.True_"),
        (5.0, "5.0"),
        (float("nan"), "nan"),
        ("5", "'5'"),
        (torch.tensor(5), "tensor(5)"),
        (0, "0"),
        (11, "11"),
        (np.int64(11), "np.int64(11)"),
    ],
)
def test_everything_else_is_refused_by_name(value: Any, shown: str) -> None:
    with pytest.raises(ConfigError) as err:
        whole_number(value, "n", 1, 10, error=ConfigError)
    assert str(err.value) == f"n={shown}; expected an int in 1..10"


def test_none_only_where_allowed() -> None:
    assert whole_number_or_none(None, "limit", 0) is None
    assert whole_number_or_none(np.int64(3), "limit", 0) == 3
    with pytest.raises(ValueError, match=r"^limit=None; expected an int >= 0$"):
        whole_number(None, "limit", 0)
    with pytest.raises(ValueError, match=r"^limit=-1; expected an int >= 0 or None$"):
        whole_number_or_none(-1, "limit", 0)


def _resized(table: CachedEmbedding, cache_rows: Any) -> int:
    table.resize(cache_rows)
    return table.cache_rows


CALLS: list[tuple[str, Callable[[Any], Any]]] = [
    ("CachedEmbedding cache_rows", lambda n: CachedEmbedding(100, 4, cache_rows=n).cache_rows),
    ("CachedEmbedding resize", lambda n: _resized(CachedEmbedding(100, 4, cache_rows=8), n)),
    ("LookAhead ahead", lambda n: LookAhead([torch.tensor([1])], ahead=n).ahead),
    ("hash_ids num_buckets", lambda n: int(hash_ids(torch.arange(50), n).max()) < n),
    ("estimate rows", lambda n: estimate(n, 4).total_bytes),
    ("Policy cooldown_steps", lambda n: Policy(cooldown_steps=n).cooldown_steps),
    ("Policy forecast_steps", lambda n: Policy(forecast_steps=n).forecast_steps),
]


@pytest.mark.parametrize(("what", "call"), CALLS, ids=[c[0] for c in CALLS])
def test_the_arguments_take_numpy_ints_as_ints(what: str, call: Callable[[Any], Any]) -> None:
    """Each was refused for ``np.int64(16)`` ("expected an int"); each gives what 16 gives."""
    assert call(np.int64(16)) == call(16)
    with pytest.raises(ValueError, match=r"=True; expected an int >= \d"):
        call(True)


def test_a_compression_tuple_takes_numpy_ints_and_refuses_bools() -> None:
    """``("int4", np.int64(32))`` was "not allowed"; ``("int4", True)`` stays refused."""
    numpy_group = estimate(1000, 64, compression=("int4", np.int64(32))).total_bytes
    assert numpy_group == estimate(1000, 64, compression=("int4", 32)).total_bytes
    with pytest.raises(ConfigError, match=r"^compression=\('int4', True\) is not allowed"):
        estimate(1000, 64, compression=("int4", True))
    with pytest.raises(ConfigError, match=r"the group size G must be a positive multiple of 8"):
        estimate(1000, 64, compression=("int4", np.int64(-8)))


@pytest.mark.parametrize(
    ("given", "shown"),
    [
        ("perrow:3:2:12", "'perrow:3:2:12'"),
        ("perrow:11", "'perrow:11'"),
        (("int4", 12), "('int4', 12)"),
        ("lowrank:99", "'lowrank:99'"),
        ("hybrid:5:0", "'hybrid:5:0'"),
    ],
)
def test_a_refused_compression_is_quoted_as_the_user_wrote_it(given: object, shown: str) -> None:
    """Regression: the refusal quoted a form the user never wrote (``'perrow:3:2:12'`` as
    ``'perrow:12'``, ``'perrow:11'`` (20 rows) as ``'perrow:11:4'``)."""
    with pytest.raises(ConfigError, match=rf"^compression={re.escape(shown)} is not allowed; "):
        estimate(10, 16, compression=given)


@pytest.mark.parametrize("bits", [4.0, 2.0, True, "4", 3])
def test_a_bit_width_is_an_int_of_those_allowed(bits: object) -> None:
    """Regression: ``4.0 in (2, 4)`` is true, so a float width passed the check and failed
    deep inside the packing (``TypeError: unsupported operand type(s) for <<``), or, through
    ``compress_embedding_perrow``, only when the action was applied."""
    w = torch.randn(20, 16)
    with pytest.raises(ValueError, match=rf"^bits={re.escape(repr(bits))}; expected 2 or 4 "):
        GroupwiseEmbedding(w, EmbeddingOptions(20, 16), bits)
    with pytest.raises(ValueError, match=r"^per_row_bits=.*; expected 4 or 2 \(an int\)"):
        CompressEmbedding("perrow", per_row_bits=bits)
    assert CompressEmbedding("perrow", per_row_bits=np.int64(2)).per_row_bits == 2
