"""Linear layers: y = x @ weight.T (+ bias), and the MLP's gate/up projection fused with SwiGLU.

Weights are in the Hugging Face layout [out_features, in_features], row-major. The engine fuses
q/k/v into one [q_size + 2 * kv_size, hidden] weight and gate/up into one [2 * intermediate, hidden]
weight (gate rows first, then up rows).

Three Triton kernels serve every call, picked here by the number of rows of x:
- one row (M == 1, batch-1 decode): a GEMV (kernels/linear_gemv.py).
- a few rows (2 <= M <= SKINNY_MAX_M: batched decode, verify steps, small prefill chunks): a skinny GEMM
  with the operands swapped, K split where N alone gives too few programs (kernels/linear_skinny.py).
- prefill (M > SKINNY_MAX_M): a tiled GEMM on the tensor cores (kernels/linear_gemm.py). INT8 weights in
  the MMA order (kernels/int8.py) take the skinny kernel instead, x in tiles of SWAPPED_BLOCK_M rows;
  narrower ones and those in input order (Q8_0's), at M >= INT8_DEQUANT_MIN_M, are first dequantized into
  a buffer (the next such weight ahead on a side stream), and the GEMM runs on that
  (kernels/linear_dequant.py).
Tiles measured fastest per shape on a GPU (kernels/linear_tuned.py) override the heuristics.

The scratch the kernels need beside their operands (split-K partials, dequantized weights) is a
LinearWorkspace: each decoder builds its own (engine/models/decoder.py) and passes it with every call, so two
decoders in one process never share one. Without a workspace K is not split and INT8 weights are not
dequantized.

The gate/up kernels compute the matching gate and up columns in the same program and write
silu(gate) * up, so the [M, 2 * intermediate] activation never reaches memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tileinfer.kernels.activation import silu_and_mul_reference
from tileinfer.kernels.int8 import LinearWeight, dequantize, split
from tileinfer.kernels.linear_dequant import (
    DEQUANT_BUFFERS,
    INT8_DEQUANT_MIN_M,
    DequantWorkspace,
    dequantized_at_prefill,
    dequantized_weights,
)
from tileinfer.kernels.linear_gemm import launch_gemm
from tileinfer.kernels.linear_gemv import launch_gemv
from tileinfer.kernels.linear_skinny import SKINNY_MAX_M, SplitKScratch, launch_skinny

GEMV_MAX_M = 1  # up to this many rows of x take the GEMV; up to SKINNY_MAX_M the skinny GEMM

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
# Workspace
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LinearWorkspace:
    """One decoder's scratch for the Triton linears: the skinny GEMM's split-K partials, and (INT8 weights
    that a prefill dequantizes) the buffers their dense copies go into, with the order a forward takes them
    in. Allocated once, before any CUDA graph is captured; the graphs read it, so it lives as long as the
    decoder that holds them."""

    split_k: SplitKScratch
    dequant: DequantWorkspace | None = None  # None: prefills multiply INT8 weights as stored

    @classmethod
    def for_weights(
        cls, weights: Sequence[LinearWeight], dtype: torch.dtype, device: torch.device
    ) -> LinearWorkspace:
        """For a decoder whose activations are in dtype, given its layers' weights in the order a forward
        multiplies by them: DEQUANT_BUFFERS buffers for the largest of them that a prefill dequantizes."""
        largest = max((weight.values.numel() for weight in dequantized_weights(weights)), default=0)
        dequant = None
        if largest:
            dequant = DequantWorkspace(device, largest * dtype.itemsize, DEQUANT_BUFFERS, weights)
        return cls(SplitKScratch.allocate(device), dequant)


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
    x: torch.Tensor,
    weight: LinearWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    gate_up: bool,
    workspace: LinearWorkspace | None = None,
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
    dequant = workspace.dequant if workspace is not None else None
    through_workspace = (
        scale is not None
        and m >= INT8_DEQUANT_MIN_M
        and dequant is not None
        and dequant.holds(weight, x.dtype)
    )
    swapped = mma_order and not (through_workspace and dequantized_at_prefill(weight.shape[0], mma_order))
    if m <= GEMV_MAX_M:
        launch_gemv(x, weight, bias, out, gate_up, **int8)
    elif m <= SKINNY_MAX_M or swapped:
        scratch = workspace.split_k if workspace is not None else None
        launch_skinny(x, weight, bias, out, gate_up, **int8, scratch=scratch)
    elif through_workspace:
        dense = dequant.dense(kernel_weight, x.dtype)  # group scales applied, per-row not
        launch_gemm(x, dense, bias, out, gate_up, scale=None if scale_group else scale)
    else:
        launch_gemm(x, weight, bias, out, gate_up, **int8)
    return out


def linear_triton(
    x: torch.Tensor,
    weight: LinearWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    workspace: LinearWorkspace | None = None,
) -> torch.Tensor:
    """As linear_reference: one launch (two for an INT8 weight's prefill, dequantized first), no host
    sync, no allocation when out is given. workspace: the caller's (a decoder's) scratch."""
    out = _check_and_make_out(x, weight, weight.shape[0], out)
    if bias is not None:
        assert bias.shape == (weight.shape[0],) and bias.stride(0) == 1, bias.shape
    return _launch(x, weight, bias, out, gate_up=False, workspace=workspace)


def gate_up_silu_triton(
    x: torch.Tensor,
    weight: LinearWeight,
    out: torch.Tensor | None = None,
    workspace: LinearWorkspace | None = None,
) -> torch.Tensor:
    """As gate_up_silu_reference: one launch; the [M, 2I] gate/up activations stay in registers."""
    assert weight.shape[0] % 2 == 0, weight.shape
    out = _check_and_make_out(x, weight, weight.shape[0] // 2, out)
    return _launch(x, weight, None, out, gate_up=True, workspace=workspace)
