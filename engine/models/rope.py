"""RoPE frequencies for every scaling the supported families use: default, linear, llama3 and yarn.

The rotation itself is a kernel (kernels/rope.py); this module only builds the table it reads.
"""

from __future__ import annotations

import math

import torch
from tileinfer.engine.errors import ModelLoadError
from tileinfer.engine.models.shape import ModelSpec

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(spec: ModelSpec, scaling: dict) -> tuple[torch.Tensor, float]:
    dim, base = spec.head_dim, spec.rope_theta
    original = scaling.get("original_max_position_embeddings", spec.max_position_embeddings)
    factor = scaling.get("factor") or spec.max_position_embeddings / original

    def mscale(scale: float, coefficient: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_inv_freq(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the factor that scales cos and sin."""
    scaling = spec.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    base_inv_freq = 1.0 / (
        spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float() / spec.head_dim)
    )
    if rope_type == "default":
        return base_inv_freq, 1.0
    if rope_type == "linear":
        return base_inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(base_inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(spec, scaling)
    raise ModelLoadError(
        f"unsupported RoPE scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def rope_cos_sin_cache(
    spec: ModelSpec, max_positions: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half of each row, sin in the second."""
    inv_freq, attention_factor = rope_inv_freq(spec)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    angles = torch.outer(positions, inv_freq)
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1) * attention_factor
    return cache.to(device)
