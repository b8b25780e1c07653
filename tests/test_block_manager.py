"""Block manager: reference counts, free list, slot mapping and token-granular prefix reuse."""

from __future__ import annotations

from tileinfer.engine.kv.block_manager import BlockManager
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.sequence import Sequence


def _seq(token_ids: list[int], name: str = "s") -> Sequence:
    return Sequence(name, token_ids, SamplingParams())


def _compute_all(manager: BlockManager, seq: Sequence) -> None:
    """What a step does once the model has written the keys and values of every token."""
    seq.num_computed_tokens = seq.num_tokens
    manager.commit_computed(seq)


def test_allocate_gives_each_token_a_distinct_slot_and_free_returns_blocks() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = _seq(list(range(10)))
    assert manager.allocate(seq) == []
    assert len(seq.block_table) == 3 and seq.num_computed_tokens == 0
    slots = BlockManager.slots([seq.block_table] * 10, range(10), manager.block_size)
    assert len(set(slots)) == 10
    assert all(slot // 4 == seq.block_table[position // 4] for position, slot in enumerate(slots))
    assert manager.num_free_blocks == 5
    manager.free(seq)
    assert manager.num_free_blocks == 8 and seq.block_table == []


def test_full_blocks_are_shared_by_reference_and_at_least_one_token_is_left_to_compute() -> None:
    manager = BlockManager(num_blocks=16, block_size=4)
    first = _seq(list(range(12)), "a")
    manager.allocate(first)
    _compute_all(manager, first)
    second = _seq(list(range(12)) + [99, 98], "b")
    assert manager.allocate(second) == []
    assert second.num_computed_tokens == 12
    assert second.block_table[:3] == first.block_table
    assert all(manager.blocks[block_id].ref_count == 2 for block_id in first.block_table)
    # the same prompt again: the last block must be recomputed for its final token, so it is copied
    third = _seq(list(range(12)), "c")
    copies = manager.allocate(third)
    assert third.num_computed_tokens == 11
    assert third.block_table[:2] == first.block_table[:2]
    assert [(c.src_block, c.num_slots) for c in copies] == [(first.block_table[2], 3)]
    assert third.block_table[2] not in first.block_table


def test_partial_match_reaches_the_first_changed_token() -> None:
    manager = BlockManager(num_blocks=16, block_size=4)
    first = _seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "a")
    manager.allocate(first)
    _compute_all(manager, first)
    manager.free(first)  # its partial last block [9, 10] stays cached
    # changes at position 6: blocks [1..4] shared, then 2 tokens of [5, 6, 7, 8] copied
    second = _seq([1, 2, 3, 4, 5, 6, 70, 80, 90], "b")
    copies = manager.allocate(second)
    assert second.num_computed_tokens == 6
    assert len(copies) == 1 and copies[0].num_slots == 2
    # a continuation of the whole first sequence reuses its partial tail too
    manager.free(second)
    third = _seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], "c")
    copies = manager.allocate(third)
    assert third.num_computed_tokens == 10
    assert [c.num_slots for c in copies] == [2]


def test_unreferenced_cached_blocks_are_evicted_last_and_lru_first() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    first = _seq([1, 2, 3, 4], "a")
    manager.allocate(first)
    _compute_all(manager, first)
    manager.free(first)
    assert manager.num_free_blocks == 4
    # two never-used blocks go first; the cached ones survive a 2-block allocation
    other = _seq([7, 8, 9], "b")
    manager.allocate(other)
    assert not set(other.block_table) & set(first.block_table)
    manager.free(other)
    again = _seq([1, 2, 3, 4, 5], "c")
    manager.allocate(again)
    assert again.num_computed_tokens == 4
    # a sequence needing every block evicts the cache, and the hash map forgets the evicted blocks
    manager.free(again)
    big = _seq(list(range(100, 108)), "d")
    manager.allocate(big)
    assert len(set(big.block_table)) == 4 and manager.num_free_blocks == 0
    manager.free(big)
    fresh = _seq([1, 2, 3, 4, 5], "e")
    manager.allocate(fresh)
    assert fresh.num_computed_tokens == 0


def test_identical_concurrent_blocks_are_registered_once() -> None:
    manager = BlockManager(num_blocks=8, block_size=2)
    a, b = _seq([5, 6, 7], "a"), _seq([5, 6, 8], "b")
    manager.allocate(a)
    manager.allocate(b)  # before a is computed: nothing to share yet
    assert set(a.block_table).isdisjoint(b.block_table)
    _compute_all(manager, a)
    _compute_all(manager, b)
    assert len(manager.hash_to_block) == 1
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 8
    c = _seq([5, 6, 9], "c")
    manager.allocate(c)
    assert c.num_computed_tokens == 2


def test_a_partial_match_from_the_last_free_block_is_computed_instead_of_copied() -> None:
    """A waiting sequence that needs one more block, when the only free block is the unreferenced cached
    block it partly matches: a copy would need that block and a fresh one at once, so those tokens are
    computed in it instead. Found by preemption in a small cache (a resumed sequence matching its own
    evicted tail)."""
    manager = BlockManager(num_blocks=2, block_size=4)
    first = _seq([1, 2, 3, 4, 5, 6], "a")
    manager.allocate(first)
    _compute_all(manager, first)
    manager.free(first)  # [1..4] and [5, 6] cached, unreferenced: no block never used
    second = _seq([1, 2, 3, 4, 5, 6, 7], "b")  # [1..4] shared; [5, 6] matches the last free block
    assert manager.can_allocate(second)
    assert manager.allocate(second) == []
    assert second.num_computed_tokens == 4 and len(set(second.block_table)) == 2
    assert manager.num_free_blocks == 0
    manager.free(second)
    assert manager.num_free_blocks == 2
