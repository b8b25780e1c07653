"""Every decoder layer of a one-sequence decode step in one launch: a persistent kernel.

The kernel-per-operation step launches six kernels a layer, and each pays a ramp and a tail (filling the
GPU, waiting on its first loads, draining its last wave). Here one grid of programs, all resident at
once, walks the layers' operations in order:

    0  residual add + RMSNorm + QKV GEMV        (norm_linear.add_rms_norm_gemv_program)
    1  q/k RMSNorm + RoPE + the KV-cache write  (qkv_epilogue.qkv_epilogue_program)
    2  split-KV decode attention                (decode_attention.decode_attention_program)
    3  o_proj GEMV                              (linear_gemv.gemv_program)
    4  residual add + RMSNorm + gate/up SwiGLU  (norm_linear.add_rms_norm_gemv_program)
    5  down_proj GEMV                           (linear_gemv.gemv_program)

Each operation deals its tiles (the programs of its own kernel) to the grid's programs in turn, and
every program waits at a grid barrier before the next operation: blocks synchronise through one
counter in global memory. The per-operation programs are the same code as the standalone kernels'.

The layers' weights are stacked, one tensor a kind [num_layers, ...] (LayerStack), so a layer is an
offset. The grid must fit on the GPU at once, or the barrier never opens: the launcher compiles first
and refuses a grid larger than the compiled kernel's occupancy allows. Under the CPU interpreter, which
runs programs one at a time, the barrier is compiled out (SYNC) and the launcher runs one launch per
operation instead, so the CPU tests check the arithmetic and the tile dealing.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from tileinfer.kernels.decode_attention import DecodeWorkspace, decode_attention_program, decode_launch
from tileinfer.kernels.kv_cache import KVCache
from tileinfer.kernels.linear_gemv import GemvConfig, gemv_program
from tileinfer.kernels.norm_linear import add_rms_norm_gemv_program
from tileinfer.kernels.qkv_epilogue import qkv_epilogue_program
from tileinfer.kernels.triton_common import INTERPRET, num_sms

OPS_PER_LAYER = 6
MAX_PROGRAMS_PER_SM = 2  # the grid: this many programs an SM at most, fewer where occupancy allows fewer
NUM_WARPS = 4  # a program's warps
GEMV_ACCUMULATORS = 8192  # fp32 partial sums a GEMV tile holds (64 a thread at 4 warps)
GEMV_STAGES = 3  # a GEMV tile's K steps in flight (pipelined through shared memory)
MAX_REGISTERS: int | None = None  # a cap on a thread's registers (more programs an SM), or the compiler's
# A barrier still waiting after this many polls (each an L2 round trip: seconds) has hung: the kernel
# traps, so the step fails with an error instead of holding the GPU forever.
BARRIER_POLLS = tl.constexpr(1 << 22)


@dataclasses.dataclass
class LayerStack:
    """A decoder's layer weights, one tensor a kind with the layer first (the decoder's own layer weights
    are views of these). Dense float weights only; biases and q/k norms where the family has them."""

    input_norm: torch.Tensor  # [L, hidden]
    qkv: torch.Tensor  # [L, q + 2 kv, hidden]
    qkv_bias: torch.Tensor | None  # [L, q + 2 kv]
    q_norm: torch.Tensor | None  # [L, head_dim]
    k_norm: torch.Tensor | None  # [L, head_dim]
    o: torch.Tensor  # [L, hidden, q]
    post_norm: torch.Tensor  # [L, hidden]
    gate_up: torch.Tensor  # [L, 2 intermediate, hidden]
    down: torch.Tensor  # [L, hidden, intermediate]
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def num_layers(self) -> int:
        return self.qkv.shape[0]


@dataclasses.dataclass
class PersistentDecodeWorkspace:
    """The kernel's scratch between operations (one row each), and its barrier's counter: zero at first,
    and every barrier leaves its low 31 bits at zero again, so graph replays need no reset."""

    qkv: torch.Tensor
    query: torch.Tensor
    attention: torch.Tensor
    activation: torch.Tensor
    residual: torch.Tensor  # the residual stream's second buffer (the add reads one, writes the other)
    barrier: torch.Tensor

    @classmethod
    def allocate(
        cls, stack: LayerStack, dtype: torch.dtype, device: torch.device
    ) -> PersistentDecodeWorkspace:
        heads, kv_heads, head_dim = stack.num_heads, stack.num_kv_heads, stack.head_dim
        hidden, intermediate = stack.qkv.shape[2], stack.down.shape[2]
        empty = functools.partial(torch.empty, dtype=dtype, device=device)
        return cls(
            qkv=empty(1, (heads + 2 * kv_heads) * head_dim),
            query=empty(1, heads, head_dim),
            attention=empty(1, heads, head_dim),
            activation=empty(1, intermediate),
            residual=empty(1, hidden),
            barrier=torch.zeros(1, dtype=torch.int32, device=device),
        )


@triton.jit
def _grid_barrier(barrier_ptr, pid, num_programs):
    """Wait until all num_programs programs arrive. Program 0 adds 2^31 - (num_programs - 1) to the
    counter and every other program 1, so its sign bit flips exactly when the last one arrives, and its
    low bits are back at zero (nothing to reset between launches). Each program polls with gpu-scope
    acquire loads (which also drop its stale L1 lines) until the sign differs from what it saw on
    arriving; its arrival releases its writes. Scalar atomics run once a program, and the thread barriers
    around them order its threads' stores before the arrival and their loads after the wait."""
    tl.debug_barrier()
    increment = tl.where(pid == 0, 2147483647 - (num_programs - 2), 1)  # 2^31 - (num_programs - 1)
    arrived = tl.atomic_add(barrier_ptr, increment, sem="acq_rel", scope="gpu")
    seen = tl.atomic_add(barrier_ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while (seen ^ arrived) >= 0:  # the same sign bit: not everyone yet
        seen = tl.atomic_add(barrier_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
        if polls > BARRIER_POLLS:
            _trap(polls)
    tl.debug_barrier()


@triton.jit
def _trap(value):
    """End the kernel with an error (PTX `trap`): the launch fails instead of hanging."""
    tl.inline_asm_elementwise("trap; mov.u32 $0, $1;", "=r,r", [value], dtype=tl.int32, is_pure=False, pack=1)


# the op range and the grid size take no specialization: the compile that sizes the grid is the launch's
@triton.jit(do_not_specialize=["first_op", "last_op", "num_programs"])
def _persistent_decode_kernel(
    hidden_ptr,  # [1, hidden]: the embedded token in; the last layer's output out
    residual_ptr,  # [1, hidden]: the residual stream before the last layer's output, out
    residual_other_ptr,  # [1, hidden] scratch: the stream's other buffer
    qkv_ptr,  # [1, q + 2 kv] scratch
    query_ptr,  # [1, heads, head_dim] scratch
    attention_ptr,  # [1, heads, head_dim] scratch
    activation_ptr,  # [1, intermediate] scratch
    barrier_ptr,  # int32 [1]
    input_norm_ptr,
    qkv_weight_ptr,
    qkv_bias_ptr,  # (HAS_QKV_BIAS)
    q_norm_ptr,  # (HAS_QK_NORM)
    k_norm_ptr,  # (HAS_QK_NORM)
    o_weight_ptr,
    post_norm_ptr,
    gate_up_ptr,
    down_ptr,
    positions_ptr,
    cos_sin_ptr,
    kv_cache_ptr,  # [L, 2, num_blocks, block_size, kv_heads, head_dim]
    slot_mapping_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    counters_ptr,
    qkv_layer_stride,  # elements between layers, per stacked kind
    qkv_bias_layer_stride,
    o_layer_stride,
    gate_up_layer_stride,
    down_layer_stride,
    cache_layer_stride,
    cos_sin_row_stride,
    stride_kv,
    stride_block,
    stride_slot,
    stride_kv_head,
    stride_table_seq,
    block_size,
    eps,
    qk_scale,
    window,
    first_op,  # the ops [first_op, last_op) of the step, OPS_PER_LAYER a layer
    last_op,
    num_programs,
    HIDDEN: tl.constexpr,
    QKV_SIZE: tl.constexpr,
    Q_SIZE: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_QKV_BIAS: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    QKV_TILE: tl.constexpr,  # each GEMV's (BLOCK_N, BLOCK_K, stages), as its kernel would launch
    QKV_K: tl.constexpr,
    QKV_STAGES: tl.constexpr,
    O_TILE: tl.constexpr,
    O_K: tl.constexpr,
    O_STAGES: tl.constexpr,
    GATE_UP_TILE: tl.constexpr,
    GATE_UP_K: tl.constexpr,
    GATE_UP_STAGES: tl.constexpr,
    DOWN_TILE: tl.constexpr,
    DOWN_K: tl.constexpr,
    DOWN_STAGES: tl.constexpr,
    EPILOGUE_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    GROUP: tl.constexpr,  # the attention's constexprs (decode_attention.decode_launch)
    GROUP_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MIN_TILES: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SYNC: tl.constexpr,  # False under the interpreter: one launch an op, no barrier
):
    pid = tl.program_id(0)
    num_qkv_tiles = tl.cdiv(QKV_SIZE, QKV_TILE)
    num_gate_up_tiles = tl.cdiv(INTERMEDIATE, GATE_UP_TILE)
    num_epilogue_items = tl.cdiv(NUM_HEADS, EPILOGUE_HEADS) + tl.cdiv(NUM_KV_HEADS, EPILOGUE_HEADS)
    token = pid * 0  # the one sequence, as a tensor
    zero64 = token.to(tl.int64)
    for op in range(first_op, last_op):
        layer = zero64 + op // 6  # int64 offsets: a layer's cache may pass 2^31 elements
        kind = op % 6
        if kind == 0:  # hidden (+ the residual) -> norm -> qkv; the sum -> residual_other
            norm = input_norm_ptr + layer * HIDDEN
            weight = qkv_weight_ptr + layer * qkv_layer_stride
            bias = qkv_bias_ptr + layer * qkv_bias_layer_stride
            chunk = tl.cdiv(HIDDEN, num_qkv_tiles)
            for tile in range(pid, num_qkv_tiles, num_programs):
                if layer == 0:  # the embedding alone: no residual yet
                    add_rms_norm_gemv_program(
                        tile, hidden_ptr, hidden_ptr, norm, weight, bias, qkv_ptr, qkv_ptr,
                        residual_other_ptr, QKV_SIZE, HIDDEN, eps, chunk, HIDDEN, False, True, HAS_QKV_BIAS,
                        False, 0, False, False, QKV_TILE, QKV_K, QKV_STAGES,
                    )  # fmt: skip
                else:
                    add_rms_norm_gemv_program(
                        tile, hidden_ptr, residual_ptr, norm, weight, bias, qkv_ptr, qkv_ptr,
                        residual_other_ptr, QKV_SIZE, HIDDEN, eps, chunk, HIDDEN, True, True, HAS_QKV_BIAS,
                        False, 0, False, False, QKV_TILE, QKV_K, QKV_STAGES,
                    )  # fmt: skip
        elif kind == 1:  # q/k norm, RoPE, the new key and value into this layer's cache
            for item in range(pid, num_epilogue_items, num_programs):
                qkv_epilogue_program(
                    token, item, qkv_ptr, positions_ptr, cos_sin_ptr, q_norm_ptr + layer * HEAD_DIM,
                    k_norm_ptr + layer * HEAD_DIM, kv_cache_ptr + layer * cache_layer_stride, qkv_ptr,
                    qkv_ptr, qkv_ptr, slot_mapping_ptr, query_ptr, QKV_SIZE, cos_sin_row_stride, Q_SIZE,
                    HEAD_DIM, stride_kv, stride_block, stride_slot, stride_kv_head, 0, 0, block_size, eps,
                    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_HALF, EPILOGUE_HEADS, HAS_QK_NORM, HAS_QK_NORM,
                    False,
                )  # fmt: skip
        elif kind == 2:  # attention over the cache, split-KV; the last split of a head merges
            for item in range(pid, NUM_KV_HEADS * NUM_SPLITS, num_programs):
                decode_attention_program(
                    token, item // NUM_SPLITS, item % NUM_SPLITS, NUM_KV_HEADS, query_ptr,
                    kv_cache_ptr + layer * cache_layer_stride, kv_cache_ptr, block_tables_ptr, seq_lens_ptr,
                    attention_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, counters_ptr, qk_scale,
                    window, Q_SIZE, HEAD_DIM, stride_kv, stride_block, stride_slot, stride_kv_head, 0, 0,
                    stride_table_seq, Q_SIZE, HEAD_DIM, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
                    BLOCK_N, NUM_SPLITS, MIN_TILES, MERGE_ROWS, SPLIT_CHUNK, False, UPCAST, DOT_PRECISION,
                )  # fmt: skip
        elif kind == 3:  # o_proj -> hidden
            for tile in range(pid, tl.cdiv(HIDDEN, O_TILE), num_programs):
                gemv_program(
                    tile, attention_ptr, o_weight_ptr + layer * o_layer_stride, hidden_ptr, hidden_ptr,
                    hidden_ptr, HIDDEN, Q_SIZE, Q_SIZE, False, False, 0, False, False, O_TILE, O_K, O_STAGES,
                )  # fmt: skip
        elif kind == 4:  # hidden + residual_other -> norm -> SwiGLU(gate, up); the sum -> residual
            for tile in range(pid, num_gate_up_tiles, num_programs):
                add_rms_norm_gemv_program(
                    tile, hidden_ptr, residual_other_ptr, post_norm_ptr + layer * HIDDEN,
                    gate_up_ptr + layer * gate_up_layer_stride, hidden_ptr, hidden_ptr, activation_ptr,
                    residual_ptr, INTERMEDIATE, HIDDEN, eps, tl.cdiv(HIDDEN, num_gate_up_tiles), HIDDEN, True,
                    True, False, False, 0, True, False, GATE_UP_TILE, GATE_UP_K, GATE_UP_STAGES,
                )  # fmt: skip
        else:  # down_proj -> hidden
            for tile in range(pid, tl.cdiv(HIDDEN, DOWN_TILE), num_programs):
                gemv_program(
                    tile, activation_ptr, down_ptr + layer * down_layer_stride, hidden_ptr, hidden_ptr,
                    hidden_ptr, HIDDEN, INTERMEDIATE, INTERMEDIATE, False, False, 0, False, False, DOWN_TILE,
                    DOWN_K, DOWN_STAGES,
                )  # fmt: skip
        if SYNC:
            _grid_barrier(barrier_ptr, pid, num_programs)


def grid_gemv_config(n: int, k: int, gate_up: bool, programs: int) -> GemvConfig:
    """A GEMV's tiles inside the persistent kernel: about one tile a program (BLOCK_N rows, the fewest
    whose tiles `programs` programs cover), its K loop pipelined where it takes more than one step.
    The standalone kernel's many small tiles suit a launch of up to 16 programs an SM; dealt to two
    resident programs an SM they leave a few KiB in flight each, and Qwen3-0.6B's GEMVs then ran at
    half the copy bandwidth."""
    block_n = triton.next_power_of_2(triton.cdiv(n, programs))
    rows_a_tile = block_n * (2 if gate_up else 1)
    block_k = min(triton.next_power_of_2(k), max(64, GEMV_ACCUMULATORS // rows_a_tile))
    return GemvConfig(block_n, block_k, NUM_WARPS, GEMV_STAGES if k > block_k else 1)


def persistent_decode_supported(stack: LayerStack | None, kv_cache: KVCache, rows: int) -> bool:
    """Whether a step may take the persistent kernel: one row, stacked weights and a float cache."""
    return stack is not None and rows == 1 and isinstance(kv_cache, torch.Tensor)


@functools.cache
def _resident_programs(n_regs: int, shared: int, num_warps: int, device_index: int) -> int:
    """Programs of a compiled kernel an SM holds at once: registers, shared memory and threads allow."""
    props = torch.cuda.get_device_properties(device_index)
    threads = num_warps * 32
    regs_per_warp = -(-n_regs * 32 // 256) * 256  # allocated a warp at a time, in units of 256
    by_regs = props.regs_per_multiprocessor // (regs_per_warp * num_warps)
    by_shared = props.shared_memory_per_multiprocessor // shared if shared else 32
    by_threads = props.max_threads_per_multi_processor // threads
    return min(by_regs, by_shared, by_threads, 32)


class GridDoesNotFit(RuntimeError):
    """The persistent kernel's grid would not be resident at once: its barrier would never open."""


def persistent_decode_layers(
    stack: LayerStack,
    workspace: PersistentDecodeWorkspace,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    num_splits: int | None,
    decode_workspace: DecodeWorkspace | None,
    num_programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer of one sequence's decode step: hidden [1, hidden] (the embedded token, overwritten
    with the last layer's output) -> (hidden, the residual stream before it), as the decoder's layers
    would return them. kv_cache: all layers' [L, 2, num_blocks, block_size, kv_heads, head_dim].
    num_programs: the grid (default fitting_grid's; under the interpreter 4); it must be resident at
    once. CUDA-graph safe: no host sync, no allocation but the residual."""
    assert hidden.shape[0] == 1 and hidden.is_contiguous(), hidden.shape
    assert kv_cache.dim() == 6 and kv_cache.shape[0] == stack.num_layers and kv_cache.is_contiguous()
    heads, kv_heads, head_dim = stack.num_heads, stack.num_kv_heads, stack.head_dim
    hidden_size, q_size = stack.qkv.shape[2], heads * head_dim
    qkv_size, intermediate = stack.qkv.shape[1], stack.down.shape[2]
    residual = torch.empty_like(hidden)
    attention = decode_launch(
        workspace.query, kv_cache[0], block_tables, seq_lens, scale, sliding_window, num_splits,
        workspace.attention, decode_workspace,
    )  # fmt: skip
    (_, _, _, _, _, _, partial_acc, partial_max, partial_sum, counters, qk_scale, window) = (
        attention.arguments[:12]
    )
    strides = attention.arguments[12:]  # query (2), cache (4), scales (2), table, out (2)
    device_index = hidden.device.index or 0
    programs = num_programs or (4 if INTERPRET else num_sms(device_index) * MAX_PROGRAMS_PER_SM)
    tiles = {}
    for name, (n, k, gate_up) in {
        "QKV": (qkv_size, hidden_size, False), "O": (hidden_size, q_size, False),
        "GATE_UP": (intermediate, hidden_size, True), "DOWN": (hidden_size, intermediate, False),
    }.items():  # fmt: skip
        config = grid_gemv_config(n, k, gate_up, programs)
        tiles |= {
            f"{name}_TILE": config.block_n,
            f"{name}_K": config.block_k,
            f"{name}_STAGES": config.num_stages,
        }
    constexprs = {
        key: attention.constexprs[key]
        for key in ("GROUP", "GROUP_PAD", "BLOCK_D", "BLOCK_SIZE", "BLOCK_N", "NUM_SPLITS", "MIN_TILES",
                    "MERGE_ROWS", "SPLIT_CHUNK", "UPCAST", "DOT_PRECISION")
    }  # fmt: skip
    epilogue_heads = min(4, triton.next_power_of_2(kv_heads))
    constexprs |= tiles | dict(
        HIDDEN=hidden_size, QKV_SIZE=qkv_size, Q_SIZE=q_size, INTERMEDIATE=intermediate, NUM_HEADS=heads,
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, HAS_QKV_BIAS=stack.qkv_bias is not None,
        HAS_QK_NORM=stack.q_norm is not None, EPILOGUE_HEADS=epilogue_heads,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )  # fmt: skip
    qkv_bias = stack.qkv_bias if stack.qkv_bias is not None else stack.input_norm
    q_norm = stack.q_norm if stack.q_norm is not None else stack.input_norm
    k_norm = stack.k_norm if stack.k_norm is not None else stack.input_norm
    arguments = [
        hidden, residual, workspace.residual, workspace.qkv, workspace.query, workspace.attention,
        workspace.activation, workspace.barrier, stack.input_norm, stack.qkv, qkv_bias, q_norm, k_norm,
        stack.o, stack.post_norm, stack.gate_up, stack.down, positions, cos_sin_cache, kv_cache, slot_mapping,
        block_tables, seq_lens, partial_acc, partial_max, partial_sum, counters, stack.qkv.stride(0),
        qkv_bias.stride(0), stack.o.stride(0), stack.gate_up.stride(0), stack.down.stride(0),
        kv_cache.stride(0), cos_sin_cache.stride(0), *strides[2:6], strides[8], kv_cache.shape[3], stack.eps,
        qk_scale, window,
    ]  # fmt: skip
    num_ops = OPS_PER_LAYER * stack.num_layers
    options = dict(num_warps=NUM_WARPS, num_stages=attention.num_stages)
    if MAX_REGISTERS is not None:
        options["maxnreg"] = MAX_REGISTERS
    if INTERPRET:  # programs run one at a time: one launch an op, each a barrier
        for op in range(num_ops):
            _persistent_decode_kernel[(programs,)](
                *arguments, op, op + 1, programs, **constexprs, SYNC=False, **options
            )
        return hidden, residual
    # a cooperative launch: the driver refuses a grid that would not be resident at once (no hang)
    options["launch_cooperative_grid"] = True
    grid = num_programs or fitting_grid(arguments, num_ops, constexprs, options, device_index)
    _persistent_decode_kernel[(grid,)](*arguments, 0, num_ops, grid, **constexprs, SYNC=True, **options)
    return hidden, residual


def fitting_grid(
    arguments: list, num_ops: int, constexprs: dict[str, object], options: dict[str, int], device_index: int
) -> int:
    """The persistent grid for these operands: MAX_PROGRAMS_PER_SM an SM, or as many as the compiled
    kernel's registers and shared memory let an SM hold at once. Compiles the kernel first (the variant
    the launch takes); raises GridDoesNotFit where not even one program an SM fits (its barrier would
    never open)."""
    compiled = _persistent_decode_kernel.warmup(
        *arguments, 0, num_ops, num_sms(device_index), **constexprs, SYNC=True, **options, grid=(1,)
    )
    compiled._init_handles()  # loads the binary: its registers are known from here
    resident = _resident_programs(
        compiled.n_regs, compiled.metadata.shared, options["num_warps"], device_index
    )
    if resident == 0:
        raise GridDoesNotFit(
            f"{compiled.n_regs} registers and {compiled.metadata.shared} bytes of shared memory a program"
        )
    return num_sms(device_index) * min(resident, MAX_PROGRAMS_PER_SM)
