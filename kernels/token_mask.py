"""The allowed-token mask of structured output (engine/sampling/grammar.py), applied to logits before
sampling: a torch reference (the CPU's) and a Triton kernel (a GPU's).

The mask is llguidance's (and xgrammar's) bitmask, int32 [rows, ceil(vocab / 32)]: bit j of word i allows
token 32 i + j. A disallowed token's logit becomes -inf, which every sampling path (greedy, the race, top-k,
top-p, min-p, penalties) already treats as a token that never wins. A row of all ones (-1 words) is left as
it is: unconstrained rows share the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from tileinfer.kernels.triton_common import INTERPRET

_BLOCK = 128 if INTERPRET else 1024


def bitmask_words(vocab_size: int) -> int:
    """The int32 words of one row's mask."""
    return (vocab_size + 31) // 32


def apply_token_mask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits [rows, V] get -inf where bitmask [rows, ceil(V / 32)] (int32) has a 0 bit."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).reshape(bitmask.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(allowed.to(logits.device) == 0, float("-inf"))


@triton.jit
def _apply_token_mask_kernel(
    logits_ptr,  # [rows, vocab_size], row stride logits_stride
    bitmask_ptr,  # [rows, num_words] int32, contiguous
    vocab_size,
    logits_stride,
    num_words,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offsets < vocab_size
    words = tl.load(bitmask_ptr + row * num_words + offsets // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (offsets % 32)) & 1) != 0
    tl.store(logits_ptr + row * logits_stride + offsets, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_mask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """apply_token_mask_reference on the device: one program per row and BLOCK tokens."""
    rows, vocab_size = logits.shape
    assert bitmask.dtype == torch.int32 and bitmask.shape == (rows, bitmask_words(vocab_size))
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    if rows == 0:
        return
    bitmask = bitmask.contiguous()
    grid = (rows, triton.cdiv(vocab_size, _BLOCK))
    _apply_token_mask_kernel[grid](
        logits, bitmask, vocab_size, logits.stride(0), bitmask.shape[1], BLOCK=_BLOCK
    )  # fmt: skip


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The Triton kernel on a GPU's logits (bitmask on the same device), the reference on the CPU."""
    if logits.is_cuda:
        apply_token_mask_triton(logits, bitmask)
    else:
        apply_token_mask_reference(logits, bitmask)
