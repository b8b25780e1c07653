"""Random paged KV caches for the attention kernels' tests, poisoned where a kernel must not read.

Each sequence's blocks are scattered over the cache (shuffled block ids). The poisoned copy holds NaN
wherever no query of a sequence may look: slots before its first visible key, blocks no sequence owns,
and the trap block that pads every block-table row. An unmasked load then shows up as a NaN.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class PagedCache:
    query: torch.Tensor  # [num_query_rows, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, head_dim], clean: the reference reads it
    poisoned_cache: torch.Tensor  # NaN wherever the kernel must not look
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with the trap block


def paged_cache(
    seq_lens: list[int],
    first_keys: list[int],
    num_query_rows: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    max_blocks: int | None = None,
    padded: bool = False,
) -> PagedCache:
    """Sequence i holds seq_lens[i] keys, of which its queries may see first_keys[i] onwards. Block-table
    rows have max_blocks entries (default: the longest sequence's, plus a trap entry at least when
    `padded`). On the CPU; the caller moves what it needs."""
    blocks_needed = [-(-seq_len // block_size) for seq_len in seq_lens]
    max_blocks = max_blocks or max(max(blocks_needed), 1) + int(padded)
    num_blocks = sum(blocks_needed) + 3  # two unused blocks and the trap block
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=generator).to(dtype)
    query = torch.randn(num_query_rows, num_heads, head_dim, generator=generator).to(dtype)

    trap = num_blocks - 1
    order = torch.randperm(num_blocks - 1, generator=generator).tolist()
    block_tables = torch.full((len(seq_lens), max_blocks), trap, dtype=torch.int32)
    poisoned = torch.full_like(kv_cache, float("nan"))
    clean_slots = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_blocks * block_size, ...]
    poisoned_slots = poisoned.view(2, -1, num_kv_heads, head_dim)
    for seq, (seq_len, first_key, needed) in enumerate(zip(seq_lens, first_keys, blocks_needed, strict=True)):
        blocks, order = torch.tensor(order[:needed], dtype=torch.int64), order[needed:]
        block_tables[seq, :needed] = blocks.int()
        keys = torch.arange(first_key, seq_len)
        slots = blocks[keys // block_size] * block_size + keys % block_size
        poisoned_slots[:, slots] = clean_slots[:, slots]
    return PagedCache(query, kv_cache, poisoned, block_tables)
