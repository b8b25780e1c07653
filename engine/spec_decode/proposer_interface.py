"""What the engine consumes from the layers above it: a draft Proposer, what it is asked (DraftRequest), and
the drafts one hands over on the device (DeviceDrafts, read by a verify step).

proposers/ implements these; the engine imports nothing from there (pyproject.toml's import-linter
contract).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from tileinfer.engine.spec_decode.draft_tree import DraftTree

if TYPE_CHECKING:
    import torch


class ProposerUnavailableError(RuntimeError):
    """No drafts now, and no fault either (a remote proposer not attached yet): the step decodes plainly."""


@dataclasses.dataclass(frozen=True)
class DraftRequest:
    """One sequence that wants drafts for its next step."""

    request_id: str
    token_ids: Sequence[int]  # every committed token so far, prompt + output; never a draft
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


class DraftsRead(Protocol):
    """One verify step's read of DeviceDrafts: the packed input ids at token_rows take the drafts."""

    token_rows: list[int]

    def gather_into(self, ids: torch.Tensor) -> None:
        """Fill ids[token_rows] with the drafts, before the forward pass."""

    def finish(self) -> tuple[list[int], dict[int, int]]:
        """After the forward pass: the ids the step used at token_rows, and each ring row's number of
        drafts."""


class DeviceDrafts(Protocol):
    """A step's drafts that a proposer hands over on the device (the draft ring, proposers/draft_ring.py):
    request i's drafts, up to num_drafts[i], in ring row rows[i] (None: it asked for none)."""

    rows: list[int | None]
    num_drafts: list[int]
    timed_out: bool  # the proposer never answered: set by the read's finish
    waited_s: float  # how long the engine's host waited for the drafts

    def read(self, token_rows: list[int], slots: list[tuple[int, int]], device: torch.device) -> DraftsRead:
        """A verify step's read: token_rows[i] (of the packed ids on `device`) takes draft
        slots[i] = (ring row, draft index)."""


class Proposer(abc.ABC):
    """Guesses the next tokens of each sequence so that the target can verify them in one forward pass.

    Contract:
    - `propose` returns one list per request, in order, of at most `num_drafts` token ids: the guessed
      continuation of `token_ids`. It may be shorter than asked, or empty when there is no good guess;
      the engine then verifies fewer drafts (an empty list means plain decoding for that sequence).
    - A live request's `token_ids` are committed tokens and only grow between calls, so a proposer may
      keep per-request state and look only at the new tokens; a request whose tokens were replaced is
      `forget`-ten first. Drafts are never in them: a proposer rolls its own drafts back to the longest
      common prefix.
    - `forget(request_id)` drops that request's state (finished, aborted or preempted); forgetting an
      unknown request is a no-op.
    Drafts only affect speed: verification makes the output what plain decoding would give, whatever
    a proposer returns. The rest has defaults for a proposer that needs none of it.
    """

    # The target decoder layers whose hidden states the proposer reads (DraftRequest.target_hidden), as
    # hidden_width values of hidden_dtype a token; () for none (all but DFlash).
    target_layer_ids: tuple[int, ...] = ()
    hidden_width: int = 0
    hidden_dtype: torch.dtype | None = None
    # Its drafts are made by a model (on the proposer's GPU): in another process they cross in the draft
    # ring (proposers/channel.py); n-gram's stay on the host.
    drafts_from_model: bool = False

    @abc.abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]: ...

    @abc.abstractmethod
    def forget(self, request_id: str) -> None: ...

    def propose_trees(self, requests: Sequence[DraftRequest], max_nodes: int) -> list[DraftTree]:
        """Drafts as trees of at most max_nodes nodes, num_drafts deep at most (engine/spec_decode/
        draft_tree.py); by default each request's chain from propose, the one-branch tree."""
        return [DraftTree.chain(drafts[:max_nodes]) for drafts in self.propose(requests)]

    def launch(self, requests: Sequence[DraftRequest]) -> DeviceDrafts | None:
        """Ask for drafts that cross on the device, without waiting for them; None: call propose (drafts on
        the host). Raises as propose does."""
        return None

    def draft_ahead(self) -> None:  # noqa: B027 - optional: nothing by default
        """Draft the next block of the last call's sequences, assuming the engine accepts all their drafts
        (a proposer actor on a GPU of its own calls it after answering, so that it drafts while the engine
        verifies); nothing by default."""

    def warm_up(self, num_drafts: int) -> None:  # noqa: B027 - optional: nothing by default
        """Run the first calls' set-up before serving (a first step must not wait it out); nothing by
        default."""
