"""Module names as a tree: bytes that include the submodules' made into bytes that add up."""

from __future__ import annotations

from edo_monitor.measure.module_tree import largest_disjoint, nested, own_bytes


def test_nested_names() -> None:
    assert nested("b1", "b1.attn") and nested("b1.attn", "b1") and nested("b1", "b1")
    assert nested("", "b1")  # the model holds every module
    assert not nested("b1", "b10") and not nested("b1.attn", "b1.ff")


def test_the_largest_modules_none_inside_another_in_listed_order_on_ties() -> None:
    sizes = {"b1": 10, "b1.attn": 9, "layers.2": 4, "layers.10": 4, "b2": 3, "empty": 0}
    assert largest_disjoint(sizes, 3) == [("b1", 10), ("layers.2", 4), ("layers.10", 4)]
    assert largest_disjoint(sizes, 10) == [("b1", 10), ("layers.2", 4), ("layers.10", 4), ("b2", 3)]


def test_own_bytes_take_out_the_nearest_listed_submodules() -> None:
    inclusive = {"": 20, "b1": 10, "b1.attn": 6, "b1.attn.q": 1, "b2.ff": 4}
    own = own_bytes(inclusive)
    # b1.attn.q is inside b1.attn only; b2.ff's nearest listed holder is the model
    assert own == {"": 6, "b1": 4, "b1.attn": 5, "b1.attn.q": 1, "b2.ff": 4}
    assert sum(own.values()) == inclusive[""]
    assert own_bytes({"b1": 1, "b1.x": 3}) == {"b1": 0, "b1.x": 3}  # never below 0
