"""MLP activations: SwiGLU (llama, Mistral, Qwen) and xIELU (Apertus)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def xielu_reference(
    x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: torch.Tensor, eps: torch.Tensor
) -> torch.Tensor:
    """xIELU (arXiv 2411.13010); alpha_p and alpha_n are stored before softplus, as in the checkpoints."""
    alpha_p = F.softplus(alpha_p)
    alpha_n = beta + F.softplus(alpha_n)
    return torch.where(
        x > 0,
        alpha_p * x * x + beta * x,
        (torch.expm1(torch.minimum(x, eps)) - x) * alpha_n + beta * x,
    )
