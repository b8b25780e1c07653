"""Weight-only INT8 (W8A16): a linear layer's weight as int8 values and fp32 scales, one per output row
or one per group of `group_size` consecutive inputs of a row (GGUF Q8_0: groups of 32).

weight[n, k] ~ values[n, k] * scale[n] (per row) or values[n, k] * scale[n, k // group_size]; symmetric,
values in [-127, 127]. The linear kernels (kernels/linear.py, kernels/norm_linear.py) read the int8
values and convert them in registers (a long prefill dequantizes the weight into a workspace first); a
per-row scale multiplies each output column once, after the sum over K, and group scales multiply the
weight tile before its products. Activations keep their dtype
(bf16 on a GPU). Fused weights (q/k/v, gate/up) are rows stacked like any other, so gate/up's scales
hold the gate rows' scales, then the up rows'.

The MMA order (prepared at load, `in_mma_order`, for weights with a scale per row): within each 64
inputs of a row, the values are stored in the order a tensor-core thread consumes them. The bf16 A
operand of an m64n*k16 wgmma gives thread t = lane % 4 of a quad the inputs 2t, 2t+1, 2t+8 and 2t+9 of
every 16, so a row-major tile hands each thread two bytes at a time (LDS.U16). Stored as (t, k16 step,
half, pair), a thread's inputs for four k16 steps are 16 consecutive bytes: one 128-bit load from shared
memory. Only the order within a row changes (rows and scales stay), so stacking rows keeps it. The
tensor-core kernels put a tile back in input order in registers, which the compiler folds into the
load's layout; the GEMVs multiply it as stored by their input vector gathered in the same order.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

INT8_MAX = 127
MMA_CHUNK = 64  # inputs a row's MMA order permutes within (four k16 steps)


class Int8Values:
    """What an INT8 store shows of its int8 values where a caller takes it for the float tensor it
    replaces: the shape and the device (Int8Weight here, Int8KVCache in kernels/kv_cache.py)."""

    values: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device


@dataclasses.dataclass(frozen=True)
class Int8Weight(Int8Values):
    """values [N, K] int8 (rows contiguous) and scale fp32, [N] (per row) or [N, K // group_size];
    mma_order: each row's values in the MMA order (K a multiple of MMA_CHUNK, a scale per row), else in
    input order."""

    values: torch.Tensor
    scale: torch.Tensor
    mma_order: bool = False

    def __post_init__(self) -> None:
        values, scale = self.values, self.scale
        assert values.dtype == torch.int8 and values.dim() == 2, (values.dtype, values.shape)
        assert scale.dtype == torch.float32 and scale.is_contiguous(), (scale.dtype, scale.stride())
        n, k = values.shape
        assert scale.shape == (n,) or (
            scale.dim() == 2 and scale.shape[0] == n and k % scale.shape[1] == 0
        ), (
            scale.shape,
            values.shape,
        )
        group = self.group_size
        # a power of two: the kernels' K tiles (powers of two) then hold whole groups, or lie in one
        assert scale.dim() == 1 or group & (group - 1) == 0, f"scale groups of {group} inputs"
        assert not self.mma_order or fits_mma_order(k, group_scales=scale.dim() == 2), (k, scale.shape)

    @property
    def group_size(self) -> int:
        """Inputs that share a scale: K for a per-row scale."""
        return self.values.shape[1] if self.scale.dim() == 1 else self.values.shape[1] // self.scale.shape[1]

    def nbytes(self) -> int:
        return self.values.numel() + self.scale.numel() * self.scale.element_size()


LinearWeight = torch.Tensor | Int8Weight


def quantize_int8(weight: torch.Tensor, group_size: int | None = None, mma_order: bool = True) -> Int8Weight:
    """Symmetric INT8 of a [N, K] float weight, a scale per row (or per group_size inputs of a row);
    rounded to nearest; an all-zero row (or group) gets scale 1 and zeros. mma_order: the values in the
    MMA order where K allows (in_mma_order), as the engine keeps them."""
    assert weight.dim() == 2 and weight.is_floating_point(), (weight.shape, weight.dtype)
    n, k = weight.shape
    group = k if group_size is None else group_size
    assert k % group == 0, (k, group)
    wide = weight.float().reshape(n, k // group, group)
    amax = wide.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    values = torch.round(wide / scale[:, :, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8).reshape(n, k)
    quantized = Int8Weight(values.contiguous(), (scale[:, 0] if group_size is None else scale).contiguous())
    return in_mma_order(quantized) if mma_order else quantized


def fits_mma_order(k: int, group_scales: bool) -> bool:
    """Whether a weight of k inputs is held in the MMA order: k whole chunks, and a scale per row (group
    scales, a GGUF's Q8_0, keep the input order: in the MMA order a group's scale lands on scattered
    columns, and a Qwen3-4B-shaped Q8_0 file decoded at 348.9 tok/s so, against 386.1)."""
    return k % MMA_CHUNK == 0 and not group_scales


def in_mma_order(weight: Int8Weight) -> Int8Weight:
    """weight with each row's values in the MMA order (module docstring); unchanged where it does not fit
    it (fits_mma_order) or is in that order already. One copy of the values, on their device."""
    n, k = weight.shape
    if weight.mma_order or not fits_mma_order(k, group_scales=weight.scale.dim() == 2):
        return weight
    # input k = 64c + 16s + 8h + 2t + p is stored at 64c + 16t + 4s + 2h + p
    chunks = weight.values.reshape(n, k // MMA_CHUNK, 4, 2, 4, 2)  # (c, s, h, t, p)
    values = chunks.permute(0, 1, 4, 2, 3, 5).reshape(n, k).contiguous()
    return Int8Weight(values, weight.scale, mma_order=True)


def values_in_input_order(weight: Int8Weight) -> torch.Tensor:
    """[N, K] int8: the values with input k at column k, whatever the stored order."""
    if not weight.mma_order:
        return weight.values
    n, k = weight.shape
    stored = weight.values.reshape(n, k // MMA_CHUNK, 4, 4, 2, 2)  # (c, t, s, h, p)
    return stored.permute(0, 1, 3, 4, 2, 5).reshape(n, k)


def expanded_scale(weight: Int8Weight) -> torch.Tensor:
    """fp32 [N, K]: each element's scale."""
    if weight.scale.dim() == 1:
        return weight.scale[:, None].expand(weight.values.shape)
    return weight.scale.repeat_interleave(weight.group_size, dim=1)


def dequantize(weight: LinearWeight, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight in dtype: values * scale rounded once (the torch reference path's weight)."""
    if isinstance(weight, torch.Tensor):
        return weight
    return (values_in_input_order(weight).float() * expanded_scale(weight)).to(dtype)


def stack_rows(weights: list[Int8Weight]) -> Int8Weight:
    """One weight of the given ones' rows in order (fused q/k/v, gate/up); their scales must match in
    kind, and their values in order."""
    orders = {w.mma_order for w in weights}
    if len(orders) != 1:
        raise ValueError("stacked weights must hold their values in one order")
    (mma_order,) = orders
    return Int8Weight(
        torch.cat([w.values for w in weights]), torch.cat([w.scale for w in weights]), mma_order
    )


class KernelWeight(NamedTuple):
    """What a linear kernel reads of a weight."""

    values: torch.Tensor  # the float weight, or the int8 values
    scale: torch.Tensor | None  # INT8: the scales
    scale_group: int  # inputs a scale covers; 0 for none or one per row
    mma_order: bool  # the values in the MMA order


def split(weight: LinearWeight) -> KernelWeight:
    """A weight as the kernels take it."""
    if isinstance(weight, Int8Weight):
        group = 0 if weight.scale.dim() == 1 else weight.group_size
        return KernelWeight(weight.values, weight.scale, group, weight.mma_order)
    return KernelWeight(weight, None, 0, False)
