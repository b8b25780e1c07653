"""How a step graph's sequence slots are filled (tileinfer.engine.graph_buckets.padded_sequences): the real
sequences, then padding sequences no longer than a context, then empty slots. The graphs themselves are
checked on the GPU (tests/test_graphs_cuda.py)."""

from __future__ import annotations

import pytest
from tileinfer.engine.graph_buckets import padded_sequences


@pytest.mark.parametrize(
    ("query_start_loc", "seq_lens", "size", "pad_len", "num_slots"),
    [
        ([0, 90, 180, 270, 307, 312], [90, 90, 90, 37, 5], 512, 100, 14),  # two whole padding sequences
        ([0, 3], [40], 16, 100, 17),  # one short padding sequence
        ([0, 16], [16], 16, 100, 17),  # no padding
        ([0], [], 8192, 640, 13),  # a capture: every token a padding one
    ],
)
def test_the_padding_fills_the_step_in_sequences_of_at_most_a_context(
    query_start_loc: list[int], seq_lens: list[int], size: int, pad_len: int, num_slots: int
) -> None:
    starts, lengths = padded_sequences(query_start_loc, seq_lens, size, pad_len, num_slots)
    assert len(starts) == num_slots + 1 and len(lengths) == num_slots
    assert starts[: len(query_start_loc)] == query_start_loc and lengths[: len(seq_lens)] == seq_lens
    query_lens = [end - start for start, end in zip(starts, starts[1:], strict=False)]
    padding = lengths[len(seq_lens) :]
    # each padding sequence's queries are its keys: positions 0..n-1, within one block-table row
    assert query_lens[len(seq_lens) :] == padding
    assert all(0 <= n <= pad_len for n in padding) and sum(padding) == size - query_start_loc[-1]
    assert starts[-1] == size


def test_more_sequences_than_slots_is_refused() -> None:
    with pytest.raises(AssertionError):
        padded_sequences([0, 8, 16], [8, 8], 512, 100, 3)  # 496 padding tokens need 5 more slots
