"""Draft trees: several guessed continuations of a sequence at once, sharing their common prefixes.

The root is the sequence's last committed token (not a node). Node i holds tokens[i] and hangs under
parents[i] (-1: the root); every parent comes before its children, so the nodes are already in the order a
verify step computes them. A chain of drafts is the tree whose node i hangs under node i - 1, so a
proposer that returns chains is the one-branch case.

A verify step scores the root and every node (rows 0 and 1 + i); node i is at position context + depth(i)
and attends to the committed context and its own ancestors only (ancestor_mask). Verification
(accept_path) walks down from the root, taking at each node the child that equals the target's own token
there, and ends with the target's token after the last node taken. The target's token at a row is what
plain decoding would give there: its argmax (greedy), or its sample drawn at that row's draw position
(context + depth: siblings share it), so sampled output is plain sampling's token for token. With
deterministic drafts (every proposer's here) this is SpecInfer's multi-step speculative sampling: a child
is taken with its target probability, in order, and otherwise the token comes from the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class DraftTree:
    tokens: list[int]
    parents: list[int]

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.parents)
        assert all(-1 <= parent < node for node, parent in enumerate(self.parents)), "parents come first"

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    @classmethod
    def from_branches(cls, branches: Iterable[Sequence[int]], max_nodes: int) -> DraftTree:
        """The branches (token lists below the root), best first, merged where they share a prefix, up to
        max_nodes nodes: a branch that no longer fits is cut where the budget ends, and later ones only
        add what fits. Nodes are laid out depth-first, each branch's new nodes after its shared ones."""
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for branch in branches:
            if len(tokens) == max_nodes:  # full: no later branch adds a node
                break
            parent = -1
            for token in branch:
                node = children.get((parent, token))
                if node is None:
                    if len(tokens) == max_nodes:
                        break
                    node = children[(parent, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(parent)
                parent = node
        return cls(tokens, parents)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))

    def depths(self) -> list[int]:
        """Each node's depth: 1 for the root's children (its position is context + depth - 1 + 1)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """bool [1 + n, 1 + n] over the root and the nodes (row/column 0: the root): row a may attend to
        column b when b is a itself or one of its ancestors (the root is every node's)."""
        import torch  # not at import: the proposer interface that names trees needs no torch

        size = 1 + len(self.tokens)
        mask = torch.zeros(size, size, dtype=torch.bool)
        mask[:, 0] = True
        for node, parent in enumerate(self.parents):
            row = 1 + node
            mask[row] = mask[1 + parent] if parent >= 0 else mask[0]
            mask[row, row] = True
        return mask


def accept_path(tree: DraftTree, target: Sequence[int]) -> tuple[list[int], list[int]]:
    """Verification of a tree: target[0] is the target's next token after the root, target[1 + i] its next
    token after node i (argmax, or a sample at that row's draw position). Walks down from the root, at each
    step into the child whose token equals the target's there (tokens are unique among siblings). Returns
    the nodes accepted (a path from the root) and the tokens the sequence keeps: theirs, then the target's
    own after the last one."""
    children: dict[tuple[int, int], int] = {
        (parent, token): node
        for node, (parent, token) in enumerate(zip(tree.parents, tree.tokens, strict=True))
    }
    accepted: list[int] = []
    parent = -1
    while (node := children.get((parent, target[1 + parent]))) is not None:
        accepted.append(node)
        parent = node
    return accepted, [tree.tokens[node] for node in accepted] + [target[1 + parent]]
