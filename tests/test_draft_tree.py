"""Draft trees (engine/spec_decode/draft_tree.py) and the n-gram proposer's branches: hand-made trees,
greedy acceptance against a chain's (verify_greedy), and the n-gram branches against a brute-force rescan."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from test_proposer_ngram import propose
from tileinfer.engine.spec_decode.draft_tree import DraftTree, accept_path
from tileinfer.engine.spec_decode.proposer_interface import DraftRequest, Proposer
from tileinfer.engine.spec_decode.verification import verify_greedy
from tileinfer.proposers.ngram import BRANCHES_PER_NODE, NgramProposer


def test_branches_share_their_common_prefixes_within_the_budget() -> None:
    tree = DraftTree.from_branches([[5, 6, 7], [5, 6, 9], [8, 1], [5, 2]], max_nodes=6)
    # 5-6-7, then 9 under 6, then 8-1 under the root, then 2 under 5: the budget of 6 cuts nothing
    assert tree.tokens == [5, 6, 7, 9, 8, 1]
    assert tree.parents == [-1, 0, 1, 1, -1, 4]
    assert tree.depths() == [1, 2, 3, 3, 1, 2]
    assert tree.path(3) == [0, 1, 3]
    assert not tree.is_chain and DraftTree.chain([5, 6, 7]).is_chain
    assert DraftTree.from_branches([[5, 6, 7]], max_nodes=2) == DraftTree.chain([5, 6])


def test_a_node_sees_the_root_itself_and_its_ancestors_only() -> None:
    tree = DraftTree.from_branches([[5, 6, 7], [5, 9], [8]], max_nodes=8)  # nodes 5 6 7 9 8
    mask = tree.ancestor_mask()
    sees = {row: [col for col in range(len(tree) + 1) if mask[row, col]] for row in range(len(tree) + 1)}
    assert sees == {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 2, 3], 4: [0, 1, 4], 5: [0, 5]}
    chain = DraftTree.chain([1, 2, 3]).ancestor_mask()
    assert torch.equal(chain, torch.ones(4, 4, dtype=torch.bool).tril())  # a chain: causal


def test_greedy_acceptance_takes_the_branch_the_target_agrees_with() -> None:
    tree = DraftTree.from_branches([[5, 6, 7], [5, 9, 4], [8]], max_nodes=8)  # 5 6 7 9 4 8
    argmax = [5, 9, 0, 0, 4, 3, 0]  # root -> 5; after 5 -> 9; after 9 -> 4; after 4 -> 3
    assert accept_path(tree, argmax) == ([0, 3, 4], [5, 9, 4, 3])
    assert accept_path(tree, [2, 0, 0, 0, 0, 0, 0]) == ([], [2])  # no child matches: the target's own


def test_on_a_chain_greedy_acceptance_equals_verify_greedy() -> None:
    rng = random.Random(0)
    for _ in range(200):
        drafts = [rng.randrange(4) for _ in range(rng.randint(0, 6))]
        argmax = [rng.randrange(4) for _ in range(len(drafts) + 1)]
        _, kept = accept_path(DraftTree.chain(drafts), argmax)
        verified = verify_greedy(
            torch.tensor([argmax]),
            torch.tensor([drafts + [0]])[:, : len(drafts)],
            torch.tensor([len(drafts)]),
        )
        num_accepted = int(verified.num_accepted[0])
        assert kept == verified.output_token_ids[0, : num_accepted + 1].tolist()


def brute_force_branches(
    token_ids: Sequence[int], depth: int, min_ngram: int, max_ngram: int
) -> list[list[int]]:
    """Every earlier occurrence of a suffix, longest suffix first and the latest first, each once (the
    place after it), continued depth tokens past the end by copying the continuation itself."""
    num_tokens, branches, taken = len(token_ids), [], set()
    for ngram_size in range(min(max_ngram, num_tokens - 1), min_ngram - 1, -1):
        suffix = list(token_ids[num_tokens - ngram_size :])
        for next_index in range(num_tokens - 1, ngram_size - 1, -1):
            if list(token_ids[next_index - ngram_size : next_index]) == suffix and next_index not in taken:
                taken.add(next_index)
                extended = list(token_ids)
                while len(extended) < num_tokens + depth:
                    extended.append(extended[next_index + len(extended) - num_tokens])
                branches.append(extended[num_tokens : num_tokens + depth])
    return branches


@pytest.mark.parametrize(("min_ngram", "max_ngram"), [(1, 4), (2, 3)])
def test_ngram_trees_hold_every_earlier_continuation_best_first(min_ngram: int, max_ngram: int) -> None:
    """Random small-vocabulary tokens, grown step by step: each tree is the brute-force branches merged
    within the node budget, and its first branch is what propose drafts."""
    rng = random.Random(max_ngram)
    proposer, chains = NgramProposer(min_ngram, max_ngram), NgramProposer(min_ngram, max_ngram)
    tokens: list[int] = []
    while len(tokens) < 200:
        tokens.extend(rng.randrange(4) for _ in range(rng.randint(1, 4)))
        depth, budget = rng.randint(1, 5), rng.randint(1, 12)
        tree = proposer.propose_trees([DraftRequest("r", tokens, depth)], budget)[0]
        branches = brute_force_branches(tokens, depth, min_ngram, max_ngram)
        assert tree == DraftTree.from_branches(branches[: BRANCHES_PER_NODE * budget], budget)
        first = branches[0][:budget] if branches else []
        assert propose(chains, tokens, depth) == (branches[0] if branches else [])
        assert tree.tokens[: len(first)] == first  # the first branch is laid out first


def test_a_chain_proposer_gives_one_branch_trees() -> None:
    """A proposer with no trees of its own (the draft model, DFlash): its chains, cut at the budget."""

    class Fixed(Proposer):
        def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
            return [[7, 8, 9][: request.num_drafts] for request in requests]

        def forget(self, request_id: str) -> None:
            pass

    trees = Fixed().propose_trees([DraftRequest("a", [1], 3), DraftRequest("b", [1], 0)], max_nodes=2)
    assert trees == [DraftTree.chain([7, 8]), DraftTree.chain([])]
