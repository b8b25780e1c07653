"""Speculative decoding in the engine: which sequences get drafts this step, how many, from the proposer.

Each step, every running sequence that is ready to decode gets k drafts (k from its own
DraftLengthController), which its row of the step carries (engine/step.py Drafts, ScheduledRow) so that the
runner computes [last token, drafts] in one forward pass and verifies them
(engine/spec_decode/verify_step.py); the engine keeps the accepted drafts plus the target's own next token.
Sequences whose sampling needs the exact token history per position (penalties) or logprobs decode plainly.

A proposer that fails (a dead or stalled actor raises) costs nothing but speed: the step goes on without
drafts, and the proposer is tried again after a pause.

A proposer in another process whose drafts cross in the draft ring (RemoteProposer.launch) is asked
without waiting: each sequence gets its ring row and k (Drafts.ring_rows), and the verify step reads the
drafts from the ring on the device.

Structured output: a constrained sequence's host drafts are cut at the first one its grammar does not
allow (the verify step masks each draft position's logits, engine/runner.py); ring drafts, which the host
never sees, are not verified for it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import sys
import time
from collections.abc import Collection
from collections.abc import Sequence as Seq

import torch
from tileinfer.engine.kv.block_manager import BlockManager
from tileinfer.engine.sequence import Sequence
from tileinfer.engine.spec_decode.proposer_interface import (
    DeviceDrafts,
    DraftRequest,
    Proposer,
    ProposerUnavailableError,
)
from tileinfer.engine.spec_decode.verification import DraftLengthController
from tileinfer.engine.step import Drafts

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5.0  # after a proposer failure, plain decoding for this long
# One more draft of a separate draft model, as a share of a plain decode step: its size against the
# target's is not known here (deployments/replicas/proposer_build.py draft_cost prices each proposer).
DEFAULT_DRAFT_COST = 0.1
# Step times are the median of each kind's latest steps: one step that compiled a kernel, or waited out
# a stalled proposer, must not set the cost (an average once took 50x from a first verify step that
# compiled, and the controller then hardly asked for drafts again).
STEP_TIME_WINDOW = 9


@dataclasses.dataclass
class SpeculationStats:
    steps: int = 0  # steps that verified at least one draft
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    proposer_failures: int = 0
    ring_steps: int = 0  # steps whose drafts crossed in the draft ring (proposers/draft_ring.py)
    ring_wait_seconds: float = 0.0  # how long the host waited for them, all steps together


class Speculator:
    def __init__(
        self,
        proposer: Proposer,
        max_drafts: int,
        draft_cost: float = DEFAULT_DRAFT_COST,
    ) -> None:
        """draft_cost: one more draft, as a share of a plain decode step (DraftLengthController)."""
        self.proposer = proposer
        self.max_drafts = max_drafts
        self.draft_cost = draft_cost
        # A benchmark's fixed settings: adaptive False asks for max_drafts drafts every step (within the
        # cache's and each request's limits), whatever they pay; fixed_step_cost replaces the measured
        # step_cost (to replay another machine's ratio).
        self.adaptive = True
        self.fixed_step_cost: float | None = None
        # the latest wall times of steps that verified drafts, and of plain decode steps
        self._step_seconds: dict[bool, collections.deque[float]] = {
            kind: collections.deque(maxlen=STEP_TIME_WINDOW) for kind in (True, False)
        }
        self.controllers: dict[str, DraftLengthController] = {}
        self.stats = SpeculationStats()
        self._paused_until = 0.0
        # A proposer that reads the target's hidden states (DFlash) names the layers; the engine hands
        # over the rows of each request's newly kept tokens, sent with its next DraftRequest.
        self.target_layer_ids: tuple[int, ...] = tuple(proposer.target_layer_ids)
        # per request: the position of its first unsent row, and the unsent rows (contiguous chunks)
        self._unsent_hidden: dict[str, tuple[int, list[torch.Tensor]]] = {}

    def add_hidden(self, request_id: str, rows: torch.Tensor, first_position: int) -> None:
        """The target's captured hidden states of tokens this step kept, in token order, the first at
        first_position. A sequence computed again from an earlier position (preempted) replaces its
        unsent rows from there on; the proposer skips rows it holds already (DraftRequest.hidden_start).
        """
        start, chunks = self._unsent_hidden.get(request_id, (first_position, []))
        end = start + sum(chunk.shape[0] for chunk in chunks)
        if not start <= first_position <= end:  # recomputed from before the unsent rows (or a gap)
            start, chunks = first_position, []
        elif first_position < end:  # recomputed from inside them: keep the rows before
            kept = torch.cat(chunks)[: first_position - start]
            chunks = [kept] if kept.shape[0] else []
        self._unsent_hidden[request_id] = (start, [*chunks, rows])

    def _target_hidden(self, request_id: str) -> tuple[torch.Tensor | None, int | None]:
        """A request's unsent rows, concatenated, and the position of the first (None, None: none)."""
        start, chunks = self._unsent_hidden.get(request_id, (None, []))
        if not self.target_layer_ids or not chunks:
            return None, None
        return (torch.cat(chunks) if len(chunks) > 1 else chunks[0]), start

    def record_step(self, seconds: float, verified_drafts: bool) -> None:
        """The wall time of an engine step: one that verified drafts, or a plain decode step."""
        self._step_seconds[verified_drafts].append(seconds)

    @property
    def step_cost(self) -> float:
        """A step with drafts over a plain decode step: the fixed one if given, else the ratio of their
        median latest times (1 until both have run)."""
        if self.fixed_step_cost is not None:
            return self.fixed_step_cost
        speculative, plain = self.median_step_seconds(True), self.median_step_seconds(False)
        if speculative is None or not plain:
            return 1.0
        return speculative / plain

    def median_step_seconds(self, verified_drafts: bool) -> float | None:
        """The median wall time of the latest steps of that kind (None before one ran)."""
        times = self._step_seconds[verified_drafts]
        return statistics.median(times) if times else None

    def draft_lengths(
        self,
        running: Seq[Sequence],
        block_manager: BlockManager,
        token_budget: int,
        max_model_len: int,
        in_flight: Collection[Sequence] = (),
    ) -> dict[Sequence, int]:
        """How many drafts each sequence ready to decode asks for this step (only those that ask). Never
        more than the cache, the token budget and each sequence's limits can take, so that the step needs
        no preemption. in_flight: sequences with a next token that a launched step sampled and the host
        has not read (the engine reads it before request_drafts)."""
        if time.monotonic() < self._paused_until:
            return {}
        step_cost = self.step_cost
        wanted: dict[Sequence, int] = {}
        free_blocks = block_manager.num_free_blocks
        budget = token_budget - len(running)  # each running sequence computes at least one token
        for seq in running:
            num_pending = int(seq in in_flight)
            num_tokens = seq.num_tokens + num_pending
            if seq.num_computed_tokens + 1 != num_tokens or seq.params.has_penalties:
                continue
            if seq.params.logprobs is not None:
                continue
            controller = self.controllers.get(seq.request_id)
            if controller is None:  # a request's first step (not a new controller each step)
                controller = self.controllers[seq.request_id] = DraftLengthController(
                    self.max_drafts, self.draft_cost
                )
            limit = min(
                controller.next_num_drafts(step_cost) if self.adaptive else self.max_drafts,
                # the last token is the target's
                seq.params.max_tokens - seq.num_output_tokens - num_pending - 1,
                max_model_len - num_tokens - 1,
                budget,
            )
            # blocks for the drafts' KV, taken from what is free now
            while limit > 0:
                new_blocks = block_manager.blocks_needed(num_tokens + limit) - len(seq.block_table)
                if new_blocks <= free_blocks:
                    free_blocks -= max(new_blocks, 0)
                    break
                limit -= 1
            if limit > 0:
                wanted[seq] = limit
                budget -= limit
        return wanted

    def request_drafts(self, wanted: dict[Sequence, int]) -> Drafts:
        """Ask the proposer for wanted[seq] drafts of each sequence (draft_lengths). Returns the non-empty
        proposals, or the ring rows of drafts that cross in the draft ring."""
        if not wanted:
            return Drafts()
        requests = []
        for seq, k in wanted.items():
            hidden, hidden_start = self._target_hidden(seq.request_id)
            requests.append(DraftRequest(seq.request_id, seq.token_ids, k, hidden, hidden_start))
        try:
            ring = self.proposer.launch(requests)
            proposals = self.proposer.propose(requests) if ring is None else []
        except ProposerUnavailableError:
            return Drafts()  # e.g. a restarted proposer actor that has not attached yet: not a failure
        except Exception:  # noqa: BLE001 - any proposer fault means: decode without drafts for a while
            self.proposer_failed()
            return Drafts()
        for seq in wanted:
            self._unsent_hidden.pop(seq.request_id, None)  # the proposer has them now
        if ring is not None:
            return self._ring_drafts(list(wanted), ring)
        drafts = Drafts()
        for (seq, k), proposal in zip(wanted.items(), proposals, strict=True):
            proposal = [int(token) for token in proposal[:k]]
            if seq.grammar is not None:  # up to the first draft its grammar does not allow
                proposal = proposal[: seq.grammar.valid_drafts(proposal)]
            if proposal:
                drafts.ids[seq] = proposal
            else:
                self._no_proposal(seq)
        return drafts

    @staticmethod
    def _ring_drafts(seqs: list[Sequence], ring: DeviceDrafts) -> Drafts:
        """The ring rows of the drafts that the proposer will write into the ring."""
        drafts = Drafts(ring=ring)
        for seq, row, count in zip(seqs, ring.rows, ring.num_drafts, strict=True):
            # a constrained sequence steps aside: its drafts never reach the host to be checked
            if row is not None and count > 0 and seq.grammar is None:
                drafts.ring_rows[seq] = (row, count)
        return drafts if drafts else Drafts()

    def took_ring_drafts(self, drafts: Drafts, read: dict[Sequence, list[int]]) -> None:
        """A step read its drafts from the ring (`read`: what it found per sequence it ran)."""
        self.stats.ring_steps += 1
        self.stats.ring_wait_seconds += drafts.ring.waited_s
        if drafts.ring.timed_out:
            self.proposer_failed()
        for seq in drafts.ring_rows:
            if not read.get(seq):
                self._no_proposal(seq)

    def _no_proposal(self, seq: Sequence) -> None:
        """The proposer had no drafts for a sequence that asked (its controller probes sooner)."""
        controller = self.controllers.get(seq.request_id)
        if self.adaptive and controller is not None:
            controller.record_no_proposal()

    def proposer_failed(self) -> None:
        """The proposer raised (called while handling it), or never answered a step in the ring: decode
        plainly for a while."""
        handling = sys.exc_info()[1] is not None
        logger.warning("proposer failed; decoding without speculation for %.0f s", RETRY_AFTER_S,
                       exc_info=handling)  # fmt: skip
        self.stats.proposer_failures += 1
        self._paused_until = time.monotonic() + RETRY_AFTER_S

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:  # the ring held no drafts for it
            return
        self.stats.steps += 1
        self.stats.drafts_proposed += num_proposed
        self.stats.drafts_accepted += num_accepted
        controller = self.controllers.get(seq.request_id)
        if controller is not None:
            controller.record(num_proposed, num_accepted)

    def finish(self, seq: Sequence) -> None:
        """A request ended: hand the proposer the hidden rows it has not had yet (no drafts asked), so
        that the context it keeps of this request covers every token the target ran; then forget it.
        A later request with the same prefix (a chat's next turn) can take that context over."""
        hidden, hidden_start = self._target_hidden(seq.request_id)
        if hidden is not None and time.monotonic() >= self._paused_until:
            try:
                self.proposer.propose([DraftRequest(seq.request_id, seq.token_ids, 0, hidden, hidden_start)])
            except Exception:  # noqa: BLE001 - only a later request's speed depends on it
                logger.debug("handing the last hidden rows of %s over failed", seq.request_id, exc_info=True)
        self.forget(seq.request_id)

    def forget(self, request_id: str) -> None:
        self.controllers.pop(request_id, None)
        self._unsent_hidden.pop(request_id, None)
        try:
            self.proposer.forget(request_id)
        except Exception:  # noqa: BLE001 - a dead proposer has nothing left to forget
            logger.debug("proposer.forget(%s) failed", request_id, exc_info=True)

    def reset_measurements(self) -> None:
        """Forget the counters, step times and any failure pause (after the engine's warm-up, whose steps
        compiled kernels and so say nothing about the cost of later ones)."""
        self.stats = SpeculationStats()
        for times in self._step_seconds.values():
            times.clear()
        self._paused_until = 0.0
