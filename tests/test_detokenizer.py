"""Incremental detokenization: the deltas add up to decode(ids), across split UTF-8 characters."""

from __future__ import annotations

import pytest
from assets import llama_cpp_models_dir, qwen3_tokenizer_dir
from tileinfer.engine.models.gguf_loader import read_gguf
from tileinfer.engine.text.detokenizer import IncrementalDetokenizer
from tileinfer.engine.text.tokenizer import Tokenizer

TEXTS = [
    "Hello world, plain ASCII.",
    " leading space and  double  spaces",
    "Accents: crème brûlée, naïve, Ångström, señor, Dvořák",
    "CJK: 你好，世界！日本語のテキストです。한국어 문장",
    "Emoji: 🦙🚀 family 👩‍👩‍👧 flag 🇫🇷 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "Mixed\nlines\n\twith 🦙 and 中文 and é\n",
]


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "byte-level":
        return Tokenizer.from_folder(qwen3_tokenizer_dir())
    return Tokenizer.from_gguf(read_gguf(llama_cpp_models_dir() / "ggml-vocab-llama-spm.gguf"))


def stream(tokenizer: Tokenizer, token_ids: list[int], skip_special_tokens: bool) -> tuple[list[str], str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = [detokenizer.push(token_id) for token_id in token_ids]
    deltas.append(detokenizer.flush())
    return deltas, detokenizer.text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_concatenate_to_decode(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    for text in TEXTS:
        # BOS where the tokenizer adds one (SentencePiece), and an end-of-turn token at the end
        token_ids = [*tokenizer.encode(text), min(tokenizer.eos_token_ids)]
        deltas, streamed = stream(tokenizer, token_ids, skip_special_tokens)
        assert (
            "".join(deltas)
            == streamed
            == tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        )
        assert all("\ufffd" not in delta for delta in deltas)
        if skip_special_tokens:
            assert streamed == text


def test_split_character_is_held_back_then_emitted_whole(tokenizer: Tokenizer) -> None:
    # U+1D518 is rare enough that both vocabularies spell it with several tokens
    token_ids = tokenizer.encode("x \U0001d518", add_special_tokens=False)
    split_start = next(
        index for index, token_id in enumerate(token_ids) if b"\xf0" in tokenizer.token_bytes(token_id)
    )
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.push(token_id) for token_id in token_ids]
    assert split_start < len(token_ids) - 1
    # nothing of the character shows before its last token (a space in front of it may)
    assert all(delta.strip() == "" for delta in deltas[split_start:-1])
    assert deltas[-1] == "\U0001d518"
    assert detokenizer.text.strip() == "x \U0001d518".strip()


def test_sentencepiece_byte_fallback_character() -> None:
    tokenizer = Tokenizer.from_gguf(read_gguf(llama_cpp_models_dir() / "ggml-vocab-llama-spm.gguf"))
    # "🦙" is not in the vocabulary: "▁" then <0xF0><0x9F><0xA6><0x99>
    token_ids = tokenizer.encode("🦙", add_special_tokens=False)
    assert [tokenizer.token_bytes(token_id) for token_id in token_ids] == [
        b" ",
        *(bytes([b]) for b in "🦙".encode()),
    ]
    detokenizer = IncrementalDetokenizer(tokenizer)
    # the prefix space is dropped at the start of the text, as decode() drops it
    assert [detokenizer.push(token_id) for token_id in token_ids] == ["", "", "", "", "🦙"]
    assert detokenizer.text == tokenizer.decode(token_ids) == "🦙"


def test_incomplete_tail_flushes_as_replacement(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("ok 🦙", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.push(token_id) for token_id in token_ids[:-1]]  # the emoji's last byte never comes
    assert "".join(deltas).rstrip() == "ok"
    assert detokenizer.flush() == "\ufffd"
