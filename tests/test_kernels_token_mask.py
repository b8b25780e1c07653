"""The allowed-token mask (kernels/token_mask.py): the Triton kernel against its torch reference, and the
reference against the bit layout llguidance writes (bit j of word i allows token 32 i + j)."""

from __future__ import annotations

import pytest
import torch
from tileinfer.kernels.token_mask import apply_token_mask_reference, apply_token_mask_triton, bitmask_words

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _bitmask(allowed: list[list[int]], vocab_size: int) -> torch.Tensor:
    """A bitmask allowing exactly the listed tokens of each row, built token by token."""
    words = torch.zeros(len(allowed), bitmask_words(vocab_size), dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            words[row, token // 32] |= 1 << (token % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # as int32 bits


def test_reference_keeps_exactly_the_allowed_tokens() -> None:
    vocab_size = 100
    allowed = [[0, 31, 32, 63, 99], [], list(range(vocab_size))]
    logits = torch.randn(3, vocab_size)
    masked = logits.clone()
    apply_token_mask_reference(masked, _bitmask(allowed, vocab_size))
    for row, tokens in enumerate(allowed):
        kept = torch.isfinite(masked[row]).nonzero().flatten().tolist()
        assert kept == tokens
        assert torch.equal(masked[row, tokens], logits[row, tokens])


@pytest.mark.parametrize("vocab_size", [1, 33, 300, 1031])
def test_kernel_equals_reference(vocab_size: int) -> None:
    generator = torch.Generator().manual_seed(vocab_size)
    rows = 5
    logits = torch.randn(rows, vocab_size, generator=generator)
    words = torch.randint(-(2**31), 2**31, (rows, bitmask_words(vocab_size)), generator=generator)
    bitmask = words.to(torch.int32)
    bitmask[1] = -1  # an unconstrained row beside the others
    expected = logits.clone()
    apply_token_mask_reference(expected, bitmask)
    got = logits.to(DEVICE)
    apply_token_mask_triton(got, bitmask.to(DEVICE))
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(got[1].cpu(), logits[1])


def test_kernel_masks_a_strided_view() -> None:
    """The runner masks a slice of a wider buffer (rows of a graph's logits)."""
    vocab_size = 70
    buffer = torch.randn(4, vocab_size + 6)
    bitmask = _bitmask([[1, 2, 69], [40]], vocab_size)
    expected = buffer[1:3, :vocab_size].clone()
    apply_token_mask_reference(expected, bitmask)
    got = buffer.to(DEVICE)
    apply_token_mask_triton(got[1:3, :vocab_size], bitmask.to(DEVICE))
    assert torch.equal(got[1:3, :vocab_size].cpu(), expected)
    assert torch.equal(got[0].cpu(), buffer[0])
    assert torch.equal(got[:, vocab_size:].cpu(), buffer[:, vocab_size:])
