"""Paged flash attention for any number of new query tokens per sequence (prefill, prefill chunks,
mixed batches, speculative verification): the Triton kernel of paged_attention_reference.

The reference (kernels/paged_attention.py) defines the math: query [num_tokens, num_heads, head_dim], the new
tokens of each sequence packed along one axis (query_start_loc) and sitting at the last q_len of its
seq_lens[i] positions; keys and values read through the block table; causal, optionally windowed.

How the kernel divides the work:
- A tile's BLOCK_M rows are (token, head) pairs: TOKENS = BLOCK_M // group consecutive query tokens
  times the `group` query heads that share one KV head, so each K/V tile is loaded once per group and a
  verify step (a few tokens) still fills the rows of a tensor-core tile.
- Each sequence owns a run of "virtual" query tiles, numbered from its last tokens backwards, so the
  first program of every sequence is its heaviest (it sees the most keys). Sequence i's run starts at
  query_start_loc[i] // TOKENS + i; the total, num_tokens // TOKENS + num_seqs, is a host int, and a
  program finds its sequence by a binary search over query_start_loc. A mixed batch of one long chunk
  and many one-token rows therefore launches about one program per tile, not max_q_len per sequence.
- Keys are visited in three ranges: tiles fully visible to every row (no mask), then the tiles at the
  causal diagonal and, with a sliding window, at the window's far edge (masked). Tiles no row sees
  are never loaded.
- When the grid is too small to fill the GPU (a verify step over a long context), the key range of
  each query tile is split among up to `num_splits` programs, as in split-KV decode: as many as its
  length needs (decode_min_keys_per_split keys each), so a short context runs one and the grid's
  other programs exit. Each writes partials and the last to finish (an atomic counter) merges them in
  split order.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from tileinfer.kernels.decode_attention import (
    DecodeWorkspace,
    cache_operands,
    deal_key_tiles,
    decode_min_keys_per_split,
    int8_kv_tile,
    kernel_strides,
    store_normalized,
)
from tileinfer.kernels.kv_cache import KVCache
from tileinfer.kernels.paged_attention import AttentionMetadata
from tileinfer.kernels.triton_common import INTERPRET, num_sms

MAX_PREFILL_SPLITS = 64


def prefill_block_m(max_query_len: int, group: int, head_dim: int) -> int:
    """Rows (token, head pairs) of a query tile: all of a short query's rows (verify: q_len * group),
    up to 128 for long ones (64 at head_dim 256, to stay in registers)."""
    largest = 64 if head_dim > 128 else 128
    rows = max(16, triton.next_power_of_2(max(max_query_len, 1) * group))
    return max(min(rows, largest), triton.next_power_of_2(group))


def prefill_block_n(block_m: int, head_dim: int) -> int:
    """Keys per tile: 64 for compute-bound prefill tiles; in few-row (verify) tiles, as many keys as a
    decode tile (16 KiB of bf16 K per tile) to keep enough bytes in flight."""
    if block_m >= 128:
        return 64 if head_dim <= 128 else 32
    return max(16, min(128, 8192 // head_dim))


def prefill_grid_tiles(num_tokens: int, num_seqs: int, max_query_len: int, group: int, head_dim: int) -> int:
    """Virtual query tiles of the grid (per KV head): num_tokens // TOKENS + num_seqs."""
    tokens_per_tile = prefill_block_m(max_query_len, group, head_dim) // group
    return num_tokens // tokens_per_tile + num_seqs


def prefill_num_splits(
    num_tokens: int, num_seqs: int, max_query_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
    max_context: int,
) -> int:  # fmt: skip
    """KV splits per query tile, from host ints only: about two programs per SM over the whole grid,
    never more splits than key tiles in the longest context the block table holds. 1 for a prefill
    big enough to fill the GPU by itself."""
    group = num_heads // num_kv_heads
    block_m = prefill_block_m(max_query_len, group, head_dim)
    # programs with work: about one tile per TOKENS tokens (the grid's extra tiles exit at once)
    busy_tiles = max(triton.cdiv(num_tokens, block_m // group), num_seqs)
    wanted = triton.cdiv(2 * num_sms(), busy_tiles * num_kv_heads)
    block_n = prefill_block_n(block_m, head_dim)
    max_tiles = max(triton.cdiv(max_context, block_n), 1)
    return max(1, min(wanted, max_tiles, MAX_PREFILL_SPLITS))


def allocate_prefill_workspace(
    max_num_tokens: int,
    max_num_seqs: int,
    max_query_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_splits: int,
    device: torch.device | str,
) -> DecodeWorkspace:
    """Scratch for `num_splits` > 1 (e.g. a CUDA-graph verify step): partials [tokens, heads, splits,
    head_dim + 2] fp32 and one zeroed counter per (query tile, KV head); the kernel leaves them at zero."""
    group = num_heads // num_kv_heads
    tiles = prefill_grid_tiles(max_num_tokens, max_num_seqs, max_query_len, group, head_dim)
    return DecodeWorkspace(
        partials=torch.empty(
            DecodeWorkspace.partials_numel(max_num_tokens, num_heads, head_dim, num_splits),
            dtype=torch.float32,
            device=device,
        ),
        counters=torch.zeros(tiles * num_kv_heads, dtype=torch.int32, device=device),
    )


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    q,  # [BLOCK_M, HEAD_DIM]
    k_base,
    v_base,
    k_scale_base,  # KV_INT8: this KV head's key scales (a slot's heads contiguous), then the values'
    v_scale_base,
    table_base,
    positions,  # [BLOCK_M] int32: each row's query position
    first_key,  # keys any row sees: [first_key, last_pos]; the others are not loaded (may be stale)
    last_pos,
    tile_lo,
    tile_hi,
    window,
    stride_block,
    stride_slot,
    stride_scale_block,
    stride_scale_slot,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of every tile is visible to every valid row
    KV_INT8: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over key tiles [tile_lo, tile_hi), in log2 units."""
    dims = tl.arange(0, HEAD_DIM)
    for tile in range(tile_lo, tile_hi):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if MASKED:
            key_mask = (keys >= first_key) & (keys <= last_pos)
            block_ids = tl.load(table_base + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
            slots = block_ids * stride_block + (keys % BLOCK_SIZE) * stride_slot  # [BLOCK_N]
            kv_offsets = slots[:, None] + dims[None, :]
            k = tl.load(k_base + kv_offsets, mask=key_mask[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
            v = tl.load(v_base + kv_offsets, mask=key_mask[:, None], other=0.0)
        else:
            key_mask = keys >= 0  # all of them
            block_ids = tl.load(table_base + keys // BLOCK_SIZE).to(tl.int64)
            slots = block_ids * stride_block + (keys % BLOCK_SIZE) * stride_slot
            kv_offsets = slots[:, None] + dims[None, :]
            k = tl.load(k_base + kv_offsets)
            v = tl.load(v_base + kv_offsets)
        if KV_INT8:
            k, v, k_scale, v_scale = int8_kv_tile(
                k, v, q, k_scale_base, v_scale_base, block_ids, keys, key_mask, stride_scale_block,
                stride_scale_slot, BLOCK_SIZE,
            )  # fmt: skip
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if KV_INT8:
            scores = scores * k_scale[None, :]
        if MASKED:
            visible = (keys[None, :] <= positions[:, None]) & (keys[None, :] > positions[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # a row that has seen no visible key yet keeps m = -inf: shift by 0 so no -inf - -inf appears
        m_shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(scores - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_INT8:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _merge_splits(
    partial_acc_ptr, partial_max_ptr, partial_sum_ptr, stat_slots, dims, row_mask, active,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """The unnormalised output and denominator over the first `active` splits' partials, in split order.
    Loads bypass L1 (.cg): they read other SMs' writes."""
    m_all = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_all = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_all = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for split in range(active):
        slots = stat_slots + split
        m_s = tl.load(partial_max_ptr + slots, mask=row_mask, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(partial_sum_ptr + slots, mask=row_mask, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(partial_acc_ptr + slots[:, None] * HEAD_DIM + dims[None, :], mask=row_mask[:, None],
                        other=0.0, cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m_all, m_s)
        m_shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_all - m_shift)
        beta = tl.exp2(m_s - m_shift)
        l_all = l_all * alpha + l_s * beta
        acc_all = acc_all * alpha[:, None] + acc_s * beta[:, None]
        m_all = m_new
    return acc_all, l_all


@triton.jit
def _paged_prefill_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]: float, or int8 (KV_INT8)
    kv_scale_ptr,  # fp32 [2, num_blocks, block_size, num_kv_heads] (KV_INT8): value = int8 * scale
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    partial_acc_ptr,  # fp32 [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM]: unnormalised outputs
    partial_max_ptr,  # fp32 [num_tokens, num_heads, NUM_SPLITS]: running max, log2 units
    partial_sum_ptr,  # fp32 [num_tokens, num_heads, NUM_SPLITS]: softmax denominators
    counters_ptr,  # int32 [num_tiles, num_kv_heads]: splits done, zero between launches
    qk_scale,  # softmax scale * log2(e)
    window,  # keys visible to a query: the sliding window, or a huge number
    num_seqs,
    num_kv_heads,
    search_steps,  # ceil(log2(num_seqs)): binary-search iterations
    stride_q_token,
    stride_q_head,
    stride_kv,
    stride_block,
    stride_slot,
    stride_kv_head,
    stride_scale_kv,
    stride_scale_block,
    stride_table_seq,
    stride_out_token,
    stride_out_head,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows: TOKENS tokens x GROUP heads, padded
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (page)
    NUM_SPLITS: tl.constexpr,  # splits in the grid: the most a query tile may use
    MIN_TILES: tl.constexpr,  # the fewest key tiles a used split takes
    KV_INT8: tl.constexpr = False,  # int8 keys and values, a scale per token and KV head
    UPCAST: tl.constexpr = INTERPRET,
    DOT_PRECISION: tl.constexpr = "tf32",  # "ieee" for an fp32 cache: exact fp32, not TF32
):
    TOKENS = BLOCK_M // GROUP  # query tokens per tile
    pid = tl.program_id(0)
    split = tl.program_id(1)
    kv_head = pid % num_kv_heads
    vtile = pid // num_kv_heads

    # The sequence owning this virtual tile: the last one whose run starts at or before it.
    lo = tl.full([], 0, dtype=tl.int32)
    hi = lo + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        starts_before = tl.load(query_start_loc_ptr + mid) // TOKENS + mid <= vtile
        lo = tl.where(starts_before, mid, lo)
        hi = tl.where(starts_before, hi, mid)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_from_end = vtile - (q_start // TOKENS + seq)
    tokens_end = q_len - tile_from_end * TOKENS  # this tile's tokens: [tokens_end - TOKENS, tokens_end)
    if tokens_end > 0:
        seq_len = tl.load(seq_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_M)
        tokens = tokens_end - TOKENS + rows // GROUP  # within the sequence's new tokens
        heads = kv_head * GROUP + rows % GROUP
        row_mask = (rows < TOKENS * GROUP) & (tokens >= 0)
        positions = tl.where(row_mask, seq_len - q_len + tokens, -1)  # padded rows see no key
        dims = tl.arange(0, HEAD_DIM)
        token_rows = (q_start + tokens).to(tl.int64)

        q_rows = token_rows * stride_q_token + heads * stride_q_head
        q = tl.load(query_ptr + q_rows[:, None] + dims[None, :], mask=row_mask[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        # Keys any row sees: [first_key, last_pos]. Tiles of keys every row sees: [full_lo, full_hi).
        first_pos = seq_len - q_len + tl.maximum(tokens_end - TOKENS, 0)
        last_pos = seq_len - 1 - tile_from_end * TOKENS
        first_key = tl.maximum(first_pos - window + 1, 0)
        tile_lo = first_key // BLOCK_N
        tile_hi = last_pos // BLOCK_N + 1
        full_lo = tl.minimum(tl.maximum((last_pos - window + 1 + BLOCK_N - 1) // BLOCK_N, tile_lo), tile_hi)
        full_hi = tl.maximum(tl.minimum((first_pos + 1) // BLOCK_N, tile_hi), full_lo)
        # This program's share of the key tiles (deal_key_tiles): a verify step's grid is sized for the
        # longest context its graph may see, and a short context leaves most splits idle.
        tiles_per_split, active = deal_key_tiles(tile_hi - tile_lo, MIN_TILES, NUM_SPLITS)
        split_lo = tile_lo + split * tiles_per_split
        split_hi = tl.minimum(split_lo + tiles_per_split, tile_hi)

        if split < active:  # the other programs of the tile exit at once
            k_base = kv_cache_ptr + kv_head * stride_kv_head
            v_base = k_base + stride_kv
            k_scale_base = kv_scale_ptr + kv_head
            v_scale_base = k_scale_base + stride_scale_kv
            table_base = block_tables_ptr + seq * stride_table_seq
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            # this share of the window's far edge, the fully visible middle, the causal diagonal
            edge_hi, middle_lo = tl.minimum(split_hi, full_lo), tl.maximum(split_lo, full_lo)
            middle_hi, diagonal_lo = tl.minimum(split_hi, full_hi), tl.maximum(split_lo, full_hi)
            acc, m_i, l_i = _attend_tiles(
                acc, m_i, l_i, q, k_base, v_base, k_scale_base, v_scale_base, table_base, positions,
                first_key, last_pos,
                split_lo, edge_hi, window, stride_block, stride_slot, stride_scale_block, num_kv_heads,
                qk_scale, HEAD_DIM, BLOCK_N, BLOCK_SIZE, True, KV_INT8, UPCAST, DOT_PRECISION,
            )  # fmt: skip
            acc, m_i, l_i = _attend_tiles(
                acc, m_i, l_i, q, k_base, v_base, k_scale_base, v_scale_base, table_base, positions,
                first_key, last_pos,
                middle_lo, middle_hi, window, stride_block, stride_slot, stride_scale_block, num_kv_heads,
                qk_scale, HEAD_DIM, BLOCK_N, BLOCK_SIZE, False, KV_INT8, UPCAST, DOT_PRECISION,
            )  # fmt: skip
            acc, m_i, l_i = _attend_tiles(
                acc, m_i, l_i, q, k_base, v_base, k_scale_base, v_scale_base, table_base, positions,
                first_key, last_pos,
                diagonal_lo, split_hi, window, stride_block, stride_slot, stride_scale_block, num_kv_heads,
                qk_scale, HEAD_DIM, BLOCK_N, BLOCK_SIZE, True, KV_INT8, UPCAST, DOT_PRECISION,
            )  # fmt: skip

            out_rows = (token_rows * stride_out_token + heads * stride_out_head)[:, None] + dims[None, :]
            if NUM_SPLITS == 1:  # noqa: SIM114 (constexpr: the merge below is not even compiled)
                store_normalized(out_ptr + out_rows, acc, l_i, row_mask[:, None])
            elif active == 1:  # a short key range: one split holds the whole answer, no partials
                store_normalized(out_ptr + out_rows, acc, l_i, row_mask[:, None])
            else:
                # Every active split writes its partials (a row with no visible key in its share: m = -inf,
                # l = 0), then counts itself in; the active-th to arrive merges, in split order. The barrier
                # makes all threads' writes precede the release by the atomic.
                num_heads = num_kv_heads * GROUP
                stat_slots = (token_rows * num_heads + heads) * NUM_SPLITS  # [BLOCK_M] int64, split 0
                tl.store(partial_acc_ptr + (stat_slots + split)[:, None] * HEAD_DIM + dims[None, :], acc,
                         mask=row_mask[:, None])  # fmt: skip
                tl.store(partial_max_ptr + stat_slots + split, m_i, mask=row_mask)
                tl.store(partial_sum_ptr + stat_slots + split, l_i, mask=row_mask)
                tl.debug_barrier()
                done_before = tl.atomic_add(counters_ptr + pid, 1, sem="acq_rel", scope="gpu")
                if done_before == active - 1:
                    acc, l_i = _merge_splits(
                        partial_acc_ptr, partial_max_ptr, partial_sum_ptr, stat_slots, dims, row_mask, active,
                        BLOCK_M, HEAD_DIM,
                    )  # fmt: skip
                    store_normalized(out_ptr + out_rows, acc, l_i, row_mask[:, None])
                    tl.store(counters_ptr + pid, 0)  # ready for the next launch (graph replay)


def paged_prefill_attention_triton(
    query: torch.Tensor,
    kv_cache: KVCache,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_attention_reference on the GPU, in one launch (see the module docstring).

    query [num_tokens, num_heads, head_dim] (query_start_loc[-1] == num_tokens) -> the same shape.
    head_dim a power of two, 16..256. Host ints from metadata: max_query_len (None: one host read of
    query_start_loc) and prefill_num_splits (None: prefill_num_splits() from shapes). With more than
    one split it uses metadata.prefill_workspace (allocate_prefill_workspace), or allocates one.
    CUDA-graph safe when max_query_len, prefill_num_splits, `out` and (splits > 1) the workspace are
    given: the grid comes from shapes and those ints only, never from the tensors' values.
    max_query_len only picks the tile shape: any value gives the right answer (the grid always covers
    every token), so a captured verify graph may pass its largest q_len. An INT8 cache (Int8KVCache) is
    read as int8 with its scales.
    """
    kv_cache, scales = cache_operands(query, kv_cache)
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    assert head_dim in (16, 32, 64, 128, 256), f"head_dim {head_dim}: a power of two 16..256"
    block_tables, seq_lens = metadata.block_tables, metadata.seq_lens
    query_start_loc = metadata.query_start_loc
    assert block_tables.stride(1) == 1 and seq_lens.is_contiguous() and query_start_loc.is_contiguous()
    group = num_heads // num_kv_heads
    num_seqs = metadata.num_seqs
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(2) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    max_query_len = metadata.max_query_len
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    num_splits = metadata.prefill_num_splits
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = prefill_num_splits(
            num_tokens, num_seqs, max_query_len, num_heads, num_kv_heads, head_dim, max_context
        )
    block_m = prefill_block_m(max_query_len, group, head_dim)
    block_n = prefill_block_n(block_m, head_dim)
    num_tiles = prefill_grid_tiles(num_tokens, num_seqs, max_query_len, group, head_dim)

    if num_splits > 1:
        workspace = metadata.prefill_workspace
        if workspace is None:
            shape = (num_tokens, num_seqs, max_query_len, num_heads, num_kv_heads, head_dim, num_splits)
            workspace = allocate_prefill_workspace(*shape, query.device)
        counters = workspace.counters
        partial_acc, partial_max, partial_sum = workspace.split_partials(
            num_tokens, num_heads, head_dim, num_splits, num_tiles * num_kv_heads
        )
    else:  # not touched by the kernel
        partial_acc = partial_max = partial_sum = out
        counters = seq_lens

    _paged_prefill_kernel[(num_tiles * num_kv_heads, num_splits)](
        query,
        kv_cache,
        scales if scales is not None else out,  # never read without KV_INT8
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        partial_acc,
        partial_max,
        partial_sum,
        counters,
        scale * math.log2(math.e),
        sliding_window if sliding_window else 2**31 - 1,
        num_seqs,
        num_kv_heads,
        max(num_seqs - 1, 0).bit_length(),
        *kernel_strides(query, kv_cache, scales, block_tables, out),
        GROUP=group,
        KV_INT8=scales is not None,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        MIN_TILES=triton.cdiv(decode_min_keys_per_split(head_dim), block_n),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=8 if block_m * head_dim >= 128 * 128 else 4,  # the fp32 accumulator's registers
        num_stages=2 if head_dim > 128 else 3,
    )
    return out
