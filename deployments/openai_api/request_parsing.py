"""A request body into a validated request model (deployments/openai_api/chat_request.py,
completion_request.py), every problem a 400 in OpenAI's words that names the field."""

from __future__ import annotations

import json
import re
from typing import Any

import pydantic_core
from pydantic import ValidationError
from tileinfer.deployments.openai_api.errors import OpenAIError
from tileinfer.deployments.openai_api.generation_request import RequestT


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """An HTTP request body as a dict; 400 for what is not a JSON object.

    pydantic's JSON parser (jiter), not json.loads: it refuses lone surrogates ("\\ud800", which the
    tokenizer cannot take), NaN and Infinity (not JSON), and nesting past 200 levels, where json.loads
    raised RecursionError (a 500) past about 1,000.
    """
    try:
        body = pydantic_core.from_json(raw, allow_inf_nan=False, cache_strings="keys")
    except ValueError as error:
        raise OpenAIError.invalid_request(f"The request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise OpenAIError.invalid_request("The request body must be a JSON object.")
    return body


def json_bytes_of(body: Any) -> bytes:
    """A Python handle's request as the JSON body it stands for; 400 for what JSON cannot hold."""
    try:
        return json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except UnicodeEncodeError as error:
        raise OpenAIError.invalid_request(f"The request's text is not valid Unicode: {error}") from None
    except RecursionError:
        raise OpenAIError.invalid_request("The request is nested too deeply.") from None
    except (TypeError, ValueError) as error:
        raise OpenAIError.invalid_request(f"The request is not what a JSON body can hold: {error}") from None


def parse_body(model_cls: type[RequestT], raw: bytes, stream: bool | None = None) -> RequestT:
    """A JSON request body validated into model_cls, its `stream` set where given (a handle's method says
    whether it streams)."""
    body = parse_json_body(raw)
    if stream is not None:
        body["stream"] = stream
    return parse_request(model_cls, body)


def parse_request(model_cls: type[RequestT], body: Any) -> RequestT:
    """Validate a decoded JSON body; every problem becomes a 400 OpenAIError that names the field."""
    if not isinstance(body, dict):
        raise OpenAIError.invalid_request("The request body must be a JSON object.")
    try:
        return model_cls.model_validate(body)
    except ValidationError as error:
        raise _openai_error_from_validation(error) from None


# A pydantic error location mixes our field names with the names of union members ("str", "list[int]",
# "TextPart"), which are left out of the path a client sees.
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict"})


def _openai_error_from_validation(error: ValidationError) -> OpenAIError:
    # a value that fits no member of a union fails once per member; the deepest failure is the telling one
    first = max(error.errors(), key=lambda failure: len(failure["loc"]))
    kind, context = first["type"], first.get("ctx") or {}
    param = _param_path(first["loc"], keep_last=kind == "extra_forbidden")
    if kind == "unsupported_parameter":
        field_path = f"{param}.{context['field']}" if param else context["field"]
        return OpenAIError.unsupported(field_path, context["detail"])
    if kind == "unsupported_content":
        return OpenAIError.invalid_request(f"{param}: {first['msg']}", param=param, code="unsupported_value")
    if kind == "extra_forbidden":
        return OpenAIError.invalid_request(f"Unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return OpenAIError.invalid_request(f"Missing required parameter: '{param}'.", param=param)
    message = first["msg"].removeprefix("Value error, ")
    return OpenAIError.invalid_request(f"Invalid value for '{param}': {message}", param=param)


def _param_path(loc: tuple[int | str, ...], keep_last: bool) -> str | None:
    """("messages", 0, "content", "list[TextPart]", 0, "text") -> "messages[0].content[0].text"."""
    path = ""
    for position, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif (keep_last and position == len(loc) - 1) or (
            _FIELD_NAME.fullmatch(part) and part not in _TYPE_NAMES
        ):
            path += f".{part}" if path else part
    return path or None
