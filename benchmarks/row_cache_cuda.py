"""The row cache on a CUDA device (issue 23's GPU figures): table 8 of ``row_cache.py`` with the
tables on the GPU (cached + Adam against ``nn.Embedding(sparse=True)`` + ``SparseAdam`` and a
resident dense ``nn.Embedding`` + Adam), then the look-ahead wrapper's prefetch on the side
stream: two caches over the same host table and batches, one read through ``LookAhead(ahead=K)``,
stepped alternately (order rotated each round); per-step medians with ``torch.cuda.synchronize()``
before each clock read, and the loads each cache did inside its forward (on the critical path).
Table 8 also counts each table's waits for the device a step (torch's sync debug mode over 5
untimed steps, the ids moved to the device in the step as in the timed ones: the cache reads them
back once).

    python benchmarks/row_cache_cuda.py                  # 1 M and 8 M rows, about 2 minutes
    python benchmarks/row_cache_cuda.py --sizes 1000000 --steps 30   # shorter

Needs CUDA (exits 2 without it); ``--device cpu`` runs the same code on the CPU (a dry run), and
with ``--dim 1`` it measures what bounds the step on a GPU: the host's bookkeeping and operator
calls, the arithmetic (64 columns a row by default) nearly gone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from row_cache_timing import DIM, _zipf_batch, sparse_comparison

from edo_monitor.nn import CachedEmbedding, LookAhead
from edo_monitor.surfaces import scripting


def lookahead_comparison(
    rows: int,
    cache_rows: int,
    batch: int,
    ahead: int,
    warmup: int,
    steps: int,
    device: str,
    dim: int = DIM,
) -> dict[str, float]:
    """Seconds per step (median; the look-ahead's ``next()`` counted in its step) of a plain
    cache and one read through ``LookAhead(ahead)``, and each one's forward loads per lookup."""
    torch.manual_seed(0)
    host = torch.randn(rows, dim)
    plain = CachedEmbedding(rows, dim, cache_rows, _weight=host.clone(), device=device)
    ahead_table = CachedEmbedding(rows, dim, cache_rows, _weight=host.clone(), device=device)
    opts = {
        "plain": torch.optim.Adam(plain.parameters(), lr=1e-3),
        "lookahead": torch.optim.Adam(ahead_table.parameters(), lr=1e-3),
    }
    tables = {"plain": plain, "lookahead": ahead_table}
    gen = torch.Generator().manual_seed(0)
    batches = [(_zipf_batch(rows, batch, gen),) for _ in range(warmup + steps)]
    it = iter(LookAhead(batches, ahead=ahead, tables=ahead_table))

    def step(name: str, ids: torch.Tensor | None) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        if ids is None:
            (ids,) = next(it)
        tables[name](ids.to(device)).pow(2).mean().backward()
        opts[name].step()
        opts[name].zero_grad()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, ids

    times: dict[str, list[float]] = {"plain": [], "lookahead": []}
    start = {k: (t.stats().forward_loads, t.stats().lookups) for k, t in tables.items()}
    for i in range(warmup + steps):
        if i == warmup:
            start = {k: (t.stats().forward_loads, t.stats().lookups) for k, t in tables.items()}
        if i % 2 == 0:
            t_la, ids = step("lookahead", None)
            t_plain, _ = step("plain", ids)
        else:
            t_plain, _ = step("plain", batches[i][0])
            t_la, _ = step("lookahead", None)
        if i >= warmup:
            times["plain"].append(t_plain)
            times["lookahead"].append(t_la)
    out = {k: statistics.median(v) for k, v in times.items()}
    for k, t in tables.items():
        loads, lookups = t.stats().forward_loads, t.stats().lookups
        out[f"{k}_forward_loads"] = (loads - start[k][0]) / max(1, lookups - start[k][1])
        out[f"{k}_hit_rate"] = t.stats().hit_rate or 0.0
    return out


def _waits(result: dict[str, float]) -> str:
    """The waits-a-step column: synchronizing CUDA calls per step of each table (CUDA only)."""
    names = ("sparse", "cached", "resident")
    if "cached_waits" not in result:
        return "n/a (not CUDA)"
    return " / ".join(f"{result[f'{n}_waits']:.1f}" for n in names)


def _sizes(text: str) -> list[int]:
    """``type=`` for ``--sizes``: a comma list of row counts, each 1 or more."""
    try:
        return [scripting.positive_int(part) for part in text.split(",")]
    except argparse.ArgumentTypeError as exc:
        if "," not in text:
            raise
        raise argparse.ArgumentTypeError(f"in {text!r}: {exc}") from None


def main() -> int:
    parser = scripting.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=_sizes, default=[1_000_000, 8_000_000], help="table rows, comma list"
    )
    parser.add_argument("--cache-rows", type=scripting.positive_int, default=100_000)
    parser.add_argument(
        "--batch", type=scripting.positive_int, default=4096, help="Zipf ids per step"
    )
    parser.add_argument(
        "--warmup", type=scripting.positive_int, default=300, help="cached warm-up steps"
    )
    parser.add_argument("--steps", type=scripting.positive_int, default=60, help="timed rounds")
    parser.add_argument(
        "--ahead", type=scripting.positive_int, default=8, help="look-ahead window (batches)"
    )
    parser.add_argument(
        "--dim",
        type=scripting.positive_int,
        default=DIM,
        help="table columns (1 with --device cpu: the step's host work alone)",
    )
    parser.add_argument(
        "--device",
        type=scripting.torch_device,
        default=None,
        help="cuda (default) or cuda:N; cpu: a dry run of the plumbing",
    )
    args = parser.parse_args()
    if args.cache_rows >= min(args.sizes):
        parser.error(
            f"--cache-rows {args.cache_rows} is not below every table size {args.sizes}: "
            "a cache holding the whole table caches nothing"
        )
    if args.device is None:
        if not torch.cuda.is_available():
            print("row_cache_cuda.py: no CUDA device (--device cpu: a dry run)", file=sys.stderr)
            return 2
        args.device = "cuda"
    cuda = args.device.startswith("cuda")
    name = torch.cuda.get_device_name(torch.device(args.device)) if cuda else "cpu"
    print(f"device: {name}, torch {torch.__version__}")
    print(
        f"\nTable 8 on {args.device}: dim {args.dim}, batch {args.batch} Zipf ids, "
        f"cache {args.cache_rows} rows,"
        f" {args.steps} rounds after {args.warmup} warm-up steps (ms per step, medians)\n"
    )
    print(
        "| rows | sparse + SparseAdam | cached + Adam | resident + Adam | cached / sparse "
        "| paired | cached / resident | waits a step: sparse / cached / resident |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.sizes:
        r = sparse_comparison(
            rows,
            args.cache_rows,
            args.batch,
            args.warmup,
            args.steps,
            True,
            device=args.device,
            dim=args.dim,
        )
        print(
            f"| {rows:,} | {r['sparse'] * 1e3:.2f} | {r['cached'] * 1e3:.2f} "
            f"| {r['resident'] * 1e3:.2f} | {r['cached'] / r['sparse']:.2f} "
            f"| {r['paired']:.2f} | {r['cached'] / r['resident']:.2f} | {_waits(r)} |",
            flush=True,
        )
        if cuda:
            torch.cuda.empty_cache()
    rows = args.sizes[0]
    print(
        f"\nLook-ahead on {args.device}: {rows:,} rows, ahead={args.ahead}, "
        "the same batches alternately\n"
    )
    r = lookahead_comparison(
        rows,
        args.cache_rows,
        args.batch,
        args.ahead,
        args.warmup,
        args.steps,
        args.device,
        args.dim,
    )
    print("| cache | ms per step | forward loads per lookup | hit rate |")
    print("|---|---:|---:|---:|")
    for k in ("plain", "lookahead"):
        print(
            f"| {k} | {r[k] * 1e3:.2f} | {r[k + '_forward_loads'] * 100:.2f} % "
            f"| {r[k + '_hit_rate'] * 100:.1f} % |"
        )
    print(f"\nlookahead / plain: {r['lookahead'] / r['plain']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
