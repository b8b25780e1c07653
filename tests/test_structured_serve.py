"""Structured output through the real application (`serve run`) and the official openai client:
response_format (json_object, json_schema, and client.chat.completions.parse with a pydantic model) and
vLLM's structured_outputs (json, regex, choice, a GBNF grammar) give output that parses and validates, the
same with n-gram speculation on, each bad constraint gets a 400 that names the problem (a schema whose grammar
cannot constrain too), and a grammar that fails while generating is an error, whole and streamed."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest
from failing_schemas import PROBED_SCHEMAS, RECURSES, past_the_probe
from serving import Served

pytestmark = pytest.mark.slow

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SCHEMA = {
    "type": "object",
    "properties": {"river": {"type": "string", "maxLength": 8}, "km": {"type": "integer", "maximum": 9999}},
    "required": ["river", "km"],
    "additionalProperties": False,
}
GBNF = 'root ::= "river: " ("Rhine" | "Danube" | "Elbe")'
ASK = [{"role": "user", "content": "Name a European river and its length in km, as JSON."}]


class River(pydantic.BaseModel):
    river: str = pydantic.Field(max_length=8)
    km: int = pydantic.Field(ge=0, le=9999)


def _async_client(served: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)


def test_every_kind_gives_output_that_parses_and_validates(served: Served) -> None:
    """All at once (one engine batch), greedy, chat and completions."""
    json_schema = {"name": "river", "schema": SCHEMA, "strict": True}
    chat_kinds = {
        "json_object": {"response_format": {"type": "json_object"}},
        "json_schema": {"response_format": {"type": "json_schema", "json_schema": json_schema}},
        "structured json": {"extra_body": {"structured_outputs": {"json": SCHEMA}}},
        "regex": {"extra_body": {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}},
        "choice": {"extra_body": {"structured_outputs": {"choice": ["Rhine", "Danube"]}}},
        "gbnf grammar": {"extra_body": {"structured_outputs": {"grammar": GBNF}}},
    }

    async def run() -> tuple[dict[str, openai.types.chat.ChatCompletion], openai.types.Completion]:
        client = _async_client(served)
        chats = [
            client.chat.completions.create(
                model=served.model, messages=ASK, max_tokens=64, temperature=0, **kind
            )
            for kind in chat_kinds.values()
        ]
        completion = client.completions.create(
            model=served.model, prompt="The Rhine as JSON:", max_tokens=40, temperature=0,
            extra_body={"response_format": {"type": "json_schema", "json_schema": json_schema}},
        )  # fmt: skip
        *chat_results, completion_result = await asyncio.gather(*chats, completion)
        return dict(zip(chat_kinds, chat_results, strict=True)), completion_result

    chats, completion = asyncio.run(run())
    texts = {kind: result.choices[0].message.content for kind, result in chats.items()}
    assert isinstance(json.loads(texts["json_object"]), dict)
    for kind in ("json_schema", "structured json"):
        jsonschema.validate(json.loads(texts[kind]), SCHEMA)
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", texts["regex"]), texts["regex"]
    assert texts["choice"] in ("Rhine", "Danube")
    assert texts["gbnf grammar"] in ("river: Rhine", "river: Danube", "river: Elbe")
    assert {result.choices[0].finish_reason for result in chats.values()} == {"stop"}


def test_parse_with_a_pydantic_model_works_unchanged(served: Served) -> None:
    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.parse(
        model=served.model, messages=ASK, response_format=River, max_tokens=40, temperature=0
    )
    river = completion.choices[0].message.parsed
    assert isinstance(river, River) and 0 <= river.km <= 9999


def test_constrained_output_equals_itself_with_ngram_speculation(served: Served) -> None:
    body = {
        "model": served.model, "messages": ASK, "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "river", "schema": SCHEMA}},
    }  # fmt: skip
    texts = [
        httpx.post(url + CHAT, json=body, timeout=120).json()["choices"][0]["message"]["content"]
        for url in (served.base_url, served.speculative_url)
    ]
    assert texts[0] == texts[1]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)


BAD_CONSTRAINTS = {  # name: (fields, what the message names)
    "invalid JSON schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strin"}},
            }
        },
        "strin",
    ),
    "unsupported keyword": (
        {"structured_outputs": {"json": {"type": "string", "not": {"const": "a"}}}},
        "Unimplemented keys",
    ),
    "regex that does not compile": ({"structured_outputs": {"regex": "[0-9"}}, "regex"),
    "grammar that does not parse": ({"structured_outputs": {"grammar": 'root ::= "yes'}}, "grammar"),
    "response_format with structured_outputs": (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "cannot be combined",
    ),
    "json_schema type without its schema": ({"response_format": {"type": "json_schema"}}, "json_schema"),
    "two structured_outputs": ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    "too many optional properties": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": PROBED_SCHEMAS["500 optional properties"]},
            }
        },
        "too many alternatives",
    ),
    "recursion with no base case": (
        {"structured_outputs": {"json": PROBED_SCHEMAS["a recursive $ref"]}},
        "no base case",
    ),
}


@pytest.mark.parametrize("stream", [False, True])
def test_each_bad_constraint_gets_a_400_naming_it(served: Served, stream: bool) -> None:
    """Streaming too: a grammar that does not compile is refused before the stream begins."""
    for name, (fields, named) in BAD_CONSTRAINTS.items():
        body = {"model": served.model, "messages": ASK, "max_tokens": 4, "stream": stream, **fields}
        response = httpx.post(served.base_url + CHAT, json=body, timeout=120)
        assert response.status_code == 400, (name, response.text)
        assert named in response.json()["error"]["message"], (name, response.text)


def test_a_grammar_that_fails_while_generating_is_an_error_not_a_stop(served: Served) -> None:
    """Off the compile's probe path (tests/failing_schemas.py), both at once: whole, a 400 naming why;
    streamed, what came so far with no finish_reason, then an in-band error event."""
    json_schema = {"name": "x", "schema": past_the_probe(RECURSES)}
    body = {
        "model": served.model, "messages": ASK, "max_tokens": 16, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": json_schema},
    }  # fmt: skip

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=served.base_url, timeout=120) as client:
            streamed = {**body, "stream": True}
            return await asyncio.gather(client.post(CHAT, json=body), client.post(CHAT, json=streamed))

    whole, streamed = asyncio.run(run())
    assert whole.status_code == 400 and "no base case" in whole.json()["error"]["message"], whole.text
    events = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and events[-1] == "[DONE]", streamed.text
    assert "no base case" in json.loads(events[-2])["error"]["message"], streamed.text
    chunks = [json.loads(event) for event in events[:-2]]
    assert chunks and all(choice["finish_reason"] is None for chunk in chunks for choice in chunk["choices"])
