"""The interface every draft proposer implements: n-gram here, a draft model and DFlash in their own actor."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class ProposerUnavailableError(RuntimeError):
    """No drafts now, and no fault either (a remote proposer not attached yet): the step decodes plainly."""


@dataclasses.dataclass(frozen=True)
class DraftRequest:
    """One sequence that wants drafts for its next step."""

    request_id: str
    token_ids: Sequence[int]  # every token so far, prompt + output; drafts are never part of it
    num_drafts: int  # how many drafts the engine will verify at most (0 = none this step)
    # DFlash only: the target's hidden states at the proposer's target_layer_ids, concatenated per token
    # ([num_rows, len(target_layer_ids) * hidden_size]), for the tokens the proposer has not seen yet that
    # the target has run (every token but the last); extra trailing rows (rejected drafts) are ignored
    target_hidden: torch.Tensor | None = None
    # the position of target_hidden's first row; None: right after the rows the proposer has seen. A
    # request whose prompt hit the target's prefix cache starts past 0: the proposer drafts for it only
    # if it still holds that prefix's context (from an earlier request), else it returns no drafts
    hidden_start: int | None = None


@dataclasses.dataclass
class AheadStats:
    drafts_made: int = 0  # drafts decoded ahead (draft_ahead), while the engine verified
    # drafts a call returned without decoding them: made ahead, or left from an earlier call's drafts
    # beyond the ones the engine accepted when its own next token agreed with the next draft
    drafts_reused: int = 0


class Proposer(Protocol):
    """Guesses the next tokens of each sequence so that the target can verify them in one forward pass.

    Contract:
    - `propose` returns one list per request, in order, of at most `num_drafts` token ids: the guessed
      continuation of `token_ids`. It may be shorter than asked, or empty when there is no good guess;
      the engine then verifies fewer drafts (an empty list means plain decoding for that sequence).
    - A request's `token_ids` only grow between calls, by the tokens the engine accepted, so a proposer
      may keep per-request state and look only at the new tokens. A sequence whose tokens were replaced
      (not extended) must be `forget`-ten first.
    - `forget(request_id)` drops that request's state (finished, aborted or preempted); forgetting an
      unknown request is a no-op.
    Drafts only affect speed: verification makes the output what plain decoding would give, whatever
    a proposer returns.

    Optional: `draft_ahead()` drafts the next block of the last call's sequences, assuming the engine
    accepts all their drafts (the draft-model and DFlash proposers have it; `ahead_stats` counts). A
    proposer actor on a GPU of its own calls it after answering, so that it drafts while the engine
    verifies.
    """

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]: ...

    def forget(self, request_id: str) -> None: ...
