"""Prompt lookup decoding: draft the tokens that followed the latest earlier occurrence of the suffix."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.spec_decode.draft_tree import DraftTree
from tileinfer.engine.spec_decode.proposer_interface import DraftRequest, Proposer


@dataclasses.dataclass
class _History:
    """What one request's tokens have been indexed into so far."""

    num_indexed: int = 0  # tokens[:num_indexed] are in the tables
    # for each n: n-gram -> where each of its occurrences that has a token after it ends (the index of that
    # next token), oldest first; one dict per n so that each step only adds the n-grams the new tokens
    # complete
    ends: dict[int, dict[tuple[int, ...], list[int]]] = dataclasses.field(default_factory=dict)


# A tree of n nodes looks at up to this many times n earlier occurrences (a short suffix recurs all over a
# long context, and branches that repeat one already taken add no node).
BRANCHES_PER_NODE = 4


class NgramProposer(Proposer):
    """Find the longest suffix of the tokens so far (max_ngram down to min_ngram tokens) that occurred
    earlier, take its most recent earlier occurrence, and propose the tokens that followed it.

    When the copied span reaches the end of the tokens (the match lies within the last few tokens, as in
    a repeating loop), the drafts go on copying themselves: the match implies that period, so
    "a b a b" drafts "a b a b ...", not just "a b".

    Each call indexes only the tokens added since the last one (a few dict updates per token), so a
    32k-token context costs one pass when first seen and then next to nothing per step.
    """

    def __init__(self, min_ngram: int = 1, max_ngram: int = 4) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidRequestError(
                f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}"
            )
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self._histories: dict[str, _History] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self._propose_one(request) for request in requests]

    def forget(self, request_id: str) -> None:
        self._histories.pop(request_id, None)

    def propose_trees(self, requests: Sequence[DraftRequest], max_nodes: int) -> list[DraftTree]:
        """Every earlier occurrence of the current suffix gives a branch: the longest suffix first, the
        more recent first, each continued num_drafts deep; branches that share a prefix share nodes, up to
        max_nodes nodes a tree. Its first branch is what propose drafts."""
        return [
            DraftTree.from_branches(self._branches(request, BRANCHES_PER_NODE * max_nodes), max_nodes)
            for request in requests
        ]

    def _propose_one(self, request: DraftRequest) -> list[int]:
        return next(self._branches(request, 1), [])

    def _branches(self, request: DraftRequest, max_branches: int) -> Iterator[list[int]]:
        """The continuations of the request's suffix, best first, up to max_branches distinct ones."""
        token_ids = request.token_ids
        history = self._histories.get(request.request_id)
        if history is None or len(token_ids) < history.num_indexed:  # new, or rolled back: start over
            history = self._histories[request.request_id] = _History()
        self._index_new_tokens(history, token_ids)
        if request.num_drafts <= 0:
            return
        num_tokens = len(token_ids)
        taken: set[int] = set()  # where the branches start: a shorter suffix finds the longer one's too
        for ngram_size in range(min(self.max_ngram, num_tokens - 1), self.min_ngram - 1, -1):
            suffix = tuple(token_ids[num_tokens - ngram_size :])
            for next_index in reversed(history.ends[ngram_size].get(suffix, ())):
                if next_index not in taken:
                    taken.add(next_index)
                    yield _copy_forward(token_ids, next_index, request.num_drafts)
                    if len(taken) == max_branches:
                        return

    def _index_new_tokens(self, history: _History, token_ids: Sequence[int]) -> None:
        """Record every n-gram that the tokens since the last call gave a following token."""
        num_tokens = len(token_ids)
        # An n-gram ending at `end` (exclusive) becomes usable once token `end` exists, i.e. end < num_tokens.
        for ngram_size in range(self.min_ngram, self.max_ngram + 1):
            first_end = max(ngram_size, history.num_indexed)
            window = token_ids[first_end - ngram_size : num_tokens - 1]  # tokens of the n-grams ending there
            ngrams = zip(*(window[offset:] for offset in range(ngram_size)), strict=False)
            ends = range(first_end, max(first_end, num_tokens))
            table = history.ends.setdefault(ngram_size, {})
            for ngram, end in zip(ngrams, ends, strict=True):
                table.setdefault(ngram, []).append(end)
        history.num_indexed = num_tokens


def _copy_forward(token_ids: Sequence[int], start: int, num_drafts: int) -> list[int]:
    """tokens[start:start + num_drafts], continued past the end by copying the drafts themselves."""
    drafts = list(token_ids[start : start + num_drafts])
    period = len(token_ids) - start
    while len(drafts) < num_drafts:
        drafts.append(drafts[len(drafts) - period])
    return drafts
