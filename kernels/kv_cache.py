"""Writing new keys and values into the paged KV cache."""

from __future__ import annotations

import torch


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots.

    kv_cache: one layer's [2, num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: [num_tokens], slot = block_id * block_size + offset in the block.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    key_cache.index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    value_cache.index_copy_(0, slot_mapping, value.to(kv_cache.dtype))
