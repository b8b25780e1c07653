"""Linear layers: y = x @ weight.T (+ bias), and the MLP's gate/up projection fused with SwiGLU.

Weights are in the Hugging Face layout [out_features, in_features], row-major. The engine fuses
q/k/v into one [q_size + 2 * kv_size, hidden] weight and gate/up into one [2 * intermediate, hidden]
weight (gate rows first, then up rows).

Two Triton kernels serve every call, picked by the number of rows of x:
- decode (M <= 8): a GEMV. Each program owns BLOCK_N whole output columns (weight rows) and streams
  them over its slice of K with 16-byte loads, multiply-adding into an fp32 register tile that is
  reduced once at the end. Where K is long for the row count (the program would loop over K, one
  dependent DRAM round trip per iteration, with few programs in flight), K is split: SPLIT_K programs
  per row block each stream one K-slice in one go.
- prefill (M > 8): a tiled GEMM on the tensor cores (tl.dot, bf16 in, fp32 accumulation), tiles chosen
  per shape by a small cost model (waves over the SMs x K steps per program), grouped tile order for L2
  reuse; split-K where the output has too few tiles to fill the SMs (small N, long K).

Split-K is one launch and deterministic: each program writes its fp32 partial tile to a workspace and
bumps the tile's counter; the program that brings the count to SPLIT_K sums the partials in split
order (0, 1, ...), adds the bias / applies SwiGLU, writes the output and resets the counter to zero
for the next launch (CUDA-graph replay). The workspace is cached per device (see _workspace).

The gate/up kernels compute the matching gate and up columns in the same program and write
silu(gate) * up, so the [M, 2 * intermediate] activation never reaches memory.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.activation import silu_and_mul_reference
from kernels.triton_common import INTERPRET, num_sms

# Up to this many rows of x take the GEMV; more take the tensor-core GEMM.
GEMV_MAX_M = 8


# ----------------------------------------------------------------------------------------------------------
# References (the CPU path and the ground truth)
# ----------------------------------------------------------------------------------------------------------


def linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T + bias [N] -> [M, N] (torch.nn.functional.linear)."""
    result = F.linear(x, weight, bias)
    if out is None:
        return result
    return out.copy_(result)


def gate_up_silu_reference(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) -> [M, I], where weight [2I, K] holds the gate rows, then the up rows."""
    intermediate = weight.shape[0] // 2
    gate_up = F.linear(x, weight)
    result = silu_and_mul_reference(gate_up[..., :intermediate], gate_up[..., intermediate:])
    if out is None:
        return result
    return out.copy_(result)


# ----------------------------------------------------------------------------------------------------------
# The output tile: bias, SwiGLU, store; and the split-K reduction (shared by the GEMV and the GEMM)
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _write_output(acc, acc_up, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, GATE_UP):
    """out[offs_m, offs_n] = acc (+ bias), or silu(acc) * acc_up for GATE_UP; acc [BLOCK_M, BLOCK_N] fp32."""
    n_mask = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GATE_UP:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & n_mask[None, :])


@triton.jit
def _split_k_epilogue(
    acc,
    acc_up,
    partials_ptr,  # fp32 [tiles, NUM_PARTS, SPLIT_K, BLOCK_M, BLOCK_N]
    counters_ptr,  # int32 [tiles]: splits of the tile done so far, zero between launches
    tile,
    split,
    bias_ptr,
    out_ptr,
    offs_m,
    offs_n,
    M,
    N,
    stride_om,
    HAS_BIAS: tl.constexpr,
    GATE_UP: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_PARTS: tl.constexpr,  # 2 for GATE_UP (gate and up partials), else 1
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Store this split's partial tile; the split that completes the tile sums all SPLIT_K partials in
    split order (deterministic whatever the arrival order) and writes the output."""
    slots = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_base = partials_ptr + tile.to(tl.int64) * (NUM_PARTS * SPLIT_K * BLOCK_M * BLOCK_N)
    tl.store(tile_base + split * (BLOCK_M * BLOCK_N) + slots, acc)
    if GATE_UP:
        tl.store(tile_base + (SPLIT_K + split) * (BLOCK_M * BLOCK_N) + slots, acc_up)
    # Every thread's partials are written (barrier) before one thread releases them with the counter;
    # the program that brings the count to SPLIT_K acquires them all (as kernels/attention.py's decode).
    tl.debug_barrier()
    done_before = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if done_before == SPLIT_K - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            # .cg: read from L2, where the other programs' partials are, not from a stale L1 line
            total += tl.load(tile_base + s * (BLOCK_M * BLOCK_N) + slots, cache_modifier=".cg")
            if GATE_UP:
                up_slots = tile_base + (SPLIT_K + s) * (BLOCK_M * BLOCK_N) + slots
                total_up += tl.load(up_slots, cache_modifier=".cg")
        _write_output(total, total_up, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, GATE_UP)
        tl.store(counters_ptr + tile, 0)  # ready for the next launch (graph replay)


@dataclasses.dataclass
class _Workspace:
    partials: torch.Tensor  # fp32, flat
    counters: torch.Tensor  # int32, zero between launches (each launch's reducing programs reset theirs)
    captured: bool = False  # a captured CUDA graph holds these addresses: never free them


# The split-K workspace of each device, shared by every split-K launch on it (launches on one stream run
# one after another; concurrent split-K launches on two streams of one device are not supported).
_WORKSPACES: dict[torch.device, _Workspace] = {}
# Outgrown workspaces that a captured graph still points at; kept alive for as long as the process.
_RETIRED_WORKSPACES: list[_Workspace] = []


def _workspace(device: torch.device, partials_numel: int, counters_numel: int) -> _Workspace:
    """The device's workspace, grown (never shrunk) to hold at least the given numbers of elements.

    Allocated (and its counters zeroed) outside CUDA graph capture only: a buffer allocated during
    capture would come from the graph's private pool and its zero fill would only run at replay. Every
    shape's first call is outside capture in the engine (a warm-up step precedes each capture), so a
    capture finds the workspace it needs; if not, this raises rather than capture garbage counters.
    A workspace used during a capture is kept alive when outgrown, since the graph holds its address."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    workspace = _WORKSPACES.get(device)
    if (
        workspace is None
        or workspace.partials.numel() < partials_numel
        or (workspace.counters.numel() < counters_numel)
    ):
        if capturing:
            raise RuntimeError(
                "kernels.linear: the split-K workspace for this shape was not allocated before CUDA graph "
                "capture; run the same call once outside the capture first (a warm-up step)"
            )
        if workspace is not None:
            if workspace.captured:
                _RETIRED_WORKSPACES.append(workspace)
            partials_numel = max(partials_numel, workspace.partials.numel())
            counters_numel = max(counters_numel, workspace.counters.numel())
        workspace = _Workspace(
            partials=torch.empty(partials_numel, dtype=torch.float32, device=device),
            counters=torch.zeros(counters_numel, dtype=torch.int32, device=device),
        )
        _WORKSPACES[device] = workspace
    if capturing:
        workspace.captured = True
    return workspace


# ----------------------------------------------------------------------------------------------------------
# Decode: GEMV, each program owns whole output columns over a slice of K
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K], K contiguous
    w_ptr,  # [N, K] or [2 * N, K] (GATE_UP: gate rows, then up rows), K contiguous
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N], N contiguous
    partials_ptr,  # split-K workspace (SPLIT_K > 1)
    counters_ptr,  # split-K counters (SPLIT_K > 1)
    M,
    N,  # output columns: weight rows, or intermediate size for GATE_UP
    K,
    k_per_split,  # K columns per split, a multiple of 16 (SPLIT_K > 1)
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    GATE_UP: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # next power of two >= M (all rows of x in one program)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # The products are formed in fp32 on every path (weights are upcast on load), so there is no bf16
    # arithmetic for the interpreter to get wrong and no UPCAST flag is needed here.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    # The last program's surplus rows re-read row N - 1 (in bounds) and are not stored: no row mask on loads.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    gate_rows = w_ptr + rows[:, None] * stride_wn  # [BLOCK_N, 1]
    up_rows = w_ptr + (rows + N)[:, None] * stride_wn  # [BLOCK_N, 1] (GATE_UP only)
    offs_k0 = tl.arange(0, BLOCK_K)
    k_begin = 0
    k_end = K
    if SPLIT_K > 1:
        # k_per_split and K are multiples of 16 on the real shapes, so the masks stay 16-byte vectorizable.
        k_begin = split * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, K)

    if BLOCK_M == 1:
        # [BLOCK_N, BLOCK_K] partial sums, reduced across K once after the loop.
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            offs_k = k0 + offs_k0
            k_mask = offs_k < k_end
            xk = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            w = tl.load(gate_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
            acc += w.to(tl.float32) * xk
            if GATE_UP:
                w_up = tl.load(up_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
                acc_up += w_up.to(tl.float32) * xk
        result = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
        result_up = tl.sum(acc_up, axis=1)[None, :]
    else:
        # A few rows of x (batched decode): [BLOCK_M, BLOCK_N, BLOCK_K] partial sums; each weight tile
        # is loaded once and used for every row of x.
        m_mask = offs_m < M
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            offs_k = k0 + offs_k0
            k_mask = offs_k < k_end
            xk = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            xk = xk.to(tl.float32)[:, None, :]  # [BLOCK_M, 1, BLOCK_K]
            w = tl.load(gate_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
            acc += w.to(tl.float32)[None, :, :] * xk
            if GATE_UP:
                w_up = tl.load(up_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
                acc_up += w_up.to(tl.float32)[None, :, :] * xk
        result = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
        result_up = tl.sum(acc_up, axis=2)

    if SPLIT_K == 1:
        _write_output(
            result, result_up, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, GATE_UP
        )
    else:
        _split_k_epilogue(
            result, result_up, partials_ptr, counters_ptr, pid, split, bias_ptr, out_ptr, offs_m, offs_n,
            M, N, stride_om, HAS_BIAS, GATE_UP, SPLIT_K, NUM_PARTS, BLOCK_M, BLOCK_N,
        )  # fmt: skip


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    split_k: int = 1  # programs per row block, each over one K-slice (see _k_per_split)


# Accumulators per thread that a GEMV program's [BLOCK_M, BLOCK_N, BLOCK_K] fp32 tile may take.
GEMV_ACC_PER_THREAD = 64
# With at least this many row blocks per SM, a GEMV loops over K rather than splitting it (the LM heads:
# thousands of programs keep the memory system busy and there is nothing to reduce).
GEMV_LOOP_ROW_BLOCKS_PER_SM = 16


def _k_per_split(k: int, split_k: int) -> int:
    """K columns per split: an even share rounded up to 16 (16-byte aligned, vectorizable slices)."""
    return triton.cdiv(triton.cdiv(k, split_k), 16) * 16


def gemv_config(m: int, n: int, k: int, gate_up: bool) -> GemvConfig:
    """Tiles for the GEMV: n output columns (intermediate size for gate/up), k = in_features.

    BLOCK_K fills a budget of 64 fp32 accumulators per thread for the BLOCK_N rows, so that every thread
    has 4-8 16-byte loads in flight per iteration. BLOCK_N is the largest power of two <= 32 (16 for
    gate/up, which streams two tiles) that still gives >= 4 programs per SM; if that gives so many
    programs that the loop hardly matters (the LM heads), that is the tile; if it, or one with fewer
    rows (down to 8), covers K in one iteration, so is that. Otherwise each program would walk K
    serially, one dependent DRAM round trip per iteration, with too little in flight per SM (the 4B
    shapes, K = 2560-9728): split K instead, with 16 rows per program (8 for gate/up; fewer for several
    rows of x) and one BLOCK_K-wide slice per program, so that every program issues all its loads
    (16 KB of weights at M = 1) at once and the grid is several waves."""
    block_m = triton.next_power_of_2(m)
    tiles = 2 if gate_up else 1
    num_warps = 4 if block_m <= 2 else 8
    budget = GEMV_ACC_PER_THREAD * 32 * num_warps  # fp32 accumulator elements per program
    k_cap = max(16, triton.next_power_of_2(k))

    def block_k_for(block_n: int) -> int:
        return min(k_cap, max(16, budget // (block_m * block_n * tiles)))

    block_n = 16 if gate_up else 32
    while block_n > 1 and triton.cdiv(n, block_n) < 4 * num_sms():
        block_n //= 2
    block_k = block_k_for(block_n)
    if triton.cdiv(n, block_n) >= GEMV_LOOP_ROW_BLOCKS_PER_SM * num_sms():
        return GemvConfig(block_n, block_k, num_warps)
    # Fewer rows per program (not below 8 at M = 1, so that each x slice still serves several rows) may
    # cover K in one iteration without a split.
    min_block_n = max(1, (4 if gate_up else 8) // block_m)
    while k > block_k and block_n > min_block_n:
        block_n //= 2
        block_k = block_k_for(block_n)
    if k <= block_k:
        return GemvConfig(block_n, block_k, num_warps)

    block_n = max(1, (8 if gate_up else 16) // block_m)
    block_k = block_k_for(block_n)
    split_k = triton.cdiv(k, block_k)
    k_per_split = _k_per_split(k, split_k)
    split_k = triton.cdiv(k, k_per_split)  # no empty splits
    block_k = min(block_k, max(16, triton.next_power_of_2(k_per_split)))
    return GemvConfig(block_n, block_k, num_warps, split_k)


def _launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    gate_up: bool,
    config: GemvConfig | None = None,
) -> None:
    m, k = x.shape
    n = out.shape[1]
    block_n, block_k, num_warps, split_k = config or gemv_config(m, n, k, gate_up)
    block_m = triton.next_power_of_2(m)
    row_blocks = triton.cdiv(n, block_n)
    num_parts = 2 if gate_up else 1
    partials, counters = out, out  # never touched when split_k == 1
    if split_k > 1:
        workspace = _workspace(x.device, row_blocks * num_parts * split_k * block_m * block_n, row_blocks)
        partials, counters = workspace.partials, workspace.counters
    _gemv_kernel[(row_blocks, split_k)](
        x,
        weight,
        bias if bias is not None else out,  # never read without HAS_BIAS
        out,
        partials,
        counters,
        m,
        n,
        k,
        _k_per_split(k, split_k) if split_k > 1 else k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        GATE_UP=gate_up,
        SPLIT_K=split_k,
        NUM_PARTS=num_parts,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )


# ----------------------------------------------------------------------------------------------------------
# Prefill: tensor-core GEMM
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _gemm_kernel(
    x_ptr,  # [M, K], K contiguous
    w_ptr,  # [N, K] or [2 * N, K] (GATE_UP), K contiguous
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N], N contiguous
    partials_ptr,  # split-K workspace (SPLIT_K > 1)
    counters_ptr,  # split-K counters (SPLIT_K > 1)
    M,
    N,  # output columns: weight rows, or intermediate size for GATE_UP
    K,
    k_tiles_per_split,  # BLOCK_K steps per split (SPLIT_K > 1)
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    GATE_UP: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks in the K loop
    UPCAST: tl.constexpr,  # the interpreter: multiply in fp32 (it computes bf16 wrongly)
    SPLIT_K: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr = "tf32",  # "ieee" for fp32 inputs: exact fp32, not TF32
):
    # Grouped order: GROUP_M row-tiles share each weight column-tile while it is hot in L2.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    num_k_tiles = tl.cdiv(K, BLOCK_K)
    k_tile_begin = 0
    k_tile_end = num_k_tiles
    if SPLIT_K > 1:
        k_tile_begin = split * k_tiles_per_split
        k_tile_end = tl.minimum(k_tile_begin + k_tiles_per_split, num_k_tiles)

    # Rows and columns past the edge wrap around to valid ones (loads stay in bounds without masks);
    # the store is masked.
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    first_k = k_tile_begin * BLOCK_K
    x_ptrs = x_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_xm + (first_k + offs_k)[None, :]
    w_rows = (offs_n % N).to(tl.int64)
    w_ptrs = w_ptr + w_rows[None, :] * stride_wn + (first_k + offs_k)[:, None]  # [BLOCK_K, BLOCK_N]
    w_up_ptrs = w_ptr + (w_rows + N)[None, :] * stride_wn + (first_k + offs_k)[:, None]  # GATE_UP only

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_tile in range(k_tile_begin, k_tile_end):
        k_left = K - k_tile * BLOCK_K
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATE_UP:
            if EVEN_K:
                b_up = tl.load(w_up_ptrs)
            else:
                b_up = tl.load(w_up_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if UPCAST:
                b_up = b_up.to(tl.float32)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
            w_up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if SPLIT_K == 1:
        _write_output(acc, acc_up, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, GATE_UP)
    else:
        _split_k_epilogue(
            acc, acc_up, partials_ptr, counters_ptr, pid, split, bias_ptr, out_ptr, offs_m, offs_n,
            M, N, stride_om, HAS_BIAS, GATE_UP, SPLIT_K, NUM_PARTS, BLOCK_M, BLOCK_N,
        )  # fmt: skip


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs per output tile, each over one share of the BLOCK_K steps


# Candidate tiles, largest first, with the fraction of an SM's tensor-core peak that one program on that
# tile reached in bench/bench_linear.py on the H200 (M = 512, triton 3.6; 64-wide tiles guessed). For
# gate/up the two accumulators make BLOCK_N count double.
GEMM_CANDIDATES: tuple[tuple[GemmConfig, float], ...] = (
    (GemmConfig(128, 256, 64, 8, 3), 0.55),
    (GemmConfig(128, 128, 64, 8, 4), 0.65),
    (GemmConfig(128, 64, 64, 4, 4), 0.55),
    (GemmConfig(64, 128, 64, 4, 4), 0.5),
    (GemmConfig(64, 64, 64, 4, 4), 0.4),
    (GemmConfig(64, 32, 64, 4, 4), 0.3),
)
GATE_UP_CANDIDATES: tuple[tuple[GemmConfig, float], ...] = (
    (GemmConfig(128, 128, 64, 8, 3), 0.5),
    (GemmConfig(128, 64, 64, 8, 4), 0.55),
    (GemmConfig(128, 32, 64, 4, 4), 0.45),
    (GemmConfig(64, 64, 64, 4, 4), 0.4),
    (GemmConfig(64, 32, 64, 4, 4), 0.3),
    (GemmConfig(64, 16, 64, 4, 4), 0.2),
)
GEMM_SPLIT_K = (1, 2, 3, 4, 6, 8)
# The cost model's machine: one H200 SM's dense bf16 tensor-core rate (989 TFLOP/s / 132) and shared
# memory; the least time of one BLOCK_K step of a program (load latency: small tiles do not reach the
# tensor-core rate, measured ~0.3 us); the rate at which split-K partials are written and read back
# (mostly in the 50 MB L2) and the latency the reduction adds (counter atomic, reading the partials).
SM_FLOPS = 7.5e12
SM_SHARED_BYTES = 227 * 1024
STEP_LATENCY_S = 0.3e-6
PARTIALS_BYTES_PER_S = 8e12
SPLIT_K_LATENCY_S = 1e-6
# Split-K is considered only while its fp32 partials (all splits) stay within this (and the L2).
GEMM_MAX_PARTIAL_BYTES = 32 * 2**20


def gemm_seconds(m: int, n: int, k: int, gate_up: bool, config: GemmConfig, throughput: float) -> float:
    """The cost model: estimated seconds of the GEMM with this tile and split (launch costs left out).

    Each SM runs cdiv(programs, SMs) programs, up to `slots` at a time (shared memory of the pipeline
    stages); each program runs cdiv(K steps, split_k) BLOCK_K steps, a step taking the tile's flops at
    `throughput` of the SM's rate shared among the programs running on it, or the step latency if
    longer. Split-K adds its fp32 partials written and read back and the reduction's latency."""
    parts = 2 if gate_up else 1
    sms = num_sms()
    element_size = 2
    stage_bytes = config.block_k * (config.block_m + parts * config.block_n) * element_size
    slots = max(1, min(4, SM_SHARED_BYTES // (stage_bytes * config.num_stages)))
    programs = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n) * config.split_k
    per_sm = triton.cdiv(programs, sms)
    concurrent = min(per_sm, slots)
    # A tile clipped by m does proportionally less work but does not get faster per element.
    step_flops = 2 * config.block_m * config.block_n * parts * config.block_k
    step_seconds = max(STEP_LATENCY_S, concurrent * step_flops / (SM_FLOPS * throughput))
    steps = triton.cdiv(triton.cdiv(k, config.block_k), config.split_k)
    seconds = triton.cdiv(per_sm, slots) * steps * step_seconds
    if config.split_k > 1:
        seconds += 2 * config.split_k * m * n * parts * 4 / PARTIALS_BYTES_PER_S + SPLIT_K_LATENCY_S
    return seconds


def gemm_config(m: int, n: int, k: int, gate_up: bool, element_size: int = 2) -> GemmConfig:
    """The candidate tile and split with the least estimated time (gemm_seconds).

    Split-K is tried only when the output has fewer tiles than SMs (small N, long K: o, down and qkv at
    M = 512), each split keeps >= 4 BLOCK_K steps and the partials fit GEMM_MAX_PARTIAL_BYTES.
    BLOCK_M is capped at the next power of two >= m (at least 16, the smallest tl.dot). BLOCK_K is 128
    bytes of a row (64 bf16, 32 fp32) unless k is smaller, which keeps 3-4 pipeline stages of the
    largest tiles within the 227 KB of shared memory."""
    block_m_cap = max(16, triton.next_power_of_2(m))
    block_k = min(128 // element_size, max(16, triton.next_power_of_2(k)))
    k_tiles = triton.cdiv(k, block_k)
    parts = 2 if gate_up else 1
    best: GemmConfig | None = None
    best_seconds = float("inf")
    for candidate, throughput in GATE_UP_CANDIDATES if gate_up else GEMM_CANDIDATES:
        block_m = min(candidate.block_m, block_m_cap)
        throughput *= min(1.0, block_m / candidate.block_m) ** 0.5
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, candidate.block_n)
        for split_k in GEMM_SPLIT_K:
            if split_k > 1 and (
                tiles >= num_sms()
                or k_tiles < 4 * split_k
                or split_k * m * n * parts * 4 > GEMM_MAX_PARTIAL_BYTES
            ):
                continue
            config = candidate._replace(block_m=block_m, block_k=block_k, split_k=split_k)
            seconds = gemm_seconds(m, n, k, gate_up, config, throughput)
            if seconds < best_seconds:
                best_seconds = seconds
                best = config
    assert best is not None
    return best


def _launch_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    gate_up: bool,
    config: GemmConfig | None = None,
) -> None:
    m, k = x.shape
    n = out.shape[1]
    block_m, block_n, block_k, num_warps, num_stages, split_k = config or gemm_config(
        m, n, k, gate_up, x.element_size()
    )
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    num_parts = 2 if gate_up else 1
    k_tiles_per_split = triton.cdiv(triton.cdiv(k, block_k), split_k)
    partials, counters = out, out  # never touched when split_k == 1
    if split_k > 1:
        workspace = _workspace(x.device, tiles * num_parts * split_k * block_m * block_n, tiles)
        partials, counters = workspace.partials, workspace.counters
    _gemm_kernel[(tiles, split_k)](
        x,
        weight,
        bias if bias is not None else out,  # never read without HAS_BIAS
        out,
        partials,
        counters,
        m,
        n,
        k,
        k_tiles_per_split,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        GATE_UP=gate_up,
        EVEN_K=k % block_k == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=INTERPRET,
        SPLIT_K=split_k,
        NUM_PARTS=num_parts,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=8,
        num_warps=num_warps,
        num_stages=num_stages,
    )


# ----------------------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------------------

# Per-shape configs measured best on the H200 (bench/bench_linear.py --sweep prints entries to paste here);
# they override the heuristics for bf16/fp16 weights. Key: (m, n, k, gate_up), where n is the output
# width (the intermediate size for gate/up) and m is the row count for decode (m <= GEMV_MAX_M) or, for
# prefill, the next power of two >= m. A GemmConfig may serve a decode shape (BLOCK_M = 16, tensor cores).
TUNED: dict[tuple[int, int, int, bool], GemvConfig | GemmConfig] = {}


def tuned_key(m: int, n: int, k: int, gate_up: bool) -> tuple[int, int, int, bool]:
    return (m if m <= GEMV_MAX_M else max(16, triton.next_power_of_2(m)), n, k, gate_up)


def pick_config(m: int, n: int, k: int, gate_up: bool, element_size: int = 2) -> GemvConfig | GemmConfig:
    """TUNED's entry for the shape, else the GEMV heuristic (m <= GEMV_MAX_M) or the GEMM one."""
    if element_size == 2 and (tuned := TUNED.get(tuned_key(m, n, k, gate_up))) is not None:
        return tuned
    if m <= GEMV_MAX_M:
        return gemv_config(m, n, k, gate_up)
    return gemm_config(m, n, k, gate_up, element_size)


def _check_and_make_out(
    x: torch.Tensor, weight: torch.Tensor, n_out: int, out: torch.Tensor | None
) -> torch.Tensor:
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.dtype == weight.dtype, (x.dtype, weight.dtype)
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight rows must be contiguous"
    if out is None:
        return torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)
    assert out.shape == (x.shape[0], n_out) and out.stride(1) == 1, (out.shape, out.stride())
    assert out.dtype == x.dtype, (out.dtype, x.dtype)
    return out


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    gate_up: bool,
    config: GemvConfig | GemmConfig | None = None,
) -> torch.Tensor:
    m, k = x.shape
    n = out.shape[1]
    if m == 0 or n == 0:
        return out
    if k == 0:
        # An empty sum: only the bias (or silu(0) * 0 = 0) remains.
        return out.copy_(bias.expand_as(out)) if bias is not None else out.zero_()
    config = config or pick_config(m, n, k, gate_up, x.element_size())
    if isinstance(config, GemvConfig):
        _launch_gemv(x, weight, bias, out, gate_up, config)
    else:
        _launch_gemm(x, weight, bias, out, gate_up, config)
    return out


def linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """As linear_reference: one launch, no host sync, no allocation when out is given (a split-K
    shape's first call allocates the cached workspace; make it outside CUDA graph capture)."""
    out = _check_and_make_out(x, weight, weight.shape[0], out)
    if bias is not None:
        assert bias.shape == (weight.shape[0],) and bias.stride(0) == 1, bias.shape
    return _launch(x, weight, bias, out, gate_up=False)


def gate_up_silu_triton(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """As gate_up_silu_reference: one launch; the [M, 2I] gate/up activations stay in registers. Same
    allocation rules as linear_triton."""
    assert weight.shape[0] % 2 == 0, weight.shape
    out = _check_and_make_out(x, weight, weight.shape[0] // 2, out)
    return _launch(x, weight, None, out, gate_up=True)
