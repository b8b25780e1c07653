"""Weight-only INT8 (W8A16): a linear layer's weight as int8 values and one fp32 scale per output row.

weight[n, k] ~ values[n, k] * scale[n], symmetric: values in [-127, 127], scale = max |weight[n, :]| / 127.
The linear kernels (kernels/linear.py, kernels/norm_linear.py) read the int8 values, convert them in
registers and apply the scale to each output column once, after the sum over K; activations stay in
their dtype (bf16 on a GPU). Fused weights (q/k/v, gate/up) are quantized row by row like any other, so
gate/up's scale holds the gate rows' scales, then the up rows'.
"""

from __future__ import annotations

import dataclasses

import torch

INT8_MAX = 127


@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """values [N, K] int8 (rows contiguous) and scale [N] fp32: weight ~ values * scale[:, None]."""

    values: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        values, scale = self.values, self.scale
        assert values.dtype == torch.int8 and values.dim() == 2, (values.dtype, values.shape)
        assert scale.dtype == torch.float32 and scale.shape == (values.shape[0],), (scale.dtype, scale.shape)

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    def nbytes(self) -> int:
        return self.values.numel() + self.scale.numel() * self.scale.element_size()


LinearWeight = torch.Tensor | Int8Weight


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Per-output-row symmetric INT8 of a [N, K] float weight (rounded to nearest; an all-zero row gets
    scale 1 and zeros)."""
    assert weight.dim() == 2 and weight.is_floating_point(), (weight.shape, weight.dtype)
    wide = weight.float()
    amax = wide.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    values = torch.round(wide / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(values.contiguous(), scale.contiguous())


def dequantize(weight: LinearWeight, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight in dtype: values * scale rounded once (the torch reference path's weight)."""
    if isinstance(weight, torch.Tensor):
        return weight
    return (weight.values.float() * weight.scale[:, None]).to(dtype)


def split(weight: LinearWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the tensor a kernel reads, the per-row scale or None)."""
    if isinstance(weight, Int8Weight):
        return weight.values, weight.scale
    return weight, None
