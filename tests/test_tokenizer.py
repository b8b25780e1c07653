"""Tokenizers against llama.cpp's golden vectors and against transformers on the same files."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import gguf
import pytest
import tokenizers
from assets import llama3_tokenizer_dir, llama_cpp_models_dir, qwen3_tokenizer_dir
from tileinfer.engine.errors import InvalidRequestError, ModelLoadError
from tileinfer.engine.models.gguf_loader import read_gguf
from tileinfer.engine.text.tokenizer import Tokenizer
from tokenizers import models, pre_tokenizers
from transformers import AutoTokenizer

# Texts that exercise the pre-tokenizers: unicode, code, whitespace runs, special tokens, numbers.
TEXTS = [
    "",
    " ",
    "Hello world",
    " Hello World!",
    "  leading and trailing  ",
    "\n\n\tTabs\tand\r\nnewlines\n\n\n",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский язык, עברית, العربية",
    "中文分词测试，你好世界！ 日本語のテキスト 한국어 텍스트",
    "emoji 🦙🚀 family 👩‍👩‍👧 flag 🇫🇷 ✨",
    'def square(x: int) -> int:\n    """Square."""\n    return x**2  # done\n\n\n'
    'if __name__ == "__main__":\n\tprint(square(3))',
    "numbers 1234567 3.14159 -42 1e10 0x1F 2024-11-29 100,000.00",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "      many      spaces\u3000ideographic\u00a0nbsp",
    "I'm you're they'LL WE'VE she'd",
    "<think>\nreasoning goes here\n</think>\n\nanswer",
]


# ---- llama.cpp golden vectors ----------------------------------------------------------------------

# The supported families' vocabularies, plus the cheap ones; each costs a second or more to read.
SUPPORTED_VOCABS = [
    "llama-bpe",
    "qwen2",
    "llama-spm",
    "phi-3",
    "gpt-2",
    "starcoder",
    "deepseek-coder",
]
# Also supported, but slow to read (4-16 s each on two cores) or covered by a regex set tested above; about
# 40 s in all, so they run only with TILEINFER_ALL_VOCABS=1 (the suite keeps within CI's time).
SLOW_VOCABS = ["qwen35", "deepseek-llm", "command-r", "refact", "falcon", "mpt"]
ALL_VOCABS = os.environ.get("TILEINFER_ALL_VOCABS") == "1"
UNSUPPORTED_VOCABS = {
    "bert-bge": (
        "WordPiece (tokenizer.ggml.model 'bert') is not supported: it serves no decoder model",
        True,
    ),
    # its 262k-token vocabulary takes 20 s to read just to fail, so it is not run
    "gemma-4": ("Gemma 4's SentencePiece-style BPE ('gemma4') is not supported yet", False),
}


def read_golden_vectors(vocab: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test-tokenizer-0 format: texts split by a marker line, one line of ids per text."""
    models_dir = llama_cpp_models_dir()
    raw = (models_dir / f"ggml-vocab-{vocab}.gguf.inp").read_text(encoding="utf-8")
    texts = raw.split("\n__ggml_vocab_test__\n")
    if texts[-1] == "":  # the file ends with a marker
        texts.pop()
    id_lines = (models_dir / f"ggml-vocab-{vocab}.gguf.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(id_lines)
    return [
        (text, [int(token) for token in line.split()]) for text, line in zip(texts, id_lines, strict=True)
    ]


@functools.cache
def load_vocab(vocab: str) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf(llama_cpp_models_dir() / f"ggml-vocab-{vocab}.gguf"))


@pytest.mark.parametrize(
    "vocab",
    SUPPORTED_VOCABS
    + [
        pytest.param(
            name, marks=[pytest.mark.slow, pytest.mark.skipif(not ALL_VOCABS, reason="TILEINFER_ALL_VOCABS")]
        )
        for name in SLOW_VOCABS
    ]
    + [
        pytest.param(
            name, marks=pytest.mark.xfail(reason=reason, raises=ModelLoadError, strict=True, run=run)
        )
        for name, (reason, run) in UNSUPPORTED_VOCABS.items()
    ],
)
def test_gguf_vocab_matches_llama_cpp_golden_vectors(vocab: str) -> None:
    tokenizer = load_vocab(vocab)
    golden = read_golden_vectors(vocab)
    assert len(golden) >= 40
    # test-tokenizer-0 tokenizes with add_special=false: no BOS in the .out files
    mismatches = [
        (text, expected, got)
        for text, expected in golden
        if (got := tokenizer.encode(text, add_special_tokens=False)) != expected
    ]
    assert mismatches == []


def test_sentencepiece_gguf_adds_bos_and_round_trips() -> None:
    tokenizer = load_vocab("llama-spm")
    assert tokenizer.add_bos_token and tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
    assert tokenizer.encode("Hello world") == [1, 15043, 3186]
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [15043, 3186]
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text
    # byte fallback: a character missing from the vocabulary becomes its UTF-8 bytes as <0xNN> tokens
    ids = tokenizer.encode("🦙", add_special_tokens=False)
    assert [tokenizer.token_bytes(token_id) for token_id in ids[1:]] == [
        bytes([byte]) for byte in "🦙".encode()
    ]
    assert tokenizer.token_bytes(15043) == b" Hello"


def test_unsupported_gguf_tokenizer_names_the_supported_ones() -> None:
    with pytest.raises(ModelLoadError, match="gpt2"):
        load_vocab("bert-bge")


# ---- tokenizer.json folders against transformers -----------------------------------------------------


@pytest.fixture(scope="module", params=["qwen3", "llama3"])
def folder_pair(request: pytest.FixtureRequest) -> tuple[Tokenizer, object]:
    folder = qwen3_tokenizer_dir() if request.param == "qwen3" else llama3_tokenizer_dir()
    return Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_folder_tokenizer_encodes_like_transformers(folder_pair, add_special_tokens: bool) -> None:
    ours, reference = folder_pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == reference.encode(
            text, add_special_tokens=add_special_tokens
        )


def test_folder_tokenizer_decodes_like_transformers(folder_pair) -> None:
    ours, reference = folder_pair
    for text in TEXTS:
        token_ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(token_ids) == text  # byte-level BPE is lossless
        for skip in (False, True):
            expected = reference.decode(
                token_ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            )
            assert ours.decode(token_ids, skip_special_tokens=skip) == expected
        assert b"".join(ours.token_bytes(token_id) for token_id in token_ids) == text.encode()


def test_qwen3_special_tokens() -> None:
    tokenizer = Tokenizer.from_folder(qwen3_tokenizer_dir())
    im_start, im_end = 151644, 151645
    assert tokenizer.encode("<|im_start|>user<|im_end|>") == [im_start, 872, im_end]
    assert tokenizer.is_special(im_end) and not tokenizer.is_special(872)
    assert tokenizer.eos_token == "<|im_end|>" and im_end in tokenizer.eos_token_ids
    assert tokenizer.bos_token_id is None and not tokenizer.add_bos_token
    assert tokenizer.decode([im_start, 872, im_end], skip_special_tokens=True) == "user"
    assert tokenizer.vocab_size == 151669
    assert "enable_thinking" in tokenizer.chat_template


def test_llama3_end_of_turn_tokens_end_generation() -> None:
    tokenizer = Tokenizer.from_folder(llama3_tokenizer_dir())
    assert tokenizer.bos_token == "<|begin_of_text|>" and tokenizer.bos_token_id == 128000
    assert tokenizer.eos_token_ids == {128001, 128009}  # <|end_of_text|>, <|eot_id|>


def test_generation_config_eos_ids_and_config_add_bos(tmp_path: Path) -> None:
    source = llama3_tokenizer_dir()
    (tmp_path / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008, 128009]}))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}")
    tokenizer = Tokenizer.from_folder(tmp_path)
    assert tokenizer.eos_token_ids == {128001, 128008, 128009}
    assert (
        tokenizer.encode("hi")[0] == 128000 and tokenizer.encode("hi", add_special_tokens=False)[0] != 128000
    )
    assert tokenizer.chat_template == "{{ bos_token }}"


# ---- the SmolLM2 GGUF (pre-type "smollm") against transformers' GGUF tokenizer -----------------------


def test_smollm2_gguf_tokenizer_matches_transformers(smollm2_gguf: Path) -> None:
    ours = Tokenizer.from_gguf(read_gguf(smollm2_gguf))
    reference = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    assert ours.vocab_size == 49152 and not ours.add_bos_token
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_ids == {2}
    for text in TEXTS:
        token_ids = ours.encode(text)
        assert token_ids == reference.encode(text)
        assert (
            ours.decode(token_ids) == reference.decode(token_ids, clean_up_tokenization_spaces=False) == text
        )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🦙"}]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages) == expected
    assert ours.encode_chat(messages) == reference.encode(expected, add_special_tokens=False)


# ---- the fewest tokens a text may take, found without tokenizing it ---------------------------------


@pytest.mark.parametrize("source", ["smollm2", "llama-bpe", "llama-spm", "qwen2", "qwen3"])
def test_fewest_tokens_is_at_most_the_tokens(source: str, request: pytest.FixtureRequest) -> None:
    """fewest_tokens (the ingress refuses a prompt too long for the context without tokenizing it) never
    says more than encode gives: over llama.cpp's test texts, this file's, and a run of the vocabulary's
    longest token, where the bound is closest."""
    if source == "smollm2":
        tokenizer = Tokenizer.from_gguf(read_gguf(request.getfixturevalue("smollm2_gguf")))
    elif source == "qwen3":  # NFC may compose 4 characters into 1: a looser bound
        tokenizer = Tokenizer.from_folder(qwen3_tokenizer_dir())
    else:
        tokenizer = load_vocab(source)
    longest = max(tokenizer._backend.get_vocab(), key=len)
    run = tokenizer.decode([tokenizer._backend.token_to_id(longest)]) * 100
    texts = TEXTS + [run]
    if source in SUPPORTED_VOCABS:
        texts += [text for text, _ in read_golden_vectors(source)]
    for text in texts:
        assert tokenizer.fewest_tokens(text) <= len(tokenizer.encode(text, add_special_tokens=False)), text
    assert tokenizer.fewest_tokens(run) > 0


def test_no_fewest_tokens_where_the_tokenizer_may_drop_text(tmp_path: Path) -> None:
    backend = tokenizers.Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()  # drops the spaces
    backend.save(str(tmp_path / "tokenizer.json"))
    assert Tokenizer.from_folder(tmp_path).fewest_tokens(" " * 10_000) == 0


# ---- bad input -------------------------------------------------------------------------------------


def test_missing_or_corrupt_tokenizer_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ModelLoadError, match="cannot read"):
        Tokenizer.from_folder(tmp_path)


def test_bad_token_ids_and_text() -> None:
    tokenizer = Tokenizer.from_folder(qwen3_tokenizer_dir())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        tokenizer.decode([1, tokenizer.vocab_size])
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        tokenizer.token_bytes(-1)
    with pytest.raises(InvalidRequestError, match="string"):
        tokenizer.encode(None)  # type: ignore[arg-type]


def write_tiny_gguf(path: Path, pre_type: str, merges: list[str]) -> gguf.GGUFReader:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_type)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_types([1, 1, 1])
    writer.add_token_merges(merges)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_gguf(path)


def test_bad_gguf_tokenizer_metadata(tmp_path: Path) -> None:
    tiny = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "ok.gguf", "gpt-2", ["a b"]))
    assert tiny.encode("ab") == [2] and tiny.decode([0, 1]) == "ab"
    with pytest.raises(ModelLoadError, match="unsupported GGUF pre-tokenizer 'martian'.*llama-bpe"):
        Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "pre.gguf", "martian", ["a b"]))
    with pytest.raises(ModelLoadError, match="corrupt"):
        Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "merges.gguf", "gpt-2", ["a zzz"]))
