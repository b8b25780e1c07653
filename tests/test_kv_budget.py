"""The KV cache's size on a GPU (engine/kv/budget.py), checked on the CPU: the pure arithmetic."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.kv.budget import (
    dequant_buffer_bytes,
    kv_bytes_per_token,
    kv_cache_tokens_from_memory,
    largest_dequantized_linear,
    step_reserve_bytes,
)
from tileinfer.engine.models.decoder import Decoder, weight_shapes
from tileinfer.engine.models.random_model import QWEN3_0_6B, QWEN3_SIZES, TINY, random_weights
from tileinfer.engine.ops import TRITON_OPS
from tileinfer.kernels.int8 import Int8Weight
from tileinfer.kernels.linear_dequant import dequantized_at_prefill

from bench.capacity import capacity

GIB = 1 << 30


def test_bytes_per_token_count_keys_and_values_of_every_layer() -> None:
    # Qwen3-0.6B: 28 layers x (key, value) x 8 KV heads x 128 x 2 bytes (bf16)
    assert kv_bytes_per_token(QWEN3_0_6B, torch.bfloat16) == 28 * 2 * 8 * 128 * 2 == 114688
    assert kv_bytes_per_token(QWEN3_0_6B, torch.float32) == 2 * 114688


def test_the_cache_takes_the_fraction_of_free_memory_less_the_reserve_in_whole_blocks() -> None:
    per_token = 114688
    tokens = kv_cache_tokens_from_memory(100 * GIB, 0.9, per_token, 10 * GIB, 16, max_tokens=10**9)
    assert tokens % 16 == 0
    assert tokens * per_token <= 80 * GIB < (tokens + 16) * per_token
    # never more than max_num_seqs full contexts need (rounded up to a block)
    assert kv_cache_tokens_from_memory(100 * GIB, 0.9, per_token, 10 * GIB, 16, max_tokens=1000) == 1008


def test_too_little_memory_or_a_bad_fraction_is_an_error_naming_it() -> None:
    with pytest.raises(InvalidRequestError, match="gpu_memory_utilization"):
        kv_cache_tokens_from_memory(GIB, 1.5, 1024, 0, 16, max_tokens=4096)
    with pytest.raises(InvalidRequestError, match="no GPU memory left for the KV cache"):
        kv_cache_tokens_from_memory(GIB, 0.9, 1024, GIB, 16, max_tokens=4096)


def test_the_reserve_grows_with_the_step_and_the_logits() -> None:
    small = step_reserve_bytes(QWEN3_0_6B, 2048, 256, 151669)
    assert step_reserve_bytes(QWEN3_0_6B, 8192, 256, 151669) > small
    assert step_reserve_bytes(QWEN3_0_6B, 2048, 1280, 151669) - small == 1024 * 151669 * 32


@pytest.mark.parametrize("mlp", ["swiglu", "xielu"])
def test_the_dequantization_workspace_holds_the_largest_int8_layer_weight(mlp: str) -> None:
    """INT8 prefill dequantizes the layer weights that do not take the swapped-operand GEMM into one
    workspace, sized from the spec before the decoder is built: the largest such INT8 weight (q/k/v and
    gate/up fused) the built decoder holds, in each of the buffers the decoder (Triton's ops) allocates.
    Qwen3-4B's are all wide enough: no workspace, unless they hold group scales."""
    spec = dataclasses.replace(TINY, mlp=mlp)
    weights = random_weights(spec, torch.float32, "cpu")
    decoder = Decoder.from_weights(spec, weights, 64, TRITON_OPS, quantization="int8")
    int8_weights = [
        value
        for module in decoder.modules()
        for value in vars(module).values()
        if isinstance(value, Int8Weight)
    ]
    assert len(int8_weights) == 4 * spec.num_layers
    assert all(weight.mma_order == (weight.shape[1] % 64 == 0) for weight in int8_weights)  # K 64 or 160
    dequantized = [w.values.numel() for w in int8_weights if dequantized_at_prefill(w.shape[0], w.mma_order)]
    assert largest_dequantized_linear(spec) == max(dequantized) > 0
    buffers = decoder.linear_workspace.dequant.buffers
    assert sum(buffer.numel() for buffer in buffers) == dequant_buffer_bytes(spec, torch.float32)
    qwen3_4b = QWEN3_SIZES["Qwen3-4B"]
    assert largest_dequantized_linear(qwen3_4b) == 0  # and Q8_0's group scales dequantize every weight:
    assert largest_dequantized_linear(qwen3_4b, group_scales=True) == 2 * 9728 * 2560


def test_qwen3_sizes_have_their_model_cards_parameter_counts() -> None:
    """bench/capacity.py sizes these shapes: each has the parameter count its model card gives."""
    cards = {"Qwen3-0.6B": 0.6, "Qwen3-1.7B": 1.7, "Qwen3-4B": 4.0, "Qwen3-8B": 8.2, "Qwen3-14B": 14.8,
             "Qwen3-32B": 32.8}  # fmt: skip
    for name, spec in QWEN3_SIZES.items():
        parameters = sum(math.prod(shape) for shape in weight_shapes(spec).values())
        assert round(parameters / 1e9, 1) == cards[name], name


def test_capacity_counts_int8_weights_and_kv() -> None:
    """The sizing report on an H200's free memory: Qwen3-32B's bf16 cache falls short of 64 sequences
    of 4k tokens, its INT8 weights leave room for them, and an INT8 cache holds about twice the tokens."""
    free = int(139 * 2**30)
    bf16, int8 = (capacity(QWEN3_SIZES["Qwen3-32B"], mode, free, 64, 4096) for mode in ("base", "int8"))
    assert not bf16["serves"] and int8["serves"]
    assert int8["weights_gib"] < bf16["weights_gib"] / 1.8
    kv, int8_kv = (capacity(QWEN3_SIZES["Qwen3-8B"], mode, free, 64, 4096) for mode in ("base", "int8-kv"))
    assert 1.9 < int8_kv["kv_tokens"] / kv["kv_tokens"] < 2.0
