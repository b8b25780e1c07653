"""Prefill with INT8 weights that dequantized_at_prefill picks: the whole weight dequantized once into a
buffer in x's dtype (a DequantWorkspace's), then the float GEMM on it (kernels/linear_gemm.py). The INT8
GEMM converts each weight tile in every program that reads it (every BLOCK_M rows of x) through shared
memory; dequantizing costs three bytes a weight of memory traffic instead, about 70 us a Qwen3-4B layer on
the H200. With two buffers and the decoder's order of weights, a side stream dequantizes the next weight
while the GEMM multiplies by this one, so the two overlap."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from tileinfer.kernels.int8 import Int8Weight, KernelWeight, LinearWeight, split
from tileinfer.kernels.linear_tiles import group_scales, input_order, widen

INT8_DEQUANT_MIN_M = 256  # rows of x from which an INT8 weight is dequantized (H200: BENCHMARKS.md)
# Weights in the MMA order are dequantized only under this many rows: more make enough tiles for the
# swapped-operand GEMM (kernels/linear_skinny.py), which multiplies them as stored (H200, 512 rows,
# Qwen3-0.6B's o and down, 1024 rows: 14.8 and 20.2 us swapped, 13.4 and 16.0 dequantized; its qkv, 4096:
# 11.9 against 14.8).
SWAPPED_MIN_ROWS = 2048
DEQUANT_BUFFERS = 2  # a decoder's: one that the GEMM reads, one that the next weight is dequantized into


@dataclasses.dataclass
class _Prefetch:
    values_ptr: int  # the weight it dequantized (its int8 values' address)
    buffer: int
    done: torch.cuda.Event | None  # recorded on the side stream (None on the CPU: done already)
    captured: bool  # issued while a CUDA graph was being captured


class DequantWorkspace:
    """Buffers for dense copies of one decoder's INT8 weights, and which weight its forward takes next.
    Allocate it before the CUDA graphs that use it are captured, and keep it as long as they are."""

    def __init__(
        self,
        device: torch.device,
        num_bytes: int,
        num_buffers: int = DEQUANT_BUFFERS,
        order: Sequence[LinearWeight] = (),
    ) -> None:
        """num_bytes a buffer: room for the largest weight in x's dtype (its numel x element size); a
        weight it does not hold takes the INT8 GEMM. order: the weights in the order a forward multiplies
        by them; with two buffers, each that a prefill dequantizes dequantizes the next such one ahead,
        on a side stream."""
        self.buffers = [torch.empty(num_bytes, dtype=torch.uint8, device=device) for _ in range(num_buffers)]
        dequantized = dequantized_weights(order)
        self.successor: dict[int, KernelWeight] = {  # values_ptr -> the next weight
            weight.values.data_ptr(): following
            for weight, following in zip(dequantized, dequantized[1:], strict=False)
        }
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


def dequantized_at_prefill(rows: int, mma_order: bool) -> bool:
    """Whether an INT8 weight of this many rows is dequantized for prefill rows (from INT8_DEQUANT_MIN_M,
    given a workspace that holds it), rather than multiplied by the swapped-operand GEMM: weights in input
    order (group scales among them: the GEMM would scale every tile in fp32, and a Qwen3-4B-shaped Q8_0
    file prefilled 512 tokens at 31.0k tok/s so, against 37.4k dequantized) and narrow ones."""
    return not mma_order or rows < SWAPPED_MIN_ROWS


def dequantized_weights(weights: Sequence[LinearWeight]) -> list[KernelWeight]:
    """The INT8 weights among these that a prefill dequantizes (dequantized_at_prefill), in order."""
    int8 = [split(weight) for weight in weights if isinstance(weight, Int8Weight)]
    return [weight for weight in int8 if dequantized_at_prefill(weight.values.shape[0], weight.mma_order)]


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
