"""The paged KV cache's bookkeeping: fixed-size blocks, a free list, reference counts, block tables,
and prefix reuse.

Prefix reuse works at token granularity. A full block whose keys and values are computed is
registered under a chained hash (parent block's hash, its tokens) and shared by reference.
Below a full-block match, a sequence may still reuse the first tokens of a cached block that
matches only partly (a chat template that rewrote a turn, or the partial last block of a finished
turn): those slots are copied into a fresh block of its own. Blocks nobody references keep their
contents and are evicted least recently used first, after the never-used ones.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import struct
from collections import abc

from tileinfer.engine.sequence import Sequence

_ROOT = b""  # the parent hash of a sequence's first block


def _chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


def chained_block_hashes(token_ids: abc.Sequence[int], block_size: int) -> list[bytes]:
    """The hashes under which the full blocks of these tokens register in the prefix cache, in order
    (the ingress's router keys prompts by them: deployments/replicas/routing.py)."""
    hashes, parent = [], _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _chain_hash(parent, list(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


def common_prefix_length(a: abc.Sequence[int], b: abc.Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


@dataclasses.dataclass
class Block:
    block_id: int
    ref_count: int = 0
    parent_hash: bytes | None = None  # set while the block is registered in the prefix cache
    block_hash: bytes | None = None  # set for a registered full block
    token_ids: list[int] = dataclasses.field(default_factory=list)  # the tokens whose KV it holds


@dataclasses.dataclass(frozen=True)
class BlockCopy:
    """Copy the first num_slots slots of src_block's keys and values into dst_block."""

    src_block: int
    dst_block: int
    num_slots: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_block_ids: collections.deque[int] = collections.deque(range(num_blocks))
        # unreferenced blocks that still hold cached KV, least recently used first
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.hash_to_block: dict[bytes, int] = {}
        self.children: dict[bytes, dict[int, None]] = collections.defaultdict(dict)

    # --- capacity -------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (never used, or cached but unreferenced)."""
        return len(self.free_block_ids) + len(self.evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- allocation -----------------------------------------------------------------------------

    def _take_block(self) -> Block:
        if self.free_block_ids:
            block = self.blocks[self.free_block_ids.popleft()]
        else:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            self._unregister(block)
        block.ref_count = 1
        block.token_ids = []
        return block

    def _reference(self, block: Block) -> None:
        if block.ref_count == 0:
            self.evictable.pop(block.block_id, None)
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.parent_hash is not None:
            self.evictable[block.block_id] = None
        else:
            block.token_ids = []
            self.free_block_ids.append(block.block_id)

    def _register(
        self, block: Block, parent_hash: bytes, token_ids: list[int], block_hash: bytes | None
    ) -> None:
        """Enter a block whose KV for token_ids is computed into the prefix cache."""
        self._unregister(block)
        block.parent_hash = parent_hash
        block.block_hash = block_hash
        block.token_ids = list(token_ids)
        if block_hash is not None:
            self.hash_to_block[block_hash] = block.block_id
        self.children[parent_hash][block.block_id] = None

    def _unregister(self, block: Block) -> None:
        if block.parent_hash is None:
            return
        siblings = self.children[block.parent_hash]
        siblings.pop(block.block_id, None)
        if not siblings:
            del self.children[block.parent_hash]
        if block.block_hash is not None:
            del self.hash_to_block[block.block_hash]
        block.parent_hash = block.block_hash = None

    def _best_partial_match(self, parent_hash: bytes, token_ids: list[int]) -> tuple[Block | None, int]:
        best, best_length = None, 0
        for block_id in self.children.get(parent_hash, {}):
            block = self.blocks[block_id]
            length = common_prefix_length(block.token_ids, token_ids)
            if length > best_length:
                best, best_length = block, length
        return best, best_length

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq.num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> list[BlockCopy]:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix KV.

        Sets seq.block_table and seq.num_computed_tokens (the tokens whose KV it reuses; at least
        one token is always left to compute, so the step yields logits). Returns the slot copies
        the runner must make before the step.
        """
        assert not seq.block_table
        tokens = seq.token_ids
        reusable = len(tokens) - 1
        block_size = self.block_size
        parent_hash, num_reused, copies = _ROOT, 0, []
        # full blocks, shared by reference
        while num_reused + block_size <= reusable:
            chunk = tokens[num_reused : num_reused + block_size]
            block_hash = _chain_hash(parent_hash, chunk)
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            self._reference(self.blocks[block_id])
            seq.block_table.append(block_id)
            parent_hash = block_hash
            seq.block_hashes.append(parent_hash)
            num_reused += block_size
        # then the longest partial match below, copied into a block of the sequence's own
        limit = min(block_size, reusable - num_reused)
        source, length = self._best_partial_match(parent_hash, tokens[num_reused : num_reused + limit])
        if source is not None:
            self._reference(source)  # protect it from eviction while the fresh block is taken
            if self.num_free_blocks > 0:  # else the source was the last free block: compute its tokens
                block = self._take_block()
                copies.append(BlockCopy(source.block_id, block.block_id, length))
                seq.block_table.append(block.block_id)
                num_reused += length
            self._release(source.block_id)
        while len(seq.block_table) < self.blocks_needed(len(tokens)):
            seq.block_table.append(self._take_block().block_id)
        seq.num_computed_tokens = num_reused
        seq.num_cached_prompt_tokens = num_reused
        return copies

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        needed = self.blocks_needed(seq.num_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        """Make room in seq.block_table for its tokens plus num_new_tokens more."""
        while len(seq.block_table) < self.blocks_needed(seq.num_tokens + num_new_tokens):
            seq.block_table.append(self._take_block().block_id)

    def commit_computed(self, seq: Sequence) -> None:
        """Register the blocks that are now full of computed KV, so later prompts can share them."""
        block_size = self.block_size
        for index in range(len(seq.block_hashes), seq.num_computed_tokens // block_size):
            parent_hash = seq.block_hashes[-1] if seq.block_hashes else _ROOT
            chunk = seq.token_ids[index * block_size : (index + 1) * block_size]
            block_hash = _chain_hash(parent_hash, chunk)
            seq.block_hashes.append(block_hash)
            if block_hash not in self.hash_to_block:  # else an identical block is cached already
                self._register(self.blocks[seq.block_table[index]], parent_hash, chunk, block_hash)

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks; its computed partial last block stays reusable."""
        block_size = self.block_size
        num_full = seq.num_computed_tokens // block_size
        tail = seq.num_computed_tokens % block_size
        if tail and num_full == len(seq.block_hashes) and num_full < len(seq.block_table):
            parent_hash = seq.block_hashes[-1] if seq.block_hashes else _ROOT
            start = num_full * block_size
            block = self.blocks[seq.block_table[num_full]]
            self._register(block, parent_hash, seq.token_ids[start : start + tail], block_hash=None)
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    @staticmethod
    def slots(
        block_tables: abc.Sequence[list[int]], positions: abc.Sequence[int], block_size: int
    ) -> list[int]:
        """The KV cache slot of each (block table, position) pair: where a step writes that token's keys
        and values (engine/step_inputs.py; the runner knows the block size, not the manager)."""
        return [
            table[position // block_size] * block_size + position % block_size
            for table, position in zip(block_tables, positions, strict=True)
        ]

    def reset_prefix_cache(self) -> None:
        """Forget the cached KV of every block no sequence references (they become never-used blocks), so
        that no later prompt reuses it (the engine's warm-up requests leave no matches behind)."""
        while self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            self._unregister(block)
            block.token_ids = []
            self.free_block_ids.append(block_id)
