"""TextStream: incremental text with stop strings, as the engine and the ingress replicas both run it."""

from __future__ import annotations

import random

import pytest
from assets import qwen3_tokenizer_dir
from tileinfer.engine.text.detokenizer import TextStream
from tileinfer.engine.text.tokenizer import Tokenizer

TEXT = "The sea is calm. 🦙 Waves: crème brûlée, 你好！ END of story. More text after the end."


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(qwen3_tokenizer_dir())


def _run(
    tokenizer: Tokenizer, token_ids: list[int], stop: tuple[str, ...]
) -> tuple[list[str], int | None, str]:
    """The visible deltas, the index of the token that completed a stop string, and the final flush."""
    stream = TextStream(tokenizer, stop)
    deltas = []
    for index, token_id in enumerate(token_ids):
        deltas.append(stream.push(token_id))
        if stream.stopped:
            return deltas, index, stream.finish(flush=False)
    return deltas, None, stream.finish(flush=True)


@pytest.mark.parametrize("stop", [(), ("END",), ("brûlée", "calm"), ("你好",), ("never there",), ("🦙",)])
def test_text_is_decode_cut_at_the_first_stop_string(tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
    token_ids = tokenizer.encode(TEXT)
    deltas, stopped_at, rest = _run(tokenizer, token_ids, stop)
    text = "".join(deltas) + rest
    positions = [TEXT.find(s) for s in stop if s in TEXT]
    assert text == (TEXT[: min(positions)] if positions else TEXT)
    if positions:  # it stopped on the token that completed the stop string, not later
        assert stopped_at is not None
        assert any(s in tokenizer.decode(token_ids[: stopped_at + 1]) for s in stop)
        assert not any(s in tokenizer.decode(token_ids[:stopped_at]) for s in stop)
    else:
        assert stopped_at is None


def test_held_back_text_never_shows_a_stop_string_prefix_early(tokenizer: Tokenizer) -> None:
    """What has been shown is always a prefix of the final text, even when a stop string's start
    appears before the stop string itself does."""
    rng = random.Random(3)
    for _ in range(20):
        words = [rng.choice(["ab", "abc", "a", "b", "c", " ", "é", "🦙"]) for _ in range(30)]
        text = "".join(words)
        stop = (rng.choice(["abca", "bc ", "🦙é", "cc"]),)
        token_ids = tokenizer.encode(text)
        deltas, _, rest = _run(tokenizer, token_ids, stop)
        final = "".join(deltas) + rest
        assert final == (text[: text.find(stop[0])] if stop[0] in text else text)
        shown = ""
        for delta in deltas:
            shown += delta
            assert final.startswith(shown)


def test_finish_flushes_a_split_character_only_for_length(tokenizer: Tokenizer) -> None:
    # a rare character that the byte-level tokenizer splits into byte tokens
    token_ids = next(ids for char in "𝔘𝔫𝔦𝔠𓀀𓁐" if len(ids := tokenizer.encode(char)) > 1)
    stream = TextStream(tokenizer)
    assert stream.push(token_ids[0]) == ""
    assert stream.finish(flush=True) == "\ufffd"
    stream = TextStream(tokenizer)
    stream.push(token_ids[0])
    assert stream.finish(flush=False) == ""
