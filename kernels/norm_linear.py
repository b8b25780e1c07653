"""Residual add + RMSNorm fused into the linear layer that follows it (decode: one launch instead of two).

    residual_out = hidden + residual              (hidden alone when residual is None: the first layer)
    normed       = rms_norm(residual_out) * norm_weight
    out          = normed @ weight.T (+ bias)     or, gate_up: silu(gate) * up, weight [2N, K] = [gate; up]

The sum is rounded to the activation dtype (it is the residual stream) and the statistics are fp32.
Several rows take the unfused chain's rounding points (kernels/rmsnorm.py, then kernels/linear.py): the
normed row is rounded to the activation dtype, before and after the norm weight, as HF does. The same op
with the LM head's weight is the final norm + LM head.

Batch-1 decode (M <= GEMV_MAX_M rows) on a weight of up to FUSED_GEMV_MAX_WEIGHTS elements: one GEMV
launch, tiles from kernels/linear_gemv.py's gemv_config, one pass over K (larger weights: as several rows).
rstd is one scalar for the row, so each program sums w[n, k] * summed[k] * norm_weight[k] and the
squares of summed in the same loop and multiplies the sums by rstd at the end: the normed row is never
rounded (fp32 throughout, within bf16 noise of the chain), and no statistics pass goes before the weight
loads (the two-pass kernel before it took 39.9 us on Qwen3-4B's bf16 gate/up, this one 32.1).
Every program reads the whole row of hidden (+ residual) from L2 beside its BLOCK_N weight rows, and
stores its own disjoint slice of residual_out, so residual_out is written exactly once and must not alias
hidden or residual (other programs still read them).

Several rows (batched decode, verify, prefill): two launches, the add and the norm in one pass
(add_rms_norm_into_triton, into a scratch row block), then kernels/linear.py's skinny GEMM (M <=
SKINNY_MAX_M, each weight read once for all rows) or its tiled GEMM, storing straight into `out` (fp32
logits too). Fusing the norm into the GEMM would make every one of its programs re-read all M rows of the
input for their statistics. Only gate/up with a bias past SKINNY_MAX_M rows (no model here) runs the
unfused chain: an add, rms_norm_triton, linear_triton, then SwiGLU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from tileinfer.kernels.activation import silu_and_mul_reference
from tileinfer.kernels.int8 import MMA_CHUNK, LinearWeight, split
from tileinfer.kernels.linear import (
    GEMV_MAX_M,
    LinearWorkspace,
    _launch,
    gate_up_silu_reference,
    gate_up_silu_triton,
    linear_reference,
    linear_triton,
)
from tileinfer.kernels.linear_gemv import GemvConfig, gemv_config
from tileinfer.kernels.linear_skinny import SKINNY_MAX_M
from tileinfer.kernels.linear_tiles import group_scales, load_stored_order, stored_inputs, widen
from tileinfer.kernels.linear_tuned import weights_kind
from tileinfer.kernels.rmsnorm import add_rms_norm_into_triton, rms_norm_reference, rms_norm_triton

# One row takes the fused GEMV up to this many weight elements (rows x K), and a norm launch, then the
# plain GEMV, past it: every fused program loads three [BLOCK_K] vectors a K step beside its weight tile
# (hidden, residual, the norm weight), which cost more than the saved launch on larger weights (H200,
# bench_norm_linear: Qwen3-0.6B's qkv, 4M, 0.4-0.7 us faster fused; Qwen3-4B's gate/up, 50M, 2.2-3.3 us
# slower; the LM heads 0-43 us slower).
FUSED_GEMV_MAX_WEIGHTS = 8 * 2**20

# ----------------------------------------------------------------------------------------------------------
# The unfused chain: the reference, and the Triton prefill path
# ----------------------------------------------------------------------------------------------------------


def _chain(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: LinearWeight,
    bias: torch.Tensor | None,
    gate_up: bool,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    rms_norm: Callable,
    linear: Callable,
    gate_up_silu: Callable,
) -> tuple[torch.Tensor, torch.Tensor]:
    """add -> rms_norm -> linear (or gate/up + SwiGLU) with the given ops (reference or Triton)."""
    if residual is None:
        summed = hidden if residual_out is None else residual_out.copy_(hidden)
    else:
        summed = torch.add(hidden, residual, out=residual_out)  # rounded as add_rms_norm_reference's sum
    normed = rms_norm(summed, norm_weight, eps)
    # out may hold a wider dtype (fp32 logits): the product is rounded to the activation dtype first.
    direct_out = out if out is not None and out.dtype == normed.dtype else None
    if not gate_up:
        result = linear(normed, weight, bias, out=direct_out)
    elif bias is None:
        result = gate_up_silu(normed, weight, out=direct_out)
    else:
        gate, up = linear(normed, weight, bias).chunk(2, dim=-1)
        result = silu_and_mul_reference(gate, up)
    if out is None or result is out:
        return result, summed
    return out.copy_(result), summed


def add_rms_norm_linear_reference(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: LinearWeight,
    bias: torch.Tensor | None = None,
    gate_up: bool = False,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, residual_out): hidden [M, K] (+ residual [M, K]) -> RMSNorm -> @ weight.T (+ bias) -> [M, N].

    weight is [N, K], or [2N, K] (gate rows, then up rows) with gate_up, where out = silu(gate) * up;
    bias is [N] or [2N] to match. residual_out is hidden + residual (hidden itself when residual is None
    and no residual_out is given). out may be float32 with bf16/fp16 activations (logits): it then holds
    the activation-dtype result, widened."""
    return _chain(
        hidden, residual, norm_weight, eps, weight, bias, gate_up, out, residual_out,
        rms_norm_reference, linear_reference, gate_up_silu_reference,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Decode: the GEMV with the residual add and RMSNorm in front, in one pass over K
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _weight_tile(
    gate_rows,
    up_rows,
    k_start,
    offs_k,  # k_start + [0, BLOCK_K)
    k_mask,
    scale_ptr,
    rows,
    N,
    K,
    GATE_UP: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The [BLOCK_N, BLOCK_K] gate (or only) and up weight tiles in fp32 as stored, group scales applied
    (SCALE_GROUP > 0); without GATE_UP, up is gate."""
    w = widen(tl.load(gate_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0), tl.float32)
    if SCALE_GROUP > 0:
        w *= group_scales(scale_ptr, rows, k_start, K, SCALE_GROUP, BLOCK_K)  # (never in the MMA order)
    w_up = w
    if GATE_UP:
        w_up = widen(tl.load(up_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0), tl.float32)
        if SCALE_GROUP > 0:
            w_up *= group_scales(scale_ptr, rows + N, k_start, K, SCALE_GROUP, BLOCK_K)
    return w, w_up


@triton.jit
def add_rms_norm_gemv_program(
    pid,  # which BLOCK_N output columns: the program id, or a persistent kernel's tile
    hidden_ptr,  # [K], the row
    residual_ptr,  # [K] (HAS_RESIDUAL)
    norm_weight_ptr,  # [K]
    w_ptr,  # [N, K] or [2N, K] (GATE_UP: gate rows, then up rows), K contiguous; float or int8
    bias_ptr,  # [N] or [2N] (HAS_BIAS)
    scale_ptr,  # fp32 (HAS_SCALE: int8 weights) [N] or [2N], or [rows, K / SCALE_GROUP]
    out_ptr,  # [N]
    residual_out_ptr,  # [K] (WRITE_RESIDUAL)
    N,  # output columns: weight rows, or intermediate size for GATE_UP
    K,
    eps,
    residual_chunk,  # program p stores residual_out[p * residual_chunk : (p + 1) * residual_chunk]
    stride_wn,
    HAS_RESIDUAL: tl.constexpr,
    WRITE_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SCALE_GROUP: tl.constexpr,  # 0: a scale per row (after the sum); else inputs per scale (per tile)
    GATE_UP: tl.constexpr,
    MMA_ORDER: tl.constexpr,  # int8 values in the MMA order (BLOCK_K a multiple of 64)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr = 1,  # > 1: the K loop's loads pipelined through shared memory (cp.async)
):
    # sum_k w[n, k] * normed[k] = rstd * sum_k w[n, k] * (summed[k] * norm_weight[k]): rstd, a scalar,
    # multiplies the sums at the end, so the sum of squares accumulates in the same pass as the products.
    act_dtype: tl.constexpr = hidden_ptr.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # The last program's surplus rows re-read row N - 1 (in bounds) and are not stored: no row mask on loads.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    gate_rows = w_ptr + rows[:, None] * stride_wn  # [BLOCK_N, 1]
    up_rows = w_ptr + (rows + N)[:, None] * stride_wn  # [BLOCK_N, 1] (GATE_UP only)
    offs_k0 = tl.arange(0, BLOCK_K)
    stored = stored_inputs(offs_k0, MMA_ORDER)  # the input of each weight column (its vectors' order)
    own_start = pid * residual_chunk

    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + offs_k0
        k_mask = offs_k < K  # in the MMA order K is whole chunks: a chunk's columns and inputs alike
        w, w_up = _weight_tile(
            gate_rows, up_rows, k0, offs_k, k_mask, scale_ptr, rows, N, K, GATE_UP, SCALE_GROUP, BLOCK_K
        )
        summed = load_stored_order(hidden_ptr, k0, K, BLOCK_K, MMA_ORDER)
        if HAS_RESIDUAL:  # rounded to the activation dtype, as the residual stream is
            residual = load_stored_order(residual_ptr, k0, K, BLOCK_K, MMA_ORDER)
            summed = (summed + residual).to(act_dtype).to(tl.float32)
        if WRITE_RESIDUAL:
            inputs = k0 + stored
            own = k_mask & (inputs >= own_start) & (inputs < own_start + residual_chunk)
            tl.store(residual_out_ptr + inputs, summed.to(act_dtype), mask=own)
        squares += summed * summed
        x = (summed * load_stored_order(norm_weight_ptr, k0, K, BLOCK_K, MMA_ORDER))[None, :]
        acc += w * x
        if GATE_UP:
            acc_up += w_up * x

    rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    result = tl.sum(acc, axis=1) * rstd  # [BLOCK_N]
    result_up = tl.sum(acc_up, axis=1) * rstd
    if HAS_SCALE and SCALE_GROUP == 0:
        result *= tl.load(scale_ptr + rows)
        if GATE_UP:
            result_up *= tl.load(scale_ptr + rows + N)
    if HAS_BIAS:
        result += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if GATE_UP:
            result_up += tl.load(bias_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if GATE_UP:
        result = result / (1.0 + tl.exp(-result)) * result_up
    # Rounded to the activation dtype first, as the reference's result is, whatever out's dtype.
    tl.store(out_ptr + offs_n, result.to(act_dtype).to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _add_rms_norm_gemv_kernel(
    hidden_ptr, residual_ptr, norm_weight_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, residual_out_ptr, N, K,
    eps, residual_chunk, stride_wn, HAS_RESIDUAL: tl.constexpr, WRITE_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, SCALE_GROUP: tl.constexpr, GATE_UP: tl.constexpr,
    MMA_ORDER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr = 1,
):  # fmt: skip
    add_rms_norm_gemv_program(
        tl.program_id(0), hidden_ptr, residual_ptr, norm_weight_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr,
        residual_out_ptr, N, K, eps, residual_chunk, stride_wn, HAS_RESIDUAL, WRITE_RESIDUAL, HAS_BIAS,
        HAS_SCALE, SCALE_GROUP, GATE_UP, MMA_ORDER, BLOCK_N, BLOCK_K, NUM_STAGES,
    )  # fmt: skip


def _launch_gemv(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gate_up: bool,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
    config: GemvConfig | None = None,
    scale: torch.Tensor | None = None,
    scale_group: int = 0,
    mma_order: bool = False,
) -> None:
    """One launch; residual_out None: not written. config overrides the tile heuristics (tests, sweeps);
    scale: int8 weight's per-row scales."""
    m, k = hidden.shape
    n = out.shape[1]
    assert m == 1, "the fused GEMV takes one row; more take the norm, then the skinny GEMM"
    config = config or gemv_config(m, n, k, gate_up, weights_kind(weight))
    if mma_order:
        config = config._replace(block_k=max(config.block_k, MMA_CHUNK))
    num_programs = triton.cdiv(n, config.block_n)
    _add_rms_norm_gemv_kernel[(num_programs,)](
        hidden,
        residual if residual is not None else hidden,  # never read without HAS_RESIDUAL
        norm_weight,
        weight,
        bias if bias is not None else out,  # never read without HAS_BIAS
        scale if scale is not None else out,  # never read without HAS_SCALE
        out,
        residual_out if residual_out is not None else hidden,  # never written without WRITE_RESIDUAL
        n,
        k,
        eps,
        triton.cdiv(k, num_programs),
        weight.stride(0),
        HAS_RESIDUAL=residual is not None,
        WRITE_RESIDUAL=residual_out is not None,
        HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None,
        SCALE_GROUP=scale_group,
        GATE_UP=gate_up,
        MMA_ORDER=mma_order,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
    )


# ----------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------


def _norm_then_linear(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: LinearWeight,
    bias: torch.Tensor | None,
    gate_up: bool,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
    workspace: LinearWorkspace | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Several rows: the add and the norm in one launch, then the skinny GEMM (a few rows) or the tiled
    GEMM, straight into out (fp32 logits too)."""
    normed = torch.empty_like(hidden)
    if residual is None:
        rms_norm_triton(hidden, norm_weight, eps, out=normed)
        summed = hidden if residual_out is None else residual_out.copy_(hidden)
    else:
        summed = residual_out if residual_out is not None else torch.empty_like(hidden)
        add_rms_norm_into_triton(hidden, residual, norm_weight, eps, normed, summed)
    _launch(normed, weight, bias, out, gate_up, workspace)  # linear.py's choice: skinny or tiled GEMM
    return out, summed


def _check_rows(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    assert tensor.shape == shape, (name, tensor.shape, shape)
    assert tensor.dtype == dtype, (name, tensor.dtype, dtype)
    assert tensor.stride(-1) == 1, f"{name}: the last dim must be contiguous"


def add_rms_norm_linear_triton(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: LinearWeight,
    bias: torch.Tensor | None = None,
    gate_up: bool = False,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    workspace: LinearWorkspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As add_rms_norm_linear_reference. One row on a weight of up to FUSED_GEMV_MAX_WEIGHTS elements
    (M <= GEMV_MAX_M): one launch, no host sync, no allocation when out (and residual_out, unless
    residual is None) are given (past that size: two launches and a scratch row); residual_out must not
    overlap hidden or residual. More rows: the add and norm in one launch into a scratch buffer, then the
    skinny or tiled GEMM (see the module docstring). workspace: the caller's (a decoder's) scratch for
    the GEMMs (kernels/linear.py)."""
    values, scale, scale_group, mma_order = split(weight)
    assert hidden.dim() == 2 and values.dim() == 2, (hidden.shape, values.shape)
    m, k = hidden.shape
    dtype = hidden.dtype
    assert values.shape[1] == k, (values.shape, hidden.shape)
    assert values.dtype == dtype or scale is not None, (values.dtype, dtype)
    assert values.stride(1) == 1 and hidden.stride(1) == 1, "hidden and weight rows must be contiguous"
    assert not gate_up or weight.shape[0] % 2 == 0, weight.shape
    n = weight.shape[0] // 2 if gate_up else weight.shape[0]
    assert norm_weight.shape == (k,) and norm_weight.is_contiguous(), norm_weight.shape
    if residual is not None:
        _check_rows("residual", residual, (m, k), dtype)
    if bias is not None:
        assert bias.shape == (weight.shape[0],) and bias.stride(0) == 1, (bias.shape, weight.shape)
    if out is None:
        out = torch.empty(m, n, dtype=dtype, device=hidden.device)
    assert out.dtype in (dtype, torch.float32), (out.dtype, dtype)
    _check_rows("out", out, (m, n), out.dtype)
    if residual_out is not None:
        _check_rows("residual_out", residual_out, (m, k), dtype)
        sources = (hidden, residual) if residual is not None else (hidden,)
        # Other programs still read hidden and residual while one writes its slice of residual_out.
        assert all(residual_out.data_ptr() != t.data_ptr() for t in sources), "residual_out aliases an input"

    if m > GEMV_MAX_M and k > 0 and n > 0 and (m <= SKINNY_MAX_M or not (gate_up and bias is not None)):
        return _norm_then_linear(
            hidden, residual, norm_weight, eps, weight, bias, gate_up, out, residual_out, workspace
        )
    if m > GEMV_MAX_M or k == 0:
        return _chain(
            hidden, residual, norm_weight, eps, weight, bias, gate_up, out, residual_out,
            rms_norm_triton, functools.partial(linear_triton, workspace=workspace),
            functools.partial(gate_up_silu_triton, workspace=workspace),
        )  # fmt: skip
    if residual is not None and residual_out is None:
        residual_out = torch.empty_like(hidden)
    if m > 0 and n > 0 and values.shape[0] * k > FUSED_GEMV_MAX_WEIGHTS:
        return _norm_then_linear(
            hidden, residual, norm_weight, eps, weight, bias, gate_up, out, residual_out, workspace
        )
    if m > 0 and n > 0:
        _launch_gemv(
            hidden, residual, norm_weight, eps, values, bias, gate_up, out, residual_out, scale=scale,
            scale_group=scale_group, mma_order=mma_order,
        )  # fmt: skip
    elif residual_out is not None:
        # No GEMV programs to write it (N == 0): the sum alone.
        if residual is not None:
            torch.add(hidden, residual, out=residual_out)
        else:
            residual_out.copy_(hidden)
    return out, residual_out if residual_out is not None else hidden
