"""Matrix factorisation on MovieLens ratings (user and item embedding tables) under edo-monitor.

    python examples/train_recommender.py --data ../shared/data/movielens-small

Reads ``ratings.csv`` (userId, movieId, rating, timestamp), trains ``rating ~ <u, i> + b_u + b_i +
mu`` with Adam on a 90/10 split, and prints train/test RMSE per epoch and edo-monitor's summary.
The MovieLens data is not shipped with edo-monitor; see its README for the license.
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
from pathlib import Path

import torch
from torch import nn

import edo_monitor
from edo_monitor.units import format_bytes


def load_ratings(data_dir: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """``(users [N], items [N], ratings [N] float32, num_users, num_items)`` with dense ids."""
    path = data_dir / "ratings.csv"
    if not path.is_file():
        raise SystemExit(f"{path} not found; pass --data DIR with MovieLens ratings.csv")
    users, items, ratings = [], [], []
    user_ids: dict[str, int] = {}
    item_ids: dict[str, int] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            users.append(user_ids.setdefault(row["userId"], len(user_ids)))
            items.append(item_ids.setdefault(row["movieId"], len(item_ids)))
            ratings.append(float(row["rating"]))
    return (
        torch.tensor(users),
        torch.tensor(items),
        torch.tensor(ratings),
        len(user_ids),
        len(item_ids),
    )


class MatrixFactorization(nn.Module):
    """Biased matrix factorisation: two embedding tables of ``dim`` columns plus bias tables."""

    def __init__(self, num_users: int, num_items: int, dim: int = 64, mean: float = 3.5) -> None:
        super().__init__()
        self.users = nn.Embedding(num_users, dim)
        self.items = nn.Embedding(num_items, dim)
        self.user_bias = nn.Embedding(num_users, 1)
        self.item_bias = nn.Embedding(num_items, 1)
        for table in (self.users, self.items):
            nn.init.normal_(table.weight, std=0.05)
        for bias in (self.user_bias, self.item_bias):
            nn.init.zeros_(bias.weight)
        self.mean = mean

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        dot = (self.users(users) * self.items(items)).sum(-1)
        return (
            dot + self.user_bias(users).squeeze(-1) + self.item_bias(items).squeeze(-1) + self.mean
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="folder with ratings.csv")
    parser.add_argument("--db", default=None, help="history database (default: ./edo-history.db)")
    parser.add_argument("--budget", default=None, help="memory budget, e.g. 64MiB")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1024)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    torch.manual_seed(0)
    users, items, ratings, num_users, num_items = load_ratings(args.data)
    perm = torch.randperm(len(ratings))
    split = int(0.9 * len(ratings))
    train_idx, test_idx = perm[:split], perm[split:]
    model = MatrixFactorization(num_users, num_items, args.dim, float(ratings[train_idx].mean()))
    opt = torch.optim.Adam(model.parameters(), lr=0.005)
    print(f"{len(ratings):,} ratings, {num_users:,} users x {num_items:,} items, dim {args.dim}")

    def rmse(idx: torch.Tensor) -> float:
        with torch.no_grad():
            pred = model(users[idx], items[idx])
            return float(((pred - ratings[idx]) ** 2).mean().sqrt())

    with edo_monitor.watch(
        model, opt, db=args.db, budget=args.budget, run_name="recommender"
    ) as mon:
        for epoch in range(args.epochs):
            order = train_idx[torch.randperm(len(train_idx))]
            for start in range(0, len(order), args.batch_size):
                b = order[start : start + args.batch_size]
                loss = nn.functional.mse_loss(model(users[b], items[b]), ratings[b])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            print(
                f"epoch {epoch}: train RMSE {rmse(train_idx):.4f}  test RMSE {rmse(test_idx):.4f}"
            )
    s = mon.summary()
    print(
        f"\nrun {s.run_id}: {s.steps} steps, peak in use {format_bytes(s.peak_in_use_bytes)}, "
        f"{s.samples} samples -> {s.db_url}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
