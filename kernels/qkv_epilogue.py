"""What follows the fused QKV projection: q/k RMSNorm, RoPE, and the paged KV-cache write, in one kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from tileinfer.kernels.kv_cache import Int8KVCache, KVCache, write_kv_cache_reference
from tileinfer.kernels.rmsnorm import rms_norm_reference
from tileinfer.kernels.rope import apply_rope_reference
from tileinfer.kernels.triton_common import num_sms


def qkv_epilogue_reference(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    kv_cache: KVCache,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Split qkv [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] into q, k, v; RMSNorm each head
    of q and k (when the weights [head_dim] are given); rotate q and k by positions [num_tokens] (RoPE,
    cos_sin_cache [max_positions, head_dim] fp32); store k and v into kv_cache (one layer's
    [2, num_blocks, block_size, num_kv_heads, head_dim]) at slot_mapping [num_tokens] (-1: padding,
    nothing stored). Returns the rotated query [num_tokens, num_heads, head_dim] (into out if given).
    An INT8 cache (Int8KVCache) stores the keys smoothed ((k - offset) / smoothing), and the query comes
    back multiplied by its KV head's smoothing, so that each query's scores move by a constant only.
    """
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    query = query.reshape(num_tokens, num_heads, head_dim)
    key = key.reshape(num_tokens, num_kv_heads, head_dim)
    value = value.reshape(num_tokens, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        query = rms_norm_reference(query, q_norm_weight, eps)
    if k_norm_weight is not None:
        key = rms_norm_reference(key, k_norm_weight, eps)
    query = apply_rope_reference(query, positions, cos_sin_cache)
    key = apply_rope_reference(key, positions, cos_sin_cache)
    write_kv_cache_reference(key, value, kv_cache, slot_mapping)
    if isinstance(kv_cache, Int8KVCache):
        smoothing = kv_cache.key_smoothing.repeat_interleave(num_heads // num_kv_heads, dim=0)
        query = (query.float() * smoothing).to(query.dtype)
    if out is None:
        return query
    return out.copy_(query)


@triton.jit
def _norm_and_rotate(
    x1,  # [HEADS, BLOCK_HALF] fp32: first halves of the heads
    x2,  # [HEADS, BLOCK_HALF] fp32: second halves
    cos,  # [1, BLOCK_HALF] fp32, rounded to the activation dtype
    sin,  # [1, BLOCK_HALF] fp32, rounded to the activation dtype
    norm_weight_ptr,
    dims,  # [1, BLOCK_HALF]
    dim_mask,  # [1, BLOCK_HALF]
    eps,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    DTYPE: tl.constexpr,
):
    # Each step rounds to the activation dtype where the reference (plain torch in that dtype) does,
    # so the rotated heads match it closely; the arithmetic itself is fp32.
    if HAS_NORM:
        squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [HEADS]
        rstd = tl.rsqrt(squares / (2 * HALF) + eps)[:, None]
        w1 = tl.load(norm_weight_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)
        w2 = tl.load(norm_weight_ptr + HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd).to(DTYPE).to(tl.float32) * w1).to(DTYPE).to(tl.float32)
        x2 = ((x2 * rstd).to(DTYPE).to(tl.float32) * w2).to(DTYPE).to(tl.float32)
    # HF rotate-half: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]
    out1 = (x1 * cos).to(DTYPE).to(tl.float32) - (x2 * sin).to(DTYPE).to(tl.float32)
    out2 = (x2 * cos).to(DTYPE).to(tl.float32) + (x1 * sin).to(DTYPE).to(tl.float32)
    return out1, out2


@triton.jit
def qkv_epilogue_program(
    token,  # the program's token and group of heads: its ids, or a persistent kernel's work item
    group,
    qkv_ptr,  # [num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM]
    positions_ptr,  # [num_tokens] int64
    cos_sin_ptr,  # [max_positions, HEAD_DIM] fp32
    q_norm_weight_ptr,  # [HEAD_DIM] (HAS_Q_NORM)
    k_norm_weight_ptr,  # [HEAD_DIM] (HAS_K_NORM)
    kv_cache_ptr,  # [2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM]: float, or int8 (QUANTIZE)
    kv_scale_ptr,  # fp32 [2, num_blocks, block_size, NUM_KV_HEADS] (QUANTIZE)
    offset_ptr,  # fp32 [NUM_KV_HEADS, HEAD_DIM] (QUANTIZE): keys are stored as (k - offset) / smoothing
    smoothing_ptr,  # fp32 [NUM_KV_HEADS, HEAD_DIM] (QUANTIZE)
    slot_mapping_ptr,  # [num_tokens] int64, -1 for padding
    query_ptr,  # [num_tokens, NUM_HEADS, HEAD_DIM]
    qkv_row_stride,
    cos_sin_row_stride,
    query_token_stride,
    query_head_stride,
    cache_kv_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    scale_kv_stride,
    scale_block_stride,
    block_size,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HEADS: tl.constexpr,  # heads per program
    HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr,
    QUANTIZE: tl.constexpr,  # an INT8 cache: smoothed keys, a scale per token and head; queries x smoothing
):
    # Work items (token, group of HEADS heads); the first groups cover the query heads, the rest the
    # kv heads (a kv program also copies the value heads).
    HALF: tl.constexpr = HEAD_DIM // 2
    NUM_Q_GROUPS: tl.constexpr = (NUM_HEADS + HEADS - 1) // HEADS
    DTYPE: tl.constexpr = qkv_ptr.dtype.element_ty
    token = token.to(tl.int64)

    head_in_group = tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
    dims = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    dim_mask = dims < HALF
    position = tl.load(positions_ptr + token)
    cos_sin_row = cos_sin_ptr + position * cos_sin_row_stride
    cos = tl.load(cos_sin_row + dims, mask=dim_mask, other=0.0).to(DTYPE).to(tl.float32)
    sin = tl.load(cos_sin_row + HALF + dims, mask=dim_mask, other=0.0).to(DTYPE).to(tl.float32)
    qkv_row = qkv_ptr + token * qkv_row_stride

    if group < NUM_Q_GROUPS:
        heads = group * HEADS + head_in_group  # [HEADS, 1]
        mask = (heads < NUM_HEADS) & dim_mask
        src = qkv_row + heads * HEAD_DIM + dims
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        out1, out2 = _norm_and_rotate(
            x1, x2, cos, sin, q_norm_weight_ptr, dims, dim_mask, eps, HALF, HAS_Q_NORM, DTYPE
        )
        if QUANTIZE:  # each query head times its KV head's smoothing, rounded as the reference rounds
            smooth_row = smoothing_ptr + (heads // (NUM_HEADS // NUM_KV_HEADS)) * HEAD_DIM + dims
            out1 = out1 * tl.load(smooth_row, mask=mask, other=1.0)
            out2 = out2 * tl.load(smooth_row + HALF, mask=mask, other=1.0)
        dst = query_ptr + token * query_token_stride + heads * query_head_stride + dims
        tl.store(dst, out1, mask=mask)
        tl.store(dst + HALF, out2, mask=mask)
    else:
        slot = tl.load(slot_mapping_ptr + token)
        kv_heads = (group - NUM_Q_GROUPS) * HEADS + head_in_group  # [HEADS, 1]
        # Padding tokens (slot -1) touch nothing: every load and store below is masked off. (A bound
        # rather than `& (slot >= 0)`: the interpreter mistypes a tensor & scalar mask.)
        heads_to_store = tl.where(slot >= 0, NUM_KV_HEADS, 0)
        mask = (kv_heads < heads_to_store) & dim_mask
        key_src = qkv_row + (NUM_HEADS + kv_heads) * HEAD_DIM + dims
        value_src = key_src + NUM_KV_HEADS * HEAD_DIM
        x1 = tl.load(key_src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(key_src + HALF, mask=mask, other=0.0).to(tl.float32)
        v1 = tl.load(value_src, mask=mask, other=0.0)
        v2 = tl.load(value_src + HALF, mask=mask, other=0.0)
        out1, out2 = _norm_and_rotate(
            x1, x2, cos, sin, k_norm_weight_ptr, dims, dim_mask, eps, HALF, HAS_K_NORM, DTYPE
        )
        safe_slot = tl.maximum(slot, 0)
        block = safe_slot // block_size
        offset = safe_slot % block_size
        key_dst = kv_cache_ptr + block * cache_block_stride + offset * cache_slot_stride
        key_dst = key_dst + kv_heads * cache_head_stride + dims
        value_dst = key_dst + cache_kv_stride
        cache_dtype = kv_cache_ptr.dtype.element_ty
        if QUANTIZE:
            channel = kv_heads * HEAD_DIM + dims
            out1 = (out1 - tl.load(offset_ptr + channel, mask=mask, other=0.0)) / tl.load(
                smoothing_ptr + channel, mask=mask, other=1.0
            )
            out2 = (out2 - tl.load(offset_ptr + channel + HALF, mask=mask, other=0.0)) / tl.load(
                smoothing_ptr + channel + HALF, mask=mask, other=1.0
            )
            scale_dst = kv_scale_ptr + block * scale_block_stride + offset * NUM_KV_HEADS + kv_heads
            _store_int8_rows(key_dst, key_dst + HALF, scale_dst, out1, out2, mask)
            _store_int8_rows(
                value_dst, value_dst + HALF, scale_dst + scale_kv_stride,
                v1.to(tl.float32), v2.to(tl.float32), mask,
            )  # fmt: skip
        else:
            tl.store(key_dst, out1.to(cache_dtype), mask=mask)
            tl.store(key_dst + HALF, out2.to(cache_dtype), mask=mask)
            tl.store(value_dst, v1.to(cache_dtype), mask=mask)
            tl.store(value_dst + HALF, v2.to(cache_dtype), mask=mask)


@triton.jit
def _qkv_epilogue_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, q_norm_weight_ptr, k_norm_weight_ptr, kv_cache_ptr, kv_scale_ptr,
    offset_ptr, smoothing_ptr, slot_mapping_ptr, query_ptr, qkv_row_stride, cos_sin_row_stride,
    query_token_stride, query_head_stride, cache_kv_stride, cache_block_stride, cache_slot_stride,
    cache_head_stride, scale_kv_stride, scale_block_stride, block_size, eps, NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr, HEADS: tl.constexpr,
    HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr, QUANTIZE: tl.constexpr,
):  # fmt: skip
    # Grid: (token, group of HEADS heads)
    qkv_epilogue_program(
        tl.program_id(0), tl.program_id(1), qkv_ptr, positions_ptr, cos_sin_ptr, q_norm_weight_ptr,
        k_norm_weight_ptr, kv_cache_ptr, kv_scale_ptr, offset_ptr, smoothing_ptr, slot_mapping_ptr, query_ptr,
        qkv_row_stride, cos_sin_row_stride, query_token_stride, query_head_stride, cache_kv_stride,
        cache_block_stride, cache_slot_stride, cache_head_stride, scale_kv_stride, scale_block_stride,
        block_size, eps, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_HALF, HEADS, HAS_Q_NORM, HAS_K_NORM,
        QUANTIZE,
    )  # fmt: skip


@triton.jit
def _round_to_int8(x):
    """x rounded half away from zero, within [-127, 127], as int8."""
    rounded = tl.where(x >= 0, tl.floor(x + 0.5), -tl.floor(-x + 0.5))
    return tl.minimum(tl.maximum(rounded, -127.0), 127.0).to(tl.int8)


@triton.jit
def _store_int8_rows(dst1, dst2, scale_dst, x1, x2, mask):
    """Each head row [x1, x2] (fp32 halves [HEADS, BLOCK_HALF]) as int8 with its scale (scale_dst
    [HEADS, 1]): symmetric, rounded half away from zero (kv_cache.quantize_kv_reference)."""
    amax = tl.maximum(tl.max(tl.abs(x1), axis=1), tl.max(tl.abs(x2), axis=1))[:, None]  # [HEADS, 1]
    scale = tl.where(amax > 0.0, amax / 127.0, 1.0)
    tl.store(dst1, _round_to_int8(x1 / scale), mask=mask)
    tl.store(dst2, _round_to_int8(x2 / scale), mask=mask)
    head_mask = tl.max(mask.to(tl.int32), axis=1)[:, None] > 0
    tl.store(scale_dst, scale, mask=head_mask)


def _heads_per_program(num_tokens: int, num_heads: int, num_kv_heads: int) -> int:
    """Most heads per program (up to 8, not past the kv heads) that still leaves >= 4 programs per SM."""
    for heads in (8, 4, 2):
        if heads > triton.next_power_of_2(num_kv_heads):
            continue
        num_groups = triton.cdiv(num_heads, heads) + triton.cdiv(num_kv_heads, heads)
        if num_tokens * num_groups >= 4 * num_sms():
            return heads
    return 1


def qkv_epilogue_triton(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    kv_cache: KVCache,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """As qkv_epilogue_reference, in one launch over (token, group of heads)."""
    quantized = isinstance(kv_cache, Int8KVCache)
    scales = offset = smoothing = None
    if quantized:
        scales, offset, smoothing = kv_cache.scales, kv_cache.key_offset, kv_cache.key_smoothing
        kv_cache = kv_cache.values
        assert scales.is_contiguous() and offset.is_contiguous() and smoothing.is_contiguous()
    num_tokens = qkv.shape[0]
    assert head_dim % 2 == 0
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert kv_cache.shape[0] == 2 and kv_cache.shape[3:] == (num_kv_heads, head_dim)
    assert kv_cache.stride(4) == 1 and cos_sin_cache.stride(1) == 1
    assert cos_sin_cache.shape[1] == head_dim and cos_sin_cache.dtype == torch.float32
    for weight in (q_norm_weight, k_norm_weight):
        assert weight is None or (weight.shape == (head_dim,) and weight.is_contiguous())
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    assert out.shape == (num_tokens, num_heads, head_dim) and out.stride(2) == 1
    if num_tokens == 0:
        return out
    heads = _heads_per_program(num_tokens, num_heads, num_kv_heads)
    grid = (num_tokens, triton.cdiv(num_heads, heads) + triton.cdiv(num_kv_heads, heads))
    block_half = triton.next_power_of_2(head_dim // 2)
    _qkv_epilogue_kernel[grid](
        qkv,
        positions,
        cos_sin_cache,
        q_norm_weight if q_norm_weight is not None else qkv,  # a placeholder, never read
        k_norm_weight if k_norm_weight is not None else qkv,
        kv_cache,
        scales if quantized else qkv,  # placeholders, never read without QUANTIZE
        offset if quantized else qkv,
        smoothing if quantized else qkv,
        slot_mapping,
        out,
        qkv.stride(0),
        cos_sin_cache.stride(0),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        scales.stride(0) if quantized else 0,
        scales.stride(1) if quantized else 0,
        kv_cache.shape[2],
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HALF=block_half,
        HEADS=heads,
        HAS_Q_NORM=q_norm_weight is not None,
        HAS_K_NORM=k_norm_weight is not None,
        QUANTIZE=quantized,
        # 16-byte accesses where the tile allows: a warp covers 32 x 8 bf16 elements of a [HEADS, half] tile.
        num_warps=max(1, min(4, heads * block_half // 256)),
    )
    return out
