"""Writing new keys and values into the paged KV cache."""

from __future__ import annotations

import torch


def write_kv_cache_reference(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots.

    kv_cache: one layer's [2, num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: [num_tokens], slot = block_id * block_size + offset in the block; a slot of -1 marks
    a padding token (a CUDA graph's batch is padded), whose key and value are not stored.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    stored = slot_mapping >= 0
    slots = slot_mapping[stored]
    key_cache.index_copy_(0, slots, key[stored].to(kv_cache.dtype))
    value_cache.index_copy_(0, slots, value[stored].to(kv_cache.dtype))
