"""Tool calls through the real application (`serve run`, SmolLM2-135M on the CPU, greedy) with the official
openai client: a forced call, whole and streamed, whose arguments validate against the function's
parameters and take one line (the grammar forces them: SmolLM2 knows no tools, its template none); a second
turn with the tool's result; each bad tool request's 400; the README's example."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import jsonschema
import openai
import pytest
from serving import Served
from tileinfer.engine.models.loader import load_tokenizer

pytestmark = pytest.mark.slow

PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
USER = {"role": "user", "content": "What is the weather in Paris for the next three days?"}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MAX_TOKENS = 48  # the longest call the schema allows is about 40 tokens


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)


def _check_call(name: str, arguments: str) -> None:
    """A call of get_weather with valid arguments, written as a json_schema answer is: on one line."""
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), PARAMETERS)
    assert arguments == json.dumps(json.loads(arguments)), arguments  # no newline, no indent


def test_a_forced_call(client: openai.OpenAI, served: Served) -> None:
    reply = client.chat.completions.create(
        model=served.model, messages=[USER], tools=[WEATHER, TIME], tool_choice=NAMED,
        parallel_tool_calls=False, temperature=0, max_tokens=MAX_TOKENS,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    _check_call(call.function.name, call.function.arguments)
    # fewer tokens than the same call with its arguments indented, as the grammar let SmolLM2 write it before
    indented = json.dumps(json.loads(call.function.arguments), indent=2)
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {indented}}}\n</tool_call>'
    indented_tokens = load_tokenizer("smollm2-135m").encode(text, add_special_tokens=False)
    assert reply.usage.completion_tokens < len(indented_tokens)  # its own count has the end token too


def test_a_forced_call_streamed(client: openai.OpenAI, served: Served) -> None:
    stream = client.chat.completions.create(
        model=served.model, messages=[USER], tools=[WEATHER], tool_choice="required", temperature=0,
        max_tokens=MAX_TOKENS, stream=True, parallel_tool_calls=False,
    )  # fmt: skip
    chunks = list(stream)
    pieces = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()]
    assert pieces[0].id.startswith("call_") and {piece.index for piece in pieces} == {0}
    _check_call(pieces[0].function.name, "".join(piece.function.arguments or "" for piece in pieces))
    assert len(pieces) > 2  # the arguments came in pieces
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_second_turn_with_the_tool_result(client: openai.OpenAI, served: Served) -> None:
    called = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0123456789abcdef01234567", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]}  # fmt: skip
    result = {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "sunny, 24 C"}
    reply = client.chat.completions.create(
        model=served.model, messages=[USER, called, result], tools=[WEATHER], temperature=0, max_tokens=8
    )
    assert reply.choices[0].message.content and reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
          "properties": {"a": {"type": "strng"}}}}}]}, "tools[0].function.parameters"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         "tool_choice.function.name"),
        ({"tools": [WEATHER], "messages": [USER, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]},
         "messages[1].tool_call_id"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
    ],
)  # fmt: skip
def test_bad_tool_requests_get_400(client: openai.OpenAI, served: Served, fields: dict, param: str) -> None:
    body = {"model": served.model, "messages": [USER], "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**body)
    assert raised.value.status_code == 400 and raised.value.param == param


def test_readme_tool_call_example_runs_as_written(served: Served) -> None:
    """The README's example as a user copies it, against this app's port (run in this process)."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = text.index("```python\n", text.index("### Tool calls")) + len("```python\n")
    script = text[start : text.index("\n```", start)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(script.replace("http://127.0.0.1:8000", served.base_url), {})  # noqa: S102
    call, answer = printed.getvalue().split("\n", 1)
    assert call.startswith("get_weather {'city': ") and answer.strip()
