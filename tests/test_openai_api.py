"""The OpenAI protocol: request validation, SamplingParams, errors, logprobs and response shapes.

Response shapes are checked against the official `openai` package's own types, with no unknown keys; the
last tests send the official client's requests to the ingress's own HTTP app (tests/ingress_harness.py).
"""

from __future__ import annotations

import asyncio
import json
import pickle
from pathlib import Path
from typing import Any

import httpx
import openai
import openai.types
import openai.types.chat
import pydantic
import pytest
from ingress_harness import MODEL as SERVED_MODEL
from ingress_harness import build
from tileinfer.deployments.openai_api.chat_request import ChatCompletionRequest
from tileinfer.deployments.openai_api.completion_request import CompletionRequest
from tileinfer.deployments.openai_api.errors import OpenAIError, openai_error_from
from tileinfer.deployments.openai_api.generation_request import MAX_CHOICES
from tileinfer.deployments.openai_api.logprobs import chat_logprobs_content, completion_logprobs, token_text
from tileinfer.deployments.openai_api.request_parsing import parse_request
from tileinfer.deployments.openai_api.request_to_engine import (
    chat_messages_for_template,
    max_tokens_for,
    sampling_params_for,
)
from tileinfer.deployments.openai_api.responses import (
    ChatResponse,
    ChoiceResult,
    CompletionResponse,
    echo_text,
    usage,
)
from tileinfer.deployments.openai_api.sse import SSE_DONE, sse
from tileinfer.engine.errors import ContextLengthExceededError, InvalidRequestError
from tileinfer.engine.models.gguf_loader import read_gguf
from tileinfer.engine.sampling.params import SamplingParams, TokenLogprob
from tileinfer.engine.text.tokenizer import Tokenizer

MODEL = "smollm2"
HELLO = [{"role": "user", "content": "Hello"}]
# Its first three SmolLM2 tokens are b"\xf0\x9f", b"\x98", b"\x8a": one emoji split into partial UTF-8.
MIXED_TEXT = "😊 café “quoted” 日本語"


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf(smollm2_gguf))


def chat(**fields: Any) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"model": MODEL, "messages": HELLO, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return parse_request(CompletionRequest, {"model": MODEL, "prompt": "Once upon a time", **fields})


def rejection(model_cls: type, body: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as raised:
        parse_request(model_cls, body)
    assert raised.value.status_code == 400
    return raised.value


# ---- request -> SamplingParams -----------------------------------------------------------------


def test_chat_fields_become_sampling_params() -> None:
    request = chat(
        temperature=0.5,
        top_p=0.9,
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        stop=["\n\n", "END"],
        seed=11,
        logprobs=True,
        top_logprobs=3,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        ignore_eos=True,
        skip_special_tokens=False,
        stop_token_ids=[2],
    )
    assert sampling_params_for(request, choice_index=0, max_tokens=50) == SamplingParams(
        max_tokens=50,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        seed=11,
        stop=("\n\n", "END"),
        stop_token_ids=(2,),
        ignore_eos=True,
        logprobs=3,
        skip_special_tokens=False,
    )


def test_openai_defaults_and_nulls() -> None:
    explicit_nulls = {"temperature": None, "top_p": None, "n": None, "stop": None, "seed": None}
    for request in (chat(), chat(**explicit_nulls)):
        assert (request.n, request.stream, request.include_usage, request.requested_max_tokens) == (
            1,
            False,
            False,
            None,
        )
        assert sampling_params_for(request, 0, max_tokens=7) == SamplingParams(max_tokens=7)
    assert completion().requested_max_tokens == 16  # the completions endpoint's default
    assert completion(max_tokens=None).requested_max_tokens == 16


def test_logprobs_per_endpoint() -> None:
    assert sampling_params_for(chat(), 0, 8).logprobs is None
    assert sampling_params_for(chat(logprobs=True), 0, 8).logprobs == 0
    assert sampling_params_for(chat(logprobs=True, top_logprobs=20), 0, 8).logprobs == 20
    assert sampling_params_for(completion(), 0, 8).logprobs is None
    assert sampling_params_for(completion(logprobs=0), 0, 8).logprobs == 0
    assert sampling_params_for(completion(logprobs=5), 0, 8).logprobs == 5


def test_seed_gives_each_choice_its_own_reproducible_seed() -> None:
    request = chat(n=3, seed=7, temperature=1.0)
    assert [sampling_params_for(request, index, 8).seed for index in range(3)] == [7, 8, 9]
    assert [sampling_params_for(chat(n=3), index, 8).seed for index in range(3)] == [None, None, None]


def test_seed_out_of_range_names_seed() -> None:
    request = chat(n=2, seed=2**64 - 1)
    assert sampling_params_for(request, 0, 8).seed == 2**64 - 1
    with pytest.raises(OpenAIError) as raised:
        sampling_params_for(request, 1, 8)
    assert (raised.value.status_code, raised.value.param) == (400, "seed")


def test_stop_string_or_list() -> None:
    assert sampling_params_for(chat(stop="\n"), 0, 8).stop == ("\n",)
    assert sampling_params_for(chat(stop=["a", "b"]), 0, 8).stop == ("a", "b")
    assert sampling_params_for(completion(stop=[]), 0, 8).stop == ()


def test_max_tokens_and_max_completion_tokens() -> None:
    assert chat(max_tokens=5).requested_max_tokens == 5
    assert chat(max_completion_tokens=6).requested_max_tokens == 6
    assert chat(max_tokens=7, max_completion_tokens=7).requested_max_tokens == 7
    assert chat(max_tokens=5, max_completion_tokens=6).requested_max_tokens == 6  # vLLM's precedence


# ---- fields: unsupported, unknown, ignored -----------------------------------------------------

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("model_cls", "field_name", "value"),
    [
        (ChatCompletionRequest, "functions", [TOOL["function"]]),
        (ChatCompletionRequest, "function_call", {"name": "get_weather"}),
        (ChatCompletionRequest, "logit_bias", {"50256": -100}),
        (ChatCompletionRequest, "audio", {"voice": "alloy", "format": "wav"}),
        (ChatCompletionRequest, "modalities", ["text", "audio"]),
        (ChatCompletionRequest, "prediction", {"type": "content", "content": "x"}),
        (ChatCompletionRequest, "web_search_options", {}),
        (ChatCompletionRequest, "reasoning_effort", "low"),
        (ChatCompletionRequest, "verbosity", "low"),
        (CompletionRequest, "logit_bias", {"50256": -100}),
        (CompletionRequest, "suffix", " and they lived happily"),
        (CompletionRequest, "best_of", 3),
        (CompletionRequest, "best_of", 1.5),
        (CompletionRequest, "echo", True),  # with logprobs: prompt logprobs are not supported
    ],
)
def test_unsupported_fields_get_400_naming_them(model_cls: type, field_name: str, value: Any) -> None:
    base = {"messages": HELLO} if model_cls is ChatCompletionRequest else {"prompt": "Hi", "logprobs": 1}
    error = rejection(model_cls, {"model": MODEL, **base, field_name: value})
    assert (error.param, error.code) == (field_name, "unsupported_parameter")
    assert error.message.startswith(f"{field_name} is not supported by this server")
    assert error.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("message_field", "value"),
    [
        ("tool_calls", [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]),
        ("tool_call_id", "call_1"),
    ],
)
def test_tool_fields_only_where_they_belong(message_field: str, value: Any) -> None:
    """tool_calls only in an assistant's message, a tool_call_id only where it answers an earlier call."""
    messages = [*HELLO, {"role": "user" if message_field == "tool_calls" else "tool", "content": "ok",
                         message_field: value}]  # fmt: skip
    error = rejection(ChatCompletionRequest, {"model": MODEL, "messages": messages})
    assert error.param.startswith("messages[1]")


@pytest.mark.parametrize(
    ("model_cls", "path", "body"),
    [
        (ChatCompletionRequest, "frobnicate", {"model": MODEL, "messages": HELLO, "frobnicate": 1}),
        (CompletionRequest, "messages", {"model": MODEL, "prompt": "Hi", "messages": HELLO}),
        (
            ChatCompletionRequest,
            "messages[0].mood",
            {"model": MODEL, "messages": [{**HELLO[0], "mood": "x"}]},
        ),
        (
            ChatCompletionRequest,
            "stream_options.flush",
            {"model": MODEL, "messages": HELLO, "stream": True, "stream_options": {"flush": True}},
        ),
    ],
)
def test_unknown_fields_are_rejected_as_openai_does(model_cls: type, path: str, body: dict[str, Any]) -> None:
    error = rejection(model_cls, body)
    assert (error.message, error.param) == (f"Unrecognized request argument supplied: {path}", path)


def test_fields_without_effect_are_accepted_and_change_nothing() -> None:
    no_effect = {
        "user": "user-123",
        "metadata": {"purpose": "test"},
        "store": False,
        "service_tier": "auto",
        "parallel_tool_calls": True,
        "tool_choice": "none",
        "tools": [],
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "logit_bias": {},
        "prompt_cache_key": "key",
        "safety_identifier": "abc",
        "stream_options": {"include_usage": False, "include_obfuscation": True},
        "reasoning_effort": None,
    }
    request = chat(**no_effect)
    assert sampling_params_for(request, 0, 8) == sampling_params_for(chat(), 0, 8)
    assert chat(tool_choice="auto").messages == chat().messages
    assert sampling_params_for(completion(user="u", suffix="", logit_bias={}, best_of=1), 0, 8) == (
        sampling_params_for(completion(), 0, 8)
    )
    assert completion(n=2, best_of=1).n == 2  # one candidate per choice, as vLLM's V1 engine takes it


# ---- validation errors name the field ----------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "message_part"),
    [
        ({"messages": HELLO}, "model", "Missing required parameter: 'model'"),
        ({"model": MODEL}, "messages", "Missing required parameter: 'messages'"),
        ({"model": MODEL, "messages": []}, "messages", "at least 1 item"),
        ({"model": 5, "messages": HELLO}, "model", "valid string"),
        ({"model": MODEL, "messages": HELLO, "temperature": 3}, "temperature", "less than or equal to 2"),
        ({"model": MODEL, "messages": HELLO, "temperature": "0.5"}, "temperature", "valid number"),
        ({"model": MODEL, "messages": HELLO, "top_p": 0}, "top_p", "greater than 0"),
        ({"model": MODEL, "messages": HELLO, "n": 0}, "n", "greater than or equal to 1"),
        (
            {"model": MODEL, "messages": HELLO, "n": MAX_CHOICES + 1},
            "n",
            f"less than or equal to {MAX_CHOICES}",
        ),
        ({"model": MODEL, "messages": HELLO, "n": True}, "n", "valid integer"),
        ({"model": MODEL, "messages": HELLO, "stream": "yes"}, "stream", "valid boolean"),
        ({"model": MODEL, "messages": HELLO, "presence_penalty": -2.5}, "presence_penalty", "-2"),
        ({"model": MODEL, "messages": HELLO, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"model": MODEL, "messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"model": MODEL, "messages": HELLO, "stop": [""]}, "stop", "must not be empty"),
        ({"model": MODEL, "messages": HELLO, "stop": 5}, "stop", "valid"),
        ({"model": MODEL, "messages": HELLO, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
        ({"model": MODEL, "messages": HELLO, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        (
            {"model": MODEL, "messages": HELLO, "stream_options": {"include_usage": True}},
            "stream_options",
            "only allowed when 'stream' is enabled",
        ),
        (
            {"model": MODEL, "messages": HELLO, "chat_template_kwargs": []},
            "chat_template_kwargs",
            "dictionary",
        ),
        (
            {"model": MODEL, "messages": HELLO, "chat_template_kwargs": {"add_generation_prompt": False}},
            "chat_template_kwargs.add_generation_prompt",
            "must not set",
        ),
        (
            {"model": MODEL, "messages": [{"role": "tool", "content": "42"}]},
            "messages[0].tool_call_id",
            "Missing required",
        ),
        ({"model": MODEL, "messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "'assistant'"),
        ({"model": MODEL, "messages": [{"role": "user"}]}, "messages[0].content", "Missing required"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 7}]}, "messages[0].content", "valid"),
        ({"model": MODEL, "messages": ["Hello"]}, "messages[0]", "valid dictionary"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
            "Missing required",
        ),
    ],
)
def test_chat_validation_errors_name_the_field(body: dict[str, Any], param: str, message_part: str) -> None:
    error = rejection(ChatCompletionRequest, body)
    assert error.param == param
    assert message_part in error.message
    assert error.body() == {
        "error": {"message": error.message, "type": "invalid_request_error", "param": param, "code": None}
    }


def test_non_text_content_parts_name_the_message() -> None:
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
    error = rejection(ChatCompletionRequest, {"model": MODEL, "messages": messages})
    assert error.param == "messages[0].content"
    assert "'image_url'" in error.message


@pytest.mark.parametrize(
    ("body", "param", "message_part"),
    [
        ({"model": MODEL}, "prompt", "Missing required parameter"),
        ({"model": MODEL, "prompt": []}, "prompt", "must not be empty"),
        ({"model": MODEL, "prompt": ""}, "prompt", "must not be empty"),
        ({"model": MODEL, "prompt": ["a", ""]}, "prompt", "must not be empty"),
        ({"model": MODEL, "prompt": [[1, 2], []]}, "prompt", "must not be empty"),
        ({"model": MODEL, "prompt": [1, -2]}, "prompt", "negative"),
        ({"model": MODEL, "prompt": [[1], [-3]]}, "prompt", "negative"),
        ({"model": MODEL, "prompt": 12}, "prompt", "valid"),
        ({"model": MODEL, "prompt": "Hi", "logprobs": 6}, "logprobs", "less than or equal to 5"),
        ({"model": MODEL, "prompt": "Hi", "logprobs": True}, "logprobs", "valid integer"),
        ({"model": MODEL, "prompt": ["a"] * 5, "n": 30}, "n", f"at most {MAX_CHOICES}"),
    ],
)
def test_completion_validation_errors_name_the_field(
    body: dict[str, Any], param: str, message_part: str
) -> None:
    error = rejection(CompletionRequest, body)
    assert error.param == param
    assert message_part in error.message


@pytest.mark.parametrize("body", [None, [], "text", 3])
def test_body_must_be_an_object(body: Any) -> None:
    assert rejection(ChatCompletionRequest, body).message == "The request body must be a JSON object."


def test_completion_prompt_batches() -> None:
    assert completion(prompt="Hi").prompt_list() == ["Hi"]
    assert completion(prompt=["Hi", "Yo"]).prompt_list() == ["Hi", "Yo"]
    assert completion(prompt=[1, 2, 3]).prompt_list() == [[1, 2, 3]]
    assert completion(prompt=[[1, 2], [3]]).prompt_list() == [[1, 2], [3]]


# ---- context length ----------------------------------------------------------------------------


def test_max_tokens_for_fits_or_fills_the_context() -> None:
    assert max_tokens_for(chat(max_tokens=10), num_prompt_tokens=90, max_model_len=100) == 10
    assert max_tokens_for(chat(), num_prompt_tokens=90, max_model_len=100) == 10
    assert max_tokens_for(completion(), num_prompt_tokens=84, max_model_len=100) == 16


def test_prompt_plus_completion_over_the_context() -> None:
    with pytest.raises(OpenAIError) as raised:
        max_tokens_for(chat(max_completion_tokens=20), num_prompt_tokens=90, max_model_len=100)
    error = raised.value
    assert (error.status_code, error.code, error.param) == (400, "context_length_exceeded", "messages")
    assert error.message == (
        "This model's maximum context length is 100 tokens. However, you requested 110 tokens "
        "(90 in the messages, 20 in the completion). Please reduce the length of the messages or completion."
    )
    with pytest.raises(OpenAIError) as raised:
        max_tokens_for(completion(), num_prompt_tokens=85, max_model_len=100)
    assert (raised.value.param, raised.value.code) == ("prompt", "context_length_exceeded")
    assert "(85 in the prompt, 16 in the completion)" in raised.value.message


@pytest.mark.parametrize("num_prompt_tokens", [100, 150])
def test_prompt_alone_over_the_context(num_prompt_tokens: int) -> None:
    for request in (chat(), completion(max_tokens=1)):
        with pytest.raises(OpenAIError) as raised:
            max_tokens_for(request, num_prompt_tokens=num_prompt_tokens, max_model_len=100)
        assert raised.value.code == "context_length_exceeded"
        assert raised.value.param == request.prompt_field
        assert f"resulted in {num_prompt_tokens} tokens" in raised.value.message


# ---- errors ------------------------------------------------------------------------------------


def test_engine_errors_map_to_openai_errors() -> None:
    too_long = openai_error_from(ContextLengthExceededError("prompt of 5000 tokens"), prompt_param="prompt")
    assert (too_long.status_code, too_long.code, too_long.param) == (400, "context_length_exceeded", "prompt")
    invalid = openai_error_from(InvalidRequestError("token id 99999 is outside the vocabulary"))
    assert (invalid.status_code, invalid.message) == (400, "token id 99999 is outside the vocabulary")
    internal = openai_error_from(RuntimeError("CUDA error: secret internals at 0xdeadbeef"))
    assert (internal.status_code, internal.type) == (500, "server_error")
    assert "0xdeadbeef" not in internal.message
    queue_full = OpenAIError.queue_full()
    assert openai_error_from(queue_full) is queue_full


def test_errors_raised_in_a_ray_actor_are_unwrapped() -> None:
    ray_exceptions = pytest.importorskip("ray.exceptions")
    for cause, status_code in (
        (ContextLengthExceededError("too long"), 400),
        (OpenAIError.queue_full(), 503),
    ):
        try:
            raise cause
        except Exception as raised:
            task_error = ray_exceptions.RayTaskError(
                "generate", "Traceback ...", raised
            ).as_instanceof_cause()
        assert isinstance(task_error, type(cause))  # what Ray guarantees
        error = openai_error_from(task_error, prompt_param="messages")
        assert error.status_code == status_code
        assert error.message == str(cause) and "Traceback" not in error.message


def test_error_constructors_and_pickling() -> None:
    cases = {
        OpenAIError.invalid_api_key(provided=True): (401, "invalid_request_error", None, "invalid_api_key"),
        OpenAIError.model_not_found("gpt-9"): (404, "invalid_request_error", "model", "model_not_found"),
        OpenAIError.request_too_large(1024): (413, "invalid_request_error", None, "request_too_large"),
        OpenAIError.queue_full(): (503, "server_error", None, "queue_full"),
        OpenAIError.service_unavailable("the engine is restarting"): (503, "server_error", None, None),
        OpenAIError.invalid_api_key(provided=False): (401, "invalid_request_error", None, "invalid_api_key"),
        OpenAIError.internal(): (500, "server_error", None, None),
    }
    for error, (status_code, error_type, param, code) in cases.items():
        assert (error.status_code, error.type, error.param, error.code) == (
            status_code,
            error_type,
            param,
            code,
        )
        body = error.body()["error"]
        assert set(body) == {"message", "type", "param", "code"} and body["message"] == str(error)
        copy = pickle.loads(pickle.dumps(error))
        assert (copy.status_code, copy.body()) == (error.status_code, error.body())
    assert "`gpt-9`" in OpenAIError.model_not_found("gpt-9").message
    assert "serves `smollm2`" in OpenAIError.model_not_found("gpt-9", served_model="smollm2").message


# ---- chat template input -----------------------------------------------------------------------


def test_messages_for_template(tokenizer: Tokenizer) -> None:
    request = chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello!", "name": "bot", "refusal": None, "annotations": []},
            {"role": "user", "content": "Bye"},
        ]
    )
    messages = chat_messages_for_template(request)
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi\nthere"},
        {"role": "assistant", "content": "Hello!", "name": "bot"},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tokenizer.render_chat(messages)  # the real ChatML template accepts them
    assert "<|im_start|>system\nBe brief.<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


def test_echo_text(tokenizer: Tokenizer) -> None:
    assert echo_text("Once upon", tokenizer) == "Once upon"
    assert echo_text(tokenizer.encode(MIXED_TEXT, add_special_tokens=False), tokenizer) == MIXED_TEXT


# ---- logprobs ----------------------------------------------------------------------------------


def fake_logprobs(token_ids: list[int]) -> list[TokenLogprob]:
    """Made-up logprobs for given tokens; each was the most likely, and the next id came second."""
    return [
        TokenLogprob(token_id, -0.25 * position, top=[(token_id, -0.25 * position), (token_id + 1, -2.0)])
        for position, token_id in enumerate(token_ids)
    ]


def test_token_text_marks_partial_utf8() -> None:
    assert token_text(" caf\xe9".encode()) == " café"
    assert token_text(b"\xf0\x9f") == "bytes:\\xf0\\x9f"


def test_chat_logprobs_with_partial_utf8_tokens(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(MIXED_TEXT, add_special_tokens=False)
    content = chat_logprobs_content(tokenizer, fake_logprobs(token_ids))
    assert b"".join(bytes(entry["bytes"]) for entry in content) == MIXED_TEXT.encode()
    first = content[0]
    assert (first["token"], first["bytes"]) == ("bytes:\\xf0\\x9f", [0xF0, 0x9F])  # half an emoji
    assert content[3]["token"] == " café"
    assert [entry["logprob"] for entry in content[:3]] == [0.0, -0.25, -0.5]
    assert [top["logprob"] for top in content[1]["top_logprobs"]] == [-0.25, -2.0]
    assert content[1]["top_logprobs"][1]["bytes"] == list(tokenizer.token_bytes(token_ids[1] + 1))
    json.dumps(content, allow_nan=False)  # strict JSON


def test_completion_logprobs_offsets_index_the_text(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(MIXED_TEXT, add_special_tokens=False)
    logprobs = completion_logprobs(tokenizer, fake_logprobs(token_ids), skip_special_tokens=True)
    pieces = [tokenizer.token_bytes(token_id) for token_id in token_ids]
    # where each token starts: the characters completed by the tokens before it
    expected_offsets = [len(b"".join(pieces[:index]).decode(errors="ignore")) for index in range(len(pieces))]
    assert logprobs["text_offset"] == expected_offsets
    assert logprobs["text_offset"][:4] == [0, 0, 0, 1]  # three tokens of one emoji, then " café"
    assert logprobs["tokens"][:4] == ["bytes:\\xf0\\x9f", "bytes:\\x98", "bytes:\\x8a", " café"]
    assert logprobs["token_logprobs"][:2] == [0.0, -0.25]
    runner_up = token_text(tokenizer.token_bytes(token_ids[3] + 1))
    assert logprobs["top_logprobs"][3] == {" café": -0.75, runner_up: -2.0}
    # the sampled token is always listed, also when it is not among the top N (here N = 0)
    unlikely = TokenLogprob(token_ids[3], -7.0, top=[])
    assert completion_logprobs(tokenizer, [unlikely], skip_special_tokens=True)["top_logprobs"] == [
        {" café": -7.0}
    ]
    streamed = completion_logprobs(
        tokenizer, fake_logprobs(token_ids[3:4]), skip_special_tokens=True, text_offset=1
    )
    assert streamed["text_offset"] == [1]


def test_unlikely_tokens_stay_valid_json(tokenizer: Tokenizer) -> None:
    item = TokenLogprob(token_id=100, logprob=float("-inf"), top=[(101, float("-inf"))])
    content = chat_logprobs_content(tokenizer, [item])
    assert content[0]["logprob"] == content[0]["top_logprobs"][0]["logprob"] == -9999.0
    json.dumps(completion_logprobs(tokenizer, [item], skip_special_tokens=True), allow_nan=False)


# ---- response shapes against the openai package ------------------------------------------------


def assert_no_unknown_keys(value: Any) -> None:
    """openai's models accept extra keys silently; ours must have none."""
    if isinstance(value, pydantic.BaseModel):
        assert not value.model_extra, f"{type(value).__name__} got unknown keys {value.model_extra}"
        for name in type(value).model_fields:
            assert_no_unknown_keys(getattr(value, name))
    elif isinstance(value, list):
        for item in value:
            assert_no_unknown_keys(item)


def openai_parse(openai_cls: type[pydantic.BaseModel], body: dict[str, Any]) -> Any:
    body = json.loads(sse(body).removeprefix(b"data: "))  # what goes over the wire
    parsed = openai_cls.model_validate(body)
    assert_no_unknown_keys(parsed)
    return parsed


def test_chat_completion_response_shape(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(MIXED_TEXT, add_special_tokens=False)
    choices = [
        ChoiceResult(0, MIXED_TEXT, token_ids, "stop", fake_logprobs(token_ids)),
        ChoiceResult(1, "😊", token_ids[:3], "length", fake_logprobs(token_ids[:3])),
    ]
    response = ChatResponse("chatcmpl-abc", 1700000000, chat(logprobs=True), tokenizer)
    body = response.body(choices, usage(12, len(token_ids) + 3))
    parsed = openai_parse(openai.types.chat.ChatCompletion, body)
    assert (parsed.id, parsed.object, parsed.created, parsed.model) == (
        "chatcmpl-abc",
        "chat.completion",
        1700000000,
        MODEL,
    )
    assert [choice.message.content for choice in parsed.choices] == [MIXED_TEXT, "😊"]
    assert [choice.finish_reason for choice in parsed.choices] == ["stop", "length"]
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[1].logprobs.content[0].bytes == [0xF0, 0x9F]
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens, parsed.usage.total_tokens) == (
        12,
        18,
        30,
    )
    plain = ChatResponse("chatcmpl-abc", 1, chat(), tokenizer).body(choices[:1], usage(1, 1))
    assert openai_parse(openai.types.chat.ChatCompletion, plain).choices[0].logprobs is None


def test_chat_stream_chunk_shapes(tokenizer: Tokenizer) -> None:
    chunk_cls = openai.types.chat.ChatCompletionChunk
    request = chat(stream=True, stream_options={"include_usage": True}, logprobs=True)
    response = ChatResponse("chatcmpl-abc", 5, request, tokenizer)
    first = response.chunk(0, {"role": "assistant", "content": ""})
    parsed = openai_parse(chunk_cls, first)
    assert (parsed.object, parsed.choices[0].delta.role, parsed.usage) == (
        "chat.completion.chunk",
        "assistant",
        None,
    )
    without_usage = ChatResponse("c", 5, chat(stream=True), tokenizer)
    assert "usage" in first and "usage" not in without_usage.chunk(0, {})

    logprobs = fake_logprobs([tokenizer.encode("Hi", add_special_tokens=False)[0]])
    middle = openai_parse(chunk_cls, response.chunk(1, {"content": "Hi"}, logprobs=logprobs))
    assert (middle.choices[0].index, middle.choices[0].delta.content) == (1, "Hi")
    assert middle.choices[0].logprobs.content[0].token == "Hi"
    # logprobs only when asked for, and none for a chunk without tokens
    assert without_usage.chunk(1, {"content": "Hi"}, logprobs=logprobs)["choices"][0]["logprobs"] is None
    assert response.chunk(1, {"content": "Hi"})["choices"][0]["logprobs"] is None

    last = openai_parse(chunk_cls, response.chunk(0, {}, "length"))
    assert (last.choices[0].finish_reason, last.choices[0].delta.content) == ("length", None)

    totals = openai_parse(chunk_cls, response.usage_chunk(usage(3, 4)))
    assert (totals.choices, totals.usage.total_tokens, totals.object) == ([], 7, "chat.completion.chunk")


def test_completion_response_and_chunk_shapes(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(MIXED_TEXT, add_special_tokens=False)
    choices = [
        ChoiceResult(index, MIXED_TEXT, token_ids, "stop", fake_logprobs(token_ids)) for index in range(2)
    ]
    response = CompletionResponse("cmpl-abc", 9, completion(logprobs=1), tokenizer)
    body = response.body(choices, usage(4, 2 * len(token_ids)))
    parsed = openai_parse(openai.types.Completion, body)
    assert (parsed.object, parsed.id, [choice.index for choice in parsed.choices]) == (
        "text_completion",
        "cmpl-abc",
        [0, 1],
    )
    assert parsed.choices[0].logprobs.tokens[3] == " café"
    expected_offsets = completion_logprobs(tokenizer, choices[0].logprobs, skip_special_tokens=True)
    assert parsed.choices[0].logprobs.text_offset == expected_offsets["text_offset"]
    plain = CompletionResponse("cmpl-abc", 9, completion(), tokenizer).body(choices, usage(4, 30))
    assert openai_parse(openai.types.Completion, plain).choices[1].logprobs is None

    request = completion(stream=True, stream_options={"include_usage": True}, logprobs=1)
    streamed = CompletionResponse("cmpl-abc", 9, request, tokenizer)
    last_token = fake_logprobs(token_ids[3:4])  # " café", after the emoji already sent
    parsed_last = openai_parse(openai.types.Completion, streamed.chunk(0, " café", "stop", last_token, 1))
    assert parsed_last.choices[0].text == " café" and parsed_last.usage is None
    assert (parsed_last.choices[0].logprobs.tokens, parsed_last.choices[0].logprobs.text_offset) == (
        [" café"],
        [1],
    )
    # OpenAI streams null finish_reason before the end, which its Completion type does not admit
    middle = CompletionResponse("cmpl-abc", 9, completion(stream=True), tokenizer).chunk(0, "mid")
    assert middle["choices"] == [{"index": 0, "text": "mid", "logprobs": None, "finish_reason": None}]
    assert "usage" not in middle
    totals = openai_parse(openai.types.Completion, streamed.usage_chunk(usage(4, 5)))
    assert (totals.object, totals.choices, totals.usage.completion_tokens) == ("text_completion", [], 5)


def test_sse_framing() -> None:
    event = sse({"text": "café", "n": 1})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    assert json.loads(event[len(b"data: ") :]) == {"text": "café", "n": 1}
    assert sse("[DONE]") == SSE_DONE == b"data: [DONE]\n\n"


# ---- through the ingress's own HTTP app, on a stand-in engine (tests/ingress_harness.py) --------------


def sse_events(body: str) -> list[dict[str, Any]]:
    """A stream's JSON events, checked to end with [DONE]."""
    events = [line.removeprefix("data: ") for line in body.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def test_official_client_round_trip(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The official client's requests reach the engine as the prompt and SamplingParams they ask for, and
    the ingress's answers parse as its types."""
    messages = [{"role": "developer", "content": "Be brief."}, *HELLO]
    hi_there = tokenizer.encode("Hi there", add_special_tokens=False)

    async def run() -> None:
        http_client, engine = build(tokenizer, monkeypatch)
        engine.reply = hi_there
        client = openai.AsyncOpenAI(
            api_key="test", base_url=http_client.base_url.join("/v1"), http_client=http_client, max_retries=0
        )
        async with http_client:
            reply = await client.chat.completions.create(
                model=SERVED_MODEL,
                messages=messages,
                max_completion_tokens=2,
                seed=3,
                logprobs=True,
                top_logprobs=2,
                user="someone",
                extra_body={"top_k": 5, "chat_template_kwargs": {"enable_thinking": False}},
            )
            assert reply.choices[0].message.content == "Hi there"
            assert [entry.token for entry in reply.choices[0].logprobs.content] == ["Hi", " there"]
            assert [len(entry.top_logprobs) for entry in reply.choices[0].logprobs.content] == [2, 2]
            prompt, params = engine.submitted[-1]
            system_first = [{"role": "system", "content": "Be brief."}, *HELLO]
            assert prompt == tokenizer.encode_chat(system_first, add_generation_prompt=True)
            assert (params.max_tokens, params.seed, params.top_k, params.logprobs) == (2, 3, 5, 2)

            stream = await client.chat.completions.create(
                model=SERVED_MODEL, messages=HELLO, stream=True, stream_options={"include_usage": True}
            )
            chunks = [chunk async for chunk in stream]
            assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == (
                "Hi there"
            )
            assert chunks[-1].usage.total_tokens == len(engine.submitted[-1][0]) + len(hi_there)

            text = await client.completions.create(model=SERVED_MODEL, prompt=[[1, 2], [3]], max_tokens=2)
            assert [choice.text for choice in text.choices] == ["Hi there", "Hi there"]
            assert [prompt for prompt, _ in engine.submitted[-2:]] == [[1, 2], [3]]

            with pytest.raises(openai.BadRequestError) as raised:
                await client.chat.completions.create(
                    model=SERVED_MODEL, messages=HELLO, tools=[TOOL],
                    tool_choice={"type": "function", "function": {"name": "get_time"}},
                )  # fmt: skip
            assert raised.value.status_code == 400
            assert raised.value.param == "tool_choice.function.name"

    asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_offsets_count_the_special_tokens_kept(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """With skip_special_tokens false the text holds the special tokens, and so must the offsets that
    index it (the ingress once computed them as if they were skipped)."""
    im_end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1 and tokenizer.is_special(im_end[0])

    async def run() -> httpx.Response:
        http_client, engine = build(tokenizer, monkeypatch)
        engine.reply = im_end + tokenizer.encode(" hi there", add_special_tokens=False)
        body = {"model": SERVED_MODEL, "prompt": "x", "logprobs": 0, "skip_special_tokens": False}
        async with http_client:
            return await http_client.post("/v1/completions", json={**body, "stream": stream})

    response = asyncio.run(run())
    assert response.status_code == 200, response.text
    choices = (
        [event["choices"][0] for event in sse_events(response.text)] if stream else response.json()["choices"]
    )
    text = "".join(choice["text"] for choice in choices)
    tokens = [token for choice in choices for token in choice["logprobs"]["tokens"]]
    offsets = [offset for choice in choices for offset in choice["logprobs"]["text_offset"]]
    assert (text, tokens) == ("<|im_end|> hi there", ["<|im_end|>", " hi", " there"])
    assert offsets == [0, len("<|im_end|>"), len("<|im_end|> hi")]
