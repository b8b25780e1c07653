"""Streaming token ids -> text, right across UTF-8 characters split over several tokens.

Each token's raw bytes go through an incremental UTF-8 decoder, which holds back an incomplete
character until the token that completes it arrives: O(1) work per token, no re-decoding.
"""

from __future__ import annotations

import codecs

from engine.tokenizer import Tokenizer


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
