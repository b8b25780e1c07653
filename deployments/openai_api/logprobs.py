"""Token logprobs in OpenAI's two shapes: chat's `logprobs.content` and the legacy completions object."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tileinfer.engine.sampling.params import TokenLogprob
from tileinfer.engine.text.detokenizer import IncrementalDetokenizer
from tileinfer.engine.text.tokenizer import Tokenizer

# What OpenAI reports for a logprob too small to matter; JSON has no -Infinity.
LOWEST_LOGPROB = -9999.0


def token_text(token_bytes: bytes) -> str:
    """A token as a JSON string: its text, or "bytes:\\xe2\\x80" when it holds part of a UTF-8 character.

    The exact bytes are always in the `bytes` field; this spelling (OpenAI's) keeps the string honest
    instead of a replacement character that looks like real text.
    """
    try:
        return token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in token_bytes)


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)  # -inf becomes OpenAI's "very unlikely" value


def chat_logprobs_content(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's `logprobs.content`: per token its text, logprob, bytes and top alternatives."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        raw = tokenizer.token_bytes(token_id)
        return {"token": token_text(raw), "logprob": _finite(logprob), "bytes": list(raw)}

    return [
        {
            **entry(item.token_id, item.logprob),
            "top_logprobs": [entry(*alternative) for alternative in item.top],
        }
        for item in logprobs
    ]


def completion_logprobs(
    tokenizer: Tokenizer,
    logprobs: Sequence[TokenLogprob],
    *,
    skip_special_tokens: bool,
    text_offset: int = 0,
) -> dict[str, Any]:
    """The legacy completions `logprobs` object; text_offset[i] is where token i starts in the text.

    `text_offset` is where these tokens' text starts (the length of the text already sent, in a stream).
    Offsets follow the engine's own detokenizer with the request's skip_special_tokens, so they index the
    returned text exactly.
    """
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for item in logprobs:
        offsets.append(text_offset + len(detokenizer.text))
        detokenizer.push(item.token_id)
        tokens.append(token_text(tokenizer.token_bytes(item.token_id)))
        token_logprobs.append(_finite(item.logprob))
        top = {token_text(tokenizer.token_bytes(token_id)): _finite(value) for token_id, value in item.top}
        # OpenAI lists the top N and always the sampled token too: up to N + 1 entries
        top.setdefault(tokens[-1], token_logprobs[-1])
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
