"""The quality cost of parameter sharing: compression ratio against model quality.

Two real models, each trained once per variant from the same seed and the same batches:

* **MovieLens matrix factorisation** (``examples/train_recommender.py``'s model: user and item
  tables of 64 columns plus biases, Adam): test RMSE after ``--epochs`` epochs. Needs
  ``--data`` (MovieLens ``ratings.csv``; skipped with a message when absent).
* **The main example's word model** (``examples/train_embedding.py``: an EmbeddingBag of 100,003
  hashed n-gram features × 64, mean, then a 2,048-way classifier; Adam): cross-entropy on held-out
  positions after ``--word-steps`` steps at batch 1,024, on the Python standard library's source.

Variants, for the embedding tables (the bias tables and the classifier stay as they are):

* ``full``: ``nn.Embedding`` / ``nn.EmbeddingBag`` in float32 (the reference);
* ``bf16``: the table stored in bf16 (:class:`LowPrecisionEmbedding`), trained from the start;
* ``hash xR``: :class:`HashedEmbedding` with ``N / R`` buckets (x1.5 and x2 are the seeds' "30-50 %
  fewer rows"); ``hash2 x10`` with two hashes;
* ``qr``: :class:`QREmbedding`, ``R = ceil(sqrt(N))``, product;
* ``hybrid P% hot``: :class:`HybridEmbedding`, the ``P %`` most frequent ids of the training data
  keep their rows, the rest share buckets numbering 5 % of the rows;
* ``... mid-run``: trained full for the first half, then converted by the actions themselves
  (``share_embedding`` with the agent's :class:`LookupCounter` for the hybrids and the hash,
  ``compress_embedding_bf16`` for bf16) and trained on for the second half with the same
  optimizer.

Each variant is evaluated after every epoch (MovieLens) or every third of the steps (words): the
table gives the final value and the best one (the full model overfits MovieLens-small within a
few epochs, so the final values alone would credit sharing with a regularising effect).

``ratio`` is the tables' bytes (weights; their gradients and Adam's moments scale the same way)
of the full model over the variant's.

    python benchmarks/sharing.py --data ../shared/data/movielens-small
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from edo_monitor.actions import ACTIONS, ActionContext, ActivationRecorder
from edo_monitor.measure.frequency import LookupCounter
from edo_monitor.nn import (
    EmbeddingOptions,
    HashedEmbedding,
    HybridEmbedding,
    LowPrecisionEmbedding,
    QREmbedding,
)

ROOT = Path(__file__).resolve().parent.parent
BUCKET_FRACTION = 0.05

TableFactory = Callable[[nn.Module, torch.Tensor], nn.Module]


def _example(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bf16(table: nn.Module, _counts: torch.Tensor) -> nn.Module:
    weight = nn.Parameter(table.weight.detach().to(torch.bfloat16))
    return LowPrecisionEmbedding(weight, EmbeddingOptions.from_module(table), torch.float32)


def _hash(ratio: float, hashes: int = 1) -> TableFactory:
    def make(table: nn.Module, _counts: torch.Tensor) -> nn.Module:
        opts = EmbeddingOptions.from_module(table)
        buckets = max(1, round(opts.num_embeddings / ratio))
        return HashedEmbedding(
            opts, buckets, num_hashes=hashes, weight=table.weight.detach()[:buckets].clone()
        )

    return make


def _qr(table: nn.Module, _counts: torch.Tensor) -> nn.Module:
    return QREmbedding(EmbeddingOptions.from_module(table), operation="mult")


def _hybrid(hot_fraction: float) -> TableFactory:
    def make(table: nn.Module, counts: torch.Tensor) -> nn.Module:
        opts = EmbeddingOptions.from_module(table)
        n = opts.num_embeddings
        k = min(round(n * hot_fraction), int((counts > 0).sum()))
        hot = torch.sort(-counts, stable=True).indices[:k]
        buckets = max(1, round(n * BUCKET_FRACTION))
        std = float(table.weight.detach().std())
        return HybridEmbedding(
            opts,
            hot,
            buckets,
            hot_weight=torch.randn(k, opts.embedding_dim) * std,
            cold_weight=torch.randn(buckets, opts.embedding_dim) * std,
        )

    return make


FROM_START: dict[str, TableFactory] = {
    "bf16": _bf16,
    "hash x1.5": _hash(1.5),
    "hash x2": _hash(2),
    "hash x4": _hash(4),
    "hash x10": _hash(10),
    "hash x50": _hash(50),
    "hash2 x10": _hash(10, 2),
    "qr": _qr,
    "hybrid 1% hot": _hybrid(0.01),
    "hybrid 5% hot": _hybrid(0.05),
    "hybrid 10% hot": _hybrid(0.10),
}
# mid-run conversions: (action, hot fraction for share_embedding)
MID_RUN: dict[str, tuple[str, float]] = {
    "bf16 mid-run": ("compress_embedding_bf16", 0.0),
    "hash x20 mid-run": ("share_embedding", 0.0),
    "hybrid 1% hot mid-run": ("share_embedding", 0.01),
    "hybrid 5% hot mid-run": ("share_embedding", 0.05),
    "hybrid 10% hot mid-run": ("share_embedding", 0.10),
}


def table_bytes(model: nn.Module, names: list[str]) -> int:
    """Bytes of the named tables' parameters and buffers."""
    total = 0
    for name in names:
        module = model.get_submodule(name)
        for t in [*module.parameters(), *module.buffers()]:
            total += t.numel() * t.element_size()
    return total


def convert(model: nn.Module, names: list[str], factory: TableFactory, counts: dict) -> None:
    """Swap each named table for ``factory(table, counts)``."""
    for name in names:
        setattr(model, name, factory(model.get_submodule(name), counts[name]))


def apply_mid_run(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    counter: LookupCounter,
    probe: Callable[[nn.Module], object],
    action: str,
    hot: float,
) -> None:
    """Apply ``action`` once per table (largest first), as the agent would at a step boundary:
    with the lookup counts and a recorded forward (``probe``), which the table actions need to
    know that no weight is read outside its own module."""
    with torch.no_grad(), ActivationRecorder(model) as rec:
        probe(model)
    ctx = ActionContext(
        model,
        [opt],
        activation_profile=rec.profile(),
        lookup_counter=counter if hot else None,
        share_hot_fraction=hot,
        share_bucket_fraction=BUCKET_FRACTION,
    )
    names = list(counter.tables)
    for _ in names:
        result = ACTIONS[action].apply(ctx)
        if result.status != "applied":
            raise RuntimeError(f"{action}: {result.status}: {result.reason}")


def run_variants(
    title: str,
    names: list[str],
    build: Callable[[], nn.Module],
    counts: dict[str, torch.Tensor],
    train: Callable[[nn.Module, torch.optim.Optimizer, int, int], None],
    checkpoints: list[int],
    quality: Callable[[nn.Module], float],
    quality_name: str,
    probe: Callable[[nn.Module], object],
) -> None:
    """Train each variant, evaluating at each of ``checkpoints`` (step counts, the last one the
    end of training); print one table row per variant: the final and the best value."""
    print(f"\n{title}\n")
    print(
        f"| variant | table bytes | ratio | {quality_name} | vs full | best {quality_name} "
        "| vs full | time s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    reference: tuple[float, float] | None = None
    full_bytes = 0
    total_steps = checkpoints[-1]
    variants: list[tuple[str, TableFactory | None, tuple[str, float] | None]] = [
        ("full", None, None),
        *((k, f, None) for k, f in FROM_START.items()),
        *((k, None, m) for k, m in MID_RUN.items()),
    ]
    for label, factory, mid in variants:
        torch.manual_seed(0)
        model = build()
        if factory is not None:
            convert(model, names, factory, counts)
        opt = torch.optim.Adam(model.parameters(), lr=0.005)
        counter = LookupCounter()
        if mid is not None:
            for name in names:
                counter.watch(name, model.get_submodule(name))
        half = total_steps // 2
        stops = sorted({*checkpoints, half} if mid is not None else set(checkpoints))
        values: list[float] = []
        t0 = time.perf_counter()
        done = 0
        for stop in stops:
            train(model, opt, done, stop)
            done = stop
            if mid is not None and stop == half:
                counter.close()
                apply_mid_run(model, opt, counter, probe, *mid)
            if stop in checkpoints:
                values.append(quality(model))
        elapsed = time.perf_counter() - t0
        final, best = values[-1], min(values)
        nbytes = table_bytes(model, names)
        if reference is None:
            reference, full_bytes = (final, best), nbytes
        print(
            f"| {label} | {nbytes:,} | {full_bytes / nbytes:.1f}x | {final:.4f} | "
            f"{final - reference[0]:+.4f} | {best:.4f} | {best - reference[1]:+.4f} | "
            f"{elapsed:.1f} |",
            flush=True,
        )


def movielens(data: Path, epochs: int, batch: int) -> None:
    """Matrix factorisation: test RMSE per variant."""
    rec = _example("train_recommender")
    users, items, ratings, nu, ni = rec.load_ratings(data)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(ratings), generator=gen)
    split = int(0.9 * len(ratings))
    train_idx, test_idx = perm[:split], perm[split:]
    mean = float(ratings[train_idx].mean())
    steps_per_epoch = math.ceil(split / batch)
    orders = [train_idx[torch.randperm(split, generator=gen)] for _ in range(epochs)]
    batches = [o[s : s + batch] for o in orders for s in range(0, split, batch)]
    counts = {
        "users": torch.bincount(users[train_idx], minlength=nu),
        "items": torch.bincount(items[train_idx], minlength=ni),
    }

    def build() -> nn.Module:
        return rec.MatrixFactorization(nu, ni, 64, mean)

    def train(model: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
        for b in batches[start:stop]:
            loss = nn.functional.mse_loss(model(users[b], items[b]), ratings[b])
            opt.zero_grad()
            loss.backward()
            opt.step()

    def rmse(model: nn.Module) -> float:
        with torch.no_grad():
            pred = model(users[test_idx], items[test_idx])
            return float(((pred - ratings[test_idx]) ** 2).mean().sqrt())

    run_variants(
        f"MovieLens ({len(ratings):,} ratings, {nu:,} users x {ni:,} items, dim 64), "
        f"{epochs} epochs x {steps_per_epoch} steps of {batch}",
        ["users", "items"],
        build,
        counts,
        train,
        [steps_per_epoch * (e + 1) for e in range(epochs)],
        rmse,
        "test RMSE",
        lambda m: m(users[:8], items[:8]),
    )


def words(steps: int, batch: int) -> None:
    """The main example's word model: held-out cross-entropy per variant."""
    ex = _example("train_embedding")
    features, targets = ex.build_dataset(ex.default_text())
    n = len(targets)
    split = int(0.9 * n)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, split, (batch,), generator=gen) for _ in range(steps)]
    held_out = torch.arange(split, n)[:20_000]
    counts = {"features": torch.bincount(features[:split].reshape(-1), minlength=ex.BUCKETS)}

    def build() -> nn.Module:
        return ex.HashedWordModel()

    def train(model: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
        for idx in batches[start:stop]:
            loss = nn.functional.cross_entropy(model(features[idx]), targets[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()

    def held_out_loss(model: nn.Module) -> float:
        with torch.no_grad():
            return float(nn.functional.cross_entropy(model(features[held_out]), targets[held_out]))

    run_variants(
        f"Word model (100,003 x 64 EmbeddingBag, {n:,} positions of the stdlib), "
        f"{steps} steps of {batch}",
        ["features"],
        build,
        counts,
        train,
        [steps // 3, 2 * steps // 3, steps],
        held_out_loss,
        "held-out loss",
        lambda m: m(features[:8]),
    )


def default_data() -> Path:
    """``$EDO_DATA_DIR/movielens-small``, else ``shared/data/movielens-small`` above the repo."""
    env = os.environ.get("EDO_DATA_DIR")
    candidates = [Path(env)] if env else []
    candidates += [parent / "shared" / "data" for parent in ROOT.parents]
    for folder in candidates:
        if (folder / "movielens-small" / "ratings.csv").is_file():
            return folder / "movielens-small"
    return (candidates[0] if candidates else ROOT) / "movielens-small"


def counter_cost(steps: int, batch: int, rounds: int = 5) -> None:
    """Step time of the word model with and without a LookupCounter, interleaved (ratio)."""
    ex = _example("train_embedding")
    features, targets = ex.build_dataset(ex.default_text(500_000))
    torch.manual_seed(0)
    model = ex.HashedWordModel()
    opt = torch.optim.Adam(model.parameters(), lr=0.005)
    gen = torch.Generator().manual_seed(0)
    counter = LookupCounter()

    def timed() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            idx = torch.randint(0, len(targets), (batch,), generator=gen)
            loss = nn.functional.cross_entropy(model(features[idx]), targets[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        return (time.perf_counter() - t0) / steps

    timed()  # warm-up
    plain, counted = [], []
    for _ in range(rounds):
        plain.append(timed())
        counter.watch("features", model.features)
        counted.append(timed())
        counter.close()
    plain.sort()
    counted.sort()
    mid = rounds // 2
    print(
        f"\nLookup counting on the word model, batch {batch}, {rounds} x {steps} steps each, "
        "interleaved (medians)\n"
    )
    print("| step without counter ms | step with counter ms | ratio |")
    print("|---:|---:|---:|")
    print(
        f"| {plain[mid] * 1e3:.2f} | {counted[mid] * 1e3:.2f} | {counted[mid] / plain[mid]:.4f} |",
        flush=True,
    )
    # the hook's own cost, without the rest of the step's noise: the table's forward alone
    ids = features[torch.randint(0, len(targets), (batch,), generator=gen)]
    table = model.features

    def forwards(n: int = 200) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(n):
                table(ids)
        return (time.perf_counter() - t0) / n

    alone, hooked = [], []
    for _ in range(rounds):
        alone.append(forwards())
        counter.watch("features", table)
        hooked.append(forwards())
        counter.close()
    alone.sort()
    hooked.sort()
    hook_s = hooked[mid] - alone[mid]
    print("\n| table forward ms | with counter ms | counter ms | counter / step |")
    print("|---:|---:|---:|---:|")
    print(
        f"| {alone[mid] * 1e3:.3f} | {hooked[mid] * 1e3:.3f} | {hook_s * 1e3:.3f} | "
        f"{hook_s / plain[mid]:.2%} |",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=default_data(), help="MovieLens folder")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--word-steps", type=int, default=300)
    parser.add_argument("--skip-words", action="store_true")
    parser.add_argument("--skip-movielens", action="store_true")
    parser.add_argument("--counter-cost", action="store_true", help="only time lookup counting")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {time.strftime('%Y-%m-%d')}")
    if args.counter_cost:
        counter_cost(20, args.batch_size)
        return 0
    if args.skip_movielens:
        pass
    elif (args.data / "ratings.csv").is_file():
        movielens(args.data, args.epochs, args.batch_size)
    else:
        print(f"\nMovieLens skipped: {args.data / 'ratings.csv'} not found (pass --data DIR)")
    if not args.skip_words:
        words(args.word_steps, args.batch_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
