"""Which sequences run in the next step, and how many of their tokens.

Every step has one token budget. Running sequences come first (a decode is one token; a prompt
being prefilled in chunks takes what is left of it), then waiting ones in arrival order. When
the KV cache runs out, the most recently admitted sequence is preempted: its blocks are freed and
it waits again, to be recomputed (cheaply, through the prefix cache) once there is room.
"""

from __future__ import annotations

import collections
import dataclasses

from engine.block_manager import BlockCopy, BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclasses.dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens computed for it in this step, from seq.num_computed_tokens on


@dataclasses.dataclass
class Batch:
    scheduled: list[ScheduledSequence]
    block_copies: list[BlockCopy]

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

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
        self.block_manager.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> Batch:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:
                continue  # preempted below to make room for an earlier sequence
            while not self.block_manager.can_append(seq, 0):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.WAITING:
                continue
            self.block_manager.append_slots(seq, 0)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        copies: list[BlockCopy] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            copies += self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        return Batch(scheduled, copies)
