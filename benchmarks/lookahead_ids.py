"""``watch(loader=)`` on a two-table recommender: the ids each row cache is served, side by side.

    .venv/bin/python benchmarks/lookahead_ids.py [--ratings 30000] [--batch 1024] [--budget 45MiB]

A matrix factorisation (users 20,000 x 32, items 100,000 x 32, Adam) trains one epoch over
``--ratings`` synthetic ratings (user ids uniform, item ids skewed: ``rand() ** 3``), shuffled by a
``DataLoader`` of ``(user, item, rating)`` batches, under ``watch(budget=, policy=Policy())``: the
item table is cached when the run crosses the floor. Four runs on the same batches:

* ``no look-ahead``: no ``loader=``, the loop over the ``DataLoader``;
* ``loader=, found``: ``loader=`` without ``loader_ids``: each table's ids found from its own
  lookups (:class:`edo_monitor.nn.LookAhead`'s default);
* ``loader=, by name``: ``loader_ids=lambda b: {"users": b[0], "items": b[1]}``;
* ``loader=, first tensor``: ``loader_ids=lambda b: b[0]``: every table served the batch's first
  integer tensor, the user ids (what the default was).

Prints the item cache's ``stats()`` of each: the hit rate of lookups (rows the forward found
cached), the rows loaded inside the forward (on the critical path) and all rows loaded.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import edo_monitor
from edo_monitor.surfaces import scripting


class MF(nn.Module):
    """Users x items dot product: two tables, looked up with the batch's first two tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(20_000, 32)
        self.items = nn.Embedding(100_000, 32)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return (self.users(users) * self.items(items)).sum(-1)


MODES: dict[str, dict[str, Any]] = {
    "no look-ahead": {},
    "loader=, found": {},
    "loader=, by name": {"loader_ids": lambda b: {"users": b[0], "items": b[1]}},
    "loader=, first tensor": {"loader_ids": lambda b: b[0]},
}


def run(mode: str, data: TensorDataset, batch: int, budget: int, db: Path) -> Any:
    """One epoch in ``mode``; the item table's ``stats()`` (it must have been cached)."""
    torch.manual_seed(0)
    model = MF()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = DataLoader(
        data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(3)
    )
    kw = dict(MODES[mode], loader=loader) if mode != "no look-ahead" else {}
    with edo_monitor.watch(
        model, db=db, budget=budget, policy=edo_monitor.Policy(), interval_s=0.01, **kw
    ) as mon:
        for users, items, ratings in mon.loader or loader:
            ((model(users, items) - ratings) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
    if not isinstance(model.items, edo_monitor.nn.CachedTable):
        raise SystemExit(f"{mode}: the item table was not cached; give a smaller --budget")
    return model.items.stats()


def main() -> None:
    """Parse the options, run the four modes and print the table."""
    parser = scripting.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratings", type=scripting.positive_int, default=30_000)
    parser.add_argument("--batch", type=scripting.positive_int, default=1024)
    parser.add_argument("--budget", type=scripting.byte_size, default="45MiB")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(1)
    n = args.ratings
    users = torch.randint(0, 20_000, (n,), generator=g)
    items = torch.randperm(100_000, generator=g)[(torch.rand(n, generator=g) ** 3 * 100_000).long()]
    data = TensorDataset(users, items, torch.randn(n, generator=g))
    print(f"{n:,} ratings, batch {args.batch}, budget {args.budget:,} bytes: the item cache\n")
    print("| run | lookup hit rate | rows loaded in the forward | rows loaded |")
    print("|---|--:|--:|--:|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, mode in enumerate(MODES):
            s = run(mode, data, args.batch, args.budget, Path(tmp) / f"{i}.db")
            print(f"| {mode} | {s.lookup_hit_rate:.3f} | {s.forward_loads:,} | {s.misses:,} |")


if __name__ == "__main__":
    main()
