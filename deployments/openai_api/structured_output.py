"""The engine grammar (tileinfer.engine.sampling.params.GrammarSpec) that a request's structured-output fields
ask for (their models: ResponseFormat and StructuredOutputs, deployments/openai_api/generation_request.py).

- `response_format` (OpenAI): `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON object)
  or `{"type": "json_schema", "json_schema": {"name", "description", "schema", "strict"}}`.
- `structured_outputs` (vLLM's extension, so that a vLLM client's extra_body works unchanged): one of `json`
  (a schema, as an object or its JSON text), `regex`, `choice` (a list of strings), `grammar` (Lark, or GBNF,
  converted to Lark), or `json_object: true`.

The engine compiles the grammar (engine/sampling/grammar.py); a schema or regex that does not compile is a 400
naming the problem. Both fields at once are refused.
"""

from __future__ import annotations

import json

from llguidance.gbnf_to_lark import any_to_lark
from tileinfer.deployments.openai_api.errors import OpenAIError
from tileinfer.deployments.openai_api.generation_request import ResponseFormat, StructuredOutputs
from tileinfer.engine.sampling.params import GrammarSpec

ANY_JSON_OBJECT = '{"type": "object"}'


def _structured_spec(structured: StructuredOutputs) -> GrammarSpec:
    kind = structured.kind()
    if kind == "json":
        schema = structured.json_
        return GrammarSpec("json", schema if isinstance(schema, str) else json.dumps(schema))
    if kind == "regex":
        return GrammarSpec("regex", structured.regex)
    if kind == "choice":
        return GrammarSpec("choice", json.dumps(structured.choice))
    if kind == "grammar":
        try:
            return GrammarSpec("lark", any_to_lark(structured.grammar))
        except Exception as error:  # noqa: BLE001 - the converter's own errors: a bad GBNF grammar
            raise OpenAIError.invalid_request(
                f"structured_outputs.grammar is not a valid GBNF or Lark grammar: {error}",
                param="structured_outputs.grammar",
            ) from None
    return GrammarSpec("json", ANY_JSON_OBJECT)  # json_object


def grammar_for(
    response_format: ResponseFormat | None, structured: StructuredOutputs | None
) -> GrammarSpec | None:
    """The grammar a request's output must match; None: unconstrained."""
    if structured is not None:  # the request's validator refused it beside a constraining response_format
        return _structured_spec(structured)
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GrammarSpec("json", ANY_JSON_OBJECT)
    return GrammarSpec("json", json.dumps(response_format.json_schema.schema_))
