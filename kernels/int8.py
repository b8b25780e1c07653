"""Weight-only INT8 (W8A16): a linear layer's weight as int8 values and fp32 scales, one per output row
or one per group of `group_size` consecutive inputs of a row (GGUF Q8_0: groups of 32).

weight[n, k] ~ values[n, k] * scale[n] (per row) or values[n, k] * scale[n, k // group_size]; symmetric,
values in [-127, 127]. The linear kernels (kernels/linear.py, kernels/norm_linear.py) read the int8
values and convert them in registers (a long prefill dequantizes the weight into a workspace first); a
per-row scale multiplies each output column once, after the sum over K, and group scales multiply the
weight tile before its products. Activations keep their dtype
(bf16 on a GPU). Fused weights (q/k/v, gate/up) are rows stacked like any other, so gate/up's scales
hold the gate rows' scales, then the up rows'.
"""

from __future__ import annotations

import dataclasses

import torch

INT8_MAX = 127


@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """values [N, K] int8 (rows contiguous) and scale fp32, [N] (per row) or [N, K // group_size]."""

    values: torch.Tensor
    scale: torch.Tensor

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

    @property
    def group_size(self) -> int:
        """Inputs that share a scale: K for a per-row scale."""
        return self.values.shape[1] if self.scale.dim() == 1 else self.values.shape[1] // self.scale.shape[1]

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    def nbytes(self) -> int:
        return self.values.numel() + self.scale.numel() * self.scale.element_size()


LinearWeight = torch.Tensor | Int8Weight


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> Int8Weight:
    """Symmetric INT8 of a [N, K] float weight, a scale per row (or per group_size inputs of a row);
    rounded to nearest; an all-zero row (or group) gets scale 1 and zeros."""
    assert weight.dim() == 2 and weight.is_floating_point(), (weight.shape, weight.dtype)
    n, k = weight.shape
    group = k if group_size is None else group_size
    assert k % group == 0, (k, group)
    wide = weight.float().reshape(n, k // group, group)
    amax = wide.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    values = torch.round(wide / scale[:, :, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8).reshape(n, k)
    return Int8Weight(values.contiguous(), (scale[:, 0] if group_size is None else scale).contiguous())


def expanded_scale(weight: Int8Weight) -> torch.Tensor:
    """fp32 [N, K]: each element's scale."""
    if weight.scale.dim() == 1:
        return weight.scale[:, None].expand(weight.values.shape)
    return weight.scale.repeat_interleave(weight.group_size, dim=1)


def dequantize(weight: LinearWeight, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight in dtype: values * scale rounded once (the torch reference path's weight)."""
    if isinstance(weight, torch.Tensor):
        return weight
    return (weight.values.float() * expanded_scale(weight)).to(dtype)


def stack_rows(weights: list[Int8Weight]) -> Int8Weight:
    """One weight of the given ones' rows in order (fused q/k/v, gate/up); their scales must match in kind."""
    return Int8Weight(torch.cat([w.values for w in weights]), torch.cat([w.scale for w in weights]))


def split(weight: LinearWeight) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(the tensor a kernel reads, its scales or None, the scale group: 0 for none or one per row)."""
    if isinstance(weight, Int8Weight):
        return weight.values, weight.scale, 0 if weight.scale.dim() == 1 else weight.group_size
    return weight, None, 0
