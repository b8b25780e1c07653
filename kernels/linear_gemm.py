"""Prefill (more rows than the skinny GEMM takes): a tiled GEMM on the tensor cores (tl.dot, bf16 in, fp32
accumulation), tiles chosen per shape by a small cost model (tile efficiency x waves over the SMs), grouped
tile order for L2 reuse. INT8 weights are converted tile by tile in registers (or dequantized first:
kernels/linear_dequant.py)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from tileinfer.kernels.int8 import MMA_CHUNK
from tileinfer.kernels.linear_tiles import group_scales, input_order, widen
from tileinfer.kernels.linear_tuned import tuned_config, weights_kind
from tileinfer.kernels.triton_common import INTERPRET, num_sms


@triton.jit
def _gemm_kernel(
    x_ptr,  # [M, K], K contiguous
    w_ptr,  # [N, K] or [2 * N, K] (GATE_UP), K contiguous; x's dtype, or int8
    bias_ptr,  # [N] (HAS_BIAS)
    scale_ptr,  # fp32 (HAS_SCALE: int8 weights) [N] or [2 * N], or [rows, K / SCALE_GROUP]
    out_ptr,  # [M, N], N contiguous
    M,
    N,  # output columns: weight rows, or intermediate size for GATE_UP
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SCALE_GROUP: tl.constexpr,  # 0: a scale per row (after the loop); else inputs per scale (in it)
    GATE_UP: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks in the K loop
    UPCAST: tl.constexpr,  # the interpreter: multiply in fp32 (it computes bf16 wrongly)
    MMA_ORDER: tl.constexpr,  # int8 values in the MMA order (BLOCK_K a multiple of 64)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr = "tf32",  # "ieee" for fp32 inputs: exact fp32, not TF32
):
    # Grouped order: GROUP_M row-tiles share each weight column-tile while it is hot in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    # Rows and columns past the edge wrap around to valid ones (loads stay in bounds without masks);
    # the store is masked.
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_rows = (offs_n % N).to(tl.int64)
    if MMA_ORDER:  # [BLOCK_N, BLOCK_K], put in input order, then transposed
        w_ptrs = w_ptr + w_rows[:, None] * stride_wn + offs_k[None, :]
        w_up_ptrs = w_ptr + (w_rows + N)[:, None] * stride_wn + offs_k[None, :]  # GATE_UP only
    else:  # [BLOCK_K, BLOCK_N]
        w_ptrs = w_ptr + w_rows[None, :] * stride_wn + offs_k[:, None]
        w_up_ptrs = w_ptr + (w_rows + N)[None, :] * stride_wn + offs_k[:, None]  # GATE_UP only
    w_mask = offs_k[None, :] if MMA_ORDER else offs_k[:, None]  # < k_left: in bounds

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_tile in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k_tile * BLOCK_K
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(w_ptrs, mask=w_mask < k_left, other=0.0)
        if MMA_ORDER:
            b = tl.trans(input_order(b, MMA_ORDER))
        # int8 weights: converted in registers (exact up to 127; straight to fp32 in the interpreter)
        if SCALE_GROUP > 0:  # b is [BLOCK_K, BLOCK_N]: the scales' tile transposed
            b = widen(b, tl.float32) * tl.trans(
                group_scales(scale_ptr, w_rows, k_tile * BLOCK_K, K, SCALE_GROUP, BLOCK_K)
            )
        if UPCAST:
            a = a.to(tl.float32)
            b = widen(b, tl.float32)
        else:
            b = widen(b, x_ptr.dtype.element_ty)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATE_UP:
            if EVEN_K:  # noqa: SIM108 (a constexpr branch)
                b_up = tl.load(w_up_ptrs)
            else:
                b_up = tl.load(w_up_ptrs, mask=w_mask < k_left, other=0.0)
            if MMA_ORDER:
                b_up = tl.trans(input_order(b_up, MMA_ORDER))
            if SCALE_GROUP > 0:
                b_up = widen(b_up, tl.float32) * tl.trans(
                    group_scales(scale_ptr, w_rows + N, k_tile * BLOCK_K, K, SCALE_GROUP, BLOCK_K)
                )
            if UPCAST:  # noqa: SIM108 (a constexpr branch)
                b_up = widen(b_up, tl.float32)
            else:
                b_up = widen(b_up, x_ptr.dtype.element_ty)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
            w_up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if HAS_SCALE and SCALE_GROUP == 0:
        acc *= tl.load(scale_ptr + w_rows)[None, :]
        if GATE_UP:
            acc_up *= tl.load(scale_ptr + w_rows + N)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if GATE_UP:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    # rounded to x's dtype first, as the reference's result is, whatever out's dtype (fp32 logits)
    tl.store(out_ptrs, acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=mask)


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Candidate tiles, largest first, with a guessed relative throughput of one SM on that tile (bigger
# tiles reuse each loaded byte more). For gate/up the two accumulators make BLOCK_N count double.
GEMM_CANDIDATES: tuple[tuple[GemmConfig, float], ...] = (
    (GemmConfig(128, 256, 64, 8, 3), 1.0),
    (GemmConfig(128, 128, 64, 8, 4), 0.9),
    (GemmConfig(128, 64, 64, 4, 4), 0.75),
    (GemmConfig(64, 64, 64, 4, 4), 0.55),
    (GemmConfig(64, 32, 64, 4, 4), 0.4),
)
GATE_UP_CANDIDATES: tuple[tuple[GemmConfig, float], ...] = (
    (GemmConfig(128, 128, 64, 8, 3), 1.0),
    (GemmConfig(128, 64, 64, 8, 4), 0.9),
    (GemmConfig(128, 32, 64, 4, 4), 0.75),
    (GemmConfig(64, 32, 64, 4, 4), 0.55),
    (GemmConfig(64, 16, 64, 4, 4), 0.4),
)


def gemm_config(
    m: int, n: int, k: int, gate_up: bool, element_size: int = 2, weights: str = "float"
) -> GemmConfig:
    """The candidate tile with the least estimated time: waves over the SMs x tile area / throughput.

    BLOCK_M is capped at the next power of two >= m (at least 16, the smallest tl.dot). BLOCK_K is 128
    bytes of a row (64 bf16, 32 fp32) unless k is smaller, which keeps 3-4 pipeline stages of the
    largest tiles within the 227 KB of shared memory. A measured tile (tuned_config, for these weights)
    takes precedence."""
    tuned = tuned_config("gemm", m, n, k, gate_up, weights)
    if tuned is not None and element_size == 2:  # tuned in bf16
        return GemmConfig(**tuned)
    block_m_cap = max(16, triton.next_power_of_2(m))
    block_k = min(128 // element_size, max(16, triton.next_power_of_2(k)))
    best: GemmConfig | None = None
    best_cost = float("inf")
    for config, throughput in GATE_UP_CANDIDATES if gate_up else GEMM_CANDIDATES:
        block_m = min(config.block_m, block_m_cap)
        programs = triton.cdiv(m, block_m) * triton.cdiv(n, config.block_n)
        waves = triton.cdiv(programs, num_sms())
        # A tile clipped by m does proportionally less work but does not get faster per element.
        cost = waves * block_m * config.block_n / (throughput * min(1.0, block_m / config.block_m) ** 0.5)
        if cost < best_cost:
            best_cost = cost
            best = config._replace(block_m=block_m, block_k=block_k)
    assert best is not None
    return best


def launch_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    gate_up: bool,
    config: GemmConfig | None = None,
    scale: torch.Tensor | None = None,
    scale_group: int = 0,
    mma_order: bool = False,
) -> None:
    """out may be float32 with bf16/fp16 x (logits): it then holds the x-dtype result, widened."""
    m, k = x.shape
    n = out.shape[1]
    block_m, block_n, block_k, num_warps, num_stages = config or gemm_config(
        m, n, k, gate_up, x.element_size(), weights_kind(weight)
    )
    if mma_order:
        block_k = max(block_k, MMA_CHUNK)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gemm_kernel[grid](
        x,
        weight,
        bias if bias is not None else out,  # never read without HAS_BIAS
        scale if scale is not None else out,  # never read without HAS_SCALE
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None,
        SCALE_GROUP=scale_group,
        GATE_UP=gate_up,
        EVEN_K=k % block_k == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=INTERPRET,
        MMA_ORDER=mma_order,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
