"""Prompt lookup decoding: hand-made cases, a brute-force rescan as the reference, and real tokens."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.models.loader import load_tokenizer
from tileinfer.engine.spec_decode.proposer_interface import DraftRequest, Proposer
from tileinfer.proposers.ngram import NgramProposer


def propose(
    proposer: NgramProposer, token_ids: Sequence[int], num_drafts: int, request_id: str = "r"
) -> list[int]:
    return proposer.propose([DraftRequest(request_id, token_ids, num_drafts)])[0]


def brute_force(token_ids: Sequence[int], num_drafts: int, min_ngram: int, max_ngram: int) -> list[int]:
    """The definition, by rescanning everything: longest suffix first, latest earlier occurrence first."""
    num_tokens = len(token_ids)
    for ngram_size in range(min(max_ngram, num_tokens - 1), min_ngram - 1, -1):
        suffix = list(token_ids[num_tokens - ngram_size :])
        for next_index in range(num_tokens - 1, ngram_size - 1, -1):
            if list(token_ids[next_index - ngram_size : next_index]) == suffix:
                # copy what followed; past the end, the continued text is the drafts themselves
                extended = list(token_ids)
                while len(extended) < num_tokens + num_drafts:
                    extended.append(extended[next_index + len(extended) - num_tokens])
                return extended[num_tokens : num_tokens + num_drafts]
    return []


def agreeing_prefix(drafts: Sequence[int], truth: Sequence[int]) -> int:
    """How many leading drafts equal the true continuation (what greedy verification accepts)."""
    num_agreeing = 0
    while num_agreeing < min(len(drafts), len(truth)) and drafts[num_agreeing] == truth[num_agreeing]:
        num_agreeing += 1
    return num_agreeing


def test_is_a_proposer() -> None:
    proposer: Proposer = NgramProposer()
    assert proposer.propose([]) == []


def test_longest_match_wins() -> None:
    # suffix [3] last occurred before 9; the 2-gram [2, 3] before 5: the longer match decides
    tokens = [1, 2, 3, 5, 6, 7, 3, 9, 8, 2, 3]
    assert propose(NgramProposer(1, 4), tokens, 2) == [5, 6]
    assert propose(NgramProposer(1, 1), tokens, 2) == [9, 8]


def test_most_recent_occurrence_wins() -> None:
    tokens = [4, 5, 10, 11, 4, 5, 20, 21, 0, 4, 5]
    assert propose(NgramProposer(2, 2), tokens, 3) == [20, 21, 0]


def test_no_match_gives_nothing() -> None:
    assert propose(NgramProposer(1, 4), [1, 2, 3, 4, 5], 4) == []
    assert propose(NgramProposer(2, 4), [7, 1, 2, 7], 4) == []  # only a 1-gram matches
    assert propose(NgramProposer(), [], 4) == []
    assert propose(NgramProposer(), [42], 4) == []


def test_num_drafts_limits_the_proposal() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    proposer = NgramProposer()
    assert propose(proposer, tokens, 3) == [3, 4, 5]
    assert propose(proposer, tokens, 1) == [3]
    assert propose(proposer, tokens, 0) == []
    # past the end the match's period (7 tokens) repeats
    assert propose(proposer, tokens, 100) == ([3, 4, 5, 6, 7, 1, 2] * 15)[:100]


def test_a_loop_is_continued_past_the_end() -> None:
    assert propose(NgramProposer(), [9, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert propose(NgramProposer(), [3, 3, 3], 4) == [3, 3, 3, 3]


def test_requests_keep_separate_state_and_forget() -> None:
    proposer = NgramProposer()
    first, second = [1, 2, 3, 1, 2], [1, 2, 8, 1, 2]
    drafts = proposer.propose([DraftRequest("a", first, 1), DraftRequest("b", second, 1)])
    assert drafts == [[3], [8]]
    # the same id with unrelated, shorter tokens: the proposer must not reuse the old tables
    assert propose(proposer, [5, 6, 5], 1, request_id="a") == [6]
    proposer.forget("a")
    proposer.forget("never seen")
    assert propose(proposer, [1, 2, 9, 1, 2], 1, request_id="a") == [9]


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="min_ngram"):
        NgramProposer(0, 3)
    with pytest.raises(InvalidRequestError, match="min_ngram"):
        NgramProposer(3, 2)


@pytest.mark.parametrize(("min_ngram", "max_ngram"), [(1, 4), (2, 3), (3, 3)])
def test_incremental_state_equals_a_rescan(min_ngram: int, max_ngram: int) -> None:
    rng = random.Random(min_ngram * 10 + max_ngram)
    proposer = NgramProposer(min_ngram, max_ngram)
    for request in range(4):
        tokens: list[int] = []
        vocab_size = 3 + 2 * request  # small vocabularies repeat n-grams often
        while len(tokens) < 300:
            # the engine appends 1..k+1 accepted tokens per step
            tokens.extend(rng.randrange(vocab_size) for _ in range(rng.randint(1, 5)))
            num_drafts = rng.randint(0, 6)
            expected = brute_force(tokens, num_drafts, min_ngram, max_ngram)
            assert propose(proposer, tokens, num_drafts, request_id=str(request)) == expected


def test_real_tokens_of_a_repeated_code_block(smollm2_gguf: Path) -> None:
    tokenizer = load_tokenizer(str(smollm2_gguf))
    code = (
        "def merge_sorted(left: list[int], right: list[int]) -> list[int]:\n"
        "    merged = []\n"
        "    left_index = right_index = 0\n"
        "    while left_index < len(left) and right_index < len(right):\n"
        "        if left[left_index] <= right[right_index]:\n"
        "            merged.append(left[left_index])\n"
        "            left_index += 1\n"
        "        else:\n"
        "            merged.append(right[right_index])\n"
        "            right_index += 1\n"
        "    return merged + left[left_index:] + right[right_index:]\n"
    )
    # the code-edit pattern: the model rewrites the given code with a small change
    prompt = tokenizer.encode("Rename merged to result in:\n\n" + code + "\nHere it is:\n\n")
    answer = tokenizer.encode(code.replace("merged", "result"), add_special_tokens=False)
    # run the greedy verify loop with the answer as the target's choice: a step emits the drafts that
    # agree with it plus one token of the target's own
    proposer, num_drafts = NgramProposer(), 4
    num_generated = num_steps = 0
    while num_generated < len(answer):
        tokens = prompt + answer[:num_generated]
        drafts = propose(proposer, tokens, num_drafts)
        assert drafts == brute_force(tokens, num_drafts, 1, 4)
        num_generated += agreeing_prefix(drafts, answer[num_generated:]) + 1
        num_steps += 1
    # nearly all of the answer is copied from the prompt: at least 3 tokens a step of the 5 possible
    assert num_steps <= len(answer) / 3
