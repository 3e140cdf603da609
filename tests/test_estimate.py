"""estimate(): the pinned figures of issue 3, the compression rules, validation, and equality with
what accounting measures on real modules after one real optimizer step on the CPU."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch
from torch import nn

from edo_monitor.decide.estimate import estimate
from edo_monitor.errors import ConfigError
from edo_monitor.measure.accounting import account
from edo_monitor.surfaces.cli.estimate_text import estimate_command
from edo_monitor.units import format_bytes

# --- pinned figures (issue 3)


def test_pinned_small_table_float32_params() -> None:
    result = estimate(30_000, 768)
    assert result.params_bytes == 92_160_000  # 30,000 * 768 * 4
    assert format_bytes(result.params_bytes) == "87.89 MiB"


def test_pinned_small_table_int8_rowwise() -> None:
    result = estimate(30_000, 768, compression="int8")
    # 30,000 * 768 int8 weights + 30,000 float32 scales (no offset); frozen.
    assert result.params_bytes == 23_040_000 + 30_000 * 4
    assert result.grads_bytes == 0
    assert result.optimizer_state_bytes == 0
    assert result.step_state_bytes == 0
    assert result.total_bytes == 23_160_000


def test_pinned_big_table_adam() -> None:
    result = estimate(500_000, 12_288, optimizer="adam")
    assert result.params_bytes == 24_576_000_000  # 500,000 * 12,288 * 4
    assert format_bytes(result.params_bytes) == "22.89 GiB"
    assert result.grads_bytes == 24_576_000_000
    assert result.optimizer_state_bytes == 49_152_000_000  # exp_avg + exp_avg_sq
    assert result.total_bytes == 98_304_000_000
    assert format_bytes(result.total_bytes) == "91.55 GiB"
    # The scalar step counter (a CPU float32 tensor by default) is reported apart.
    assert result.step_state_bytes == 4
    assert result.total_with_step_bytes == 98_304_000_004


# --- equality with accounting after one real step on the CPU

OPTIMIZER_FACTORIES: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3),
}

# What torch really keeps per parameter after one step (checked below, so the rules are honest).
EXPECTED_STATE_KEYS = {
    "sgd": set(),
    "sgd-momentum": {"momentum_buffer"},
    "adam": {"step", "exp_avg", "exp_avg_sq"},
    "adamw": {"step", "exp_avg", "exp_avg_sq"},
    "adagrad": {"step", "sum"},
    "rmsprop": {"step", "square_avg"},
}


def one_step(model: nn.Module, name: str, ids: torch.Tensor) -> torch.optim.Optimizer:
    opt = OPTIMIZER_FACTORIES[name](model.parameters())
    out = model(ids)
    out.float().pow(2).sum().backward()
    opt.step()
    return opt


@pytest.mark.parametrize("name", list(OPTIMIZER_FACTORIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_estimate_equals_accounting_for_each_optimizer(name: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    table = nn.Embedding(300, 24, dtype=dtype)
    opt = one_step(table, name, torch.tensor([[0, 5, 7], [299, 5, 1]]))
    assert set(opt.state[table.weight]) == EXPECTED_STATE_KEYS[name]

    measured = account(table, [opt])
    result = estimate(300, 24, dtype=dtype, optimizer=name)
    assert measured.params_bytes == result.params_bytes
    assert measured.grads_bytes == result.grads_bytes
    # accounting counts every tensor in optimizer.state, the scalar step included.
    assert measured.optimizer_state_bytes == result.optimizer_state_bytes + result.step_state_bytes
    assert measured.total_bytes == result.total_with_step_bytes


class LowRank(nn.Module):
    def __init__(self, rows: int, cols: int, rank: int) -> None:
        super().__init__()
        self.left = nn.Parameter(torch.randn(rows, rank))
        self.right = nn.Parameter(torch.randn(rank, cols))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.left[ids] @ self.right


class Hashed(nn.Module):
    def __init__(self, buckets: int, cols: int) -> None:
        super().__init__()
        self.buckets = buckets
        self.weight = nn.Parameter(torch.randn(buckets, cols))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids % self.buckets]


@pytest.mark.parametrize("name", ["sgd-momentum", "adam", "rmsprop"])
def test_lowrank_estimate_equals_accounting(name: str) -> None:
    model = LowRank(500, 32, 4)
    opt = one_step(model, name, torch.tensor([3, 499, 42]))
    measured = account(model, [opt])
    result = estimate(500, 32, optimizer=name, compression="lowrank:4")
    assert result.params_bytes == (500 * 4 + 4 * 32) * 4
    assert measured.params_bytes == result.params_bytes
    assert measured.grads_bytes == result.grads_bytes
    assert measured.total_bytes == result.total_with_step_bytes


@pytest.mark.parametrize("name", ["sgd", "adamw", "adagrad"])
def test_hash_estimate_equals_accounting(name: str) -> None:
    model = Hashed(64, 16)
    opt = one_step(model, name, torch.tensor([1000, 7, 123456]))
    measured = account(model, [opt])
    result = estimate(10_000, 16, optimizer=name, compression=("hash", 64))
    assert result.params_bytes == 64 * 16 * 4
    assert measured.params_bytes == result.params_bytes
    assert measured.total_bytes == result.total_with_step_bytes


def test_int8_estimate_equals_accounting_of_a_rowwise_int8_module() -> None:
    class Int8Rowwise(nn.Module):
        def __init__(self, rows: int, cols: int) -> None:
            super().__init__()
            self.register_buffer("weight", torch.zeros(rows, cols, dtype=torch.int8))
            self.register_buffer("scale", torch.ones(rows, dtype=torch.float32))

    measured = account(Int8Rowwise(1000, 48), [])
    result = estimate(1000, 48, compression="int8", optimizer="adam")
    assert result.params_bytes == 1000 * 48 + 1000 * 4
    assert measured.total_bytes == result.total_with_step_bytes == result.total_bytes


# --- compression and master weights, by hand


def test_fp16_trainable_keeps_state_in_fp16() -> None:
    result = estimate(1000, 64, optimizer="sgd-momentum", compression="fp16")
    assert result.params_bytes == 1000 * 64 * 2
    assert result.grads_bytes == 1000 * 64 * 2
    assert result.optimizer_state_bytes == 1000 * 64 * 2
    assert result.step_state_bytes == 0
    assert result.compression == "fp16"


def test_bf16_with_master_weights_keeps_fp32_copy_and_state() -> None:
    result = estimate(1000, 64, optimizer="adam", compression="bf16", master_weights=True)
    assert result.params_bytes == 128_000  # 64,000 * 2
    assert result.grads_bytes == 128_000
    assert result.optimizer_state_bytes == 64_000 * 4 + 2 * 64_000 * 4  # master + two moments
    assert result.total_bytes == 128_000 + 128_000 + 768_000
    assert result.step_state_bytes == 4


def test_float16_dtype_with_master_weights() -> None:
    result = estimate(10, 10, dtype="fp16", optimizer="sgd", master_weights=True)
    assert result.dtype == "float16"
    assert (result.params_bytes, result.grads_bytes, result.optimizer_state_bytes) == (
        200,
        200,
        400,
    )


def test_lowrank_and_hash_forms() -> None:
    text = estimate(1000, 100, optimizer="adagrad", compression="lowrank:8")
    pair = estimate(1000, 100, optimizer="adagrad", compression=("lowrank", 8))
    assert text == pair
    assert text.compression == "lowrank:8"
    # factors 1000x8 and 8x100 = 8,800 elements: params, grads and Adagrad's sum, 4 bytes each.
    assert text.params_bytes == 35_200
    assert text.optimizer_state_bytes == 35_200
    assert text.step_state_bytes == 8  # two parameter tensors
    hashed = estimate(1000, 100, compression="HASH:250", optimizer="sgd")
    assert hashed.compression == "hash:250"
    assert hashed.total_bytes == 250 * 100 * 4 * 2


def test_aliases_and_torch_dtypes() -> None:
    assert estimate(10, 10, optimizer="sgd_momentum").optimizer == "sgd-momentum"
    assert estimate(10, 10, optimizer="AdamW").optimizer == "adamw"
    assert estimate(10, 10, dtype=torch.bfloat16).dtype == "bfloat16"
    assert estimate(10, 10, dtype="torch.float64").params_bytes == 800
    assert estimate(10, 10, compression="none").compression is None


def test_as_dict() -> None:
    data = estimate(30_000, 768, optimizer="sgd").as_dict()
    assert data == {
        "num_embeddings": 30_000,
        "embedding_dim": 768,
        "dtype": "float32",
        "optimizer": "sgd",
        "compression": None,
        "master_weights": False,
        "params_bytes": 92_160_000,
        "grads_bytes": 92_160_000,
        "optimizer_state_bytes": 0,
        "step_state_bytes": 0,
        "total_bytes": 184_320_000,
        "total_with_step_bytes": 184_320_000,
    }


# --- validation


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"num_embeddings": 0}, "num_embeddings=0"),
        ({"num_embeddings": True}, "num_embeddings=True"),
        ({"embedding_dim": 1.5}, "embedding_dim=1.5"),
        ({"dtype": "int4"}, "dtype='int4'"),
        ({"optimizer": "lion"}, "optimizer='lion'"),
        ({"compression": "int3"}, "compression='int3'"),
        ({"compression": "lowrank:x"}, "compression='lowrank:x'"),
        ({"compression": "lowrank:0"}, "lowrank:0"),
        ({"compression": ("lowrank", 65)}, "compression=('lowrank', 65)"),
        ({"compression": "hash:0"}, "hash:0"),
        ({"compression": "hash:1001"}, "hash:1001"),
        ({"compression": ("hash", "3")}, "compression=('hash', '3')"),
        ({"master_weights": True}, "master_weights=True"),
        ({"master_weights": True, "compression": "int8"}, "master_weights=True"),
        ({"master_weights": "yes"}, "master_weights='yes'"),
    ],
)
def test_bad_values_raise_config_error_naming_them(kwargs: dict, named: str) -> None:
    args = {"num_embeddings": 1000, "embedding_dim": 64}
    args.update(kwargs)
    rows, cols = args.pop("num_embeddings"), args.pop("embedding_dim")
    with pytest.raises(ConfigError) as caught:
        estimate(rows, cols, **args)
    assert named in str(caught.value)
    assert "allowed" in str(caught.value) or "expected" in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_optimizer_error_lists_the_allowed_names() -> None:
    with pytest.raises(ConfigError, match="sgd, sgd-momentum, adam, adamw, adagrad, rmsprop"):
        estimate(10, 10, optimizer="adafactor")


# --- the CLI text


def test_estimate_command_text() -> None:
    text = estimate_command(500_000, 12_288, "float32", "adam", None, False, False)
    lines = text.splitlines()
    assert lines[0] == (
        "Embedding table 500,000 x 12,288 float32, optimizer adam, compression none"
    )
    by_label = {line[:19].strip(): line[19:].split() for line in lines[1:7]}
    assert by_label["params"] == ["24,576,000,000", "bytes", "22.89", "GiB"]
    assert by_label["grads"] == ["24,576,000,000", "bytes", "22.89", "GiB"]
    assert by_label["optimizer state"] == ["49,152,000,000", "bytes", "45.78", "GiB"]
    assert by_label["total"] == ["98,304,000,000", "bytes", "91.55", "GiB"]
    assert by_label["step counters"] == ["4", "bytes", "4", "bytes"]


@pytest.mark.parametrize(
    ("compression", "note"),
    [
        # 100 x 1 float32 frozen: 400 bytes; int4 with a scale and zero-point a row: 800
        ("int4", "(int4:64 is not smaller than the table uncompressed: 400 bytes frozen; "),
        ("int8", "(int8 is not smaller than the table uncompressed: 400 bytes frozen; "),
        # trainable: against the uncompressed table with Adam's state (1,600 bytes)
        ("lowrank:1", "(lowrank:1 is not smaller than the table uncompressed: 1,600 bytes; "),
        ("bf16", None),  # 800 bytes with Adam's state against 1,600: smaller, no note
    ],
)
def test_a_compression_that_is_not_smaller_is_said(compression: str, note: str | None) -> None:
    """int4 of a one-column table printed 800 bytes, twice float32's 400, without a word; the
    action refuses such a variant."""
    last = estimate_command(100, 1, "float32", "adam", compression, False, False).splitlines()[-1]
    if note is None:
        assert "not smaller" not in last
    else:
        assert last.strip() == note + "compress_embedding refuses it)"


def test_estimate_command_json() -> None:
    text = estimate_command(30_000, 768, "float32", "adam", "int8", False, True)
    data = json.loads(text)
    assert data["params_bytes"] == 23_160_000
    assert data["total_bytes"] == 23_160_000
    assert data["compression"] == "int8"


def test_estimate_command_passes_errors_through() -> None:
    with pytest.raises(ConfigError, match="compression='zip'"):
        estimate_command(10, 10, "float32", "adam", "zip", False, False)
