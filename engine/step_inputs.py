"""One step's inputs as named fields (StepInputs), built once from the scheduler's rows (StepInputsBuilder);
the eager step and the graphs fill from these fields, and nothing else derives a row.

Per packed token: input id, position, KV slot (BlockManager.slots) and fed-back source row; per sequence:
query start, length and block table; the packed rows whose logits the step computes; per sampled row: its
sequence, its row of those logits, the index of the token it draws, and its sampling parameters (seed,
top-k, the float fields), which stay the same from step to step and are looked up once per request.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from tileinfer.engine.kv.block_manager import BlockManager
from tileinfer.engine.sampling.sampler import Sampler
from tileinfer.engine.sequence import Sequence
from tileinfer.engine.step import ScheduledRow, is_decode_step

# SamplingTensors' float fields, in the order of StepInputs.sampling_floats
SAMPLING_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@dataclasses.dataclass(slots=True)
class StepInputs:
    """One step's inputs, as host lists."""

    # per packed token (a row's new tokens, then its drafts)
    input_ids: list[int]  # 0 where the id comes from elsewhere: a fed-back sample, a draft-ring draft
    positions: list[int]
    slot_mapping: list[int]
    # the row of the previous launch's samples (PendingStep.device_tokens) that is the token's input id,
    # -1 for input_ids' own; None: no token is fed back
    source_rows: list[int] | None
    # per sequence
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # its tokens once this step's are computed (drafts included)
    block_tables: list[list[int]]  # the sequences' own lists, not copies
    max_query_len: int
    is_decode: bool  # one new token per sequence, each sampled, no drafts (is_decode_step)
    # the packed token rows whose logits the step computes: a sampling row's last one, a verifying row's
    # last new token and its drafts (or the last num_logits[seq] of a row)
    logit_rows: list[int]
    # per sampled row (a row that samples one token: no drafts), in row order
    sample_seqs: list[Sequence]
    sample_rows: list[int]  # its row of the step's logits
    draw_positions: list[int]  # the index in its sequence of the token it draws (ScheduledRow.end)
    seeds: list[int]  # the Philox key (Sampler.key_of)
    top_k: list[int]
    sampling_floats: list[tuple[float, ...]]  # SAMPLING_FLOAT_FIELDS

    @classmethod
    def empty(cls) -> StepInputs:
        """A step of no rows (a graph's capture: every row a padding one)."""
        return cls([], [], [], None, [0], [], [], 0, True, [], [], [], [], [], [], [])

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


class _RowConstants(NamedTuple):
    """A sequence's sampling values that stay the same at every step."""

    seq: Sequence
    seed: int  # as int64
    top_k: int
    floats: tuple[float, ...]  # SAMPLING_FLOAT_FIELDS


class StepInputsBuilder:
    """Builds StepInputs; keeps each request's sampling constants until forget."""

    def __init__(self, block_size: int, sampler: Sampler) -> None:
        self.block_size = block_size
        self.sampler = sampler
        self._constants: dict[str, _RowConstants] = {}

    def forget(self, request_id: str) -> None:
        self._constants.pop(request_id, None)

    def build(self, rows: list[ScheduledRow], num_logits: dict[Sequence, int] | None = None) -> StepInputs:
        """The step's inputs. num_logits: the number of logit rows of a sequence whose tokens are all
        computed after the step (its last ones; default 1 + its drafts)."""
        if num_logits is None and is_decode_step(rows):
            return self._build_decode(rows)
        input_ids: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []  # per packed token
        query_start_loc = [0]
        seq_lens: list[int] = []
        logit_rows: list[int] = []
        sampled: list[ScheduledRow] = []
        sample_rows: list[int] = []
        fed_back: list[tuple[int, int]] = []  # (packed token row, source row)
        for item in rows:
            seq, start, end = item.seq, item.seq.num_computed_tokens, item.end
            input_ids += seq.token_ids[start:end]
            if item.fed_back_row is not None:
                fed_back.append((len(input_ids), item.fed_back_row))
                input_ids.append(0)  # taken from the previous launch's samples on the device
            if item.num_drafts:  # ring drafts: a valid id, should the proposer never answer
                input_ids += item.draft_ids if item.ring_row is None else [0] * item.num_drafts
            end += item.num_drafts
            positions += range(start, end)
            tables += [seq.block_table] * (end - start)
            query_start_loc.append(query_start_loc[-1] + item.num_tokens)
            seq_lens.append(end)
            if item.samples:
                count = num_logits.get(seq, 1) if num_logits else 1 + item.num_drafts
                if item.num_drafts == 0:
                    sampled.append(item)
                    sample_rows.append(len(logit_rows) + count - 1)
                logit_rows += range(query_start_loc[-1] - count, query_start_loc[-1])
        source_rows = None
        if fed_back:
            source_rows = [-1] * len(input_ids)
            for row, source in fed_back:
                source_rows[row] = source
        inputs = StepInputs(
            input_ids, positions, BlockManager.slots(tables, positions, self.block_size), source_rows,
            query_start_loc, seq_lens, [item.seq.block_table for item in rows],
            max(item.num_tokens for item in rows), False, logit_rows,
            *self._sampling([item.seq for item in sampled], sample_rows, [item.end for item in sampled]),
        )  # fmt: skip
        return inputs

    def _build_decode(self, rows: list[ScheduledRow]) -> StepInputs:
        """A decode step's inputs, without the general loop (at 256 sequences the host's time per step
        is what a decode step costs: one pass over the rows per field)."""
        num_seqs = len(rows)
        seqs = [item.seq for item in rows]
        tables = [seq.block_table for seq in seqs]
        lengths = [item.end for item in rows]  # with the input token (a fed-back one too)
        positions = [length - 1 for length in lengths]
        source_rows: list[int] | None = [
            -1 if item.fed_back_row is None else item.fed_back_row for item in rows
        ]
        if max(source_rows, default=-1) < 0:
            source_rows = None
        every_row = list(range(num_seqs))
        return StepInputs(
            [0 if item.fed_back_row is not None else item.seq.token_ids[-1] for item in rows],
            positions, BlockManager.slots(tables, positions, self.block_size), source_rows,
            list(range(num_seqs + 1)), lengths, tables, 1, True, every_row,
            *self._sampling(seqs, every_row, lengths),
        )  # fmt: skip

    def _sampling(self, seqs: list[Sequence], sample_rows: list[int], draw_positions: list[int]) -> tuple:
        """The sampled rows' fields of StepInputs, from sample_seqs on."""
        cached = self._constants
        constants = [
            row
            if (row := cached.get(seq.request_id)) is not None and row.seq is seq
            else self._row_constants(seq)
            for seq in seqs
        ]
        seeds, top_k = [row.seed for row in constants], [row.top_k for row in constants]
        return seqs, sample_rows, draw_positions, seeds, top_k, [row.floats for row in constants]

    def _row_constants(self, seq: Sequence) -> _RowConstants:
        """The sequence's sampling constants, looked up now (its first step, or a new sequence)."""
        params = seq.params
        constants = _RowConstants(
            seq, self.sampler.key_of(seq), max(params.top_k, 0),
            tuple(getattr(params, field) for field in SAMPLING_FLOAT_FIELDS),
        )  # fmt: skip
        self._constants[seq.request_id] = constants
        return constants
