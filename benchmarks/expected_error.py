"""What a lossy plan's expected error costs at plan time, and how close it is on a large table.

    .venv/bin/python benchmarks/expected_error.py [--rows 1000000] [--dim 64] [--repeats 7]
        [--lookups 81920] [--threads 1] [--no-apply]

One torch thread by default (``--threads``): on a shared 2-core machine the intra-op pool makes
the small tensor operations of an estimate several times slower and far noisier. A frozen
``nn.Embedding`` of ``--rows`` × ``--dim`` float32 rows drawn from N(0, 1) (frozen, so
``compress_embedding_int8`` and ``_lowrank`` apply; no optimizer). For each lossy action
(``compress_embedding_bf16``, ``_int8``, ``_lowrank`` at rank D/2, ``share_embedding`` with 5 % hot
ids and 5 % buckets), without lookup counts and with a
:class:`edo_monitor.measure.frequency.LookupCounter` that counted ``--lookups`` Zipf(1.1) lookups
(batches of 4096):

- **plan ms**: median of ``--repeats`` calls of ``ACTIONS[name].plan(ctx)`` (everything a plan does:
  finding the table, the blockers, the byte estimate, the expected error);
- **error ms**: median time of the expected-error estimate alone (the
  :mod:`edo_monitor.actions.expected_error` function the plan calls, with the same inputs);
- **expected**: the plan's ``expected_error``;
- **measured** (unless ``--no-apply``): the action applied to a copy of the model, and
  ``Σ p ‖r̂ − r‖² / Σ p ‖r‖²`` over every row, ``p`` the distribution the lookups were drawn from
  (uniform without counts, the Zipf probabilities with them), computed in float64 in chunks.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from edo_monitor.actions import ACTIONS, ActionContext, ActivationRecorder
from edo_monitor.actions.expected_error import (
    int8_rowwise_expected_error,
    lowrank_expected_error,
    share_expected_error,
    table_distribution,
)
from edo_monitor.decide.plans import rounding_expected_error
from edo_monitor.measure.frequency import LookupCounter

ACTION_NAMES = (
    "compress_embedding_bf16",
    "compress_embedding_int8",
    "compress_embedding_lowrank",
    "share_embedding",
)


class Model(nn.Module):
    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, dim)
        self.emb.weight.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids)


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def estimate_alone(name: str, ctx: ActionContext, plan: Any) -> Callable[[], float]:
    """The expected-error call the plan made, with the same inputs."""
    t = ctx.model.get_submodule(plan.target)
    n = int(t.num_embeddings)
    if name == "compress_embedding_bf16":
        return lambda: rounding_expected_error("bf16")
    if name == "compress_embedding_int8":
        return lambda: int8_rowwise_expected_error(
            t.weight, table_distribution(ctx.lookup_counter, plan.target, n), None
        )
    if name == "compress_embedding_lowrank":
        rank = int(plan.details["rank"])
        return lambda: lowrank_expected_error(
            t.weight, rank, table_distribution(ctx.lookup_counter, plan.target, n), None
        )
    k = int(plan.details["hot_ids"])
    counter = ctx.lookup_counter
    hot = counter.hot_ids(plan.target, k) if k else torch.zeros(0, dtype=torch.long)
    b = int(plan.details["buckets"])
    return lambda: share_expected_error(
        t.weight, hot, b, table_distribution(counter, plan.target, n), None
    )


def measured_error(before: torch.Tensor, module: nn.Module, probs: torch.Tensor) -> float:
    num = den = 0.0
    n = before.shape[0]
    for start in range(0, n, 65536):
        ids = torch.arange(start, min(n, start + 65536))
        ref = before[ids].double()
        got = module(ids).detach().double()
        p = probs[ids]
        num += float((p * (got - ref).pow(2).sum(1)).sum())
        den += float((p * ref.pow(2).sum(1)).sum())
    return num / den


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--lookups", type=int, default=81_920)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--no-apply", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Model(args.rows, args.dim)
    with torch.no_grad(), ActivationRecorder(copy.deepcopy(model)) as rec:
        rec.model(torch.arange(8))
    profile = rec.profile()
    zipf = torch.arange(1, args.rows + 1, dtype=torch.float64).pow(-1.1)
    zipf /= zipf.sum()
    uniform = torch.full((args.rows,), 1.0 / args.rows, dtype=torch.float64)
    counter = LookupCounter()
    counter.watch_tables(model)
    gen = torch.Generator().manual_seed(0)
    for _ in range(max(1, args.lookups // 4096)):
        model(torch.multinomial(zipf, 4096, replacement=True, generator=gen))
    seen = int((counter.counts("emb") > 0).sum())
    print(
        f"{datetime.date.today()} {platform.node()} {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; table "
        f"{args.rows:,} x {args.dim} float32; counted {int(counter.counts('emb').sum()):,} "
        f"Zipf(1.1) lookups, {seen:,} distinct ids"
    )
    print()
    print("| action | counts | plan ms | error ms | expected | measured | expected / measured |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in ACTION_NAMES:
        for counted in (False, True):
            ctx = ActionContext(
                model, [], activation_profile=profile, lookup_counter=counter if counted else None
            )
            plan = ACTIONS[name].plan(ctx)
            plan_ms = median_ms(lambda ctx=ctx, name=name: ACTIONS[name].plan(ctx), args.repeats)
            err_ms = median_ms(estimate_alone(name, ctx, plan), args.repeats)
            measured = ratio = "-"
            if not args.no_apply:
                twin = copy.deepcopy(model)
                twin_ctx = ActionContext(
                    twin,
                    [],
                    activation_profile=profile,
                    lookup_counter=counter if counted else None,
                )
                result = ACTIONS[name].apply(twin_ctx, plan)
                assert result.status == "applied", result.reason
                value = measured_error(
                    model.emb.weight.detach(), twin.emb, zipf if counted else uniform
                )
                measured, ratio = f"{value:.3g}", f"{plan.expected_error / value:.3f}"
                del twin, twin_ctx
            print(
                f"| {name} | {'Zipf' if counted else 'none'} | {plan_ms:.1f} | {err_ms:.1f} | "
                f"{plan.expected_error:.3g} | {measured} | {ratio} |"
            )


if __name__ == "__main__":
    main()
