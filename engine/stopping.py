"""When a sequence ends, token by token: a stop token, its grammar, its text's stop strings, max_tokens
or the context (the engine emits each token with the finish reason these give)."""

from __future__ import annotations

import logging
from collections.abc import Collection

from tileinfer.engine.errors import GrammarFailedError
from tileinfer.engine.sequence import Sequence
from tileinfer.engine.text.detokenizer import TextStream

logger = logging.getLogger(__name__)


def stops_on(seq: Sequence, token_id: int, eos_token_ids: Collection[int]) -> bool:
    """Whether the token is one that stops the sequence (it adds no text and no grammar takes it)."""
    params = seq.params
    return token_id in params.stop_token_ids or (token_id in eos_token_ids and not params.ignore_eos)


def grammar_finish(seq: Sequence, token_id: int, eos_token_ids: Collection[int]) -> str | None:
    """Commit a generated token to the sequence's grammar: the finish reason that gives, or None. The mask
    allows an end-of-sequence token only where the grammar accepts, or once it has failed
    (engine/sampling/grammar.py): a stop token, which no grammar takes, ends the sequence "stop", or
    "error" where it failed. With ignore_eos, a complete grammar's taking that token ends it "stop". A
    token the grammar refuses (the mask allowed it: the matcher failed on it, at one of llguidance's
    limits) ends it "error"."""
    grammar = seq.grammar
    assert grammar is not None
    if stops_on(seq, token_id, eos_token_ids):
        return "error" if grammar.error is not None else "stop"
    if not grammar.consume(token_id):
        return "error"
    if token_id in eos_token_ids and grammar.is_complete:  # a failed matcher takes it too
        return "error" if grammar.error is not None else "stop"
    return None


def finish_reason(
    seq: Sequence,
    text: TextStream | None,
    num_known_tokens: int,
    max_model_len: int,
    eos_token_ids: Collection[int],
    grammar_finished: str | None,
) -> tuple[str | None, str]:
    """The sequence's newest known token (the last of its first num_known_tokens), stop-checked and (with
    `text`) detokenized: its finish reason or None, and the text it adds. grammar_finished: what
    grammar_finish said for it (its grammar has taken it already)."""
    token_id = seq.token_ids[num_known_tokens - 1]
    if stops_on(seq, token_id, eos_token_ids):
        return grammar_finished or "stop", ""  # a stop token adds no text
    new_text = text.push(token_id) if text is not None else ""
    if grammar_finished is not None:
        return grammar_finished, new_text
    if text is not None and text.stopped:
        return "stop", new_text
    if num_known_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or num_known_tokens >= max_model_len:
        return "length", new_text
    return None, new_text


def grammar_failed(seq: Sequence, num_generated: int) -> GrammarFailedError:
    """The error a sequence whose grammar failed ends with (logged: the client gets it, not "stop")."""
    assert seq.grammar is not None
    why = seq.grammar.error
    logger.warning("request %s: its grammar failed after %d generated tokens: %s", seq.request_id,
                   num_generated, why)  # fmt: skip
    return GrammarFailedError(
        f"the output could not follow its grammar after {num_generated} generated tokens ({why}), so "
        "it does not match it; simplify the schema or grammar"
    )
