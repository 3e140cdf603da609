"""Matrix factorisation on MovieLens ratings (user and item embedding tables) under edo-monitor.

    python examples/train_recommender.py --data ../shared/data/movielens-small

Reads ``ratings.csv`` (userId, movieId, rating, timestamp), trains ``rating ~ <u, i> + b_u + b_i +
mu`` with Adam on a 90/10 split, and prints train/test RMSE per epoch and edo-monitor's summary.
The MovieLens data is not shipped with edo-monitor; see its README for the license.

With ``--budget`` (e.g. ``--budget 8MiB``, less than training the tables needs) the auto-tuner
runs: it caches the item table (``cache_embedding``: hot rows on the device, the table and its
Adam state in host memory, exact optimizer semantics). The script then prints the actions, the
cache's hit rate and moves, and trains an uncached twin on the same batches to show the test RMSE
is the same::

    python examples/train_recommender.py --data ../shared/data/movielens-small --budget 8MiB
"""

from __future__ import annotations

# ruff: noqa: E402 (the arguments are checked before PyTorch is imported, which takes seconds)
import argparse
from pathlib import Path

from edo_monitor.surfaces import scripting  # light: no PyTorch


def ratings_folder(text: str) -> Path:
    """``--data``: a folder holding a readable ``ratings.csv`` (argparse ``type=``)."""
    folder = Path(text).expanduser()
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a folder; expected the MovieLens folder with ratings.csv"
        )
    scripting.readable_file(str(folder / "ratings.csv"))
    return folder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (light: no PyTorch); a bad argument exits 2 with one line."""
    parser = scripting.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data", type=ratings_folder, required=True, help="folder with ratings.csv"
    )
    parser.add_history_and_budget("memory budget, e.g. 8MiB: turns the auto-tuner on")
    parser.add_argument(
        "--no-compare", action="store_true", help="with --budget: skip the uncached twin run"
    )
    parser.add_argument(
        "--forecast",
        type=scripting.positive_int,
        default=None,
        metavar="N",
        help="with --budget: also act when free memory is forecast below the floor within N "
        "steps (Policy forecast_steps)",
    )
    parser.add_argument("--epochs", type=scripting.positive_int, default=5)
    parser.add_argument("--dim", type=scripting.positive_int, default=64)
    parser.add_argument("--batch-size", type=scripting.positive_int, default=1024)
    args = parser.parse_args(argv)
    if args.forecast is not None and args.budget is None:
        parser.error(
            "--forecast needs --budget: the auto-tuner that acts on forecasts runs only "
            "under a budget"
        )
    return args


if __name__ == "__main__":  # bad arguments: one line and exit 2, before the slow imports
    parse_args()

import contextlib
import csv
import logging
import math
import sys
from typing import Any

import torch
from torch import nn

import edo_monitor
from edo_monitor.nn import CachedTable
from edo_monitor.units import format_bytes

#: the columns of ``ratings.csv`` that are read (MovieLens also has ``timestamp``)
COLUMNS = ("userId", "movieId", "rating")


def load_ratings(data_dir: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """``(users [N], items [N], ratings [N] float32, num_users, num_items)`` with dense ids.

    A file that cannot be trained on (empty, another header, a rating that is not a number,
    fewer than 2 ratings: nothing to split into train and test) ends the program with one line
    naming the file and what is wrong (exit 1).
    """
    path = data_dir / "ratings.csv"
    if not path.is_file():
        raise SystemExit(f"{path} not found; pass --data DIR with MovieLens ratings.csv")
    users, items, ratings = [], [], []
    user_ids: dict[str, int] = {}
    item_ids: dict[str, int] = {}
    with path.open(newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.DictReader(f)
        expected = "expected MovieLens ratings: userId,movieId,rating,timestamp"
        if not reader.fieldnames:
            raise SystemExit(f"{path} is empty; {expected}, then one line per rating")
        missing = [c for c in COLUMNS if c not in reader.fieldnames]
        if missing:
            raise SystemExit(
                f"{path}: no column {', '.join(missing)} in its header line "
                f"({','.join(reader.fieldnames)}); {expected}"
            )
        for row in reader:
            try:
                rating = float(row["rating"])
            except (TypeError, ValueError):  # not a number; a short row's is None
                rating = math.nan
            if not math.isfinite(rating):
                raise SystemExit(
                    f"{path} line {reader.line_num}: rating {row['rating']!r} is not a number"
                )
            users.append(user_ids.setdefault(row["userId"], len(user_ids)))
            items.append(item_ids.setdefault(row["movieId"], len(item_ids)))
            ratings.append(rating)
    if len(ratings) < 2:
        raise SystemExit(
            f"{path} has {len(ratings)} rating(s); need at least 2 (90% train, 10% test)"
        )
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


def train(
    data: tuple[torch.Tensor, ...],
    dims: tuple[int, int, int, float],
    args: argparse.Namespace,
    *,
    policy: edo_monitor.Policy | None,
    watched: bool,
) -> tuple[nn.Module, float, Any]:
    """Train from seed 1 (same batches each call); returns the model, test RMSE and monitor.

    Watched, the test RMSE is the last epoch's, evaluated inside the ``watch`` block: the
    cached tables' counters after the block are then the recorded run's (an evaluation after
    it would add lookups, rows loaded and evicted that the history never sees)."""
    users, items, ratings, train_idx, test_idx = data
    torch.manual_seed(1)
    model = MatrixFactorization(*dims)
    opt = torch.optim.Adam(model.parameters(), lr=0.005)

    def rmse(idx: torch.Tensor) -> float:
        total = 0.0
        with torch.no_grad():  # in batches: a cached table needs one batch's rows at a time
            for start in range(0, len(idx), args.batch_size):
                b = idx[start : start + args.batch_size]
                total += float(((model(users[b], items[b]) - ratings[b]) ** 2).sum())
        return (total / len(idx)) ** 0.5

    block = (
        edo_monitor.watch(
            model, opt, db=args.db, budget=args.budget, run_name="recommender", policy=policy
        )
        if watched
        else contextlib.nullcontext()
    )
    test_rmse = math.nan
    with block as mon:
        for epoch in range(args.epochs):
            order = train_idx[torch.randperm(len(train_idx))]
            for start in range(0, len(order), args.batch_size):
                b = order[start : start + args.batch_size]
                loss = nn.functional.mse_loss(model(users[b], items[b]), ratings[b])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if watched:
                train_rmse, test_rmse = rmse(train_idx), rmse(test_idx)
                print(f"epoch {epoch}: train RMSE {train_rmse:.4f}  test RMSE {test_rmse:.4f}")
    if not watched:  # the twin: evaluated once, at the end
        test_rmse = rmse(test_idx)
    return model, test_rmse, mon


def percent(fraction: float | None) -> str:
    """``93.2%``; ``N/A`` for ``None`` (no lookup yet)."""
    return "N/A" if fraction is None else f"{fraction:.1%}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    scripting.check_history_db(args.db)  # unusable: one line, exit 1, before the slow work

    torch.manual_seed(0)
    users, items, ratings, num_users, num_items = load_ratings(args.data)  # bad data: exit 1
    with torch.device("meta"):  # the model's shapes only: no memory, no random numbers
        shapes = MatrixFactorization(num_users, num_items, args.dim)
    too_small = scripting.budget_below_params(args.budget, shapes)
    if too_small:  # its size is known once the ids are counted: before training
        raise edo_monitor.ConfigError(
            f"{too_small}; give a larger budget (8MiB runs the auto-tuner on MovieLens small)"
        )
    perm = torch.randperm(len(ratings))
    split = int(0.9 * len(ratings))
    train_idx, test_idx = perm[:split], perm[split:]
    print(f"{len(ratings):,} ratings, {num_users:,} users x {num_items:,} items, dim {args.dim}")
    data = (users, items, ratings, train_idx, test_idx)
    dims = (num_users, num_items, args.dim, float(ratings[train_idx].mean()))
    policy = edo_monitor.Policy(forecast_steps=args.forecast) if args.budget else None
    model, test_rmse, mon = train(data, dims, args, policy=policy, watched=True)
    s = mon.summary()
    print(
        f"\nrun {s.run_id}: {s.steps} steps, peak in use {format_bytes(s.peak_in_use_bytes)}, "
        f"{s.samples} samples -> {s.database}"
    )
    for action in s.actions:
        print(
            f"action {action['action']} on {action['target']}: "
            f"saved {format_bytes(action['saved_bytes'])}"
        )
    for name, module in model.named_modules():
        if isinstance(module, CachedTable):  # the run's counters: the history holds the same
            st = module.stats()
            print(
                f"cache {name}: {st.cache_rows} of {st.num_embeddings} rows on the device, "
                f"hit rate {percent(st.lookup_hit_rate)} of lookups "
                f"({percent(st.hit_rate)} of each batch's unique ids), "
                f"{st.misses:,} rows loaded, {st.evicted:,} evicted, "
                f"{format_bytes(st.h2d_bytes)} host->device, "
                f"{format_bytes(st.d2h_bytes)} device->host"
            )
    if args.budget and not args.no_compare:
        _, twin_rmse, _ = train(data, dims, args, policy=None, watched=False)
        print(
            f"test RMSE {test_rmse:.6f} (tuned) vs {twin_rmse:.6f} (uncached twin): "
            f"difference {abs(test_rmse - twin_rmse):.2e}"
        )
    return 0


if __name__ == "__main__":  # bad arguments: exit 2; an unusable database: 1; Ctrl-C: 130
    sys.exit(scripting.run_main(main))
