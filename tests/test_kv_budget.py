"""The KV cache's size on a GPU (engine/kv_budget.py), checked on the CPU: the pure arithmetic."""

from __future__ import annotations

import pytest
import torch

from bench.model_shapes import QWEN3_0_6B
from engine.errors import InvalidRequestError
from engine.kv_budget import kv_bytes_per_token, kv_cache_tokens_from_memory, step_reserve_bytes

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
