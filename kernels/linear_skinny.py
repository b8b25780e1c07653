"""A few rows of x (2 <= M <= SKINNY_MAX_M: batched decode, verify steps, small prefill chunks): a skinny
GEMM on the tensor cores with the operands swapped, out.T = W @ x.T, so the weight's rows fill the MMA's
large dimension and the few rows of x its small one (padded to 16). Each weight tile is read once for
every row of x, so the step reads each weight once whatever the batch. Where N alone gives too few
programs for the SMs, K is split; each split writes fp32 partials into a SplitKScratch and the last split
of a column tile to finish (an atomic counter) adds them up in split order: deterministic, one launch.
INT8 weights in the MMA order (kernels/int8.py) take this kernel past SKINNY_MAX_M rows too (a prefill
GEMM with swapped operands), x in tiles of SWAPPED_BLOCK_M rows."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from tileinfer.kernels.int8 import MMA_CHUNK
from tileinfer.kernels.linear_tiles import chunks_in_input_order, group_scales, widen
from tileinfer.kernels.linear_tuned import tuned_config, weights_kind
from tileinfer.kernels.triton_common import INTERPRET, shared_memory_per_block

SKINNY_MAX_M = 64  # rows of x up to which the skinny GEMM runs (past it: the tiled GEMM)
# INT8 weights in the MMA order take the skinny kernel past SKINNY_MAX_M too (the swapped-operand GEMM), x
# in tiles of this many rows.
SWAPPED_BLOCK_M = 128
WGMMA_MIN_ROWS = 64  # a skinny tile's weight rows from which Hopper's wgmma multiplies them


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


# The split-K scratch's size, never grown (a captured graph keeps pointing at it). A launch that would need
# more splits than it holds uses fewer.
SKINNY_PARTIALS = 1 << 23  # fp32 elements: 32 MiB
SKINNY_COUNTERS = 1 << 14  # column tiles


@dataclasses.dataclass(frozen=True)
class SplitKScratch:
    """Where split-K launches leave their partials. Allocate it outside any CUDA-graph capture and keep it
    as long as the graphs that read it. Launches that share one must run in stream order (a decoder runs
    one step at a time)."""

    partials: torch.Tensor  # fp32 [SKINNY_PARTIALS]
    counters: torch.Tensor  # int32 [SKINNY_COUNTERS]: splits done per column tile, zero between launches

    @classmethod
    def allocate(cls, device: torch.device) -> SplitKScratch:
        return cls(
            torch.empty(SKINNY_PARTIALS, dtype=torch.float32, device=device),
            torch.zeros(SKINNY_COUNTERS, dtype=torch.int32, device=device),
        )


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


def launch_skinny(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    gate_up: bool,
    config: SkinnyConfig | None = None,
    scale: torch.Tensor | None = None,
    scale_group: int = 0,
    mma_order: bool = False,
    scratch: SplitKScratch | None = None,
) -> None:
    """out may be float32 with bf16/fp16 x (logits): it then holds the x-dtype result, widened. Past
    SKINNY_MAX_M rows (INT8 weights in the MMA order only), x in tiles of SWAPPED_BLOCK_M rows, K unsplit.
    Without a scratch K is not split."""
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
        columns = 2 * n if gate_up else n
        if scratch is None or num_tiles > scratch.counters.numel():
            split_k = 1
        else:
            split_k = min(split_k, scratch.partials.numel() // (columns * block_m))
            partials, counters = scratch.partials, scratch.counters
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
