"""Token embedding: one row of the embedding table per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def embedding_reference(
    token_ids: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """weight[token_ids]: token_ids [num_tokens] int64, weight [vocab_size, hidden] -> [num_tokens, hidden]"""
    if out is None:
        return weight.index_select(0, token_ids)
    return torch.index_select(weight, 0, token_ids, out=out)


@triton.jit
def _embedding_kernel(
    token_ids_ptr,  # [num_tokens] int64
    weight_ptr,  # [vocab_size, hidden_size]
    out_ptr,  # [num_tokens, hidden_size]
    vocab_size,
    hidden_size,
    weight_row_stride,
    out_row_stride,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < hidden_size
    token_id = tl.load(token_ids_ptr + token).to(tl.int64)
    # An id outside the table would read foreign memory; such a row comes out as zeros instead.
    # (A bound rather than `in_row & valid`: the interpreter mistypes a vector & scalar mask.)
    row_len = tl.where((token_id >= 0) & (token_id < vocab_size), hidden_size, 0)
    row = tl.load(weight_ptr + token_id * weight_row_stride + cols, mask=cols < row_len, other=0.0)
    tl.store(out_ptr + token.to(tl.int64) * out_row_stride + cols, row, mask=in_row)


def embedding_triton(
    token_ids: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """As embedding_reference; an id outside [0, vocab_size) yields a row of zeros (no error, no sync)."""
    num_tokens = token_ids.shape[0]
    vocab_size, hidden_size = weight.shape
    assert weight.stride(1) == 1, "embedding rows must be contiguous"
    if out is None:
        out = torch.empty(num_tokens, hidden_size, dtype=weight.dtype, device=weight.device)
    assert out.shape == (num_tokens, hidden_size) and out.stride(1) == 1
    if num_tokens == 0:
        return out
    # One program per (token, chunk of up to 2048 columns): 16-byte accesses, 8 or 16 per thread.
    block_h = min(triton.next_power_of_2(hidden_size), 2048)
    grid = (num_tokens, triton.cdiv(hidden_size, block_h))
    _embedding_kernel[grid](
        token_ids,
        weight,
        out,
        vocab_size,
        hidden_size,
        weight.stride(0),
        out.stride(0),
        BLOCK_H=block_h,
        num_warps=max(1, min(8, block_h // 256)),
    )
    return out
