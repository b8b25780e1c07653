"""Attention over the paged KV cache: any number of new query tokens per sequence, causal."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class AttentionMetadata:
    """Where each sequence's queries and keys are, for one forward step over a batch of sequences.

    The new tokens of all sequences are packed along one axis; sequence i owns tokens
    query_start_loc[i]:query_start_loc[i+1], and they are the last ones of its seq_lens[i] positions.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, on the host
    seq_lens: torch.Tensor  # [num_seqs] int32, on the host: cached + new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32: block ids, padded with 0

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> output of the same shape.

    kv_cache: one layer's [2, num_blocks, block_size, num_kv_heads, head_dim], already holding
    the new tokens' keys and values. Heads share KV heads in groups (GQA). A query at position p
    sees keys at positions <= p, and with a sliding window only those > p - sliding_window.
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
        keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len].float()  # [seq_len, num_kv_heads, head_dim]
        values = kv_cache[1, blocks].flatten(0, 1)[:seq_len].float()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        q = query[start:end].float()  # [num_queries, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        query_positions = torch.arange(seq_len - (end - start), seq_len, device=query.device).unsqueeze(1)
        key_positions = torch.arange(seq_len, device=query.device).unsqueeze(0)
        visible = key_positions <= query_positions
        if sliding_window is not None:
            visible &= key_positions > query_positions - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        output[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
    return output
