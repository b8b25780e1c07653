"""Linear layers: y = x @ weight.T (+ bias), and the MLP's gate/up projection fused with SwiGLU.

Weights are in the Hugging Face layout [out_features, in_features], row-major. The engine fuses
q/k/v into one [q_size + 2 * kv_size, hidden] weight and gate/up into one [2 * intermediate, hidden]
weight (gate rows first, then up rows).

Three Triton kernels serve every call, picked by the number of rows of x:
- one row (M == 1, batch-1 decode): a GEMV. Each program owns BLOCK_N whole output columns (weight
  rows) and streams them over all of K with 16-byte loads, multiply-adding into an fp32 register tile
  that is reduced once at the end. BLOCK_N shrinks (down to one row) until there are >= 4 programs per
  SM, so no split-K and no cross-program reduction is needed: results are deterministic, one launch.
- a few rows (2 <= M <= SKINNY_MAX_M: batched decode, verify steps, small prefill chunks): a skinny GEMM
  on the tensor cores with the operands swapped, out.T = W @ x.T, so the weight's rows fill the MMA's
  large dimension and the few rows of x its small one (padded to 16). Each weight tile is read once
  for every row of x, so the step reads each weight once whatever the batch. Where N alone gives too
  few programs for the SMs, K is split; each split writes fp32 partials and the last split of a column
  tile to finish (an atomic counter) adds them up in split order: deterministic, one launch.
- prefill (M > SKINNY_MAX_M): a tiled GEMM on the tensor cores (tl.dot, bf16 in, fp32 accumulation),
  tiles chosen per shape by a small cost model (tile efficiency x waves over the SMs), grouped tile
  order for L2 reuse. INT8 weights in the MMA order (kernels/int8.py) take the skinny kernel instead, x
  in tiles of SWAPPED_BLOCK_M rows; narrower ones and those in input order (Q8_0's), at M >=
  INT8_DEQUANT_MIN_M, are first dequantized into a workspace (DequantWorkspace; the next such weight
  ahead on a side stream), and the GEMM runs on that (dequantized_at_prefill).
Tiles measured fastest per shape on a GPU (kernels/tuned/<device>.json) override the heuristics.

The gate/up kernels compute the matching gate and up columns in the same program and write
silu(gate) * up, so the [M, 2 * intermediate] activation never reaches memory.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.activation import silu_and_mul_reference
from kernels.int8 import MMA_CHUNK, Int8Weight, KernelWeight, LinearWeight, dequantize, split
from kernels.triton_common import INTERPRET, num_sms, shared_memory_per_block

# Up to this many rows of x take the GEMV; up to SKINNY_MAX_M the skinny GEMM; more the tiled GEMM.
GEMV_MAX_M = 1
SKINNY_MAX_M = 64
# INT8 weights in the MMA order take the skinny kernel past SKINNY_MAX_M too (the swapped-operand GEMM), x
# in tiles of this many rows; with a dequantization workspace only from SWAPPED_MIN_ROWS weight rows: fewer
# make too few tiles (H200, 512 rows, Qwen3-0.6B's o and down, 1024 rows: 14.8 and 20.2 us swapped, 13.4
# and 16.0 dequantized; its qkv, 4096: 11.9 against 14.8).
SWAPPED_BLOCK_M = 128
SWAPPED_MIN_ROWS = 2048
WGMMA_MIN_ROWS = 64  # a skinny tile's weight rows from which Hopper's wgmma multiplies them

# Tiles measured fastest per shape on a given GPU (`bench/bench_linear.py --sweep --write-tuned`), one
# JSON file per device name; shapes not in the file, and other GPUs, use the heuristics below.
TUNED_DIR = Path(__file__).parent / "tuned"


def tuned_path(device_name: str) -> Path:
    return TUNED_DIR / f"{device_name.replace(' ', '_')}.json"


@functools.cache
def _tuned_table() -> dict[tuple[str, int, int, int, bool, str], dict[str, int]]:
    """(kind, next power of two of M, N, K, gate_up, weights) -> tile config, for the current GPU.
    weights: "int8" for INT8 weights, else "float" (a row without the field: tuned in bf16)."""
    if INTERPRET or not torch.cuda.is_available():
        return {}
    path = tuned_path(torch.cuda.get_device_name())
    if not path.exists():
        return {}
    return {tuned_key(row): row["config"] for row in json.loads(path.read_text())}


def tuned_key(row: dict) -> tuple[str, int, int, int, bool, str]:
    """A tuned-table row's kernel, M, shape and weights: what its config is looked up by."""
    return row["kind"], row["m"], row["n"], row["k"], row["gate_up"], row.get("weights", "float")


def tuned_config(
    kind: str, m: int, n: int, k: int, gate_up: bool, weights: str = "float"
) -> dict[str, int] | None:
    return _tuned_table().get((kind, tuned_m(kind, m), n, k, gate_up, weights))


def weights_kind(weight: torch.Tensor) -> str:
    """The tuned table's name for a weight's storage: "int8" or "float"."""
    return "int8" if weight.dtype == torch.int8 else "float"


def tuned_m(kind: str, m: int) -> int:
    """The M a tuned-table row stands for: the next power of two, and for the skinny GEMM the rows its
    tile holds (at least 16), since every M up to that runs the same tile."""
    return max(16, triton.next_power_of_2(m)) if kind == "skinny" else triton.next_power_of_2(m)


# ----------------------------------------------------------------------------------------------------------
# References (the CPU path and the ground truth)
# ----------------------------------------------------------------------------------------------------------


def linear_reference(
    x: torch.Tensor,
    weight: LinearWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T + bias [N] -> [M, N] (torch.nn.functional.linear); an INT8 weight is
    dequantized to x's dtype first."""
    result = F.linear(x, dequantize(weight, x.dtype), bias)
    if out is None:
        return result
    return out.copy_(result)


def gate_up_silu_reference(
    x: torch.Tensor, weight: LinearWeight, out: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) -> [M, I], where weight [2I, K] holds the gate rows, then the up rows."""
    intermediate = weight.shape[0] // 2
    gate_up = F.linear(x, dequantize(weight, x.dtype))
    result = silu_and_mul_reference(gate_up[..., :intermediate], gate_up[..., intermediate:])
    if out is None:
        return result
    return out.copy_(result)


# ----------------------------------------------------------------------------------------------------------
# Decode: GEMV, each program owns whole output columns
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def group_scales(scale_ptr, rows, k_start, K, SCALE_GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [len(rows), BLOCK_K]: scale[row, k // SCALE_GROUP] for k in k_start + [0, BLOCK_K) of a
    group-scaled INT8 weight (scale [rows, K / SCALE_GROUP], rows contiguous; k_start a multiple of
    BLOCK_K); columns past K take the last group (their weights are 0). Each group's scale is loaded once
    and broadcast over its columns, so a pipelined loop stages BLOCK_K / SCALE_GROUP scales a row, not
    BLOCK_K."""
    tl.static_assert(BLOCK_K % SCALE_GROUP == 0 or SCALE_GROUP % BLOCK_K == 0)
    num_groups = K // SCALE_GROUP
    # (an else, not an early return: the compiler goes on past a return in a constexpr branch)
    if BLOCK_K <= SCALE_GROUP:  # the tile lies in one group
        group = tl.minimum(k_start // SCALE_GROUP, num_groups - 1)
        scales = tl.load(scale_ptr + rows * num_groups + group)
        tile = tl.broadcast_to(scales[:, None], (rows.shape[0], BLOCK_K))
    else:
        GROUPS: tl.constexpr = BLOCK_K // SCALE_GROUP
        groups = tl.minimum(k_start // SCALE_GROUP + tl.arange(0, GROUPS), num_groups - 1)
        scales = tl.load(scale_ptr + rows[:, None] * num_groups + groups[None, :])  # [rows, GROUPS]
        wide = tl.broadcast_to(scales[:, :, None], (rows.shape[0], GROUPS, SCALE_GROUP))
        tile = tl.reshape(wide, (rows.shape[0], BLOCK_K))
    return tile


# Four int8 weights (one 32-bit register) to four fp32 without the int-to-float instruction, which the
# CUDA guide lists at 16 a clock per SM on compute capability 9.0 (against 64 for PRMT, 128 for a float
# add): XOR turns each signed byte w into w + 128 unsigned, PRMT sets it as the low mantissa byte of 2^23,
# and subtracting 2^23 + 128 leaves w exactly.
_INT8_TO_FP32_ASM: tl.constexpr = tl.constexpr("""
{
.reg .b32 t, m;
xor.b32 t, $4, 0x80808080;
mov.b32 m, 0x4B000000;
prmt.b32 $0, t, m, 0x7650;
prmt.b32 $1, t, m, 0x7651;
prmt.b32 $2, t, m, 0x7652;
prmt.b32 $3, t, m, 0x7653;
sub.f32 $0, $0, 0f4B000080;
sub.f32 $1, $1, 0f4B000080;
sub.f32 $2, $2, 0f4B000080;
sub.f32 $3, $3, 0f4B000080;
}
""")
_ASM_WIDEN: tl.constexpr = tl.constexpr(not INTERPRET)  # the interpreter runs no PTX: arithmetic there


@triton.jit
def widen(w, dtype: tl.constexpr):
    """A weight tile in dtype (fp32, or the activations' bf16/fp16). INT8 goes through 2^23 + 128 + w, an
    fp32 whose low mantissa byte is w + 128: to fp32 (the GEMVs) four weights to a PTX block
    (_INT8_TO_FP32_ASM), elsewhere and in the interpreter in arithmetic, which measured faster than the
    same in PTX for the tensor-core kernels' bf16. A bf16 is the exact fp32's upper half. Float weights
    convert as usual."""
    if w.dtype == tl.int8:
        if _ASM_WIDEN and dtype == tl.float32:
            return tl.inline_asm_elementwise(
                _INT8_TO_FP32_ASM, "=r,=r,=r,=r,r", [w], dtype=tl.float32, is_pure=True, pack=4
            )
        f = (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        if dtype == tl.bfloat16:
            return (f.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return f.to(dtype)
    return w.to(dtype)


@triton.jit
def input_order(w, MMA_ORDER: tl.constexpr):
    """A weight tile [rows, BLOCK_K] loaded as stored, with its columns in input order: int8 values in
    the MMA order (kernels/int8.py; BLOCK_K a multiple of 64) are put back in registers, others are
    returned as they are (the GEMM's and the dequantization's tiles; the skinny kernel's:
    chunks_in_input_order)."""
    if MMA_ORDER:
        ROWS: tl.constexpr = w.shape[0]
        BLOCK_K: tl.constexpr = w.shape[1]
        w = tl.reshape(w, (ROWS, BLOCK_K // 64, 4, 4, 2, 2))  # stored (row, c, t, s, h, p)
        w = tl.reshape(tl.permute(w, (0, 1, 3, 4, 2, 5)), (ROWS, BLOCK_K))  # k = 64c + 16s + 8h + 2t + p
    return w


@triton.jit
def stored_inputs(columns, MMA_ORDER: tl.constexpr):
    """The input each stored column of a row holds: itself, or in the MMA order (kernels/int8.py) column
    64c + 16t + 4s + 2h + p holds input 64c + 16s + 8h + 2t + p."""
    if MMA_ORDER:
        chunk = columns // 64 * 64
        t, s, h, p = columns % 64 // 16, columns % 16 // 4, columns % 4 // 2, columns % 2
        columns = chunk + 16 * s + 8 * h + 2 * t + p
    return columns


@triton.jit
def load_stored_order(ptr, k_start, K, BLOCK_K: tl.constexpr, MMA_ORDER: tl.constexpr):
    """fp32 [BLOCK_K]: a row vector's inputs k_start + [0, BLOCK_K) (0 past K) in the order a weight tile
    stores its columns. The GEMVs multiply the tile as stored by x in that order rather than move the
    weight between threads; in the MMA order the inputs come in pairs, loaded
    as such (4 bytes of bf16), so the K loop's pipeline copies them ahead like the weight tile."""
    if MMA_ORDER:
        pairs = k_start + stored_inputs(tl.arange(0, BLOCK_K // 2) * 2, MMA_ORDER)
        inputs = pairs[:, None] + tl.arange(0, 2)[None, :]  # [BLOCK_K / 2, 2]
        vector = tl.load(ptr + inputs, mask=inputs < K, other=0.0)
        vector = tl.reshape(vector, (BLOCK_K,))
    else:
        inputs = k_start + tl.arange(0, BLOCK_K)
        vector = tl.load(ptr + inputs, mask=inputs < K, other=0.0)
    return vector.to(tl.float32)


@triton.jit
def chunks_in_input_order(w):
    """An MMA-order int8 tile loaded chunks first, [BLOCK_K // 64, rows, 64] (so shared memory holds
    each 64-byte chunk of the rows in a row: a warp's 128-bit loads of eight rows hit every bank once),
    as [rows, BLOCK_K] in input order. As wgmma's register operand, the compiler gives the load from
    shared memory the operand's layout through this permutation: each thread loads 16 consecutive bytes
    and nothing moves between threads."""
    CHUNKS: tl.constexpr = w.shape[0]
    ROWS: tl.constexpr = w.shape[1]
    w = tl.reshape(w, (CHUNKS, ROWS, 4, 4, 2, 2))  # (c, row, t, s, h, p)
    return tl.reshape(tl.permute(w, (1, 0, 3, 4, 2, 5)), (ROWS, CHUNKS * 64))


@triton.jit
def _gemv_kernel(
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
    pid = tl.program_id(0)
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


def _launch_gemv(
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


# ----------------------------------------------------------------------------------------------------------
# A few rows: skinny tensor-core GEMM, operands swapped, K split where N alone is too narrow
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _skinny_finish(
    acc,
    acc_up,
    bias_ptr,
    scale_ptr,
    out_ptr,
    offs_n,
    offs_m,
    M,
    N,
    stride_om,
    act_dtype: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,  # a scale per row here (group scales were applied in the K loop)
    GATE_UP: tl.constexpr,
):
    """acc [BLOCK_N, BLOCK_M] (out.T) -> out[m, n]: INT8 scales, bias, SwiGLU, rounded to the activation
    dtype first (as the reference's result is), then stored in out's dtype (fp32 logits may take bf16
    products)."""
    if HAS_SCALE:  # [N], or [2N] with GATE_UP; surplus rows re-read row N - 1
        rows = tl.minimum(offs_n, N - 1)
        acc *= tl.load(scale_ptr + rows)[:, None]
        if GATE_UP:
            acc_up *= tl.load(scale_ptr + N + rows)[:, None]
    if HAS_BIAS:  # [N], or [2N] with GATE_UP (the gate's, then the up's)
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
        if GATE_UP:
            acc_up += tl.load(bias_ptr + N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    if GATE_UP:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    tl.store(out_ptrs, acc.to(act_dtype).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _skinny_kernel(
    x_ptr,  # [M, K], K contiguous
    w_ptr,  # [N, K] or [2 * N, K] (GATE_UP: gate rows, then up rows), K contiguous; any float dtype, int8
    bias_ptr,  # [N], or [2N] with GATE_UP (HAS_BIAS)
    scale_ptr,  # fp32 (HAS_SCALE: int8 weights) [N] or [2N], or [rows, K / SCALE_GROUP]
    out_ptr,  # [M, N], N contiguous
    partials_ptr,  # fp32 [SPLIT_K, N (x2 with GATE_UP), BLOCK_M] (SPLIT_K > 1)
    counters_ptr,  # int32 [cdiv(N, BLOCK_N)]: splits done per column tile, zero between launches
    M,  # rows of x: in tiles of BLOCK_M (one tile when SPLIT_K > 1)
    N,  # output columns: weight rows, or intermediate size for GATE_UP
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SCALE_GROUP: tl.constexpr,  # 0: a scale per row (in the finish); else inputs per scale (in the loop)
    GATE_UP: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks in the K loop
    UPCAST: tl.constexpr,  # the interpreter: multiply in fp32 (it computes bf16 wrongly)
    MMA_ORDER: tl.constexpr,  # int8 values in the MMA order (BLOCK_K a multiple of 64)
    BLOCK_M: tl.constexpr,  # rows of x a program takes, a power of two >= 16 (the N of the MMA)
    BLOCK_N: tl.constexpr,  # weight rows per program (the M of the MMA)
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr = "tf32",  # "ieee" for fp32 inputs: exact fp32, not TF32
):
    act_dtype: tl.constexpr = x_ptr.dtype.element_ty
    # The row tiles of one weight tile are neighbours in launch order: the weight is read from DRAM once.
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % num_m_tiles
    pid_n = tl.program_id(0) // num_m_tiles
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past the edge re-read the last valid row (in bounds, no load masks); their results are not stored.
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_rows = tl.minimum(offs_m, M - 1).to(tl.int64)
    # This split's share of the K tiles (a trailing split may get none: it adds zeros).
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(num_k_tiles, SPLIT_K)
    tile_begin = pid_k * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_k_tiles)
    k_begin = tile_begin * BLOCK_K
    if MMA_ORDER:  # chunks first, [BLOCK_K // 64, BLOCK_N, 64] (chunks_in_input_order)
        chunk_starts = tl.arange(0, BLOCK_K // 64) * 64
        w_cols = k_begin + chunk_starts[:, None, None] + tl.arange(0, 64)[None, None, :]
        w_ptrs = w_ptr + w_rows[None, :, None] * stride_wn + w_cols
        w_up_ptrs = w_ptr + (w_rows + N)[None, :, None] * stride_wn + w_cols  # GATE_UP only
    else:  # [BLOCK_N, BLOCK_K]
        w_ptrs = w_ptr + w_rows[:, None] * stride_wn + (k_begin + offs_k)[None, :]
        w_up_ptrs = w_ptr + (w_rows + N)[:, None] * stride_wn + (k_begin + offs_k)[None, :]  # GATE_UP only
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + (k_begin + offs_k)[None, :]  # [BLOCK_M, BLOCK_K]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k_tile in range(tile_begin, tile_end):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = offs_k < K - k_tile * BLOCK_K
            # the MMA order's K is a multiple of 64: whole chunks are in or out
            w_mask = (chunk_starts < K - k_tile * BLOCK_K)[:, None, None] if MMA_ORDER else k_mask[None, :]
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if MMA_ORDER:
            w = chunks_in_input_order(w)
        # The weight-dtype hook: weights of another dtype than x (int8) are converted in registers here
        # (straight to fp32 in the interpreter, whose bf16 conversions are wrong; exact either way).
        if SCALE_GROUP > 0:
            w = widen(w, tl.float32) * group_scales(
                scale_ptr, w_rows, k_tile * BLOCK_K, K, SCALE_GROUP, BLOCK_K
            )
        if UPCAST:
            x = x.to(tl.float32)
            w = widen(w, tl.float32)
        else:
            w = widen(w, act_dtype)
        x_t = tl.trans(x)  # [BLOCK_K, BLOCK_M]
        acc = tl.dot(w, x_t, acc, input_precision=DOT_PRECISION)
        if GATE_UP:
            if EVEN_K:  # noqa: SIM108 (a constexpr branch)
                w_up = tl.load(w_up_ptrs)
            else:
                w_up = tl.load(w_up_ptrs, mask=w_mask, other=0.0)
            if MMA_ORDER:
                w_up = chunks_in_input_order(w_up)
            if SCALE_GROUP > 0:
                w_up = widen(w_up, tl.float32) * group_scales(
                    scale_ptr, w_rows + N, k_tile * BLOCK_K, K, SCALE_GROUP, BLOCK_K
                )
            if UPCAST:  # noqa: SIM108 (a constexpr branch)
                w_up = widen(w_up, tl.float32)
            else:
                w_up = widen(w_up, act_dtype)
            acc_up = tl.dot(w_up, x_t, acc_up, input_precision=DOT_PRECISION)
            w_up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if SPLIT_K == 1:
        _skinny_finish(acc, acc_up, bias_ptr, scale_ptr, out_ptr, offs_n, offs_m, M, N, stride_om,
                       act_dtype, HAS_BIAS, HAS_SCALE and SCALE_GROUP == 0, GATE_UP)  # fmt: skip
    else:
        # partials[split, column, row]: the up columns follow the N gate columns (GATE_UP)
        num_columns = 2 * N if GATE_UP else N
        slots = (pid_k * num_columns + tl.minimum(offs_n, N - 1)).to(tl.int64)[:, None] * BLOCK_M + offs_m[
            None, :
        ]
        tl.store(partials_ptr + slots, acc)
        if GATE_UP:
            tl.store(partials_ptr + slots + N * BLOCK_M, acc_up)
        # Every thread's partials are written (barrier) before one thread releases them with the counter;
        # the program that brings the count to SPLIT_K acquires them all and adds them in split order.
        tl.debug_barrier()
        done_before = tl.atomic_add(counters_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done_before == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            total_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            first = (tl.minimum(offs_n, N - 1)).to(tl.int64)[:, None] * BLOCK_M + offs_m[None, :]
            for split in range(SPLIT_K):  # loads bypass L1 (.cg): other SMs wrote them
                split_slots = first + split * num_columns * BLOCK_M
                total += tl.load(partials_ptr + split_slots, cache_modifier=".cg")
                if GATE_UP:
                    total_up += tl.load(partials_ptr + split_slots + N * BLOCK_M, cache_modifier=".cg")
            _skinny_finish(total, total_up, bias_ptr, scale_ptr, out_ptr, offs_n, offs_m, M, N, stride_om,
                           act_dtype, HAS_BIAS, HAS_SCALE and SCALE_GROUP == 0, GATE_UP)  # fmt: skip
            tl.store(counters_ptr + pid_n, 0)  # ready for the next launch (graph replay)


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


# The split-K scratch, one per device, allocated once outside any CUDA-graph capture and never grown (a
# captured graph keeps pointing at it). A launch that would need more splits than it holds uses fewer.
SKINNY_PARTIALS = 1 << 23  # fp32 elements: 32 MiB
SKINNY_COUNTERS = 1 << 14  # column tiles
_skinny_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _skinny_workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(partials, counters) for split-K launches on this device; None while a CUDA graph is being captured
    before the first eager launch allocated them (then the launch does not split K). Launches on one
    device share them, so they must run in stream order (the engine runs one step at a time)."""
    workspace = _skinny_workspaces.get(device)
    if workspace is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        workspace = (
            torch.empty(SKINNY_PARTIALS, dtype=torch.float32, device=device),
            torch.zeros(SKINNY_COUNTERS, dtype=torch.int32, device=device),
        )
        _skinny_workspaces[device] = workspace
    return workspace


def skinny_config(m: int, n: int, k: int, gate_up: bool, weights: str = "float") -> SkinnyConfig:
    """Tiles for the skinny GEMM: n output columns (intermediate size for gate/up), k = in_features.

    From the H200 sweep at 16 rows (bench/bench_linear.py --sweep): 128-column K steps in 4 stages; K is
    split 4 ways only for narrow outputs (n < 3072: o_proj, down_proj), whose column tiles alone would
    leave SMs idle; BLOCK_N is the widest of 64, 32, 16 weight rows that still makes about 96 programs.
    INT8 weights take 256-column K steps: the same bytes a stage. A tile measured fastest for this shape
    and weights on this GPU (tuned_config) takes precedence. Past SKINNY_MAX_M rows (INT8 weights in the
    MMA order: a prefill GEMM with swapped operands), 128 weight rows by 128 rows of x in two warpgroups,
    64 gate and 64 up rows in one, 64-column K steps in 4 stages (the 512-row sweep's picks on Qwen3-4B)."""
    tuned = tuned_config("skinny", m, n, k, gate_up, weights)
    if tuned is not None:
        return SkinnyConfig(**tuned)
    if m > SKINNY_MAX_M:
        return SkinnyConfig(64, 64, 1, 4, 4) if gate_up else SkinnyConfig(128, 64, 1, 8, 4)
    block_k = min(256 if weights == "int8" else 128, max(16, triton.next_power_of_2(k)))
    split_k = 1 if n >= 3072 else max(1, min(4, triton.cdiv(k, block_k) // 2))
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) * split_k < 96:
        block_n //= 2
    return SkinnyConfig(block_n, block_k, split_k, 4, 4)


def skinny_stages_that_fit(
    config: SkinnyConfig,
    block_m: int,
    gate_up: bool,
    x_bytes: int,
    w_bytes: int,
    scale_group: int,
    limit: int,
) -> int:
    """config's pipeline stages, fewer where they would pass `limit` bytes of shared memory. The model
    matches what Triton 3.6 and 3.9 allocate on sm_90: num_stages - 1 buffered K steps (the x tile, the
    weight tile or tiles, their group scales) plus 8 bytes an output element for the epilogue (fp32 x:
    at least the weight tile in fp32). In 4 stages, 64 gate/up rows take 241,664 bytes with group-32 INT8
    weights at Qwen3-4B's widths, and 237,568 in fp32 at SmolLM2's: past the H200's 232,448."""
    weight_tiles = 2 if gate_up else 1
    step = block_m * config.block_k * x_bytes + weight_tiles * config.block_n * config.block_k * w_bytes
    if scale_group:
        step += weight_tiles * config.block_n * max(1, config.block_k // scale_group) * 4
    epilogue = 8 * block_m * config.block_n
    if x_bytes == 4:  # fp32 (no tensor cores): the widened weight tile changes layout in shared memory
        epilogue = max(epilogue, 4 * config.block_n * config.block_k)
    stages = config.num_stages
    while stages > 2 and (stages - 1) * step + epilogue > limit:
        stages -= 1
    return stages


def _launch_skinny(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    gate_up: bool,
    config: SkinnyConfig | None = None,
    scale: torch.Tensor | None = None,
    scale_group: int = 0,
    mma_order: bool = False,
) -> None:
    """out may be float32 with bf16/fp16 x (logits): it then holds the x-dtype result, widened. Past
    SKINNY_MAX_M rows (INT8 weights in the MMA order only), x in tiles of SWAPPED_BLOCK_M rows, K unsplit."""
    m, k = x.shape
    n = out.shape[1]
    assert m <= SKINNY_MAX_M or mma_order, m
    config = config or skinny_config(m, n, k, gate_up, weights_kind(weight))
    if mma_order:
        # Under 64 weight rows a tile takes the older MMA (mma.sync), whose operand layout the compiler
        # does not reach through the MMA order (2-byte loads): 64 rows, and K split as much more.
        widen_by = max(1, WGMMA_MIN_ROWS // config.block_n)
        block_k = max(config.block_k, MMA_CHUNK)
        split_k = min(config.split_k * widen_by, triton.cdiv(k, block_k))
        config = config._replace(block_n=config.block_n * widen_by, block_k=block_k, split_k=split_k)
    block_m = min(max(16, triton.next_power_of_2(m)), SWAPPED_BLOCK_M)
    num_m_tiles = triton.cdiv(m, block_m)
    limit = shared_memory_per_block(x.device.index or 0)
    num_stages = skinny_stages_that_fit(
        config, block_m, gate_up, x.element_size(), weight.element_size(), scale_group, limit
    )
    block_n, block_k, split_k, num_warps, _ = config
    num_tiles = triton.cdiv(n, block_n)
    partials = counters = out  # never touched without a split
    if num_m_tiles > 1:
        split_k = 1  # the partials hold one tile of rows
    if split_k > 1:
        workspace = _skinny_workspace(x.device)
        columns = 2 * n if gate_up else n
        if workspace is None or num_tiles > workspace[1].numel():
            split_k = 1
        else:
            split_k = min(split_k, workspace[0].numel() // (columns * block_m))
            partials, counters = workspace
        split_k = max(split_k, 1)
    _skinny_kernel[(num_m_tiles * num_tiles, split_k)](
        x,
        weight,
        bias if bias is not None else out,  # never read without HAS_BIAS
        scale if scale is not None else out,  # never read without HAS_SCALE
        out,
        partials,
        counters,
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
        SPLIT_K=split_k,
        EVEN_K=k % block_k == 0,
        UPCAST=INTERPRET,
        MMA_ORDER=mma_order,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )


# ----------------------------------------------------------------------------------------------------------
# Prefill: tensor-core GEMM
# ----------------------------------------------------------------------------------------------------------


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


def _launch_gemm(
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


# Prefill with INT8 weights that dequantized_at_prefill picks: the whole weight dequantized once into a
# workspace in x's dtype, then the float GEMM on it. The INT8 GEMM above converts each weight tile in
# every program that reads it (every BLOCK_M rows of x) through shared memory; dequantizing costs three
# bytes a weight of memory traffic instead, about 70 us a Qwen3-4B layer on the H200. With two buffers
# and the decoder's order of weights, a side stream dequantizes the next weight while the GEMM multiplies
# by this one, so the two overlap.
INT8_DEQUANT_MIN_M = 256  # rows of x from which an INT8 weight is dequantized (H200: BENCHMARKS.md)


@dataclasses.dataclass
class _Prefetch:
    values_ptr: int  # the weight it dequantized (its int8 values' address)
    buffer: int
    done: torch.cuda.Event | None  # recorded on the side stream (None on the CPU: done already)
    captured: bool  # issued while a CUDA graph was being captured


class DequantWorkspace:
    """Buffers for dense copies of INT8 weights on one device, and which weight a forward takes next."""

    def __init__(self, device: torch.device, num_bytes: int, num_buffers: int) -> None:
        self.buffers = [torch.empty(num_bytes, dtype=torch.uint8, device=device) for _ in range(num_buffers)]
        self.successor: dict[int, KernelWeight] = {}  # values_ptr -> the next weight
        self.pending: _Prefetch | None = None
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def holds(self, weight: torch.Tensor, dtype: torch.dtype) -> bool:
        return weight.numel() * dtype.itemsize <= self.buffers[0].numel()

    def dense(self, weight: KernelWeight, dtype: torch.dtype) -> torch.Tensor:
        """weight dequantized in dtype (ahead, or now on this stream); the weight that follows started."""
        values = weight.values
        pending, self.pending = self.pending, None
        capturing = self.side is not None and torch.cuda.is_current_stream_capturing()
        index = 0
        if pending is not None and pending.captured != capturing:
            # issued outside this capture (a forward cut short): not waited on here, its buffer avoided
            index, pending = 1 - pending.buffer, None
        if pending is not None and pending.done is not None:
            torch.cuda.current_stream().wait_event(pending.done)  # joins the side stream either way
        if pending is not None and pending.values_ptr == values.data_ptr():
            index = pending.buffer
        else:
            index %= len(self.buffers)
            _dequantize(weight, self._view(index, values.shape, dtype))
        following = self.successor.get(values.data_ptr())
        if following is not None and len(self.buffers) > 1 and self.holds(following[0], dtype):
            self.pending = self._prefetch(following, 1 - index, dtype, capturing)
        return self._view(index, values.shape, dtype)

    def _prefetch(self, weight: KernelWeight, index: int, dtype: torch.dtype, capturing: bool) -> _Prefetch:
        """weight dequantized into buffer index on the side stream, after all work issued so far on this
        stream (the GEMM that last read that buffer is among it)."""
        dense = self._view(index, weight.values.shape, dtype)
        if self.side is None:
            _dequantize(weight, dense)
            return _Prefetch(weight.values.data_ptr(), index, None, capturing)
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            _dequantize(weight, dense)
            done = torch.cuda.Event()
            done.record(self.side)
        return _Prefetch(weight.values.data_ptr(), index, done, capturing)

    def _view(self, index: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return self.buffers[index][: shape.numel() * dtype.itemsize].view(dtype).view(shape)


_dequant_workspaces: dict[torch.device, DequantWorkspace] = {}
_replaced_workspaces: list[DequantWorkspace] = []  # kept: graphs captured before may still read them


def reserve_dequant_workspace(device: torch.device, num_bytes: int, num_buffers: int = 1) -> None:
    """Room for the largest INT8 weight in x's dtype (its numel x element size) on device, in num_buffers
    buffers (two let the next weight be dequantized ahead: prefetch_order). Call it before the graphs that
    use it are captured. A workspace is replaced only by a larger one, and the one replaced is kept
    allocated: a graph captured before (another engine's) keeps reading it. Without one (or too small) a
    prefill runs the INT8 GEMM."""
    device = torch.empty(0, device=device).device  # with its index ("cuda:0"), as tensors name it
    current = _dequant_workspaces.get(device)
    if current is None or current.buffers[0].numel() < num_bytes or len(current.buffers) < num_buffers:
        if current is not None:
            _replaced_workspaces.append(current)
        _dequant_workspaces[device] = DequantWorkspace(device, num_bytes, num_buffers)


def dequantized_at_prefill(rows: int, mma_order: bool) -> bool:
    """Whether an INT8 weight of this many rows is dequantized for prefill rows (from INT8_DEQUANT_MIN_M,
    given a workspace that holds it), rather than multiplied by the swapped-operand GEMM: weights in input
    order (group scales among them: the GEMM would scale every tile in fp32, and a Qwen3-4B-shaped Q8_0
    file prefilled 512 tokens at 31.0k tok/s so, against 37.4k dequantized) and narrow ones."""
    return not mma_order or rows < SWAPPED_MIN_ROWS


def _dequantized(weight: KernelWeight) -> bool:
    return dequantized_at_prefill(weight.values.shape[0], weight.mma_order)


def prefetch_order(weights: list[LinearWeight]) -> None:
    """The weights in the order a forward multiplies by them: each INT8 one that a prefill dequantizes
    dequantizes the next such one ahead, on a side stream (once reserve_dequant_workspace gave their
    device two buffers). It replaces the order given before for that device (another decoder's)."""
    int8 = [split(weight) for weight in weights if isinstance(weight, Int8Weight)]
    int8 = [weight for weight in int8 if _dequantized(weight)]
    for device in {weight.values.device for weight in int8} & _dequant_workspaces.keys():
        _dequant_workspaces[device].successor = {
            weight.values.data_ptr(): following
            for weight, following in zip(int8, int8[1:], strict=False)
            if weight.values.device == device
        }


@triton.jit
def _dequantize_kernel(
    values_ptr,  # int8 [rows, K], K contiguous
    scale_ptr,  # fp32 [rows, K / SCALE_GROUP] (SCALE_GROUP > 0)
    out_ptr,  # [rows, K] in the activations' dtype
    rows,
    K,
    SCALE_GROUP: tl.constexpr,  # 0: no scale (a per-row scale multiplies the GEMM's output columns)
    MMA_ORDER: tl.constexpr,  # values in the MMA order (BLOCK_K a multiple of 64)
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k_start = tl.program_id(1) * BLOCK_K
    offs_k = k_start + tl.arange(0, BLOCK_K)
    mask = (offs_r < rows)[:, None] & (offs_k < K)[None, :]
    slots = offs_r.to(tl.int64)[:, None] * K + offs_k[None, :]
    # put in input order in registers (scattered 2-byte stores of the stored order measured 3x slower)
    w = widen(input_order(tl.load(values_ptr + slots, mask=mask, other=0), MMA_ORDER), tl.float32)
    if SCALE_GROUP > 0:
        w *= group_scales(scale_ptr, tl.minimum(offs_r, rows - 1), k_start, K, SCALE_GROUP, BLOCK_K)
    tl.store(out_ptr + slots, w.to(out_ptr.dtype.element_ty), mask=mask)


def _dequantize(weight: KernelWeight, dense: torch.Tensor) -> None:
    """dense (x's dtype, the weight's shape, in input order) = values x their group scales; a per-row
    scale is left to the GEMM's output columns, and dense then holds the int8 values exactly."""
    rows, k = weight.values.shape
    block_k = min(256, triton.next_power_of_2(k))
    _dequantize_kernel[(triton.cdiv(rows, 16), triton.cdiv(k, block_k))](
        weight.values, weight.scale, dense, rows, k, SCALE_GROUP=weight.scale_group,
        MMA_ORDER=weight.mma_order, BLOCK_R=16, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------------------


def _check_and_make_out(
    x: torch.Tensor, weight: LinearWeight, n_out: int, out: torch.Tensor | None
) -> torch.Tensor:
    weight, scale, _, _ = split(weight)
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.dtype == weight.dtype or scale is not None, (x.dtype, weight.dtype)
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight rows must be contiguous"
    if out is None:
        return torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)
    assert out.shape == (x.shape[0], n_out) and out.stride(1) == 1, (out.shape, out.stride())
    assert out.dtype == x.dtype, (out.dtype, x.dtype)
    return out


def _launch(
    x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None, out: torch.Tensor, gate_up: bool
) -> torch.Tensor:
    kernel_weight = split(weight)
    weight, scale, scale_group, mma_order = kernel_weight
    m, k = x.shape
    if m == 0 or out.shape[1] == 0:
        return out
    if k == 0:
        # An empty sum: only the bias (or silu(0) * 0 = 0) remains.
        return out.copy_(bias.expand_as(out)) if bias is not None else out.zero_()
    int8 = {"scale": scale, "scale_group": scale_group, "mma_order": mma_order}
    workspace = _dequant_workspaces.get(x.device)
    through_workspace = (
        scale is not None
        and m >= INT8_DEQUANT_MIN_M
        and workspace is not None
        and workspace.holds(weight, x.dtype)
    )
    swapped = mma_order and not (through_workspace and _dequantized(kernel_weight))
    if m <= GEMV_MAX_M:
        _launch_gemv(x, weight, bias, out, gate_up, **int8)
    elif m <= SKINNY_MAX_M or swapped:
        _launch_skinny(x, weight, bias, out, gate_up, **int8)
    elif through_workspace:
        dense = workspace.dense(kernel_weight, x.dtype)  # group scales applied, per-row not
        _launch_gemm(x, dense, bias, out, gate_up, scale=None if scale_group else scale)
    else:
        _launch_gemm(x, weight, bias, out, gate_up, **int8)
    return out


def linear_triton(
    x: torch.Tensor,
    weight: LinearWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """As linear_reference: one launch (two for an INT8 weight's prefill, dequantized first), no host
    sync, no allocation when out is given."""
    out = _check_and_make_out(x, weight, weight.shape[0], out)
    if bias is not None:
        assert bias.shape == (weight.shape[0],) and bias.stride(0) == 1, bias.shape
    return _launch(x, weight, bias, out, gate_up=False)


def gate_up_silu_triton(
    x: torch.Tensor, weight: LinearWeight, out: torch.Tensor | None = None
) -> torch.Tensor:
    """As gate_up_silu_reference: one launch; the [M, 2I] gate/up activations stay in registers."""
    assert weight.shape[0] % 2 == 0, weight.shape
    out = _check_and_make_out(x, weight, weight.shape[0] // 2, out)
    return _launch(x, weight, None, out, gate_up=True)
