"""Chat templates render byte-identically to transformers' apply_chat_template(tokenize=False)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from assets import llama3_tokenizer_dir, llama_cpp_models_dir, qwen3_tokenizer_dir
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.models.gguf_loader import read_gguf
from tileinfer.engine.text.chat_template import render_chat_template
from tileinfer.engine.text.tokenizer import Tokenizer
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

SYSTEM_AND_USER = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2? Answer with “one” word — ünïcode too."},
]
MULTI_TURN = [
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "Seven.", "reasoning_content": None},
    {"role": "user", "content": "And another one?"},
]
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello"}],
    "system": SYSTEM_AND_USER,
    "multi": MULTI_TURN,
}


def assert_renders_like_transformers(
    ours: Tokenizer, reference: Any, messages: list[dict[str, Any]], **kwargs: Any
) -> None:
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        rendered = ours.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        assert rendered == expected


@pytest.fixture(scope="module")
def qwen3() -> tuple[Tokenizer, Any]:
    return Tokenizer.from_folder(qwen3_tokenizer_dir()), AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("thinking", [None, True, False])
def test_qwen3_template(qwen3, conversation: str, thinking: bool | None) -> None:
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    assert_renders_like_transformers(*qwen3, CONVERSATIONS[conversation], **kwargs)


def test_qwen3_thinking_switch_and_history(qwen3) -> None:
    ours, _ = qwen3
    prompt_off = ours.render_chat(MULTI_TURN, enable_thinking=False)
    assert prompt_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ours.render_chat(MULTI_TURN).endswith("<|im_start|>assistant\n")
    assert "The user greets me" not in prompt_off  # earlier turns' reasoning is dropped


def test_qwen3_encode_chat_matches_transformers(qwen3) -> None:
    ours, reference = qwen3
    expected = reference.apply_chat_template(SYSTEM_AND_USER, tokenize=True, add_generation_prompt=True)
    expected_ids = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ours.encode_chat(SYSTEM_AND_USER) == list(expected_ids)


def test_llama3_template() -> None:
    folder = llama3_tokenizer_dir()
    ours, reference = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    for messages in CONVERSATIONS.values():
        assert_renders_like_transformers(ours, reference, messages)
    assert ours.render_chat(CONVERSATIONS["user"]).startswith("<|begin_of_text|><|start_header_id|>user")


@pytest.fixture(scope="module")
def sentencepiece_pair() -> tuple[Tokenizer, Any]:
    models_dir = llama_cpp_models_dir()
    ours = Tokenizer.from_gguf(read_gguf(models_dir / "ggml-vocab-llama-spm.gguf"))
    return ours, AutoTokenizer.from_pretrained(models_dir, gguf_file="ggml-vocab-llama-spm.gguf")


@pytest.mark.parametrize(
    "template_name",
    [
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "Qwen-Qwen3-0.6B.jinja",
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    ],
)
def test_llama_cpp_templates_with_sentencepiece_specials(sentencepiece_pair, template_name: str) -> None:
    # llama-spm's <s> / </s> are the bos/eos these templates see, in our tokenizer and in transformers'
    ours, reference = sentencepiece_pair
    template = (llama_cpp_models_dir() / "templates" / template_name).read_text()
    ours.chat_template = reference.chat_template = template
    for name in ("user", "multi"):
        # a fixed date_string keeps Llama 3.1's strftime_now out of the comparison
        assert_renders_like_transformers(ours, reference, CONVERSATIONS[name], date_string="29 Nov 2026")
    if "Mistral" in template_name:
        assert ours.render_chat(CONVERSATIONS["user"]).startswith("<s>[INST]Hello[/INST]")


def test_smollm2_gguf_template(smollm2_gguf: Path) -> None:
    ours = Tokenizer.from_gguf(read_gguf(smollm2_gguf))
    # what transformers' GGUF tokenizer hands this template (test_tokenizer compares the tokenizers)
    special_tokens = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}
    for messages in CONVERSATIONS.values():
        for add_generation_prompt in (True, False):
            expected, _ = render_jinja_template(
                conversations=[messages],
                chat_template=ours.chat_template,
                add_generation_prompt=add_generation_prompt,
                **special_tokens,
                pad_token="<|im_end|>",
            )
            assert ours.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected[0]
    assert ours.render_chat(CONVERSATIONS["user"]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    )


def test_raise_exception_becomes_invalid_request() -> None:
    template = (
        llama_cpp_models_dir() / "templates" / "mistralai-Mistral-Nemo-Instruct-2407.jinja"
    ).read_text()
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidRequestError, match="roles must alternate user/assistant"):
        render_chat_template(template, two_users, bos_token="<s>", eos_token="</s>")


def test_template_errors_become_invalid_request() -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError, match="chat template"):
        render_chat_template("{% for m in messages %}{{ m.content ", messages)  # syntax error
    with pytest.raises(InvalidRequestError, match="no attribute 'nope'"):
        render_chat_template("{{ messages[0].content.nope.deeper }}", messages)
    with pytest.raises(InvalidRequestError, match="at least one message"):
        render_chat_template("{{ messages }}", [])


def test_template_features_match_transformers() -> None:
    # tojson without HTML escaping, loop controls, {% generation %} blocks and extra kwargs
    template = (
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}\n{% endfor %}{{ custom }}"
    )
    messages = [{"role": "user", "content": "<b>&'é"}, {"role": "skip", "content": "x"}]
    rendered = render_chat_template(template, messages, custom="!")
    expected, _ = render_jinja_template(conversations=[messages], chat_template=template, custom="!")
    assert rendered == expected[0] == '{"role": "user", "content": "<b>&\'é"}!'  # trim_blocks ate the newline


def test_model_without_template(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((llama3_tokenizer_dir() / "tokenizer.json").read_bytes())
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer.from_folder(tmp_path).render_chat([{"role": "user", "content": "hi"}])
