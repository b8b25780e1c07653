"""Weight-only INT8 linears: the quantizer, and every linear kernel path (GEMV, skinny GEMM with and
without split-K, tiled GEMM, the norm-fused GEMV, gate/up + SwiGLU) reading int8 weights, with a scale
per row or per group of inputs (GGUF Q8_0's 32), against the float64 product with the dequantized
weight. On the CPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from tileinfer.kernels import linear_gemm, linear_gemv, linear_skinny
from tileinfer.kernels.int8 import (
    Int8Weight,
    dequantize,
    in_mma_order,
    quantize_int8,
    split,
    stack_rows,
    values_in_input_order,
)
from tileinfer.kernels.linear import (
    LinearWorkspace,
    gate_up_silu_reference,
    gate_up_silu_triton,
    linear_reference,
    linear_triton,
)
from tileinfer.kernels.linear_dequant import INT8_DEQUANT_MIN_M, SWAPPED_MIN_ROWS, DequantWorkspace
from tileinfer.kernels.linear_gemm import GemmConfig
from tileinfer.kernels.linear_gemv import GemvConfig
from tileinfer.kernels.linear_skinny import SkinnyConfig, SplitKScratch
from tileinfer.kernels.linear_tiles import widen
from tileinfer.kernels.norm_linear import add_rms_norm_linear_reference, add_rms_norm_linear_triton

from tests.test_kernels_linear import tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(
    m: int,
    n_rows: int,
    k: int,
    dtype: torch.dtype,
    seed: int,
    group_size: int | None = None,
    mma_order: bool = True,
) -> tuple[torch.Tensor, Int8Weight]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    # rows (and, grouped, input columns) of very different magnitudes: a misplaced scale shows
    magnitudes = torch.logspace(-2, 0, n_rows)[torch.randperm(n_rows, generator=gen)]
    columns = torch.logspace(-1, 0, k)[torch.randperm(k, generator=gen)] if group_size else torch.ones(k)
    weight = torch.randn(n_rows, k, generator=gen) * magnitudes[:, None] * columns[None, :] / k**0.5
    return x, quantize_int8(weight.to(DEVICE), group_size, mma_order)


def _dense64(weight: Int8Weight) -> torch.Tensor:
    return dequantize(weight, torch.float64)


def _expected(
    x: torch.Tensor,
    weight: Int8Weight,
    bias: torch.Tensor | None,
    gate_up: bool,
    dense: torch.Tensor | None = None,
) -> torch.Tensor:
    """The float64 product with the exact dequantized weight (or with `dense`)."""
    dense = _dense64(weight) if dense is None else dense.double()
    product = F.linear(x.double(), dense, None if bias is None else bias.double())
    if not gate_up:
        return product
    gate, up = product.chunk(2, dim=-1)
    return F.silu(gate) * up


def test_quantize_int8_rounds_each_row_to_its_own_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 40, generator=gen) * torch.tensor([1e-3, 0.1, 1.0, 10.0, 0.0, 3.0])[:, None]
    quantized = quantize_int8(weight)
    assert quantized.values.dtype == torch.int8 and quantized.scale.dtype == torch.float32
    assert quantized.values.abs().max() <= 127
    nonzero = weight.abs().amax(dim=1) > 0
    torch.testing.assert_close(quantized.scale[nonzero], weight.abs().amax(dim=1)[nonzero] / 127)
    assert (quantized.values[~nonzero] == 0).all() and (quantized.scale[~nonzero] == 1).all()
    # round to nearest: every element within half a step of its row's scale
    error = (dequantize(quantized, torch.float32) - weight).abs()
    assert (error <= quantized.scale[:, None] / 2 + 1e-7).all()
    assert quantized.nbytes() == 6 * 40 + 6 * 4
    grouped = quantize_int8(weight, group_size=8)
    assert grouped.scale.shape == (6, 5) and grouped.group_size == 8
    blocks = weight.reshape(6, 5, 8)
    torch.testing.assert_close(grouped.scale[nonzero], blocks.abs().amax(dim=2)[nonzero] / 127)
    error = (dequantize(grouped, torch.float32) - weight).abs().reshape(6, 5, 8)
    assert (error <= grouped.scale[:, :, None] / 2 + 1e-7).all()
    assert error.sum() < (dequantize(quantized, torch.float32) - weight).abs().sum()  # finer scales help
    stacked = stack_rows([grouped, grouped])
    assert stacked.values.shape == (12, 40) and stacked.scale.shape == (12, 5)
    assert split(stacked)[2] == 8 and split(quantized)[2] == 0


@pytest.mark.parametrize("group_size", [None, 16], ids=["per-row", "group16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate_up", [False, True], ids=["linear", "gate_up"])
@pytest.mark.parametrize("m", [1, 5, 65], ids=["gemv", "skinny", "gemm"])
def test_int8_linear_matches_dequantized_product(
    m: int, gate_up: bool, dtype: torch.dtype, group_size: int | None
) -> None:
    n, k = 24, 48
    x, weight = _inputs(m, 2 * n if gate_up else n, k, dtype, seed=m * 10 + gate_up, group_size=group_size)
    bias = None if gate_up else torch.randn(n, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    expected = _expected(x, weight, bias, gate_up)
    if gate_up:
        result, reference = gate_up_silu_triton(x, weight), gate_up_silu_reference(x, weight)
    else:
        result, reference = linear_triton(x, weight, bias), linear_reference(x, weight, bias)
    assert result.shape == (m, n) and result.dtype == dtype
    torch.testing.assert_close(result.double(), expected, **tolerance(dtype))
    # the reference multiplies by the weight dequantized to x's dtype (rounded once)
    expected_reference = _expected(x, weight, bias, gate_up, dense=dequantize(weight, dtype))
    torch.testing.assert_close(reference.double(), expected_reference, **tolerance(dtype))


def launch(kind: str) -> Callable[..., None]:
    """The kernel's launch; the skinny GEMM's with split-K scratch."""
    if kind == "skinny":
        return functools.partial(
            linear_skinny.launch_skinny, scratch=SplitKScratch.allocate(torch.device(DEVICE))
        )
    return {"gemv": linear_gemv.launch_gemv, "gemm": linear_gemm.launch_gemm}[kind]


# several programs and K steps with a ragged last one; K split 3 ways (the partials carry unscaled sums)
FORCED = [
    ("gemv", 1, GemvConfig(block_n=4, block_k=32, num_warps=4)),
    ("gemv", 1, GemvConfig(block_n=4, block_k=16, num_warps=4, num_stages=3)),  # loads pipelined
    ("skinny", 3, SkinnyConfig(block_n=16, block_k=16, split_k=3, num_warps=4, num_stages=2)),
    ("gemm", 50, GemmConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2)),
]


@pytest.mark.parametrize("group_size", [None, 32], ids=["per-row", "group32"])
@pytest.mark.parametrize("gate_up", [False, True], ids=["linear", "gate_up"])
@pytest.mark.parametrize("case", FORCED, ids=[c[0] for c in FORCED])
def test_int8_forced_tiles(case: tuple, gate_up: bool, group_size: int | None) -> None:
    """K = 96 in tiles of 16 or 32 (GEMV, skinny) or 32 (GEMM): tiles smaller than a group of 32, and
    tiles ending past K (the last, ragged one)."""
    kind, m, config = case
    n, k, dtype = 37, 96 if group_size else 100, torch.bfloat16
    x, weight = _inputs(m, 2 * n if gate_up else n, k, dtype, seed=len(kind) + gate_up, group_size=group_size)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    values, scale, scale_group, mma_order = split(weight)
    assert not mma_order  # K = 96 or 100: not a multiple of 64
    launch(kind)(x, values, None, out, gate_up, config, scale=scale, scale_group=scale_group)
    torch.testing.assert_close(out.double(), _expected(x, weight, None, gate_up), **tolerance(dtype))


def test_mma_order_stores_each_threads_inputs_together() -> None:
    """Within 64 inputs, input 16s + 8h + 2t + p sits at 16t + 4s + 2h + p: the 16 bytes of quad thread t
    for four k16 steps in a row. Stacking keeps the order; K not a multiple of 64, or group scales, keep
    input order."""
    gen = torch.Generator().manual_seed(4)
    plain = quantize_int8(torch.randn(3, 128, generator=gen), mma_order=False)
    ordered = in_mma_order(plain)
    assert ordered.mma_order and not plain.mma_order and quantize_int8(torch.randn(3, 128)).mma_order
    k = torch.arange(64)
    stored_at = 16 * (k % 8 // 2) + 4 * (k // 16) + 2 * (k % 16 // 8) + k % 2
    for chunk in (0, 64):
        assert torch.equal(ordered.values[:, chunk + stored_at], plain.values[:, chunk : chunk + 64])
    assert torch.equal(values_in_input_order(ordered), plain.values)
    assert torch.equal(dequantize(ordered, torch.float32), dequantize(plain, torch.float32))
    assert stack_rows([ordered, ordered]).mma_order and split(ordered).mma_order
    assert not in_mma_order(quantize_int8(torch.randn(3, 96), mma_order=False)).mma_order
    assert not quantize_int8(torch.randn(3, 128), group_size=32).mma_order
    with pytest.raises(ValueError):
        stack_rows([ordered, plain])


# K = 192 in the MMA order (a scale per row): 64-input chunks, tiles of 64 or 128 (a ragged last one);
# the skinny kernel past SKINNY_MAX_M rows takes x in two tiles of 128.
FORCED_MMA = [
    ("gemv", 1, GemvConfig(block_n=4, block_k=128, num_warps=4)),
    ("gemv", 1, GemvConfig(block_n=4, block_k=64, num_warps=4, num_stages=3)),
    ("skinny", 3, SkinnyConfig(block_n=16, block_k=128, split_k=2, num_warps=4, num_stages=2)),
    ("skinny", 150, SkinnyConfig(block_n=32, block_k=64, split_k=1, num_warps=4, num_stages=2)),
    ("gemm", 50, GemmConfig(block_m=16, block_n=16, block_k=128, num_warps=4, num_stages=2)),
]


@pytest.mark.parametrize("gate_up", [False, True], ids=["linear", "gate_up"])
@pytest.mark.parametrize("case", FORCED_MMA, ids=[f"{c[0]}-m{c[1]}-k{c[2].block_k}" for c in FORCED_MMA])
def test_int8_mma_order_forced_tiles(case: tuple, gate_up: bool) -> None:
    kind, m, config = case
    n, k, dtype = 37, 192, torch.bfloat16
    x, weight = _inputs(m, 2 * n if gate_up else n, k, dtype, seed=m + gate_up)
    assert weight.mma_order
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    values, scale, scale_group, mma_order = split(weight)
    launch(kind)(
        x, values, None, out, gate_up, config, scale=scale, scale_group=scale_group, mma_order=mma_order
    )
    torch.testing.assert_close(out.double(), _expected(x, weight, None, gate_up), **tolerance(dtype))


def dequant_workspace(
    num_bytes: int, num_buffers: int = 1, order: Sequence[Int8Weight] = ()
) -> LinearWorkspace:
    """A decoder's workspace on DEVICE whose dequantization buffers take num_bytes each, with a forward's
    order of weights; split-K scratch beside them."""
    device = torch.device(DEVICE)
    return LinearWorkspace(
        SplitKScratch.allocate(device), DequantWorkspace(device, num_bytes, num_buffers, order)
    )


@pytest.mark.parametrize("k", [96, 192], ids=["input-order", "mma-order"])
@pytest.mark.parametrize("group_size", [None, 32], ids=["per-row", "group32"])
@pytest.mark.parametrize("gate_up", [False, True], ids=["linear", "gate_up"])
def test_int8_prefill_dequantizes_then_multiplies(gate_up: bool, group_size: int | None, k: int) -> None:
    """From INT8_DEQUANT_MIN_M rows the weight is dequantized into the workspace (in input order, group
    scales applied, rounded to x's dtype; per-row scales left to the GEMM's columns), then the float GEMM
    runs on it."""
    n, dtype = 37, torch.bfloat16
    m = INT8_DEQUANT_MIN_M + 5
    x, weight = _inputs(m, 2 * n if gate_up else n, k, dtype, seed=11 + gate_up, group_size=group_size)
    own = dequant_workspace(1 << 16)  # 64 KiB: one buffer
    buffer = own.dequant.buffers[0].zero_()
    call = gate_up_silu_triton if gate_up else linear_triton
    result = call(x, weight, workspace=own)
    torch.testing.assert_close(result.double(), _expected(x, weight, None, gate_up), **tolerance(dtype))
    dense = buffer[: weight.values.numel() * 2].view(dtype).view(weight.shape)
    assert weight.mma_order == (k % 64 == 0 and group_size is None)
    expected_dense = dequantize(weight, dtype) if group_size else values_in_input_order(weight).to(dtype)
    # exact on the GPU; the interpreter truncates fp32 to bf16 where the GPU rounds (one bf16 step)
    rounding = {"rtol": 0, "atol": 0} if DEVICE == "cuda" else {"rtol": 2**-7, "atol": 0}
    torch.testing.assert_close(dense, expected_dense, **rounding)
    # too large for the workspace: the INT8 GEMM, the same product
    _, wide = _inputs(m, 1 << 10, k, dtype, seed=3, group_size=group_size)
    torch.testing.assert_close(
        linear_triton(x, wide, workspace=own).double(), _expected(x, wide, None, False), **tolerance(dtype)
    )


@pytest.mark.parametrize("group_size", [None, 32], ids=["per-row", "group32"])
def test_int8_prefill_of_a_wide_mma_order_weight_takes_the_swapped_gemm(group_size: int | None) -> None:
    """An MMA-order weight (a scale per row) of SWAPPED_MIN_ROWS rows or more is multiplied as stored by
    the skinny kernel in tiles of SWAPPED_BLOCK_M rows of x, though the workspace would hold it: none is
    dequantized. With group scales (input order) it is dequantized."""
    n, k, dtype = SWAPPED_MIN_ROWS, 64, torch.bfloat16
    m = INT8_DEQUANT_MIN_M + 3
    x, weight = _inputs(m, n, k, dtype, seed=21, group_size=group_size)
    assert weight.mma_order == (group_size is None)
    own = dequant_workspace(n * k * 2)
    buffer = own.dequant.buffers[0].zero_()
    result = linear_triton(x, weight, workspace=own)
    assert buffer.any() == (group_size is not None)
    torch.testing.assert_close(result.double(), _expected(x, weight, None, False), **tolerance(dtype))


def test_int8_prefill_dequantizes_the_next_weight_ahead_into_the_other_buffer() -> None:
    """Three weights in a forward's order (the workspace's): each prefill dequantizes the next into the
    other buffer before its own GEMM reads its buffer (on a GPU, on a side stream), and the next prefill
    finds it there; out of order, a weight is dequantized where it is needed. Every product is right."""
    k, dtype, m = 64, torch.bfloat16, INT8_DEQUANT_MIN_M
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    weights = [
        _inputs(1, rows, k, dtype, seed=rows, group_size=group)[1]
        for rows, group in ((40, None), (24, 32), (32, 16))
    ]
    own = dequant_workspace(40 * k * 2, num_buffers=2, order=weights)
    for order in ((0, 1, 2), (0, 2, 1), (1, 2, 0)):
        for position, index in enumerate(order):
            gate_up = index == 2
            call = gate_up_silu_triton if gate_up else linear_triton
            result = call(x, weights[index], workspace=own)
            expected = _expected(x, weights[index], None, gate_up)
            torch.testing.assert_close(result.double(), expected, **tolerance(dtype))
            following = weights[index + 1].values.data_ptr() if index < 2 else None
            pending = own.dequant.pending
            assert (pending and pending.values_ptr) == following, (order, position)


@pytest.mark.parametrize("group_size", [None, 16], ids=["per-row", "group16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate_up", [False, True], ids=["linear", "gate_up"])
@pytest.mark.parametrize("m", [1, 4], ids=["fused-gemv", "norm-then-skinny"])
def test_int8_norm_linear_matches_reference(
    m: int, gate_up: bool, dtype: torch.dtype, group_size: int | None
) -> None:
    n, k = 20, 64
    gen = torch.Generator().manual_seed(m + 2 * gate_up)
    hidden = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE, dtype)
    _, weight = _inputs(1, 2 * n if gate_up else n, k, dtype, seed=7 + m, group_size=group_size)
    out, summed = add_rms_norm_linear_triton(hidden, residual, norm_weight, 1e-6, weight, gate_up=gate_up)
    expected, expected_summed = add_rms_norm_linear_reference(
        hidden, residual, norm_weight, 1e-6, weight, gate_up=gate_up
    )
    torch.testing.assert_close(out.double(), expected.double(), **tolerance(dtype))
    torch.testing.assert_close(summed, expected_summed)
    # and the reference is the dense layer's: the scales went where they belong
    dense, _ = add_rms_norm_linear_reference(
        hidden, residual, norm_weight, 1e-6, dequantize(weight, dtype), gate_up=gate_up
    )
    torch.testing.assert_close(expected, dense)


@triton.jit
def _widen_kernel(src, out_fp32, out_bf16, ROWS: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * N + tl.arange(0, N)[None, :]
    w = tl.load(src + offs)
    tl.store(out_fp32 + offs, widen(w, tl.float32))
    tl.store(out_bf16 + offs, widen(w, tl.bfloat16))


@pytest.mark.parametrize("rows", [1, 16])  # 2 weights a thread (fewer than PTX takes at once), and 32
def test_int8_widens_exactly_to_fp32_and_bf16(rows: int) -> None:
    """The kernels' int8 conversion (the weight + 128 as 2^23's low mantissa byte, less 2^23 + 128; for
    bf16 the fp32's upper half), for every int8 value, in a shuffled order: PTX four to a register on
    the GPU, arithmetic in the interpreter."""
    order = torch.randperm(256 * rows, generator=torch.Generator().manual_seed(rows))
    values = (torch.arange(256 * rows) % 256 - 128)[order].to(torch.int8).reshape(rows, 256).to(DEVICE)
    out_fp32 = torch.empty(rows, 256, device=DEVICE)
    out_bf16 = torch.empty(rows, 256, dtype=torch.bfloat16, device=DEVICE)
    _widen_kernel[(1,)](values, out_fp32, out_bf16, ROWS=rows, N=256)
    assert torch.equal(out_fp32, values.float()) and torch.equal(out_bf16.float(), values.float())
