"""Decode with one row of x (M == 1): a GEMV in which each program owns BLOCK_N whole output columns
(weight rows) and streams them over all of K with 16-byte loads, multiply-adding into an fp32 register
tile that is reduced once at the end. BLOCK_N shrinks (down to one row) until there are >= 4 programs per
SM, so no split-K and no cross-program reduction is needed: results are deterministic, one launch."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from tileinfer.kernels.int8 import MMA_CHUNK
from tileinfer.kernels.linear_tiles import group_scales, load_stored_order, widen
from tileinfer.kernels.linear_tuned import tuned_config, weights_kind
from tileinfer.kernels.triton_common import num_sms


@triton.jit
def gemv_program(
    pid,  # which BLOCK_N output columns: the program id, or a persistent kernel's tile
    x_ptr,  # [1, K], K contiguous
    w_ptr,  # [N, K] or [2 * N, K] (GATE_UP: gate rows, then up rows), K contiguous; float or int8
    bias_ptr,  # [N] (HAS_BIAS)
    scale_ptr,  # fp32 (HAS_SCALE: int8 weights) [N] or [2 * N], or [rows, K / SCALE_GROUP]
    out_ptr,  # [1, N], N contiguous
    N,  # output columns: weight rows, or intermediate size for GATE_UP
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SCALE_GROUP: tl.constexpr,  # 0: a scale per row (after the sum); else inputs per scale (in the loop)
    GATE_UP: tl.constexpr,
    MMA_ORDER: tl.constexpr,  # int8 values in the MMA order (BLOCK_K a multiple of 64)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr = 1,  # > 1: the K loop's loads pipelined through shared memory (cp.async)
):
    # The products are formed in fp32 (weights are upcast on load), so there is no bf16 arithmetic for
    # the interpreter to get wrong and no UPCAST flag is needed here.
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # The last program's surplus rows re-read row N - 1 (in bounds) and are not stored: no row mask on loads.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    gate_rows = w_ptr + rows[:, None] * stride_wn  # [BLOCK_N, 1]
    up_rows = w_ptr + (rows + N)[:, None] * stride_wn  # [BLOCK_N, 1] (GATE_UP only)
    offs_k0 = tl.arange(0, BLOCK_K)

    # [BLOCK_N, BLOCK_K] partial sums, reduced across K once after the loop.
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + offs_k0
        k_mask = offs_k < K  # in the MMA order K is whole chunks: a chunk's columns and inputs alike
        xk = load_stored_order(x_ptr, k0, K, BLOCK_K, MMA_ORDER)[None, :]
        w = widen(tl.load(gate_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0), tl.float32)
        if SCALE_GROUP > 0:
            w *= group_scales(scale_ptr, rows, k0, K, SCALE_GROUP, BLOCK_K)  # (never in the MMA order)
        acc += w * xk
        if GATE_UP:
            w_up = widen(tl.load(up_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0), tl.float32)
            if SCALE_GROUP > 0:
                w_up *= group_scales(scale_ptr, rows + N, k0, K, SCALE_GROUP, BLOCK_K)
            acc_up += w_up * xk
    result, result_up = tl.sum(acc, axis=1), tl.sum(acc_up, axis=1)  # [BLOCK_N]
    if HAS_SCALE and SCALE_GROUP == 0:
        result *= tl.load(scale_ptr + rows)
        if GATE_UP:
            result_up *= tl.load(scale_ptr + rows + N)
    if HAS_BIAS:
        result += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if GATE_UP:
        result = result / (1.0 + tl.exp(-result)) * result_up
    # rounded to x's dtype first, as the reference's result is, whatever out's dtype (fp32 logits)
    tl.store(out_ptr + offs_n, result.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, N, K, stride_wn,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, SCALE_GROUP: tl.constexpr, GATE_UP: tl.constexpr,
    MMA_ORDER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr = 1,
):  # fmt: skip
    gemv_program(
        tl.program_id(0), x_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, N, K, stride_wn, HAS_BIAS, HAS_SCALE,
        SCALE_GROUP, GATE_UP, MMA_ORDER, BLOCK_N, BLOCK_K, NUM_STAGES,
    )  # fmt: skip


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1  # K tiles in flight: > 1 pipelines the weight loads through shared memory


def gemv_config(m: int, n: int, k: int, gate_up: bool, weights: str = "float") -> GemvConfig:
    """Tiles for the GEMV: n output columns (intermediate size for gate/up), k = in_features.

    BLOCK_N is the largest power of two <= 32 (16 for gate/up, which streams two tiles) that still
    gives >= 4 programs per SM; BLOCK_K fills a budget of 64 fp32 accumulators per thread, so that
    every thread has 4-8 16-byte loads in flight per iteration and several programs fit on an SM.
    INT8 weights take half the rows and twice the K per tile: the same bytes a load, as many accumulators.
    A tile measured fastest for this shape and weights on this GPU (tuned_config) takes precedence.
    """
    tuned = tuned_config("gemv", m, n, k, gate_up, weights)
    if tuned is not None:
        return GemvConfig(**tuned)
    tiles = 2 if gate_up else 1
    block_n = 16 if gate_up else 32
    while block_n > 1 and triton.cdiv(n, block_n) < 4 * num_sms():
        block_n //= 2
    num_warps = 4
    budget = 64 * 32 * num_warps  # fp32 accumulator elements per program
    if weights == "int8" and block_n > 1:
        block_n //= 2
    block_k = max(16, budget // (block_n * tiles))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    return GemvConfig(block_n, block_k, num_warps)


def launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    gate_up: bool,
    config: GemvConfig | None = None,
    scale: torch.Tensor | None = None,
    scale_group: int = 0,
    mma_order: bool = False,
) -> None:
    m, k = x.shape
    n = out.shape[1]
    assert m == 1, "the GEMV takes one row of x; more take the skinny GEMM"
    block_n, block_k, num_warps, num_stages = config or gemv_config(m, n, k, gate_up, weights_kind(weight))
    if mma_order:
        block_k = max(block_k, MMA_CHUNK)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else out,  # never read without HAS_BIAS
        scale if scale is not None else out,  # never read without HAS_SCALE
        out,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None,
        SCALE_GROUP=scale_group,
        GATE_UP=gate_up,
        MMA_ORDER=mma_order,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NUM_STAGES=num_stages,
        num_warps=num_warps,
    )
