"""Train a word-level language model whose embedding table dominates memory, under edo-monitor.

The model is fastText-style: the previous four words, as hashed unigram and bigram features, are
looked up in one ``nn.EmbeddingBag`` of 100,003 rows x 64 (mean), and a linear layer predicts the
next word among the 2,048 most frequent ones. With Adam the table's parameters, gradients and
two optimizer states take about 102 MB; the batch size ramps up (512 -> 8,192), so the activations
saved for backward (mostly the log-softmax output, batch x 2,048 floats) grow over the run.

Run with its defaults, this is the **pressure demo**: with a 158 MiB budget, free memory crosses
the 20 % floor when the batch reaches 4,096, the auto-tuner offloads the table to the host tier at
the next step boundary, free memory goes back above the floor and the run finishes.
With ``--no-tune`` (policy "observe") the same budget is exceeded at batch 8,192 and the run
stops with an out-of-memory error, as it would on a GPU.

On CUDA the defaults are a 396 MiB budget and a sample every 0.02 s (measured on an H200 with
PyTorch 2.11: CUDA's Adam steps the table with ``foreach`` temporaries, so the allocated peak is
190 MiB from the first step, 239 MiB at batch 4,096 and 337 MiB at 8,192, above the whole
158 MiB budget; and 100 steps take 1.5 s, so a 0.25 s interval saw the pressure only after the
run had failed). Under a budget the caching allocator frees its cache and retries before it
fails, so ``--no-tune`` at 396 MiB is squeezed to about 9 % free without an out-of-memory error;
``--budget 310MiB --no-tune`` runs out of memory at batch 8,192.

Text: any file with ``--text PATH`` (e.g. ../shared/data/tinyshakespeare/input.txt); by default the
Python standard library's own source files, which every Python installation carries.

With ``--ramp linear --forecast 10`` the batch grows by the same amount every step and the policy
forecasts the crossing from the trend of in-use bytes: it caches the table (and shrinks the cache
later) ahead of the crossing, and free memory never goes below the floor. (The default doubling
ramp is a staircase: each jump is a level shift, not a trend, and is not forecast.)

    python examples/train_embedding.py                # the pressure demo, exit 0
    python examples/train_embedding.py --no-tune      # same budget, no tuner: out of memory, exit 1
    python examples/train_embedding.py --ramp linear --forecast 10   # acts before the crossing

With ``--ddp``, under ``torchrun`` (one process a rank, CPU and gloo), the model is wrapped in
``DistributedDataParallel`` and gets two residual MLP blocks (64 -> 2,048 -> 64) between the
table and the classifier. The last rank trains on the full batch ramp, the others on a quarter
of it, so only the last rank crosses the floor (budget 236 MiB). Under DDP only actions that
leave every registered parameter's device, dtype and shape alone are allowed (``release_cache``,
``checkpoint_activations``); on a CPU that leaves checkpointing, which drops the blocks'
hidden activations: the ranks agree every 4 steps and every rank checkpoints the same blocks at
the same step, so the replicas stay identical, and the job finishes.

    torchrun --nproc-per-node 2 examples/train_embedding.py --ddp
"""

from __future__ import annotations

# ruff: noqa: E402 (the arguments are checked before PyTorch is imported, which takes seconds)
import argparse
import os
import re

from edo_monitor.surfaces import scripting  # light: no PyTorch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (checked before PyTorch is imported: a bad argument is one line)."""
    parser = scripting.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--text",
        type=scripting.readable_file,
        help="text file to train on (default: Python stdlib)",
    )
    parser.add_history_and_budget(
        "memory budget (default: 158MiB on a CPU, 396MiB on CUDA; 236MiB with --ddp)"
    )
    parser.add_argument(
        "--steps",
        type=scripting.positive_int,
        default=None,
        help="optimizer steps (default: 100; 40 with --ddp)",
    )
    parser.add_argument("--no-tune", action="store_true", help="observe only (policy 'observe')")
    parser.add_argument(
        "--ramp",
        choices=("doubling", "linear"),
        default="doubling",
        help="batch-size ramp 512 -> 8,192: doubling in five phases (default) or linear",
    )
    parser.add_argument(
        "--forecast",
        type=scripting.positive_int,
        default=None,
        metavar="N",
        help="act when free memory is forecast below the floor within N steps (Policy "
        "forecast_steps; default: off)",
    )
    parser.add_argument(
        "--interval",
        type=scripting.positive_float,
        default=None,
        help="seconds between samples (default: 0.25 on a CPU, 0.02 on CUDA)",
    )
    parser.add_argument(
        "--device",
        type=scripting.torch_device,
        default=None,
        help="cpu, cuda or cuda:N (default: cuda when available)",
    )
    parser.add_argument(
        "--ddp",
        action="store_true",
        help="one rank of a DistributedDataParallel job (start with torchrun; CPU: gloo); "
        "the last rank's batches are 4x the others'",
    )
    args = parser.parse_args(argv)
    if args.forecast is not None and args.no_tune:
        parser.error("--forecast acts on a forecast, and --no-tune only watches; give one of them")
    if args.ddp and "RANK" not in os.environ:
        parser.error(
            "--ddp needs the variables torchrun sets (RANK, WORLD_SIZE …); start it with "
            "torchrun --nproc-per-node 2 examples/train_embedding.py --ddp"
        )
    return args


if __name__ == "__main__":  # bad arguments: one line and exit 2, before the slow imports
    parse_args()
    # say what is happening at once: importing PyTorch takes seconds
    print("train_embedding: loading PyTorch and edo-monitor…", flush=True)

import functools
import logging
import sys
import sysconfig
import time
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import edo_monitor
from edo_monitor.units import format_bytes

BUCKETS = 100_003  # hashed unigram + bigram features: the embedding table's rows
CLASSES = 2_048  # next-word classes: the most frequent words, the last one is "other"
CONTEXT = 4  # previous words used as features
TOKEN_RE = re.compile(r"[A-Za-z_]+|[0-9]+|[^\sA-Za-z0-9_]")


def default_text(max_chars: int = 3_000_000) -> str:
    """The standard library's top-level ``.py`` files, in name order, up to ``max_chars``."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(lib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= max_chars:
            break
    if not parts:
        raise SystemExit(f"no .py files under {lib}; pass --text PATH")
    return "".join(parts)[:max_chars]


def build_dataset(text: str, source: str = "the text") -> tuple[torch.Tensor, torch.Tensor]:
    """Features ``[N, 2*CONTEXT-1]`` (int64 bucket ids) and next-word targets ``[N]``; a text of
    ``CONTEXT`` words or fewer ends the program (exit 1) with one line naming ``source``."""
    words = TOKEN_RE.findall(text)
    if len(words) <= CONTEXT:
        raise SystemExit(f"{source} has {len(words)} words; need more than {CONTEXT}")
    vocab = {w: i for i, w in enumerate(sorted(set(words)))}
    ids = torch.tensor([vocab[w] for w in words])
    word_hash = torch.tensor([zlib.crc32(w.encode()) % BUCKETS for w in sorted(vocab)])
    top = [w for w, _ in Counter(words).most_common(CLASSES - 1)]
    class_of = torch.full((len(vocab),), CLASSES - 1)
    class_of[torch.tensor([vocab[w] for w in top])] = torch.arange(len(top))
    h = word_hash[ids]  # [T]
    n = len(words) - CONTEXT
    unigrams = torch.stack([h[i : i + n] for i in range(CONTEXT)], dim=1)  # [N, C]
    bigrams = (unigrams[:, :-1] * 1_000_003 + unigrams[:, 1:]) % BUCKETS  # [N, C-1]
    features = torch.cat([unigrams, bigrams], dim=1)
    targets = class_of[ids[CONTEXT:]]
    return features, targets


class HashedWordModel(nn.Module):
    """EmbeddingBag over hashed n-gram features -> linear next-word classifier."""

    def __init__(
        self,
        buckets: int = BUCKETS,
        dim: int = 64,
        classes: int = CLASSES,
        blocks: int = 0,
        hidden: int = 2_048,
    ) -> None:
        super().__init__()
        self.features = nn.EmbeddingBag(buckets, dim, mode="mean")
        #: ``blocks`` residual MLP blocks (dim -> hidden -> dim) between table and classifier
        self.blocks = (
            nn.Sequential(*(Block(dim, hidden) for _ in range(blocks))) if blocks else None
        )
        self.classifier = nn.Linear(dim, classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        h = self.features(features)
        if self.blocks is not None:
            h = self.blocks(h)
        return self.classifier(h)


class Block(nn.Module):
    """``x + fc2(relu(fc1(x)))``: its hidden activations (batch x hidden) are its own, so
    checkpointing it frees them."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def batch_size_at(step: int, steps: int, ramp: str = "doubling") -> int:
    """Batch-size ramp from 512 to 8,192: ``"doubling"`` in five equal phases (512, 1,024, 2,048,
    4,096, 8,192), ``"linear"`` in equal increments every step (a batch-size warm-up)."""
    if ramp == "linear":
        return 512 + (8192 - 512) * step // max(1, steps - 1)
    phase = min(4, step * 5 // max(1, steps))
    return 512 << phase


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.budget is not None and args.device == "cpu":  # the budget is enforced on a CPU
        with torch.device("meta"):  # the model's shapes only: no memory, no random numbers
            shapes = HashedWordModel(blocks=2 if args.ddp else 0)
        too_small = scripting.budget_below_params(args.budget, shapes)
        if too_small:  # one line before the text is read (watch() says it later)
            raise edo_monitor.ConfigError(
                f"{too_small}; give a larger budget (the default, 158 MiB, is the pressure demo)"
            )
    scripting.check_history_db(args.db)  # unusable: one line, exit 1, before the slow work
    cuda = args.device.startswith("cuda")
    budget = args.budget or ("236MiB" if args.ddp else "396MiB" if cuda else "158MiB")
    interval_s = args.interval or (0.02 if cuda else 0.25)
    steps = args.steps if args.steps is not None else (40 if args.ddp else 100)
    rank, world_size, say = 0, 1, print
    if args.ddp:
        rank, world_size = start_ddp(args.device)
        say = functools.partial(print, f"[rank {rank}]", flush=True)

    torch.manual_seed(0)  # the same initial model on every rank (DDP broadcasts rank 0's too)
    source = str(args.text) if args.text else "the Python standard library"
    say(f"reading the text of {source}…", flush=True)
    text = args.text.read_text(encoding="utf-8", errors="replace") if args.text else default_text()
    say(f"building the dataset from {len(text):,} characters…", flush=True)
    features, targets = build_dataset(text, f"--text {source!r}" if args.text else source)
    device = torch.device(args.device)
    if args.ddp and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    model: nn.Module = HashedWordModel(blocks=2 if args.ddp else 0).to(device)
    if args.ddp:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    policy = edo_monitor.Policy(
        mode="observe" if args.no_tune else "auto", forecast_steps=args.forecast
    )
    # under --ddp the last rank trains on the whole ramp, the others on a quarter of it
    share = 1 if rank == world_size - 1 else 4
    say(f"training on {len(targets):,} positions of {source}; table {BUCKETS:,} x 64")
    if args.ddp:
        say(f"rank {rank} of {world_size}: batches 1/{share} of the ramp")

    losses: list[float] = []
    t0 = time.monotonic()
    try:
        with edo_monitor.watch(
            model,
            opt,
            db=args.db,
            budget=budget,
            policy=policy,
            enforce=device.type == "cpu",
            interval_s=interval_s,
            run_name="train_embedding"
            + ("-ddp" if args.ddp else "")
            + ("-no-tune" if args.no_tune else ""),
            config={"ramp": args.ramp},
        ) as monitor:
            gen = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
            for step in range(steps):
                batch = batch_size_at(step, steps, args.ramp) // share
                idx = torch.randint(0, len(targets), (batch,), generator=gen)
                x, y = features[idx].to(device), targets[idx].to(device)
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
                if step % 10 == 0 or step == steps - 1:
                    latest = monitor.latest
                    free = (
                        f"{latest.free_fraction:.1%}"
                        if latest and latest.free_fraction is not None
                        else "N/A"
                    )
                    say(f"step {step:4d}  batch {len(idx):5d}  loss {loss.item():.3f}  free {free}")
    except edo_monitor.ConfigError as exc:  # e.g. a budget the model cannot fit in
        say(f"train_embedding.py: error: {exc}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as exc:
        say(f"\nout of memory at step {len(losses)}: {exc}", file=sys.stderr)
        print_summary(monitor.summary(), losses, time.monotonic() - t0, say)
        return 1  # under torchrun the launcher stops the other ranks
    print_summary(monitor.summary(), losses, time.monotonic() - t0, say)
    if args.ddp:
        torch.distributed.destroy_process_group()
    return 0


def start_ddp(device: str) -> tuple[int, int]:
    """Join the process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
    ...; gloo on a CPU, NCCL on CUDA) and return (rank, world size)."""
    if "RANK" not in os.environ:
        raise SystemExit(
            "--ddp needs the variables torchrun sets; start it with "
            "torchrun --nproc-per-node 2 examples/train_embedding.py --ddp"
        )
    backend = "nccl" if device.startswith("cuda") else "gloo"
    torch.distributed.init_process_group(backend)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def print_summary(
    summary: edo_monitor.RunSummary,
    losses: list[float],
    elapsed_s: float,
    say: Callable[..., None] = print,
) -> None:
    """Print what the run did: steps, peaks, minimum free fraction, events and actions
    (through ``say``: under --ddp each line starts with the rank)."""
    n = min(10, len(losses))  # the loss averaged over the first and the last n steps
    loss = (
        f"{sum(losses[:n]) / n:.3f} (first {n} steps) -> {sum(losses[-n:]) / n:.3f} (last {n})"
        if n
        else "N/A (no step finished)"  # out of memory in the first step: there is no loss
    )
    mff = summary.min_free_fraction
    say("")
    say("== edo-monitor summary ==")
    say(f"run              {summary.run_id} ({summary.run_name}), status {summary.status}")
    say(f"device           {summary.device_kind}, budget {format_bytes(summary.budget_bytes)}")
    say(f"steps            {summary.steps} in {elapsed_s:.1f} s")
    say(f"loss             {loss}")
    say(f"peak in use      {format_bytes(summary.peak_in_use_bytes)}")
    say(f"peak activations {format_bytes(summary.peak_activations_bytes)}")
    say(f"min free         {'N/A' if mff is None else f'{mff:.1%}'}")
    say(f"events           {summary.events or 'none'}")
    for action in summary.actions:
        say(
            f"action           {action.get('action')} on {action.get('target')}: saved "
            f"{format_bytes(action.get('saved_bytes'))} in {action.get('duration_s', 0):.3f} s"
        )
    say(f"database         {summary.database}")


if __name__ == "__main__":  # bad arguments: exit 2; an unusable database: 1; Ctrl-C: 130
    sys.exit(scripting.run_main(main))
