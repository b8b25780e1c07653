"""Constrained output is valid, or the response says it is not (engine/sampling/grammar.py's probe, the
engine's finish_reason "error"), on the real SmolLM2-135M-Instruct and llguidance: a schema whose grammar
cannot constrain (llguidance's limit of a row's items, a $ref that only recurses) is refused before
generation; a grammar that fails while it constrains ends its request with an error, logged, never "stop"; and
over a corpus of schemas, as response formats and as forced tool calls, every output that ends "stop"
validates.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import jsonschema
import pytest
from failing_schemas import NAMED, PROBED_SCHEMAS, RECURSES, past_the_probe, properties
from tileinfer.deployments.openai_api.chat_output import ChatOutputPlan
from tileinfer.deployments.openai_api.chat_request import ChatCompletionRequest
from tileinfer.deployments.openai_api.request_parsing import parse_request
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.errors import GrammarFailedError, InvalidRequestError
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.sampling.params import GrammarSpec, SamplingParams


def _closed(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    required = list(properties) if required is None else required
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


SHORT = {"type": "string", "maxLength": 8}
# schemas a client may send (each a handful of tokens long): none is refused, and each output that ends "stop"
# validates
CORPUS = {
    "river": _closed({"river": SHORT, "km": {"type": "integer", "maximum": 9999}}),
    "nested, pattern": _closed({"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                "at": _closed({"x": {"type": "number", "exclusiveMinimum": -5}})}),
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    "enum, const, null": _closed({"color": {"enum": ["red", "green"]}, "ok": {"const": True},
                                  "v": {"type": ["string", "null"], "maxLength": 4}}),
    "anyOf, allOf": {"anyOf": [{"type": "integer", "minimum": 0}, {"allOf": [_closed({"b": SHORT}), {}]}]},
    "400 optional properties": properties(400),
}  # fmt: skip
# a call's markup (SmolLM2 spells <tool_call> in characters) takes about 25 tokens: small arguments
TOOL_CORPUS = {
    "color": _closed({"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "maximum": 9}})
}


@pytest.fixture(scope="module")
def engine(smollm2_model: LoadedModel) -> Engine:
    return Engine(smollm2_model, EngineConfig(max_num_seqs=16))


@pytest.fixture(scope="module")
def prompt(smollm2_model: LoadedModel) -> list[int]:
    # short, not a chat (its system prompt): every request prefills it in the same step
    return smollm2_model.tokenizer.encode("A river, as JSON:")


def _json(schema: dict[str, Any]) -> GrammarSpec:
    return GrammarSpec("json", json.dumps(schema))


def _forced_call_plan(model: LoadedModel, parameters: dict[str, Any]) -> ChatOutputPlan:
    """The plan of a chat request that forces a call of one tool with these parameters (as the ingress
    makes it for SmolLM2's template: Hermes' format)."""
    tool = {"type": "function", "function": {"name": "record", "parameters": parameters}}
    messages = [{"role": "user", "content": "x"}]
    body = {"model": "m", "messages": messages, "tools": [tool], "tool_choice": "required",
            "parallel_tool_calls": False}  # fmt: skip
    request = parse_request(ChatCompletionRequest, body)
    return ChatOutputPlan.for_request(request, model.tokenizer.chat_template, model.tokenizer.single_token_id)


def _run(
    engine: Engine, prompt: list[int], requests: dict[str, SamplingParams]
) -> dict[str, tuple[str, str, Any]]:
    """Each accepted request's (text, finish reason, error), all added at once and stepped to the end; a
    refused one's InvalidRequestError is its error (no text, no finish reason)."""
    results: dict[str, tuple[str, str, Any]] = {}
    for name, params in requests.items():
        try:
            engine.add_request(prompt, params, name)
        except InvalidRequestError as error:
            results[name] = ("", "", error)
    texts = dict.fromkeys(set(requests) - set(results), "")
    while engine.has_unfinished():
        for output in engine.step():
            texts[output.request_id] += output.new_text
            if output.finished:
                results[output.request_id] = (texts[output.request_id], output.finish_reason, output.error)
    return results


@pytest.mark.parametrize("name", PROBED_SCHEMAS)
def test_a_schema_that_cannot_constrain_is_refused_before_generation(
    engine: Engine, prompt: list[int], smollm2_model: LoadedModel, name: str
) -> None:
    """As a response format and as a forced call's parameters (a Lark grammar that embeds the schema)."""
    plan = _forced_call_plan(smollm2_model, PROBED_SCHEMAS[name])
    refused = f"cannot constrain generation: after the output .*{NAMED[name]}"
    for params in (SamplingParams(grammar=_json(PROBED_SCHEMAS[name])), plan.constrain(SamplingParams())):
        with pytest.raises(InvalidRequestError, match=refused):
            engine.add_request(prompt, params, "refused")
            engine.abort("refused")  # not refused (the test fails): the next tests need the engine idle
    assert not engine.has_unfinished()


def test_a_grammar_that_fails_while_generating_ends_with_an_error(
    engine: Engine, prompt: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """Off the probe's path: a member that only recurses (the mask then allows only the end-of-sequence
    token, which ignore_eos does not stop on), and one with too many optional members (the matcher refuses
    the token that opens it)."""
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    recursing = _json(past_the_probe(RECURSES))
    requests = {
        "recursing": (dataclasses.replace(greedy, grammar=recursing), "no base case"),
        "recursing, ignore_eos": (
            dataclasses.replace(greedy, grammar=recursing, ignore_eos=True),
            "no base case",
        ),
        "too wide": (dataclasses.replace(greedy, grammar=_json(past_the_probe(properties(500)))), "too many"),
    }
    with caplog.at_level(logging.WARNING, logger="tileinfer.engine.stopping"):
        results = _run(engine, prompt, {name: params for name, (params, _) in requests.items()})
    for name, (_, named) in requests.items():
        text, finish_reason, error = results[name]
        assert finish_reason == "error" and isinstance(error, GrammarFailedError), (name, results[name])
        assert named in str(error) and text.startswith('{"'), (name, results[name])
        assert any(name in record.getMessage() and named in record.getMessage() for record in caplog.records)


def test_every_output_that_ends_stop_validates(
    engine: Engine, prompt: list[int], smollm2_model: LoadedModel
) -> None:
    """The corpus and the probed schemas, as response formats and forced calls, sampled: each ends "stop"
    with output that validates, or "length"; the probed schemas are refused or validate too; nothing
    else is refused."""
    sampled = SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95)
    calling = dataclasses.replace(sampled, max_tokens=40)
    requests: dict[str, SamplingParams] = {}
    plans: dict[str, ChatOutputPlan] = {}
    schemas = {**CORPUS, **TOOL_CORPUS, **PROBED_SCHEMAS}
    for seed, (name, schema) in enumerate({**CORPUS, **PROBED_SCHEMAS}.items()):
        requests[name] = dataclasses.replace(sampled, seed=seed, grammar=_json(schema))
    for seed, (name, schema) in enumerate({**TOOL_CORPUS, **PROBED_SCHEMAS}.items()):
        plans[f"call: {name}"] = plan = _forced_call_plan(smollm2_model, schema)
        requests[f"call: {name}"] = plan.constrain(dataclasses.replace(calling, seed=seed))
    results = _run(engine, prompt, requests)
    ran = stopped = 0
    for name, (text, finish_reason, error) in results.items():
        schema = schemas[name.removeprefix("call: ")]
        if name.removeprefix("call: ") in PROBED_SCHEMAS and isinstance(error, InvalidRequestError):
            continue
        ran += 1
        assert error is None and finish_reason in ("stop", "length"), (name, results[name])
        if finish_reason != "stop":
            continue
        stopped += 1
        if name in plans:
            message, finish_reason = plans[name].message(text, "stop")
            assert finish_reason == "tool_calls", (name, text)
            (call,) = message["tool_calls"]
            text = call["function"]["arguments"]
        jsonschema.validate(json.loads(text), schema)
    assert stopped >= ran // 2, results  # most end by themselves: the check is not vacuous
