"""Which sequences run in the next step, and how many of their tokens.

Every step has one token budget. Decoding sequences come first, oldest admission first (one token each,
or their last token and its drafts). Prompts share what is left: those being prefilled in chunks, oldest
first, then waiting ones in order. A prompt with more than long_prefill_token_threshold tokens left to
compute is long, and takes at most that many until every prompt of the step has had its share: a prompt
sent during a long prefill starts in the next step, and a short one (at most the threshold) gets all its
tokens when the budget holds them, so it samples its first token in that step. What the others leave goes
back to the long prompts, oldest first, so steps are as full as before and a long prompt alone takes the
whole budget. At most max_long_partial_prefills long prompts are prefilled at once; a long waiting one
beyond them waits for one to finish its prefill, and short ones start past it.

Tokens are not time: a step's cost grows with its tokens' context too (a chunk at position 15k costs
several times one at 0), and a request sent during a step waits for the step in flight before its own. So
with a time budget (step_budget_s), a long prompt's chunk (its last one too) is cut to what the step can
take and still end within it, as the engine's step-cost model predicts (engine/step_cost.py, fitted to the
engine's own measured steps): the steps of a long prefill, alone or beside others, stay near the budget,
and a request sent during one gets its first token within about two budgets. A cut chunk is never smaller
than an efficient one (its tokens cost at least what its step and its row cost anyway: half its best speed
or more), so the long prompt always progresses; where even that chunk would take a step that starts prompts
past the budget, the long prompt sits that step out (never two running), so a prompt sent during a long
prefill gets its first token from a step that costs about what it costs alone. A cut chunk ends its step
on a step size (engine/graph_buckets.py) where one is in reach; and until the model has a fit (warm-up
gives it one), a step takes at most twice the most tokens measured yet (a fresh engine's first long prompt
starts with chunks that double).

When the KV cache runs out, the most recently admitted sequence is preempted: its blocks are freed and
it waits again at the head of the queue, to be recomputed (cheaply, through the prefix cache) once
there is room.

No head-of-line blocking: a fresh request whose blocks are not free now is passed over, and smaller
ones behind it start. Fairness is bounded: once MAX_TIMES_PASSED_OVER later requests have started
before it, or at once when it was preempted, a waiting sequence reserves the cache: nothing behind
it starts until it fits. It does fit in the end, because admission (Engine.check_request) refuses a
request that the whole cache cannot hold, and without new admissions the running sequences only
finish or are preempted.

Preemption is bounded too. The running list keeps admission order (preempted sequences resume ahead
of everything that waited behind them), and the victim is always the last of it, so a sequence is
only ever preempted for older ones; those are a shrinking set, each with a bounded number of tokens
to go.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection, Mapping

from tileinfer.engine.kv.block_manager import BlockCopy, BlockManager
from tileinfer.engine.sequence import Sequence, SequenceStatus
from tileinfer.engine.step import Drafts, ScheduledRow, StepWork
from tileinfer.engine.step_cost import StepCostModel

# How many later requests may start before a waiting one that does not fit, before it reserves the cache.
MAX_TIMES_PASSED_OVER = 8
# The fewest tokens a long prompt's chunk cut to the time budget keeps: the smallest step graph.
MIN_CHUNK_TOKENS = 16


@dataclasses.dataclass
class Batch:
    scheduled: list[ScheduledRow]
    block_copies: list[BlockCopy]

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        long_prefill_token_threshold: int | None = None,
        max_long_partial_prefills: int = 1,
        max_model_len: int | None = None,
        step_budget_s: float | None = None,
        step_cost: StepCostModel | None = None,
        step_sizes: tuple[int, ...] = (),
    ) -> None:
        """long_prefill_token_threshold: None for a quarter of the budget (EngineConfig says why).
        max_model_len: a sequence's longest context (None: no limit here). step_budget_s: the time a step
        that carries a long prompt's chunk is planned to take (None: no time budget, tokens only), as
        step_cost (the engine's measured model) predicts it; step_sizes: the token counts steps run at
        without padding (engine/graph_buckets.py's step_sizes), which cut chunks end a step on."""
        self.block_manager = block_manager
        self.max_model_len = max_model_len if max_model_len is not None else 1 << 62
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        if long_prefill_token_threshold is None:
            long_prefill_token_threshold = max(1, max_num_batched_tokens // 4)
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_long_partial_prefills = max_long_partial_prefills
        self.step_budget_s = step_budget_s
        self.step_cost = step_cost if step_cost is not None else StepCostModel()
        self.step_sizes = step_sizes
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # waiting sequences that later ones started before, and how often; a preempted one starts at the limit
        self.times_passed_over: dict[Sequence, int] = {}
        self.sat_out: set[Sequence] = set()  # long prompts the last step left out (time budget)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.times_passed_over.pop(seq, None)
        self.block_manager.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.times_passed_over[seq] = MAX_TIMES_PASSED_OVER  # it resumes before anything new starts
        self.num_preemptions += 1

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """A prompt's first share of the step: all its tokens left, a long one's capped at the threshold."""
        return min(seq.num_uncomputed_tokens, self.long_prefill_token_threshold, budget)

    def schedule(
        self,
        in_flight: Mapping[Sequence, int] | None = None,
        drafts: Drafts | None = None,
        sitting_out: Collection[Sequence] = (),
    ) -> Batch:
        """in_flight: running sequences whose next token a launched step sampled and the host has not read
        yet, and its row of that step's samples. Such a token counts toward the sequence's length: the
        sequence computes it (fed back on the device), or sits this step out when it ends the sequence by
        length (it finishes once the host reads it). drafts: the speculator's, for decoding sequences: a
        row computes its last token and its drafts (the speculator asked for no more than the cache and the
        budget hold). sitting_out: running sequences whose next token is not known yet (a constrained row
        whose mask came late: Engine._defer_late_masks); they sit this step out."""
        in_flight = in_flight or {}
        drafts = drafts or Drafts()
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRow] = []
        any_sitting_out = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running or _is_prefilling(seq):
                continue  # preempted below to make room for an earlier sequence, or a prompt
            num_pending = int(seq in in_flight)
            if seq in sitting_out or (num_pending and self._ends_by_length(seq, num_pending)):
                any_sitting_out = True
                continue
            num_drafts = drafts.count(seq)
            while not self.block_manager.can_append(seq, num_pending + num_drafts):
                victim = self.running[-1]
                # alone, a sequence always fits (admission and max_model_len see to it)
                assert victim is not seq or len(self.running) > 1, "a sequence outgrew the whole KV cache"
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.WAITING:
                continue
            self.block_manager.append_slots(seq, num_pending + num_drafts)
            num_new = min(seq.num_uncomputed_tokens + num_pending, budget)
            if num_drafts:
                scheduled.append(drafts.row(seq, num_new))
            else:
                scheduled.append(ScheduledRow(seq, num_new, in_flight.get(seq)))
            budget -= scheduled[-1].num_tokens
        # Prompts being prefilled: admission gave them blocks for all their tokens, so none is preempted here.
        prefilling = [seq for seq in self.running if _is_prefilling(seq)]
        threshold = self.long_prefill_token_threshold
        num_long = sum(seq.num_uncomputed_tokens > threshold for seq in prefilling)
        chunks: list[ScheduledRow] = []
        for seq in prefilling:
            if budget == 0:
                break
            chunks.append(ScheduledRow(seq, self._chunk(seq, budget)))
            budget -= chunks[-1].num_new_tokens
        copies: list[BlockCopy] = []
        passed_over: list[Sequence] = []
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq in sitting_out:  # preempted while its token is still to come
                any_sitting_out = True
                continue
            if not self.block_manager.can_allocate(seq):
                if self.times_passed_over.get(seq, 0) >= MAX_TIMES_PASSED_OVER:
                    break  # it reserves the cache: nothing behind it starts first
                passed_over.append(seq)
                continue
            # A long one beyond max_long_partial_prefills waits and short ones start past it, even when it
            # reserves the cache: the running long prefills go on, and once they end it starts, or
            # reserves the cache as above. Its cached prefix is known only once its blocks are allocated,
            # so its whole length decides whether it is long.
            if seq.num_tokens > threshold and num_long >= self.max_long_partial_prefills:
                continue
            self.waiting.remove(seq)
            self.times_passed_over.pop(seq, None)
            for earlier in passed_over:
                self.times_passed_over[earlier] = self.times_passed_over.get(earlier, 0) + 1
            copies += self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_long += seq.num_uncomputed_tokens > threshold
            chunks.append(ScheduledRow(seq, self._chunk(seq, budget)))
            budget -= chunks[-1].num_new_tokens
        # What the prompts left goes to the long ones, oldest first (short ones have all their tokens).
        for item in chunks:
            if budget == 0:
                break
            more = min(item.seq.num_uncomputed_tokens - item.num_new_tokens, budget)
            item.num_new_tokens += more
            budget -= more
        # With a time budget, long prompts' chunks (their last ones too: their context makes them dear) are
        # cut to it; only short prompts run whole.
        long = [item for item in chunks if item.seq.num_tokens > threshold] if self.step_budget_s else []
        sat_out = set()
        if long:
            short = [item for item in chunks if item.seq.num_tokens <= threshold]
            work = StepWork.of(scheduled + short)
            for item in long:  # oldest first
                may_sit_out = bool(short) and item.seq not in self.sat_out
                item.num_new_tokens = self._timed_chunk(item, work, may_sit_out)
                if item.num_new_tokens == 0:
                    sat_out.add(item.seq)
                else:
                    work = work.plus_row(item.seq.num_computed_tokens, item.num_new_tokens)
            chunks = [item for item in chunks if item.num_new_tokens]
        self.sat_out = sat_out
        scheduled += chunks
        # an empty step with work left would repeat forever: the engine would spin without progress
        # (sequences sitting out finish when their tokens are read)
        assert scheduled or any_sitting_out or not self.has_unfinished(), (
            "no sequence can run, yet work is left"
        )
        return Batch(scheduled, copies)

    def _timed_chunk(self, item: ScheduledRow, work: StepWork, may_sit_out: bool) -> int:
        """A long prompt's chunk (its last one included) cut to the step's time budget, beside the rest of
        the step (`work`): as many of the tokens it was given as the step can take and still end within
        step_budget_s, as the step-cost model predicts it. Until the model has a fit (and never beyond what
        it has seen), the step takes at most twice the most tokens of any step measured: a fresh engine's
        first long prompt starts with small chunks that double. A cut chunk keeps an efficient chunk's
        tokens or more (StepCostModel.efficient_chunk: at least half its best speed), and
        MIN_CHUNK_TOKENS, so the long prompt always progresses; and it ends the step on a step size where
        one lies in reach (a step graph without padding, or an eager chunk of a shape warm-up compiled).
        0 (it sits this step out) where may_sit_out and even that chunk would take the step past the
        budget."""
        cost, context, given = self.step_cost, item.seq.num_computed_tokens, item.num_new_tokens
        measured = max(MIN_CHUNK_TOKENS, 2 * cost.largest_tokens - work.tokens)  # slow start
        fitting = cost.largest_chunk(work, context, self.step_budget_s)
        most = measured if fitting is None else min(measured, fitting)
        if most >= given:
            return given
        least = min(max(MIN_CHUNK_TOKENS, cost.efficient_chunk(context)), measured, given)
        if most < least and may_sit_out:
            return 0
        on_sizes = [size - work.tokens for size in self.step_sizes if least <= size - work.tokens <= most]
        return on_sizes[-1] if on_sizes else max(most, least)

    def _ends_by_length(self, seq: Sequence, num_pending: int) -> bool:
        """Whether the sequence's pending tokens bring it to max_tokens or max_model_len."""
        return (
            seq.num_output_tokens + num_pending >= seq.params.max_tokens
            or seq.num_tokens + num_pending >= self.max_model_len
        )


def _is_prefilling(seq: Sequence) -> bool:
    """Whether a running sequence has prompt tokens (or, resumed after a preemption, generated ones) to
    compute before it samples: more than its last token."""
    return seq.num_uncomputed_tokens > 1
