"""The paged KV cache's storage (float, or INT8 with scales), and writing new keys and values into it.

A float cache is one tensor: [num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim],
and a layer's is its [2, ...] slice. An INT8 cache (Int8KVCache) holds the same shape in int8 and a
symmetric scale for each token and KV head (fp32). Keys are smoothed per channel before they are
quantized: stored as (k - offset) / smoothing, with an offset and a smoothing vector per layer and KV
head, and the queries are multiplied by the smoothing (kernels/qkv_epilogue.py). Then q'.k' = q.k - q.offset:
each query's scores move by one constant, which the softmax ignores, while the channels that carry a
large constant part or a large spread (as trained models' keys do) no longer set every token's scale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from tileinfer.kernels.int8 import Int8Values


@dataclasses.dataclass
class Int8KVCache(Int8Values):
    """INT8 keys and values with their scales; indexing the leading axis (a layer) gives its views."""

    values: torch.Tensor  # int8 [..., 2, num_blocks, block_size, num_kv_heads, head_dim]
    scales: torch.Tensor  # fp32 [..., 2, num_blocks, block_size, num_kv_heads]: value = int8 * scale
    key_offset: torch.Tensor  # fp32 [..., num_kv_heads, head_dim]: subtracted from the keys,
    key_smoothing: torch.Tensor  # which are then divided by this (same shape)

    def __getitem__(self, layer: int) -> Int8KVCache:
        return Int8KVCache(
            self.values[layer], self.scales[layer], self.key_offset[layer], self.key_smoothing[layer]
        )

    def __len__(self) -> int:
        return self.values.shape[0]

    def __iter__(self) -> Iterator[Int8KVCache]:  # the layers, as a float cache tensor iterates
        return (self[layer] for layer in range(len(self)))

    @staticmethod
    def allocate(
        num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
        device: torch.device | str,
    ) -> Int8KVCache:  # fmt: skip
        """Zeros, with no smoothing (offset 0, smoothing 1) until the engine calibrates it."""
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads)
        per_channel = (num_layers, num_kv_heads, head_dim)
        return Int8KVCache(
            values=torch.zeros(*shape, head_dim, dtype=torch.int8, device=device),
            scales=torch.zeros(shape, dtype=torch.float32, device=device),
            key_offset=torch.zeros(per_channel, dtype=torch.float32, device=device),
            key_smoothing=torch.ones(per_channel, dtype=torch.float32, device=device),
        )


KVCache = torch.Tensor | Int8KVCache


def kv_cache_bytes(kv_cache: KVCache) -> int:
    if isinstance(kv_cache, Int8KVCache):
        tensors = (kv_cache.values, kv_cache.scales, kv_cache.key_offset, kv_cache.key_smoothing)
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    return kv_cache.numel() * kv_cache.element_size()


def kv_bytes_per_slot(num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """Bytes a token's keys and values take in one layer."""
    if kv_cache_dtype == "int8":
        return 2 * num_kv_heads * (head_dim + 4)  # int8 values and an fp32 scale per head
    return 2 * num_kv_heads * head_dim * dtype.itemsize


def copy_kv_blocks(kv_cache: KVCache, src_block: int, dst_block: int, num_slots: int) -> None:
    """Every layer's first num_slots slots of src_block into dst_block (a copy-on-write), scales with them."""
    tensors = (kv_cache.values, kv_cache.scales) if isinstance(kv_cache, Int8KVCache) else (kv_cache,)
    for tensor in tensors:
        tensor[:, :, dst_block, :num_slots] = tensor[:, :, src_block, :num_slots]


def quantize_kv_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 values, fp32 scales [...]): symmetric, a scale per head row, rounded half
    away from zero as the kernel does; an all-zero row gets scale 1."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    scaled = x / scale[..., None]
    values = (scaled.abs() + 0.5).floor().copysign(scaled).clamp(-127, 127)
    return values.to(torch.int8), scale


def gather_kv_reference(kv_cache: KVCache, which: int, blocks: torch.Tensor) -> torch.Tensor:
    """One layer's keys (which 0) or values (1) of `blocks`, float32 [len(blocks), block_size, heads, dim];
    INT8 keys come back as stored (smoothed), which the queries account for."""
    if isinstance(kv_cache, Int8KVCache):
        return kv_cache.values[which, blocks].float() * kv_cache.scales[which, blocks][..., None]
    return kv_cache[which, blocks].float()


def write_kv_cache_reference(
    key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots.

    kv_cache: one layer's [2, num_blocks, block_size, num_kv_heads, head_dim] (or its Int8KVCache: keys
    smoothed, then each head row quantized); slot_mapping: [num_tokens], slot = block_id *
    block_size + offset in the block; a slot of -1 marks a padding token (a CUDA graph's batch is padded),
    whose key and value are not stored.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    stored = slot_mapping >= 0
    slots = slot_mapping[stored]
    if isinstance(kv_cache, Int8KVCache):
        values = kv_cache.values.view(2, -1, num_kv_heads, head_dim)
        scales = kv_cache.scales.view(2, -1, num_kv_heads)
        smoothed = (key[stored].float() - kv_cache.key_offset) / kv_cache.key_smoothing
        for which, x in enumerate((smoothed, value[stored])):
            quantized, scale = quantize_kv_reference(x)
            values[which].index_copy_(0, slots, quantized)
            scales[which].index_copy_(0, slots, scale)
        return
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    key_cache.index_copy_(0, slots, key[stored].to(kv_cache.dtype))
    value_cache.index_copy_(0, slots, value[stored].to(kv_cache.dtype))


def smoothing_from_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's (key offset, key smoothing), each [num_kv_heads, head_dim], from calibration keys
    [tokens, num_kv_heads, head_dim] after RoPE, taken at positions spread over the context: the offset is
    each channel's mean (a pair that RoPE turns over the context averages towards 0 there, so only what
    stays put is taken out); the smoothing is the square root of the RMS of what remains (SmoothQuant's
    alpha 0.5: a channel divided by its full RMS would have its rounding error multiplied back by it in
    q.k), shared by the two channels RoPE rotates together (c and c + head_dim / 2), the RMS floored at
    1/64 of the head's largest. On SmolLM2-135M the square root gave a third of the full RMS's largest
    logit error (BENCHMARKS.md, INT8)."""
    keys = keys.float()
    offset = keys.mean(dim=0)
    power = (keys - offset).pow(2).mean(dim=0)  # [heads, dim]
    half = power.shape[-1] // 2
    paired = ((power[..., :half] + power[..., half:]) / 2).sqrt()
    smoothing = torch.cat([paired, paired], dim=-1)
    floor = smoothing.amax(dim=-1, keepdim=True) / 64
    return offset, torch.maximum(smoothing, floor).clamp(min=1e-12).sqrt()
