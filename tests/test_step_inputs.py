"""A step's inputs (engine/step_inputs.py) against a reading of its rows token by token: every packed
token's id, position, KV slot and fed-back source, every sequence's query span, length and block table,
the logit rows, and each sampled row's logits row, draw position and sampling parameters. A prompt chunk,
a chunk that completes its prompt, decoding rows (one fed back from the previous launch), and rows with
drafts from the host and from the draft ring; and a decode step, which the builder builds apart."""

from __future__ import annotations

import pytest
import torch
from tileinfer.engine.kv.block_manager import BlockManager
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.sampling.sampler import Sampler
from tileinfer.engine.sequence import Sequence
from tileinfer.engine.step import ScheduledRow
from tileinfer.engine.step_inputs import SAMPLING_FLOAT_FIELDS, StepInputs, StepInputsBuilder
from tileinfer.kernels.sampling import seed_to_int64

BLOCK_SIZE = 4


def _sequence(manager: BlockManager, name: str, num_tokens: int, num_computed: int, params: SamplingParams,
              room: int = 0) -> Sequence:  # fmt: skip
    """A sequence of num_tokens distinct ids, num_computed of them computed, with KV room for `room` more."""
    seq = Sequence(name, [1000 * (len(name) + 1) + i for i in range(num_tokens)], params)
    manager.allocate(seq)
    manager.append_slots(seq, room)
    seq.num_computed_tokens = num_computed
    return seq


def _check(inputs: StepInputs, rows: list[ScheduledRow]) -> None:
    """Each field against the rows, read one token at a time."""
    token = 0
    logit_row = 0
    sampled = [row for row in rows if row.samples and row.num_drafts == 0]
    assert inputs.sample_seqs == [row.seq for row in sampled]
    assert inputs.query_start_loc[0] == 0 and inputs.num_seqs == len(rows)
    for index, row in enumerate(rows):
        seq = row.seq
        first = seq.num_computed_tokens
        drafts = row.draft_ids if row.ring_row is None else [0] * row.num_drafts
        # the sequence's tokens from its first uncomputed one, a fed-back one (unknown to the host) and drafts
        expected_ids = seq.token_ids[first:] + [0] * (row.fed_back_row is not None) + (drafts or [])
        num_tokens = row.num_new_tokens + row.num_drafts
        assert inputs.query_start_loc[index + 1] - inputs.query_start_loc[index] == num_tokens
        assert inputs.seq_lens[index] == first + num_tokens
        assert inputs.block_tables[index] is seq.block_table
        for offset in range(num_tokens):
            position = first + offset
            assert inputs.input_ids[token] == expected_ids[offset]
            assert inputs.positions[token] == position
            block, within = divmod(inputs.slot_mapping[token], BLOCK_SIZE)
            assert block == seq.block_table[position // BLOCK_SIZE] and within == position % BLOCK_SIZE
            fed_back = row.fed_back_row is not None and offset == row.num_new_tokens - 1
            source = inputs.source_rows[token] if inputs.source_rows is not None else -1
            assert source == (row.fed_back_row if fed_back else -1)
            token += 1
        if row.samples:  # the last new token's logits, and each draft's
            last = inputs.query_start_loc[index + 1]
            wanted = list(range(last - 1 - row.num_drafts, last))
            assert inputs.logit_rows[logit_row : logit_row + len(wanted)] == wanted
            if row.num_drafts == 0:
                at = sampled.index(row)
                assert inputs.logit_rows[inputs.sample_rows[at]] == last - 1
                # the token it draws: the next after its committed ones, one later when one is in flight
                assert inputs.draw_positions[at] == seq.num_tokens + (row.fed_back_row is not None)
                params = seq.params
                assert inputs.seeds[at] == (0 if params.is_greedy else seed_to_int64(params.seed))
                assert inputs.top_k[at] == max(params.top_k, 0)
                assert inputs.sampling_floats[at] == tuple(getattr(params, f) for f in SAMPLING_FLOAT_FIELDS)
            logit_row += len(wanted)
    assert token == inputs.num_tokens and logit_row == len(inputs.logit_rows)
    assert (inputs.source_rows is None) == all(row.fed_back_row is None for row in rows)


@pytest.fixture
def builder() -> StepInputsBuilder:
    return StepInputsBuilder(BLOCK_SIZE, Sampler(50_000, torch.device("cpu")))


def test_a_mixed_step_with_drafts_gives_every_row_its_fields(builder: StepInputsBuilder) -> None:
    manager = BlockManager(num_blocks=64, block_size=BLOCK_SIZE)
    greedy = SamplingParams(temperature=0.0)
    sampled = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=11)
    chunk = _sequence(manager, "chunk", 13, 2, greedy)  # a prompt chunk: no logits
    completing = _sequence(manager, "completing", 9, 5, sampled)
    decoding = _sequence(manager, "decoding", 10, 9, sampled)
    fed = _sequence(manager, "fed", 7, 7, greedy, room=1)  # its 8th token is in flight
    host_drafts = _sequence(manager, "host", 6, 5, greedy, room=3)
    ring_drafts = _sequence(manager, "ring", 11, 10, sampled, room=2)
    rows = [
        ScheduledRow(chunk, 6),
        ScheduledRow(completing, 4),
        ScheduledRow(decoding, 1),
        ScheduledRow(fed, 1, fed_back_row=3),
        ScheduledRow(host_drafts, 1, num_drafts=3, draft_ids=[7, 8, 9]),
        ScheduledRow(ring_drafts, 1, num_drafts=2, ring_row=5),
    ]
    assert [row.samples for row in rows] == [False, True, True, True, True, True]
    inputs = builder.build(rows)
    assert not inputs.is_decode and inputs.max_query_len == 6
    _check(inputs, rows)
    assert inputs.sample_seqs == [completing, decoding, fed]


def test_a_decode_step_gives_the_fields_of_the_general_reading(builder: StepInputsBuilder) -> None:
    manager = BlockManager(num_blocks=64, block_size=BLOCK_SIZE)
    seqs = [
        _sequence(manager, f"s{n}", length, length - 1, SamplingParams(temperature=0.5 * (n % 2), seed=n))
        for n, length in enumerate((1, 4, 5, 17))
    ]
    fed = _sequence(manager, "fed", 8, 8, SamplingParams(temperature=0.0), room=1)
    rows = [ScheduledRow(seq, 1) for seq in seqs] + [ScheduledRow(fed, 1, fed_back_row=0)]
    inputs = builder.build(rows)
    assert inputs.is_decode and inputs.max_query_len == 1
    _check(inputs, rows)
    plain = builder.build(rows[:-1])
    assert plain.source_rows is None
    _check(plain, rows[:-1])
