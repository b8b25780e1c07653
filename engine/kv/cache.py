"""The engine's paged KV cache: allocating its tensors (float, or INT8 with scales and a key smoothing
calibrated once, engine/kv/calibration.py) and copying blocks (copy-on-write). The layout and the writes
the kernels make into it: kernels/kv_cache.py."""

from __future__ import annotations

import torch
from tileinfer.engine.kv.block_manager import BlockCopy
from tileinfer.engine.kv.calibration import calibrate_key_smoothing, calibration_ids
from tileinfer.engine.models.decoder import Decoder
from tileinfer.kernels.kv_cache import Int8KVCache, KVCache, copy_kv_blocks


def allocate_kv_cache(
    decoder: Decoder,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    max_context: int,
    kv_cache_dtype: str = "auto",
    calibration_tokens: list[int] | None = None,
) -> KVCache:
    """[num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim] on the decoder's
    device, zeros. kv_cache_dtype "int8": an Int8KVCache whose key smoothing comes from eager prefills of
    calibration_tokens (default: ids spread over the vocabulary) of up to max_context tokens; run it
    before any CUDA graph is captured."""
    spec = decoder.spec
    device = decoder.model.embed_tokens.weight.device
    if kv_cache_dtype == "int8":
        kv_cache = Int8KVCache.allocate(
            spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, device
        )
        tokens = calibration_tokens or calibration_ids(None, decoder.logit_vocab_size)
        calibrate_key_smoothing(kv_cache, decoder, tokens, dtype, max_context)
        return kv_cache
    shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def copy_blocks(kv_cache: KVCache, copies: list[BlockCopy]) -> None:
    """Each copy's first num_slots slots of its source block into its destination, in every layer."""
    for copy in copies:
        copy_kv_blocks(kv_cache, copy.src_block, copy.dst_block, copy.num_slots)
