"""A step as data: what the scheduler plans for each sequence (ScheduledRow), and a step launched on the
device whose sampled tokens the host has not read yet (PendingStep).

A Sequence holds committed tokens only. Run-ahead (EngineConfig.run_ahead) launches step n+1 before the
host reads step n's tokens: a row of step n+1 whose last input is such a token says so (fed_back_row)
instead of holding it in the sequence, and the step reads it on the device.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.sequence import Sequence


@dataclasses.dataclass(slots=True)
class ScheduledRow:
    """One sequence's share of a step."""

    seq: Sequence
    # tokens computed for it in this step, from seq.num_computed_tokens on (a fed-back one included)
    num_new_tokens: int
    # run-ahead: the last of them is row r of the previous PendingStep's samples, not in seq.token_ids yet
    fed_back_row: int | None = None

    @property
    def end(self) -> int:
        """The position after its last computed token: the index of the token it samples."""
        return self.seq.num_computed_tokens + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """Whether the step computes the sequence's last token (so it samples the next)."""
        return self.end == self.seq.num_tokens + (self.fed_back_row is not None)


def is_decode_step(rows: list[ScheduledRow]) -> bool:
    """One new token per sequence, each sampled: what a decode graph runs."""
    return all(row.num_new_tokens == 1 and row.samples for row in rows)


@dataclasses.dataclass
class PendingStep:
    """A step sent to the device; its sampled tokens reach the host when `ready` has fired. On a GPU the
    same tokens stay on the device (device_tokens: DecodeGraphs.token_ids, row order), where the next
    launch's fed-back rows read them."""

    seqs: list[Sequence]  # the sequences it samples a token for, in row order
    device_tokens: torch.Tensor  # what the next step's fed_back_row indexes
    host_tokens: torch.Tensor  # [num_seqs] int64 (pinned on a GPU)
    ready: torch.cuda.Event | None  # None: host_tokens is filled already (CPU)

    def sample_rows(self) -> dict[Sequence, int]:
        """Each sequence's row of the samples: its fed_back_row in the next step."""
        return {seq: row for row, seq in enumerate(self.seqs)}

    def read(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_tokens.tolist()
