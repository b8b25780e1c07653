"""RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim; computed in float32, returned in x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the next sublayer's pre-norm input and the new residual."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


# A row of up to this many elements stays in registers (one read of x); longer rows are looped over twice.
_MAX_BLOCK_H = 8192


@triton.jit
def _summed_block(x_row, residual_row, summed_row, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """x's columns `cols` in fp32; with a residual, x + residual rounded to its dtype (and stored)."""
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_row + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + residual).to(residual_row.dtype.element_ty)
        tl.store(summed_row + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    return x


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_rows, hidden_size]
    residual_ptr,  # [num_rows, hidden_size] (HAS_RESIDUAL)
    summed_ptr,  # [num_rows, hidden_size]: x + residual is written here (may be residual itself)
    weight_ptr,  # [hidden_size]
    out_ptr,  # [num_rows, hidden_size]
    hidden_size,
    x_row_stride,
    residual_row_stride,
    summed_row_stride,
    out_row_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
):
    # The reference rounds to the activation dtype after the add and after the normalisation (as HF
    # does); the same roundings here keep the GPU path close to it. Statistics are fp32.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    residual_row = residual_ptr + row * residual_row_stride
    summed_row = summed_ptr + row * summed_row_stride
    out_row = out_ptr + row * out_row_stride
    if SINGLE_BLOCK:
        cols = tl.arange(0, BLOCK_H)
        mask = cols < hidden_size
        x = _summed_block(x_row, residual_row, summed_row, cols, mask, HAS_RESIDUAL)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden_size + eps)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_row + cols, normed * weight, mask=mask)
    else:
        squares = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(0, hidden_size, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            mask = cols < hidden_size
            x = _summed_block(x_row, residual_row, summed_row, cols, mask, HAS_RESIDUAL)
            squares += x * x
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / hidden_size + eps)
        for start in range(0, hidden_size, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            mask = cols < hidden_size
            # The second pass reads back what the first pass wrote (the same program's own stores).
            if HAS_RESIDUAL:
                x = tl.load(summed_row + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
            tl.store(out_row + cols, normed * weight, mask=mask)


def _rows(t: torch.Tensor, hidden_size: int) -> torch.Tensor:
    rows = t if t.dim() == 2 else t.view(-1, hidden_size)
    assert rows.stride(-1) == 1, "rows must be contiguous in the last dim"
    return rows


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    summed: torch.Tensor | None = None,
) -> torch.Tensor:
    """summed: where x + residual goes (default: residual itself)."""
    hidden_size = x.shape[-1]
    assert weight.shape == (hidden_size,) and weight.is_contiguous()
    if out is None:
        out = torch.empty_like(x)
    assert out.shape == x.shape
    x_rows, out_rows = _rows(x, hidden_size), _rows(out, hidden_size)
    residual_rows = _rows(residual, hidden_size) if residual is not None else x_rows
    summed_rows = _rows(summed, hidden_size) if summed is not None else residual_rows
    num_rows = x_rows.shape[0]
    if num_rows == 0:
        return out
    block_h = min(triton.next_power_of_2(hidden_size), _MAX_BLOCK_H)
    # 16-byte accesses with 4-16 elements per thread: 4 warps up to 2048, 8 up to 8192, 16 beyond.
    num_warps = 4 if block_h <= 2048 else 8 if block_h <= 8192 else 16
    _rms_norm_kernel[(num_rows,)](
        x_rows,
        residual_rows,
        summed_rows,
        weight,
        out_rows,
        hidden_size,
        x_rows.stride(0),
        residual_rows.stride(0),
        summed_rows.stride(0),
        out_rows.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_H=block_h,
        SINGLE_BLOCK=block_h >= hidden_size,
        num_warps=num_warps,
    )
    return out


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """As rms_norm_reference, output in x's dtype (or out's). One program per row. out may be x itself."""
    return _launch(x, None, weight, eps, out)


def add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As add_rms_norm_reference, in one pass: residual is overwritten with x + residual (and returned),
    the normed sum goes to out (fresh if None; out may be x itself, not residual)."""
    assert residual.shape == x.shape
    return _launch(x, residual, weight, eps, out), residual


def add_rms_norm_into_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    summed: torch.Tensor,
) -> None:
    """As add_rms_norm_reference, in one pass, with both results in given buffers: summed = x + residual
    (summed may be residual itself), out = rms_norm(summed). One program per row."""
    assert residual.shape == x.shape == summed.shape == out.shape
    _launch(x, residual, weight, eps, out, summed)
