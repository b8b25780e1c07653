"""Streaming token ids -> text, right across UTF-8 characters split over several tokens.

Each token's raw bytes go through an incremental UTF-8 decoder, which holds back an incomplete
character until the token that completes it arrives: O(1) work per token, no re-decoding.
"""

from __future__ import annotations

import codecs

from tileinfer.engine.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text deltas whose concatenation is decode(ids)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # SentencePiece decoders drop the space before the first word of the whole text
        self._strip_next_space = tokenizer.strips_leading_space
        self._pieces: list[str] = []

    def push(self, token_id: int) -> str:
        """The new text this token completes; "" while a character is still split across tokens, and
        for an id the tokenizer cannot map (no text, never a failed request)."""
        if not self._tokenizer.can_decode(token_id):
            return ""
        if self._skip_special_tokens and self._tokenizer.is_special(token_id):
            return ""
        token_bytes = self._tokenizer.token_bytes(token_id)
        if self._strip_next_space and token_bytes:
            self._strip_next_space = False
            token_bytes = token_bytes.removeprefix(b" ")
        return self._emit(self._utf8.decode(token_bytes))

    def flush(self) -> str:
        """What is left at the end: an incomplete UTF-8 tail becomes replacement characters."""
        return self._emit(self._utf8.decode(b"", final=True))

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]  # join once, so repeated reads stay cheap
        return self._pieces[0] if self._pieces else ""

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        return delta


class TextStream:
    """One sequence's visible text: incremental detokenizing, cut at the first stop string.

    Text that could still turn out to be the start of a stop string is held back (up to the longest
    stop string's length less one) until the next token decides it, or until `finish`. Used by the
    Engine when it detokenizes in process (CLI, benchmarks) and by the ingress replicas when the
    engine deployment sends token ids only, so that both cut text exactly the same way.
    """

    def __init__(
        self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._holdback = max((len(text) - 1 for text in stop), default=0)
        # Text not yet returned. A stop string found in it must end in the newest delta, and so start
        # at most holdback characters back: the held-back tail is all the search needs.
        self._pending = ""
        self.stopped = False  # a stop string was found; the text ends before it

    def push(self, token_id: int) -> str:
        """The newly visible text this token adds; sets `stopped` when a stop string completes."""
        assert not self.stopped, "no text follows a stop string"
        self._pending += self._detokenizer.push(token_id)
        if not self._stop:
            return self._take(len(self._pending))
        positions = [found for text in self._stop if (found := self._pending.find(text)) >= 0]
        if positions:
            self.stopped = True
            self._pending = self._pending[: min(positions)]
            return self._take(len(self._pending))
        return self._take(len(self._pending) - self._holdback)

    def finish(self, flush: bool) -> str:
        """The held-back rest, at the end of the sequence; flush: also an incomplete UTF-8 tail (as
        replacement characters), when the sequence ended for its length rather than on a stop token."""
        if flush and not self.stopped:
            self._pending += self._detokenizer.flush()
        return self._take(len(self._pending))

    def _take(self, num_chars: int) -> str:
        if num_chars <= 0:
            return ""
        visible, self._pending = self._pending[:num_chars], self._pending[num_chars:]
        return visible
