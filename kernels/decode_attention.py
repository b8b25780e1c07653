"""Paged decode attention: one query token per sequence, as a split-KV Triton kernel (FlashDecoding-style)
with its torch reference; the split plan and workspace, and the tile helpers the prefill kernel shares.
Any number of query tokens per sequence: kernels/paged_attention.py (the reference) and
kernels/prefill_attention.py (the kernel)."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from tileinfer.kernels.kv_cache import Int8KVCache, KVCache
from tileinfer.kernels.paged_attention import AttentionMetadata, paged_attention_reference
from tileinfer.kernels.triton_common import INTERPRET, num_sms

# ---------------------------------------------------------------------------------------------
# Paged decode attention: one query token per sequence (split-KV, FlashDecoding-style).
# ---------------------------------------------------------------------------------------------


def paged_decode_attention_reference(
    query: torch.Tensor,
    kv_cache: KVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
) -> torch.Tensor:
    """query [num_seqs, num_heads, head_dim], one token per sequence -> output of the same shape.

    Sequence i's query sits at position seq_lens[i] - 1 and attends to its keys 0..seq_lens[i] - 1
    (its own key is already in kv_cache), or only the last `sliding_window` of them. A sequence
    with seq_len 0 (a padded slot of a CUDA-graph batch) gets zeros. kv_cache is one layer's
    [2, num_blocks, block_size, num_kv_heads, head_dim]; block_tables [num_seqs, max_blocks] int32.
    num_splits and workspace only shape how the Triton kernel divides the work; the math is the same,
    so they are ignored here. This is the CPU path: it reads seq_lens on the host.
    """
    del num_splits, workspace
    num_seqs = query.shape[0]
    seq_lens_host = seq_lens.to("cpu", torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=seq_lens_host.clamp(min=1),  # seq_len 0 is computed as 1 and zeroed below
        block_tables=block_tables,
    )
    output = paged_attention_reference(query, kv_cache, metadata, scale, sliding_window)
    output[seq_lens_host.to(query.device) == 0] = 0
    if out is None:
        return output
    out.copy_(output)
    return out


MAX_DECODE_SPLITS = 128  # bounds the workspace: partials per (sequence, KV head)
# The default split count stays within this, so that the merge reads every split's partials in one
# pass (one round trip to L2) for GQA groups up to 4 at head_dim 128: 32 splits x 4 rows x 128 fp32.
DEFAULT_MAX_SPLITS = 32
MERGE_ELEMENTS = 16384  # fp32 partials the merge holds at once: 128 registers a thread at 4 warps
DECODE_STAGES = 3  # K/V tiles in the kernel's software pipeline: two in flight while one is computed


def decode_block_n(head_dim: int) -> int:
    """Keys per inner-loop tile of the decode kernel: 16 KiB of bf16 K (and as much V) per tile.

    Big tiles keep enough bytes in flight with ~2 programs per SM even where Triton does not
    software-pipeline the gathered K/V loads (compiled for sm_90: 112 registers, no spills, K/V
    through cp.async, when the cache strides are multiples of 16 as they are for head_dim 64/128).
    """
    return max(16, min(128, 8192 // head_dim))


def decode_min_keys_per_split(head_dim: int) -> int:
    """The fewest keys a split takes at run time (a shorter sequence uses fewer splits).

    That is the tiles the pipeline requests together (DECODE_STAGES - 1; 64 KiB of bf16 K/V at
    head_dim 128): a split this size costs one memory round trip, like a smaller one, so smaller
    splits would only add programs and partials to merge. Above it, more splits shorten the stream
    each program reads, which is what bounds a long context.
    """
    return (DECODE_STAGES - 1) * decode_block_n(head_dim)


class DecodeTile(NamedTuple):
    """The decode kernel's launch shape: keys per tile, the fewest tiles a used split takes, warps and
    pipeline stages. decode_tile() gives the default; bench/bench_attention.py --sweep-decode tries
    others."""

    block_n: int
    min_tiles: int
    num_warps: int
    num_stages: int


def decode_tile(head_dim: int) -> DecodeTile:
    block_n = decode_block_n(head_dim)
    return DecodeTile(block_n, decode_min_keys_per_split(head_dim) // block_n, 4, DECODE_STAGES)


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, head_dim: int) -> int:
    """The most KV splits a (sequence, KV head) may use, from shapes only (CUDA graphs fix the grid).

    Aim for about two programs per SM over the whole grid when every sequence is long (K/V bytes in
    flight from two pipelines per SM), but never more splits than a sequence of max_context keys would
    use (decode_min_keys_per_split each), nor more than DEFAULT_MAX_SPLITS (a one-pass merge).
    At run time each sequence uses only as many of them as its own length needs (at least
    decode_min_keys_per_split keys each), and the programs left without keys exit at once.
    In a small batch of mixed lengths (one 32k context among short ones) the longest sequence alone
    sets the step's time, so it gets enough splits to cover every SM by itself (num_sms / kv heads),
    as long as the grid stays under 8 programs per SM: idle programs cost a launch slot each.
    """
    programs = max(num_seqs * num_kv_heads, 1)
    one_sequence_fills = min(triton.cdiv(num_sms(), num_kv_heads), triton.cdiv(8 * num_sms(), programs))
    wanted = max(triton.cdiv(2 * num_sms(), programs), one_sequence_fills)
    most_useful = max(triton.cdiv(max_context, decode_min_keys_per_split(head_dim)), 1)
    return max(1, min(wanted, most_useful, DEFAULT_MAX_SPLITS))


def decode_splits_used(
    seq_len: int,
    num_splits: int,
    head_dim: int,
    sliding_window: int | None = None,
    tile: DecodeTile | None = None,
) -> int:
    """How many of its num_splits a sequence of seq_len keys uses in the kernel (0 for an empty one):
    the kernel's own rule, mirrored on the host for tests and benchmarks. Whole tiles of block_n keys,
    at least min_tiles tiles a split, dealt evenly (tile: default decode_tile(head_dim))."""
    block_n, min_tiles, _, _ = tile or decode_tile(head_dim)
    first_tile = max(seq_len - sliding_window, 0) // block_n if sliding_window else 0
    num_tiles = -(-seq_len // block_n) - first_tile
    wanted = min(max(-(-num_tiles // min_tiles), 1), num_splits)
    tiles_per_split = max(-(-num_tiles // wanted), 1)
    return -(-num_tiles // tiles_per_split)


@dataclasses.dataclass
class DecodeWorkspace:
    """Scratch of the split-KV decode kernel. Preallocate it once for a CUDA graph (`allocate`).

    partials holds each split's unnormalised output, running max and sum; counters counts the
    splits of a (sequence, KV head) that are done, so that the last one merges them. Counters start
    at zero and every launch leaves them at zero again.
    """

    partials: torch.Tensor  # fp32, flat: outputs [num_seqs, num_heads, num_splits, head_dim], then max, sum
    counters: torch.Tensor  # int32 [num_seqs * num_kv_heads], zeros

    @staticmethod
    def partials_numel(num_seqs: int, num_heads: int, head_dim: int, num_splits: int) -> int:
        return num_seqs * num_heads * num_splits * (head_dim + 2)

    def split_partials(
        self, num_rows: int, num_heads: int, head_dim: int, num_splits: int, num_counters: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of the partials for num_rows query rows: (outputs, running maxima, sums)."""
        numel = self.partials_numel(num_rows, num_heads, head_dim, num_splits)
        partials, counters = self.partials, self.counters
        assert partials.dtype == torch.float32 and partials.is_contiguous() and partials.numel() >= numel
        assert counters.dtype == torch.int32 and counters.numel() >= num_counters
        num_stats = num_rows * num_heads * num_splits
        return (
            partials[: num_stats * head_dim],
            partials[num_stats * head_dim : num_stats * (head_dim + 1)],
            partials[num_stats * (head_dim + 1) : num_stats * (head_dim + 2)],
        )

    @classmethod
    def allocate(
        cls,
        max_num_seqs: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_context: int,
        device: torch.device | str,
        num_splits: int | None = None,
    ) -> DecodeWorkspace:
        """Large enough for every batch of up to max_num_seqs sequences whose block table holds
        max_context keys, with the default num_splits (decode_num_splits) or the one given."""
        numel = max(
            cls.partials_numel(
                num_seqs,
                num_heads,
                head_dim,
                num_splits or decode_num_splits(num_seqs, num_kv_heads, max_context, head_dim),
            )
            for num_seqs in range(1, max_num_seqs + 1)
        )
        return cls(
            partials=torch.empty(numel, dtype=torch.float32, device=device),
            counters=torch.zeros(max_num_seqs * num_kv_heads, dtype=torch.int32, device=device),
        )


@triton.jit
def deal_key_tiles(num_tiles, MIN_TILES: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """How a query's num_tiles key tiles are dealt to the splits of a split-KV grid: its length, not the
    grid, sets how many it uses (MIN_TILES tiles each at least, NUM_SPLITS at most). Returns (tiles per
    split, splits used); split s takes the tiles from s * tiles per split, and splits past the used
    ones (all of them when num_tiles is 0) have nothing to do. decode_splits_used is the host's twin."""
    splits_used = tl.minimum(tl.maximum((num_tiles + MIN_TILES - 1) // MIN_TILES, 1), NUM_SPLITS)
    tiles_per_split = tl.maximum((num_tiles + splits_used - 1) // splits_used, 1)
    return tiles_per_split, (num_tiles + tiles_per_split - 1) // tiles_per_split


@triton.jit
def int8_kv_tile(
    k, v, q, k_scale_base, v_scale_base, block_ids, keys, key_mask, stride_scale_block, stride_scale_slot,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """An INT8 cache's key and value tiles in q's dtype (exact: |int8| <= 127), and each key's and value's
    scale [BLOCK_N], which the caller applies per column (scores * k_scale, p * v_scale)."""
    scale_offsets = block_ids * stride_scale_block + (keys % BLOCK_SIZE) * stride_scale_slot
    k_scale = tl.load(k_scale_base + scale_offsets, mask=key_mask, other=0.0)
    v_scale = tl.load(v_scale_base + scale_offsets, mask=key_mask, other=0.0)
    return k.to(q.dtype), v.to(q.dtype), k_scale, v_scale


@triton.jit
def store_normalized(out_ptrs, acc, l_sum, mask):
    """out = acc / l_sum in out's dtype, zeros where nothing was summed (an empty sequence, a padded row)."""
    denom = tl.where(l_sum > 0.0, l_sum, 1.0)
    tl.store(out_ptrs, (acc / denom[:, None]).to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _store_normalized(out_ptr, stride_out_seq, stride_out_head, seq, heads, dims, mask, acc, l_sum):
    """out[seq, heads] = acc / l_sum (store_normalized)."""
    o_ptrs = out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :]
    store_normalized(o_ptrs, acc, l_sum, mask)


@triton.jit
def decode_attention_program(
    seq,  # the program's (sequence, KV head, split): its ids, or a persistent kernel's work item
    kv_head,
    split,
    num_kv_heads,
    query_ptr,  # [num_seqs, num_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]: float, or int8 (KV_INT8)
    kv_scale_ptr,  # fp32 [2, num_blocks, block_size, num_kv_heads] (KV_INT8): value = int8 * scale
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_heads, head_dim]
    partial_acc_ptr,  # fp32 [num_seqs, num_kv_heads, NUM_SPLITS, GROUP, HEAD_DIM]: unnormalised outputs
    partial_max_ptr,  # fp32 [num_seqs, num_kv_heads, NUM_SPLITS, GROUP]: running max, log2 units
    partial_sum_ptr,  # fp32 [num_seqs, num_kv_heads, NUM_SPLITS, GROUP]: softmax denominators
    counters_ptr,  # int32 [num_seqs, num_kv_heads]: splits done so far, zero between launches
    qk_scale,  # softmax scale * log2(e)
    window,  # keys visible to a query: the sliding window, or a huge number
    stride_q_seq,
    stride_q_head,
    stride_kv,
    stride_block,
    stride_slot,
    stride_kv_head,
    stride_scale_kv,
    stride_scale_block,
    stride_table_seq,
    stride_out_seq,
    stride_out_head,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP padded to a power of two >= 16 (the M of tl.dot)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (page)
    BLOCK_N: tl.constexpr,  # keys per tile
    NUM_SPLITS: tl.constexpr,  # splits in the grid: the most a sequence may use
    MIN_TILES: tl.constexpr,  # the fewest tiles a used split takes (decode_min_keys_per_split)
    MERGE_ROWS: tl.constexpr,  # GROUP padded to a power of two (rows of the merge)
    SPLIT_CHUNK: tl.constexpr,  # splits merged per step
    KV_INT8: tl.constexpr = False,  # int8 keys and values, a scale per token and KV head
    UPCAST: tl.constexpr = INTERPRET,
    DOT_PRECISION: tl.constexpr = "tf32",  # "ieee" for an fp32 cache: exact fp32, not TF32
):
    rows = tl.arange(0, GROUP_PAD)  # the query heads sharing this KV head, packed into M
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    out_mask = row_mask[:, None] & dim_mask[None, :]

    # The sequence's visible keys [first_key, seq_len) in whole tiles. Its length, not the grid, sets
    # how many splits it uses (at least MIN_TILES tiles each, at most NUM_SPLITS); the tiles are dealt
    # evenly to the first `active` splits, every tile they get holds a visible key, and the programs
    # of the other splits exit at once.
    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = tl.maximum(seq_len - window, 0)
    first_tile = first_key // BLOCK_N
    num_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N - first_tile
    tiles_per_split, active = deal_key_tiles(num_tiles, MIN_TILES, NUM_SPLITS)
    tile_begin = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, first_tile + num_tiles)

    if split < active:
        q_ptrs = query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :]
        q = tl.load(q_ptrs, mask=out_mask, other=0.0)  # [GROUP_PAD, BLOCK_D]
        if UPCAST:
            q = q.to(tl.float32)
        k_base = kv_cache_ptr + kv_head * stride_kv_head
        v_base = k_base + stride_kv
        k_scale_base = kv_scale_ptr + kv_head  # a slot's scales are its num_kv_heads contiguous ones
        v_scale_base = k_scale_base + stride_scale_kv
        table_base = block_tables_ptr + seq * stride_table_seq

        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
        for tile in range(tile_begin, tile_end):
            keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            key_mask = (keys >= first_key) & (keys < seq_len)
            block_ids = tl.load(table_base + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
            # int64 offsets: a large cache holds more than 2^31 elements per layer
            row_offsets = block_ids * stride_block + (keys % BLOCK_SIZE) * stride_slot  # [BLOCK_N]
            kv_offsets = row_offsets[:, None] + dims[None, :]
            kv_mask = key_mask[:, None] if BLOCK_D == HEAD_DIM else key_mask[:, None] & dim_mask[None, :]
            # both loads issued before any math: V's addresses do not depend on the scores
            k = tl.load(k_base + kv_offsets, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_base + kv_offsets, mask=kv_mask, other=0.0)
            if KV_INT8:  # a slot's scales: its KV heads', contiguous
                k, v, k_scale, v_scale = int8_kv_tile(
                    k, v, q, k_scale_base, v_scale_base, block_ids, keys, key_mask, stride_scale_block,
                    num_kv_heads, BLOCK_SIZE,
                )  # fmt: skip
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)

            # [GROUP_PAD, BLOCK_N], log2 units
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            if KV_INT8:
                scores = scores * k_scale[None, :]
            scores = tl.where(key_mask[None, :], scores, float("-inf"))
            # each tile holds a visible key, so m_new is finite: no -inf - -inf
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if KV_INT8:
                p = p * v_scale[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        if NUM_SPLITS == 1:  # noqa: SIM114 (constexpr: the merge below is not even compiled)
            _store_normalized(out_ptr, stride_out_seq, stride_out_head, seq, heads, dims, out_mask, acc, l_i)
        elif active == 1:  # a short sequence: its one split holds the whole answer, no partials
            _store_normalized(out_ptr, stride_out_seq, stride_out_head, seq, heads, dims, out_mask, acc, l_i)
        else:
            pair = seq * num_kv_heads + kv_head
            stat_slots = (pair * NUM_SPLITS + split).to(tl.int64) * GROUP + rows  # [GROUP_PAD]
            acc_ptrs = partial_acc_ptr + stat_slots[:, None] * HEAD_DIM + dims[None, :]
            tl.store(acc_ptrs, acc, mask=out_mask)
            tl.store(partial_max_ptr + stat_slots, m_i, mask=row_mask)
            tl.store(partial_sum_ptr + stat_slots, l_i, mask=row_mask)
            # Every thread's partials are written (barrier) before one thread releases them with the
            # counter; the program that brings the count to `active` acquires them all and merges.
            tl.debug_barrier()
            done_before = tl.atomic_add(counters_ptr + pair, 1, sem="acq_rel", scope="gpu")
            if done_before == active - 1:
                _merge_splits(
                    out_ptr,
                    partial_acc_ptr,
                    partial_max_ptr,
                    partial_sum_ptr,
                    stride_out_seq,
                    stride_out_head,
                    seq,
                    kv_head,
                    pair,
                    active,
                    GROUP,
                    HEAD_DIM,
                    BLOCK_D,
                    NUM_SPLITS,
                    MERGE_ROWS,
                    SPLIT_CHUNK,
                )
                tl.store(counters_ptr + pair, 0)  # ready for the next launch (graph replay)
    elif (split == 0) & (num_tiles == 0):
        # a padded slot (seq_len 0): zeros, and no key is read
        zeros = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
        no_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
        _store_normalized(out_ptr, stride_out_seq, stride_out_head, seq, heads, dims, out_mask, zeros, no_sum)


@triton.jit
def _paged_decode_kernel(
    query_ptr, kv_cache_ptr, kv_scale_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, partial_acc_ptr,
    partial_max_ptr, partial_sum_ptr, counters_ptr, qk_scale, window, stride_q_seq, stride_q_head, stride_kv,
    stride_block, stride_slot, stride_kv_head, stride_scale_kv, stride_scale_block, stride_table_seq,
    stride_out_seq, stride_out_head, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MIN_TILES: tl.constexpr, MERGE_ROWS: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
    KV_INT8: tl.constexpr = False, UPCAST: tl.constexpr = INTERPRET, DOT_PRECISION: tl.constexpr = "tf32",
):  # fmt: skip
    # Grid: (sequence, KV head, split)
    decode_attention_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(1), query_ptr, kv_cache_ptr,
        kv_scale_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, partial_acc_ptr, partial_max_ptr,
        partial_sum_ptr, counters_ptr, qk_scale, window, stride_q_seq, stride_q_head, stride_kv, stride_block,
        stride_slot, stride_kv_head, stride_scale_kv, stride_scale_block, stride_table_seq, stride_out_seq,
        stride_out_head, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, NUM_SPLITS, MIN_TILES,
        MERGE_ROWS, SPLIT_CHUNK, KV_INT8, UPCAST, DOT_PRECISION,
    )  # fmt: skip


@triton.jit
def _merge_splits(
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    stride_out_seq,
    stride_out_head,
    seq,
    kv_head,
    pair,
    active,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
):
    """out = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s over the `active` splits only, SPLIT_CHUNK
    at a time with a running max (one pass: each chunk's max, sum and outputs load together), in split
    order, so the result is deterministic whichever program arrives last. Loads bypass L1 (.cg): they
    read other SMs' writes."""
    rows = tl.arange(0, MERGE_ROWS)
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    first_slot = (pair * NUM_SPLITS).to(tl.int64)
    chunk = tl.arange(0, SPLIT_CHUNK)

    m_run = tl.full([MERGE_ROWS], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([MERGE_ROWS], dtype=tl.float32)
    acc = tl.zeros([MERGE_ROWS, BLOCK_D], dtype=tl.float32)
    for first in range(0, active, SPLIT_CHUNK):  # usually one step
        slots = (first_slot + first + chunk[:, None]) * GROUP + rows[None, :]  # [SPLIT_CHUNK, MERGE_ROWS]
        mask = (first + chunk[:, None] < active) & row_mask[None, :]
        m_chunk = tl.load(partial_max_ptr + slots, mask=mask, other=float("-inf"), cache_modifier=".cg")
        l_chunk = tl.load(partial_sum_ptr + slots, mask=mask, other=0.0, cache_modifier=".cg")
        acc_mask = mask[:, :, None] & dim_mask[None, None, :]
        partial = tl.load(
            partial_acc_ptr + slots[:, :, None] * HEAD_DIM + dims[None, None, :],
            mask=acc_mask,
            other=0.0,
            cache_modifier=".cg",
        )  # [SPLIT_CHUNK, MERGE_ROWS, BLOCK_D]
        m_new = tl.maximum(m_run, tl.max(m_chunk, axis=0))
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # padded rows: every weight exp2(-inf) = 0
        alpha = tl.exp2(m_run - m_new)
        weights = tl.exp2(m_chunk - m_new[None, :])  # [SPLIT_CHUNK, MERGE_ROWS]
        l_run = l_run * alpha + tl.sum(weights * l_chunk, axis=0)
        acc = acc * alpha[:, None] + tl.sum(partial * weights[:, :, None], axis=0)
        m_run = m_new

    heads = kv_head * GROUP + rows
    mask = row_mask[:, None] & dim_mask[None, :]
    _store_normalized(out_ptr, stride_out_seq, stride_out_head, seq, heads, dims, mask, acc, l_run)


def cache_operands(query: torch.Tensor, kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cache as the attention kernels read it: its values (an Int8KVCache's int8 ones) and its scales
    (None but for int8), checked against the query's heads and head size."""
    scales = kv_cache.scales if isinstance(kv_cache, Int8KVCache) else None
    if scales is not None:
        kv_cache = kv_cache.values
        assert scales.is_contiguous() and kv_cache.is_contiguous()
    num_heads, head_dim = query.shape[1], query.shape[2]
    assert kv_cache.shape[0] == 2 and kv_cache.shape[4] == head_dim and num_heads % kv_cache.shape[3] == 0
    assert query.stride(2) == 1 and kv_cache.stride(4) == 1
    return kv_cache, scales


def kernel_strides(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    scales: torch.Tensor | None,
    block_tables: torch.Tensor,
    out: torch.Tensor,
) -> tuple[int, ...]:
    """The strides the attention kernels take, in their order: the query's (token, head), the cache's (K/V,
    block, slot, head), the scales' (0, 0 without), the block table's and the output's (token, head)."""
    scale_strides = (scales.stride(0), scales.stride(1)) if scales is not None else (0, 0)
    return (
        query.stride(0), query.stride(1), *kv_cache.stride()[:4], *scale_strides, block_tables.stride(0),
        out.stride(0), out.stride(1),
    )  # fmt: skip


def paged_decode_attention_triton(
    query: torch.Tensor,
    kv_cache: KVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    tile: DecodeTile | None = None,
) -> torch.Tensor:
    """paged_decode_attention_reference on the GPU, in one launch: split-KV over the pages, merged by
    the last split to finish. tile: the launch shape (default decode_tile(head_dim)).

    Grid (num_seqs, num_kv_heads, num_splits). A program reads its KV head's keys and values once for
    all the query heads that share them (the GQA group is the M of tl.dot), over its share of the
    sequence's pages, with an online softmax in fp32. num_splits is the most splits a sequence may
    use; each sequence uses as many as its own length needs (decode_min_keys_per_split keys or more
    each), so a short context runs few programs and a 32k one all of them. A sequence that uses one
    split is written directly; otherwise each split writes partials to the workspace and the last one
    (an atomic counter) merges the used ones in split order, so the result is deterministic.
    CUDA-graph safe: no host sync; no allocation when `out` and, for num_splits > 1, `workspace`
    (DecodeWorkspace.allocate) are given; the grid depends on shapes and num_splits only, never on
    seq_lens' values. Without a workspace one is allocated per call. An INT8 cache (Int8KVCache) is read as
    int8 with its scales.
    """
    if out is None:
        out = torch.empty_like(query)
    launch = decode_launch(query, kv_cache, block_tables, seq_lens, scale, sliding_window, num_splits, out,
                           workspace, tile)  # fmt: skip
    if query.shape[0] > 0:
        _paged_decode_kernel[(query.shape[0], launch.num_kv_heads, launch.constexprs["NUM_SPLITS"])](
            *launch.arguments, **launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages
        )
    return out


class DecodeLaunch(NamedTuple):
    """What decode_attention_program takes after (seq, KV head, split, num_kv_heads): its operands and
    scalars in order, then its constexprs; and the launch's warps and stages."""

    num_kv_heads: int
    arguments: tuple
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int


def decode_launch(
    query: torch.Tensor,
    kv_cache: KVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    num_splits: int | None,
    out: torch.Tensor,
    workspace: DecodeWorkspace | None,
    tile: DecodeTile | None = None,
) -> DecodeLaunch:
    """The split-KV decode kernel's launch (paged_decode_attention_triton's, and the persistent decode
    kernel's attention): the workspace's partials, or one allocated when none is given."""
    kv_cache, scales = cache_operands(query, kv_cache)
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    assert block_tables.stride(1) == 1 and seq_lens.is_contiguous()
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, block_tables.shape[1] * block_size, head_dim)
    assert 1 <= num_splits <= MAX_DECODE_SPLITS
    assert out.shape == query.shape and out.stride(2) == 1

    if num_splits > 1:
        numel = DecodeWorkspace.partials_numel(num_seqs, num_heads, head_dim, num_splits)
        if workspace is None:
            workspace = DecodeWorkspace(
                partials=torch.empty(numel, dtype=torch.float32, device=query.device),
                counters=torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32, device=query.device),
            )
        counters = workspace.counters
        partial_acc, partial_max, partial_sum = workspace.split_partials(
            num_seqs, num_heads, head_dim, num_splits, num_seqs * num_kv_heads
        )
    else:  # not touched by the kernel
        partial_acc = partial_max = partial_sum = out
        counters = seq_lens

    block_n, min_tiles, num_warps, num_stages = tile or decode_tile(head_dim)
    block_d = triton.next_power_of_2(head_dim)
    merge_rows = triton.next_power_of_2(group)
    split_chunk = min(triton.next_power_of_2(num_splits), max(1, MERGE_ELEMENTS // (merge_rows * block_d)))
    arguments = (
        query,
        kv_cache,
        scales if scales is not None else out,  # never read without KV_INT8
        block_tables,
        seq_lens,
        out,
        partial_acc,
        partial_max,
        partial_sum,
        counters,
        scale * math.log2(math.e),
        sliding_window if sliding_window else 2**31 - 1,
        *kernel_strides(query, kv_cache, scales, block_tables, out),
    )
    constexprs = dict(
        GROUP=group,
        GROUP_PAD=max(16, merge_rows),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        MIN_TILES=min_tiles,
        MERGE_ROWS=merge_rows,
        SPLIT_CHUNK=split_chunk,
        KV_INT8=scales is not None,
        UPCAST=INTERPRET,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return DecodeLaunch(num_kv_heads, arguments, constexprs, num_warps, num_stages)
