"""A table's module hooks across the table actions (``actions.tables.replace_module``): the forward
pre-hooks and forward hooks the user put on the table run around the module that replaces it;
backward hooks, which it could not run, keep every table action off the table."""

from __future__ import annotations

import copy

import pytest
import torch
from action_helpers import VOCAB, batches, ctx_of, make

from edo_monitor.actions import ACTIONS
from edo_monitor.decide.plans import TABLE_BLOCKERS

ACTIONS_SWAPPING = ["offload_embedding", "cache_embedding", "compress_embedding_bf16"]


def _fold_ids(module: torch.nn.Module, args: tuple) -> tuple:
    """The user's pre-hook: ids of the table's upper half read row 1 (module level, so the
    model pickles)."""
    return (torch.where(args[0] >= VOCAB // 2, 1, args[0]),)


def _doubled(module: torch.nn.Module, args: tuple, kwargs: dict, output: torch.Tensor):
    return output * 2.0


def _ids() -> torch.Tensor:
    x = batches(1)[0][0].clone()
    x[0, :3] = torch.tensor([VOCAB - 1, VOCAB // 2, 2])  # two ids the pre-hook folds
    return x


@pytest.mark.parametrize("action", ACTIONS_SWAPPING)
def test_the_tables_forward_hooks_run_around_the_module_that_replaces_it(action: str) -> None:
    model, opt = make()
    model.emb.register_forward_pre_hook(_fold_ids)
    model.emb.register_forward_hook(_doubled, with_kwargs=True)
    x = _ids()
    with torch.no_grad():
        before = model.emb(x)
    assert ACTIONS[action].apply(ctx_of(model, opt)).status == "applied"
    with torch.no_grad():
        after = model.emb(x)
        bare = model.emb.forward(_fold_ids(model.emb, (x,))[0])  # the new module, no hooks
    assert torch.equal(after, 2.0 * bare)
    if action != "compress_embedding_bf16":  # lossless: the very values
        assert torch.equal(after, before)


def test_a_hook_removed_after_the_action_is_not_run_any_more() -> None:
    model, opt = make()
    handle = model.emb.register_forward_hook(_doubled, with_kwargs=True)
    assert ACTIONS["offload_embedding"].apply(ctx_of(model, opt)).status == "applied"
    handle.remove()
    x = _ids()
    with torch.no_grad():
        assert torch.equal(model.emb(x), model.emb.forward(x))


def test_a_copy_of_the_converted_model_runs_the_hooks_too() -> None:
    model, opt = make()
    model.emb.register_forward_pre_hook(_fold_ids)
    model.eval()  # no dropout
    x = _ids()
    with torch.no_grad():
        before = model(x)
    assert ACTIONS["offload_embedding"].apply(ctx_of(model, opt)).status == "applied"
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(twin(x), before)


@pytest.mark.parametrize("action", ACTIONS_SWAPPING)
def test_a_table_with_backward_hooks_is_left_as_it_is(action: str) -> None:
    model, opt = make()
    model.emb.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    table = model.emb
    result = ACTIONS[action].apply(ctx_of(model, opt))
    assert result.status == "refused", result
    assert TABLE_BLOCKERS[4] in result.reason
    assert model.emb is table


def test_the_replaced_module_called_itself_runs_its_hooks_once() -> None:
    """A reference to the table held outside the model (a teacher network sharing it) calls the
    old module, whose call runs the new one: its hooks ran twice (the output scaled 4x for 2x)."""
    model, opt = make()
    old = model.emb
    old.register_forward_hook(_doubled, with_kwargs=True)
    x = _ids()
    with torch.no_grad():
        before = old(x)
    assert ACTIONS["offload_embedding"].apply(ctx_of(model, opt)).status == "applied"
    with torch.no_grad():
        assert torch.equal(old(x), before)
        assert torch.equal(model.emb(x), before)


def test_a_hook_put_on_the_replaced_module_later_runs_too() -> None:
    """One added to the old module after the action ran only when it had one before."""
    model, opt = make()
    old = model.emb
    assert ACTIONS["offload_embedding"].apply(ctx_of(model, opt)).status == "applied"
    old.register_forward_hook(_doubled, with_kwargs=True)
    x = _ids()
    with torch.no_grad():
        assert torch.equal(model.emb(x), 2.0 * model.emb.forward(x))
