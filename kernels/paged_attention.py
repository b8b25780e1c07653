"""Attention over the paged KV cache for any number of new query tokens per sequence, causal: where each
sequence's queries and keys are (AttentionMetadata, one per forward step), and the torch reference, the
CPU's path and the ground truth of the Triton kernels (kernels/decode_attention.py for one query token per
sequence, kernels/prefill_attention.py for more)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from tileinfer.kernels.kv_cache import KVCache, gather_kv_reference

if TYPE_CHECKING:
    from tileinfer.kernels.decode_attention import DecodeWorkspace


@dataclasses.dataclass
class AttentionMetadata:
    """Where each sequence's queries and keys are, for one forward step over a batch of sequences.

    The new tokens of all sequences are packed along one axis; sequence i owns tokens
    query_start_loc[i]:query_start_loc[i+1], and they are the last ones of its seq_lens[i] positions.
    All tensors live on the model's device.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token; -1 writes nothing
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: cached + new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32: block ids, padded with 0
    is_decode: bool = False  # one query token per sequence: the split-KV decode kernel applies
    decode_num_splits: int | None = None  # fixed for a captured CUDA graph
    decode_workspace: DecodeWorkspace | None = None  # preallocated for a captured CUDA graph
    # The prefill/verify kernel (kernels/prefill_attention.py) sizes its grid from host ints only:
    max_query_len: int | None = None  # longest q_len; None: read from query_start_loc (a host sync)
    prefill_num_splits: int | None = None  # KV splits per query tile; fixed for a captured CUDA graph
    prefill_workspace: DecodeWorkspace | None = None  # its scratch when it splits (PrefillWorkspace)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


REFERENCE_QUERY_BLOCK = 256  # queries per score matrix in the reference: [heads, 256, keys] at most


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: KVCache,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> output of the same shape.

    kv_cache: one layer's [2, num_blocks, block_size, num_kv_heads, head_dim] (or its Int8KVCache),
    already holding the new tokens' keys and values. Heads share KV heads in groups (GQA). A query at
    position p sees keys at positions <= p, and with a sliding window only those > p - sliding_window.
    """
    num_heads = query.shape[1]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    output = torch.empty_like(query)
    starts = metadata.query_start_loc.tolist()
    for seq, seq_len in enumerate(metadata.seq_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        num_blocks = -(-seq_len // block_size)
        blocks = metadata.block_tables[seq, :num_blocks].long()
        keys = gather_kv_reference(kv_cache, 0, blocks).flatten(0, 1)[:seq_len]  # [seq_len, kv heads, dim]
        values = gather_kv_reference(kv_cache, 1, blocks).flatten(0, 1)[:seq_len]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        first_position = seq_len - (end - start)
        # queries in blocks, so that the score matrix of a long prompt stays small
        for block_start in range(start, end, REFERENCE_QUERY_BLOCK):
            block_end = min(block_start + REFERENCE_QUERY_BLOCK, end)
            last_key = first_position + block_end - start  # keys past the block's last query are masked
            q = query[block_start:block_end].float()  # [num_queries, num_heads, head_dim]
            scores = torch.einsum("qhd,khd->hqk", q, keys[:last_key]) * scale
            query_positions = torch.arange(
                first_position + block_start - start, last_key, device=query.device
            ).unsqueeze(1)
            key_positions = torch.arange(last_key, device=query.device).unsqueeze(0)
            visible = key_positions <= query_positions
            if sliding_window is not None:
                visible &= key_positions > query_positions - sliding_window
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            output[block_start:block_end] = torch.einsum("hqk,khd->qhd", probs, values[:last_key]).to(
                query.dtype
            )
    return output
