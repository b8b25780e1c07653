"""The published OpenAPI schema (deployments/openapi.py): it declares every route's request body and
responses, and the running app keeps to it. Schemathesis generates requests from the schema, valid and
invalid, and sends them to the real application on the CPU with the default model: no response is a
5xx, and each one's status, content type and JSON body are what the schema says.

Bounded: 10 valid and 10 invalid requests a POST operation and 3 a GET, each asking for at most a few
tokens (the CPU decodes slowly; how many tokens come back changes nothing the checks look at)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from ingress_harness import make_ingress
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from serving import Served

from engine.loader import load_tokenizer

MAX_TOKENS = 3
MAX_CHOICES = 2
EXAMPLES = 10  # per POST operation and mode (valid, invalid)


def _openapi(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    tokenizer = load_tokenizer("smollm2-135m")
    ingress, _ = make_ingress(tokenizer, monkeypatch)
    return ingress.__serve_build_asgi_app__().app.openapi()  # the FastAPI app inside the body limit


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


def _bounded(case: schemathesis.Case, model: str) -> None:
    """The served model's name where a string names one (others get a 404 and go no further), at most
    MAX_TOKENS tokens and MAX_CHOICES choices a request; everything else as generated."""
    if not isinstance(case.body, dict):
        return
    if isinstance(case.body.get("model"), str):
        case.body["model"] = model
    prompt = case.body.get("prompt")  # token ids: within any vocabulary (the schema cannot say whose)
    if isinstance(prompt, list):
        case.body["prompt"] = _small_ids(prompt)
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(case.body.get(field), int) and case.body[field] > MAX_TOKENS:
            case.body[field] = MAX_TOKENS
    if isinstance(case.body.get("n"), int) and case.body["n"] > MAX_CHOICES:
        case.body["n"] = MAX_CHOICES
    if case.path == "/v1/chat/completions" and "max_tokens" not in case.body:
        case.body["max_tokens"] = MAX_TOKENS  # unset: the rest of the context


def _small_ids(value: Any) -> Any:
    if isinstance(value, list):
        return [_small_ids(item) for item in value]
    return value % 1000 if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else value


@pytest.mark.slow
def test_no_request_from_the_schema_gets_a_5xx(served: Served) -> None:
    """Each operation, with valid and with invalid requests (schemathesis' own generation, seeded)."""
    schema = schemathesis.openapi.from_url(served.base_url + "/openapi.json")
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
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
            _bounded(case, served.model)
            response = case.call_and_validate(checks=checks, timeout=120)
            statuses[(operation.path, mode.value, response.status_code)] += 1
            if mode is GenerationMode.POSITIVE and response.status_code != 200:
                refused[(operation.path, response.status_code, response.text[:120])] += 1

        check()

    for operation in operations:
        run(operation, GenerationMode.POSITIVE)
        if operation.method.upper() == "POST":  # the GETs take nothing that could be invalid
            run(operation, GenerationMode.NEGATIVE)
    # the valid requests were served, not only refused
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert statuses[(path, "positive", 200)] >= EXAMPLES // 5, refused.most_common(8)
