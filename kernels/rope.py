"""Rotary position embedding, HF's rotate-half layout (weights stay in HF order)."""

from __future__ import annotations

import torch


def apply_rope_reference(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] by the angles of positions [num_tokens].

    cos_sin_cache: [max_positions, head_dim] float32, cos in the first half of a row, sin in the second.
    """
    half = x.shape[-1] // 2
    cos_sin = cos_sin_cache[positions].to(x.dtype)  # [num_tokens, head_dim]
    cos = torch.cat([cos_sin[:, :half], cos_sin[:, :half]], dim=-1).unsqueeze(1)
    sin = torch.cat([cos_sin[:, half:], cos_sin[:, half:]], dim=-1).unsqueeze(1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
