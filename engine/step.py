"""A step as data: the speculator's drafts (Drafts), what the scheduler plans for each sequence
(ScheduledRow), what the whole step computes in the units its time grows with (StepWork), what the runner
returns for each row (RowOutput), a step's constrained rows and their masks (GrammarMasks), a step
launched on the device whose sampled tokens the host has not read yet (PendingStep), and constrained rows
whose masks came late (LateSamples).

A Sequence holds committed tokens only. Drafts ride in the row (draft_ids, or a row of the draft ring) and
come back verified in its RowOutput. Run-ahead (EngineConfig.run_ahead) launches step n+1 before the host
reads step n's tokens: a row of step n+1 whose last input is such a token says so (fed_back_row) instead of
holding it in the sequence, and the step reads it on the device.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from tileinfer.engine.sampling.params import TokenLogprob
from tileinfer.engine.sequence import Sequence

if TYPE_CHECKING:
    from tileinfer.engine.spec_decode.proposer_interface import DeviceDrafts
    from tileinfer.engine.step_inputs import StepInputs


@dataclasses.dataclass(slots=True)
class ScheduledRow:
    """One sequence's share of a step."""

    seq: Sequence
    # tokens computed for it in this step, from seq.num_computed_tokens on (a fed-back one included)
    num_new_tokens: int
    # run-ahead: the last of them is row r of the previous PendingStep's samples, not in seq.token_ids yet
    fed_back_row: int | None = None
    num_drafts: int = 0  # drafts computed after the new tokens, to verify (1 + num_drafts logit rows)
    draft_ids: list[int] | None = None  # None with num_drafts > 0: read from the draft ring at ring_row
    ring_row: int | None = None

    @property
    def end(self) -> int:
        """The position after its last computed token (drafts aside): the index of the token it samples."""
        return self.seq.num_computed_tokens + self.num_new_tokens

    @property
    def num_tokens(self) -> int:
        """The tokens the step computes for it: the new ones and the drafts."""
        return self.num_new_tokens + self.num_drafts

    @property
    def samples(self) -> bool:
        """Whether the step computes the sequence's last token (so it samples the next)."""
        return self.end == self.seq.num_tokens + (self.fed_back_row is not None)


@dataclasses.dataclass(frozen=True, slots=True)
class StepWork:
    """What a step computes, in the units its time grows with (engine/step_cost.py)."""

    tokens: int = 0  # tokens computed, drafts included: the linear layers' rows
    keys: int = 0  # keys (and values) its rows read: each row's sequence length after the step
    attended: int = 0  # (query, key) pairs: a token at position p attends to the p + 1 keys up to its own

    @classmethod
    def of(cls, rows: Iterable[ScheduledRow]) -> StepWork:
        tokens = keys = attended = 0
        for row in rows:
            num_tokens, context = row.num_tokens, row.seq.num_computed_tokens
            tokens += num_tokens
            keys += context + num_tokens
            attended += num_tokens * context + num_tokens * (num_tokens + 1) // 2
        return cls(tokens, keys, attended)

    def plus_row(self, context: int, num_tokens: int) -> StepWork:
        """This work and one more row: num_tokens tokens after `context` computed ones."""
        return StepWork(
            self.tokens + num_tokens,
            self.keys + context + num_tokens,
            self.attended + num_tokens * context + num_tokens * (num_tokens + 1) // 2,
        )


def is_decode_step(rows: list[ScheduledRow]) -> bool:
    """One new token per sequence, each sampled, no drafts: what a decode graph runs."""
    return all(row.num_new_tokens == 1 and row.num_drafts == 0 and row.samples for row in rows)


@dataclasses.dataclass
class Drafts:
    """The speculator's drafts for one step: on the host (ids), or in the draft ring (ring: each sequence's
    ring row and number of drafts, which the verify step reads on the device)."""

    ids: dict[Sequence, list[int]] = dataclasses.field(default_factory=dict)
    ring: DeviceDrafts | None = None
    ring_rows: dict[Sequence, tuple[int, int]] = dataclasses.field(default_factory=dict)  # (row, count)

    def __bool__(self) -> bool:
        return bool(self.ids or self.ring_rows)

    def count(self, seq: Sequence) -> int:
        if seq in self.ids:
            return len(self.ids[seq])
        return self.ring_rows[seq][1] if seq in self.ring_rows else 0

    def row(self, seq: Sequence, num_new_tokens: int) -> ScheduledRow:
        """The sequence's row of a verify step (or a plain one, without drafts)."""
        ring_row, num_drafts = self.ring_rows.get(seq, (None, 0))
        draft_ids = self.ids.get(seq)
        if draft_ids is not None:
            num_drafts = len(draft_ids)
        return ScheduledRow(seq, num_new_tokens, None, num_drafts, draft_ids, ring_row)


@dataclasses.dataclass(slots=True)
class RowOutput:
    """What a step gave one of its rows (runner -> engine)."""

    token_ids: list[int]  # accepted drafts, then the target's own token; [] for a prompt chunk
    num_accepted: int = 0
    draft_ids: list[int] = dataclasses.field(default_factory=list)  # the drafts verified (ring ones as read)
    logprob: TokenLogprob | None = None
    hidden: torch.Tensor | None = None  # captured hidden rows of the tokens it keeps (for the proposer)


@dataclasses.dataclass
class GrammarMasks:
    """A step's constrained logits rows: which rows (a sequence's next token, and one after each of its
    drafts), their allowed-token bitmasks (int32 [len(rows), vocab words], row i for rows[i]) and the
    fill writing them, on the host (engine/sampling/grammar.py). The runner applies them once the fill is
    done (ModelRunner.finish_masks, masked_logits)."""

    rows: list[int]
    bitmask: torch.Tensor
    fill: concurrent.futures.Future[None]


@dataclasses.dataclass
class LateSamples:
    """A launched step's constrained rows whose masks were not written when the next launch was due: they
    sat that launch out (ModelRunner.defer_masks). Their logits are kept (a copy, float32 [rows, vocab]),
    and they are sampled at their own draw positions once the fill is done (ModelRunner.sample_late)."""

    seqs: list[Sequence]
    logits: torch.Tensor
    draw_positions: list[int]
    masks: GrammarMasks  # rows: 0..len(seqs) - 1, the kept logits'


@dataclasses.dataclass
class PendingStep:
    """A step sent to the device; its sampled tokens reach the host when `ready` has fired. On a GPU the
    same tokens stay on the device (device_tokens: GraphCache.token_ids, row order), where the next
    launch's fed-back rows read them."""

    seqs: list[Sequence]  # the sequences it samples a token for, in row order
    device_tokens: torch.Tensor  # what the next step's fed_back_row indexes
    host_tokens: torch.Tensor  # [num_seqs] int64 (pinned on a GPU)
    ready: torch.cuda.Event | None  # None: host_tokens is filled already (CPU)
    # what ModelRunner.start_masks needs: the step's StepInputs and its logits (one row per sample)
    inputs: StepInputs | None = None
    logits: torch.Tensor | None = None
    # set by ModelRunner.start_masks: its constrained rows, sampled again once their masks are written
    masks: GrammarMasks | None = None
    # the step's time, for the engine's step-cost model: what it computes, when it was scheduled, and when
    # its tokens were ready (perf_counter seconds; None until read, except on the CPU: filled at launch)
    work: StepWork | None = None
    scheduled_at: float = 0.0
    done_at: float | None = None

    def sample_rows(self) -> dict[Sequence, int]:
        """Each sequence's row of the samples: its fed_back_row in the next step."""
        return {seq: row for row, seq in enumerate(self.seqs)}

    def read(self) -> list[int]:
        assert self.masks is None, "its constrained rows are not sampled yet (ModelRunner.finish_masks)"
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_tokens.tolist()
