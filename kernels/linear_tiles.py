"""What every linear kernel (kernels/linear_*.py, kernels/norm_linear.py) reads weight tiles with: INT8
values widened to float, the MMA order (kernels/int8.py) put back in input order, and group scales."""

from __future__ import annotations

import triton
import triton.language as tl
from tileinfer.kernels.triton_common import INTERPRET


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
