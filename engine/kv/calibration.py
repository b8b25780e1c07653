"""The INT8 KV cache's key smoothing (kernels/kv_cache.py), fixed once when the engine is built.

A fixed English passage (the model's own tokens for it; token ids spread over the vocabulary when there
is no tokenizer) runs through the model into a float cache of its own, at CALIBRATION_OFFSETS positions
spread over the context. Each layer's keys, after RoPE, give its offset (their mean) and smoothing (the
square root of the rest's RMS, per RoPE channel pair): tileinfer.kernels.kv_cache.smoothing_from_keys.

Why fixed at load, not from each prompt's first chunk: prefix reuse and copy-on-write share blocks
between sequences, so a block's keys must mean the same whichever sequence wrote them. Why positions
spread over the context: RoPE turns a key's constant part with the position, so a mean taken at
positions 0-255 alone would be stale at 30k for the pairs that turn slowly; over spread positions those
pairs average out, and what is taken out is what stays put at every position.
"""

from __future__ import annotations

import torch
from tileinfer.engine.models.decoder import Decoder
from tileinfer.engine.text.tokenizer import Tokenizer
from tileinfer.kernels.kv_cache import Int8KVCache, smoothing_from_keys
from tileinfer.kernels.paged_attention import AttentionMetadata

CALIBRATION_TOKENS = 256
CALIBRATION_OFFSETS = 4  # runs of the passage, at positions starting 0, 1/4, 1/2 and 3/4 into the context
CALIBRATION_TEXT = (
    "The river rose through the night, and by morning the old bridge stood alone in brown water. "
    "People came down from the hill with ropes and boards; nobody spoke much. A boy counted the "
    "arches aloud, one to seven, as his grandfather had taught him, and then counted again because the "
    "numbers would not stay still. In the town hall the clerk wrote each name into a ledger: who had a "
    "boat, who had bread, who needed a roof. Questions arrived faster than answers. How long would the "
    "road be closed? Could the school take the families from the lower street? What did the forecast "
    "say for Thursday? Nobody knew, so they made lists, shared tea, and waited for the water to fall. "
    "def mean(values):\n    return sum(values) / len(values)\n\nprint(mean([3, 5, 8]))\n"
    "By evening the level had dropped two metres, and the first lamps came on along the quay."
)


def calibration_ids(tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    """CALIBRATION_TOKENS token ids: the passage's, repeated to length; without a tokenizer, ids spread
    evenly over the vocabulary."""
    if tokenizer is not None:
        ids = tokenizer.encode(CALIBRATION_TEXT)
        ids = [token for token in ids if token < vocab_size] or [0]
    else:
        ids = [(position * 7919 + 1) % vocab_size for position in range(CALIBRATION_TOKENS)]
    return (ids * (CALIBRATION_TOKENS // len(ids) + 1))[:CALIBRATION_TOKENS]


@torch.inference_mode()
def calibrate_key_smoothing(
    kv_cache: Int8KVCache, decoder: Decoder, token_ids: list[int], dtype: torch.dtype, max_context: int
) -> None:
    """Set kv_cache's key offset and smoothing in place from eager prefills of token_ids (at most
    max_context), at CALIBRATION_OFFSETS starting positions; max_positions bounds the positions."""
    spec = decoder.spec
    device, block_size = kv_cache.device, kv_cache.shape[3]
    # a context of whole blocks may be longer than the model's positions
    token_ids = token_ids[: min(max_context, decoder.max_positions)]
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // block_size)
    shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    cache = torch.zeros(shape, dtype=dtype, device=device)
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        max_query_len=num_tokens,
    )
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    last_start = max(min(max_context, decoder.max_positions) - num_tokens, 0)
    runs = []
    for run in range(CALIBRATION_OFFSETS):
        start = last_start * run // CALIBRATION_OFFSETS
        decoder(ids, torch.arange(start, start + num_tokens, device=device), cache, metadata)
        runs.append(cache[:, 0].flatten(1, 2)[:, :num_tokens].clone())  # [layers, tokens, kv heads, dim]
    keys = torch.cat(runs, dim=1)
    for layer in range(spec.num_layers):
        offset, smoothing = smoothing_from_keys(keys[layer])
        kv_cache.key_offset[layer].copy_(offset)
        kv_cache.key_smoothing[layer].copy_(smoothing)
