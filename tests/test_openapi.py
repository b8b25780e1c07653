"""The published OpenAPI schema (deployments/openai_api/openapi.py): it declares every route's request body
and responses, and the running app keeps to it. Schemathesis generates requests from the schema, valid and
invalid, and sends them to the real application on the CPU with the default model, under its default
checks: no response is a 5xx, a request the schema allows is served and one it does not is refused, and
each response's status, content type and JSON body are what the schema says. Direct cases pin the
disagreements schemathesis once found: each request's status, and the schema's
verdict on it.

Bounded: 10 valid and 10 invalid requests a POST operation and 3 a GET, each valid one asking for at most
a few tokens and choices (the CPU decodes slowly; how many tokens come back changes nothing the checks
look at)."""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from ingress_harness import INFO, MODEL, openapi_schema
from schemathesis import GenerationMode
from serving import Served
from tileinfer.deployments.openai_api.openapi import API_KEY_SCHEME
from tileinfer.engine.models.loader import load_tokenizer

MAX_TOKENS = 3
MAX_CHOICES = 2  # choices, and prompts in a batch
EXAMPLES = 10  # per POST operation and mode (valid, invalid)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
KEYED = (("post", CHAT), ("post", COMPLETIONS), ("get", "/v1/models"))  # the routes that check the key


def _openapi(monkeypatch: pytest.MonkeyPatch, **args: Any) -> dict[str, Any]:
    return openapi_schema(load_tokenizer("smollm2-135m"), monkeypatch, **args)


def test_the_schema_declares_bodies_responses_and_the_metrics_text(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    schema = _openapi(monkeypatch)
    paths, components = schema["paths"], schema["components"]["schemas"]
    for path, request, response in (
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletion"),
        ("/v1/completions", "CompletionRequest", "Completion"),
    ):
        operation = paths[path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert operation["requestBody"]["required"] and body == {"$ref": f"#/components/schemas/{request}"}
        ok = operation["responses"]["200"]["content"]
        assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{response}"}
        assert "text/event-stream" in ok
        assert {"400", "401", "413", "503"} <= set(operation["responses"])
        assert "422" not in operation["responses"]  # FastAPI's own validation never runs here
    assert "messages" in components["ChatCompletionRequest"]["properties"]
    assert "prompt" in components["CompletionRequest"]["properties"]
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert paths["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ModelList"
    }
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        assert components[request]["properties"]["model"] == {
            "enum": [MODEL],
            "title": "Model",
            "type": "string",
        }


def test_token_ids_are_within_the_vocabulary_the_engine_checks(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every field of token ids (a prompt's, a batch's, stop_token_ids) takes [0, the engine's vocab_size):
    the schema allowed ids the engine refuses (schemathesis' ST202)."""
    components = _openapi(monkeypatch)["components"]
    last = INFO.vocab_size - 1  # the engine's bound, as its info call tells the ingress
    bodies = {
        "CompletionRequest": {"model": MODEL, "prompt": "Hi"},
        "ChatCompletionRequest": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    }
    cases = [
        ("CompletionRequest", {"prompt": [0, last]}, True),
        ("CompletionRequest", {"prompt": [[0], [last]]}, True),
        ("CompletionRequest", {"prompt": [135631891304205]}, False),  # schemathesis' case
        ("CompletionRequest", {"prompt": [last + 1]}, False),
        ("CompletionRequest", {"prompt": [[0], [last + 1]]}, False),
        ("CompletionRequest", {"prompt": [-1]}, False),
        *((request, {"stop_token_ids": [last]}, True) for request in bodies),
        *((request, {"stop_token_ids": [last + 1]}, False) for request in bodies),
        *((request, {"stop_token_ids": [-1]}, False) for request in bodies),
    ]
    for request, fields, valid in cases:
        validator = jsonschema.Draft202012Validator(
            {"$ref": f"#/components/schemas/{request}", "components": components}
        )
        assert validator.is_valid({**bodies[request], **fields}) == valid, (request, fields)


def test_the_api_key_is_a_bearer_scheme_that_the_keyed_routes_require(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keyed = _openapi(monkeypatch, api_key="k")
    schemes = keyed["components"]["securitySchemes"]
    assert {name: (scheme["type"], scheme["scheme"]) for name, scheme in schemes.items()} == {
        API_KEY_SCHEME: ("http", "bearer")
    }
    for method, path in KEYED:
        assert keyed["paths"][path][method]["security"] == [{API_KEY_SCHEME: []}]
    assert "security" not in keyed["paths"]["/health"]["get"]
    assert keyed["paths"]["/metrics"]["get"]["security"] == [{}, {API_KEY_SCHEME: []}]  # not checked
    metrics_keyed = _openapi(monkeypatch, api_key="k", metrics_require_key=True)
    assert metrics_keyed["paths"]["/metrics"]["get"]["security"] == [{API_KEY_SCHEME: []}]
    no_key = _openapi(monkeypatch)  # any key or none
    for method, path in KEYED:
        assert no_key["paths"][path][method]["security"] == [{}, {API_KEY_SCHEME: []}]


def _bounded(case: schemathesis.Case) -> None:
    """A valid request kept valid and small: at most MAX_TOKENS tokens, MAX_CHOICES choices and prompts,
    grammars that compile (the schema cannot say which do: a 400 naming the problem, pinned by
    tests/test_structured_serve.py), and what the schema says in words only (_keep_tool_references);
    everything else as generated. (An invalid one stays as generated: the server refuses it before it
    decodes anything.)"""
    if not isinstance(case.body, dict):
        return
    _compiling_grammars(case.body)
    _keep_tool_references(case.body)
    prompt = case.body.get("prompt")
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
        case.body["prompt"] = prompt[:MAX_CHOICES]
    for field, limit in (
        ("max_tokens", MAX_TOKENS),
        ("max_completion_tokens", MAX_TOKENS),
        ("n", MAX_CHOICES),
    ):
        if _is_number(case.body.get(field)) and case.body[field] > limit:
            case.body[field] = limit
    if (
        case.path == CHAT
        and case.body.get("max_tokens") is None
        and case.body.get("max_completion_tokens") is None
    ):
        case.body["max_tokens"] = MAX_TOKENS  # unset: the rest of the context


def _keep_tool_references(body: dict[str, Any]) -> None:
    """What the schema gives in words: a tool's parameters are a JSON Schema (the generator's objects hold
    JSON Schema's keywords with any values: each becomes {"type": "object"}), a named tool_choice names one
    of the tools, and a tool message answers a call of an earlier assistant message (else it is left out)."""
    choice, tools = body.get("tool_choice"), body.get("tools") or []
    for tool in tools:
        if tool["function"].get("parameters") is not None:
            tool["function"]["parameters"] = {"type": "object"}
    if isinstance(choice, dict) and tools:
        choice["function"]["name"] = tools[0]["function"]["name"]
    if not isinstance(body.get("messages"), list):
        return
    kept, call_ids = [], []
    for message in body["messages"]:
        call_ids += [call["id"] for call in message.get("tool_calls") or ()]
        if message.get("role") == "tool":
            if not call_ids:
                continue
            message["tool_call_id"] = call_ids[-1]
        kept.append(message)
    body["messages"] = kept or [{"role": "user", "content": "Hi"}]


# a valid value of each field that holds a grammar, in place of what schemathesis generated
COMPILING = {"json": {"type": "object"}, "regex": "[a-z]{1,3}", "grammar": 'start: "yes" | "no"'}


def _compiling_grammars(body: dict[str, Any]) -> None:
    structured = body.get("structured_outputs")
    if isinstance(structured, dict):
        for field, value in COMPILING.items():
            if structured.get(field) is not None:
                structured[field] = value
    json_schema = (body.get("response_format") or {}).get("json_schema")
    if isinstance(json_schema, dict) and json_schema.get("schema") is not None:
        json_schema["schema"] = COMPILING["json"]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _engine_info_cached(base_url: str, timeout_s: float = 60) -> None:
    """Wait until /v1/models answers: the ingress has the engine's info, which each request needs. On a
    loaded machine the engine once took over 2 s to answer the first info call (a 503, as documented)."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(base_url + "/v1/models", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the engine never answered the info call"
        time.sleep(1)


@pytest.mark.slow
def test_no_request_from_the_schema_gets_a_5xx(served: Served) -> None:
    """Each operation, with valid and with invalid requests (schemathesis' own generation, seeded), under
    schemathesis' default checks (positive_data_acceptance and negative_data_rejection among them)."""
    _engine_info_cached(served.base_url)
    schema = schemathesis.openapi.from_url(served.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    statuses: collections.Counter = collections.Counter()  # (path, mode, status) -> requests
    refused: collections.Counter = collections.Counter()  # valid by the schema, yet not served: why
    assert {(operation.method.upper(), operation.path) for operation in operations} >= {
        ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
        ("GET", "/health"), ("GET", "/metrics"),
    }  # fmt: skip

    def run(operation: Any, mode: GenerationMode) -> None:
        examples = EXAMPLES if operation.method.upper() == "POST" else 3

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case: schemathesis.Case) -> None:
            if mode is GenerationMode.POSITIVE:
                _bounded(case)
            response = case.call_and_validate(timeout=120)
            statuses[(operation.path, mode.value, response.status_code)] += 1
            if mode is GenerationMode.POSITIVE and response.status_code != 200:
                refused[(operation.path, response.status_code, response.text[:120])] += 1

        check()

    for operation in operations:
        run(operation, GenerationMode.POSITIVE)
        if operation.method.upper() == "POST":  # the GETs take nothing that could be invalid
            run(operation, GenerationMode.NEGATIVE)
    # the valid requests were served, not only refused
    for path in (CHAT, COMPLETIONS):
        assert statuses[(path, "positive", 200)] >= EXAMPLES // 5, refused.most_common(8)


# ---- the disagreements schemathesis found: the status, and the schema's verdict --------------------------

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
VOCAB_SIZE = 49152  # the served model's (SmolLM2-135M)
CALL_AND_RESULT = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
AGREEMENT_CASES = {  # name: (path, fields over a small valid request, status)
    "top_logprobs without logprobs": (CHAT, {"top_logprobs": 2}, 400),
    "top_logprobs with logprobs": (CHAT, {"logprobs": True, "top_logprobs": 2}, 200),
    "top_logprobs 0 alone": (CHAT, {"top_logprobs": 0}, 200),
    "response_format text": (CHAT, {"response_format": {"type": "text"}}, 200),
    "response_format json_object": (CHAT, {"response_format": {"type": "json_object"}}, 200),
    "response_format json_schema": (
        COMPLETIONS,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}},
        200,
    ),
    "json_schema type without it": (CHAT, {"response_format": {"type": "json_schema"}}, 400),
    "json_schema with type text": (
        CHAT,
        {"response_format": {"type": "text", "json_schema": {"name": "a"}}},
        400,
    ),
    "structured_outputs regex": (CHAT, {"structured_outputs": {"regex": "[a-z]"}}, 200),
    "structured_outputs choice, a null beside": (
        COMPLETIONS,
        {"structured_outputs": {"choice": ["a"], "regex": None}},
        200,
    ),
    "structured_outputs of two kinds": (CHAT, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, 400),
    "structured_outputs empty": (CHAT, {"structured_outputs": {}}, 400),
    "response_format with structured_outputs": (
        CHAT,
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        400,
    ),
    "no tools": (CHAT, {"tools": []}, 200),
    "a tool": (CHAT, {"tools": [TOOL]}, 200),
    "a forced call without tools": (CHAT, {"tool_choice": "required"}, 400),
    "a forced call": (CHAT, {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}, 200),
    "a forced call and a response format": (
        CHAT,
        {"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
        400,
    ),
    "a call and its result": (CHAT, {"tools": [TOOL], "messages": CALL_AND_RESULT}, 200),
    "a tool message without its id": (CHAT, {"messages": [{"role": "tool", "content": "sunny"}]}, 400),
    "nulls: not given": (CHAT, {"temperature": None, "n": None, "tool_choice": None}, 200),
    "usage without stream": (CHAT, {"stream_options": {"include_usage": True}}, 400),
    "both token limits": (CHAT, {"max_tokens": 2, "max_completion_tokens": 1}, 200),
    "another model": (CHAT, {"model": "gpt-17"}, 404),
    "best_of other than 1": (COMPLETIONS, {"n": 2, "best_of": 2}, 400),
    "best_of 1": (COMPLETIONS, {"n": 2, "best_of": 1}, 200),
    "empty prompt": (COMPLETIONS, {"prompt": ""}, 400),
    "empty prompt in a batch": (COMPLETIONS, {"prompt": ["Hi", ""]}, 400),
    "echo with logprobs": (COMPLETIONS, {"echo": True, "logprobs": 1}, 400),
    # token ids past the vocabulary, which the schema once allowed (ST202)
    "the vocabulary's last token id": (COMPLETIONS, {"prompt": [VOCAB_SIZE - 1]}, 200),
    "a token id far past the vocabulary": (COMPLETIONS, {"prompt": [135631891304205]}, 400),
    "a token id just past the vocabulary": (COMPLETIONS, {"prompt": [VOCAB_SIZE]}, 400),
    "a batch with a token id past the vocabulary": (COMPLETIONS, {"prompt": [[1], [VOCAB_SIZE]]}, 400),
    "a stop token id in the vocabulary": (CHAT, {"stop_token_ids": [VOCAB_SIZE - 1]}, 200),
    "a stop token id past the vocabulary": (CHAT, {"stop_token_ids": [VOCAB_SIZE]}, 400),
}


@pytest.fixture(scope="module")
def request_validators(served: Served) -> dict[str, jsonschema.Draft202012Validator]:
    """The served /openapi.json's request body schemas, by path."""
    schema = httpx.get(served.base_url + "/openapi.json", timeout=30).json()
    return {
        path: jsonschema.Draft202012Validator(
            {**schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"],
             "components": schema["components"]}
        )
        for path in (CHAT, COMPLETIONS)
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", AGREEMENT_CASES)
def test_the_server_serves_what_the_schema_allows_and_refuses_the_rest(
    served: Served, request_validators: dict[str, jsonschema.Draft202012Validator], name: str
) -> None:
    path, fields, status = AGREEMENT_CASES[name]
    small = {"messages": [{"role": "user", "content": "Hi"}]} if path == CHAT else {"prompt": "Hi"}
    body = {"model": served.model, **small, "max_tokens": 1, **fields}
    response = httpx.post(served.base_url + path, json=body, timeout=120)
    assert response.status_code == status, response.text
    assert request_validators[path].is_valid(body) == (status == 200)


@pytest.mark.slow
def test_the_guarded_app_publishes_its_key_as_required(served: Served) -> None:
    schema = httpx.get(served.guarded_url + "/openapi.json", timeout=30).json()  # no key for the schema
    scheme = schema["components"]["securitySchemes"][API_KEY_SCHEME]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    for method, path in KEYED:
        assert schema["paths"][path][method]["security"] == [{API_KEY_SCHEME: []}]
    # the key is checked before anything else: no key, a 401 (tests/test_serve_api.py sends the key)
    assert httpx.get(served.guarded_url + "/v1/models", timeout=30).status_code == 401
