"""The base of every request model (the requests and the objects in them), field by field as the OpenAI API
reference has them: chat_request.py, completion_request.py and the fields they share, generation_request.py.

A field is either
- honoured (it changes the output as OpenAI documents),
- accepted and ignored (it has no effect on the output: `user`, `metadata`, `store`, ...),
- rejected with a 400 naming it unless it carries its no-effect value (`logit_bias`, ...), or
- unknown: rejected as OpenAI does ("Unrecognized request argument supplied: X").
JSON null means "not given", as in OpenAI's API. deployments/openai_api/request_parsing.py validates a body
into a model, deployments/openai_api/request_to_engine.py turns a model into what the engine takes.

Each model's JSON schema (published in /openapi.json, deployments/openai_api/openapi.py) says what it accepts:
null for any field that is not required, the unsupported fields' harmless values, the ignored fields, and in
`schema_constraints` what the model validators check across fields.
"""

from __future__ import annotations

import functools
import json
import typing
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

# A token id's schema; /openapi.json makes it the component of its title, with the served model's bound too
# (deployments/openai_api/openapi.py: [0, the vocabulary size that the engine checks ids against)).
TOKEN_ID_SCHEMA = {"title": "TokenId", "type": "integer", "minimum": 0}


def _accepted_in_schema(schema: dict[str, Any], model: type[RequestModel]) -> None:
    """Complete a model's JSON schema with what _drop_nulls_and_check_unsupported accepts beyond its fields'
    types, and with the model's schema_constraints."""
    properties, required = schema.setdefault("properties", {}), set(schema.get("required", ()))
    for name, field_schema in properties.items():
        if name not in required:
            properties[name] = _nullable(field_schema)
    for name, harmless_values in model.unsupported_fields.items():
        description = "not supported by this server: null, or a value that leaves the output unchanged"
        properties[name] = {"enum": [*harmless_values, None], "description": description}
    for name in sorted(model.ignored_fields):
        properties[name] = {"description": "accepted and ignored: it has no effect on the output"}
    if model.schema_constraints:
        schema["allOf"] = list(model.schema_constraints)


_ANNOTATIONS = ("title", "description", "default")


def _nullable(field_schema: dict[str, Any]) -> dict[str, Any]:
    """A field's schema that also takes null (JSON null: "not given")."""
    if {"type": "null"} in field_schema.get("anyOf", ()):
        return field_schema
    annotations = {key: field_schema[key] for key in _ANNOTATIONS if key in field_schema}
    value_schema = {key: value for key, value in field_schema.items() if key not in _ANNOTATIONS}
    return {"anyOf": [value_schema, {"type": "null"}], **annotations}


def field_given(field: str, value_schema: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema for "`field` is in the body and matches value_schema" (null matches no value_schema
    here that names a type, nor a nested field_given: an object), the `if` of a schema constraint."""
    if "required" in value_schema:  # JSON Schema's `required` holds for any value that is not an object
        value_schema = {"type": "object", **value_schema}
    return {"required": [field], "properties": {field: value_schema}}


class RequestModel(BaseModel):
    """Strict JSON types (no "1" for 1; 1.0 is 1, as in JSON), unknown fields rejected, null taken as "not
    given"."""

    # allow_inf_nan: JSON has no NaN or Infinity, but 1e999 parses as inf
    model_config = ConfigDict(
        strict=True, extra="forbid", allow_inf_nan=False, json_schema_extra=_accepted_in_schema
    )

    # field -> the values that leave the output unchanged; any other value is rejected as unsupported
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {}
    # fields accepted and dropped: they have no effect on the output
    ignored_fields: ClassVar[frozenset[str]] = frozenset()
    # what the model validators check across fields, as JSON Schema (the schema's allOf)
    schema_constraints: ClassVar[tuple[dict[str, Any], ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls_and_check_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, harmless_values in cls.unsupported_fields.items():
            value = data.get(name)
            if value is not None and not any(
                _same_json(_integral(value), harmless) for harmless in harmless_values
            ):
                allowed = " or ".join(json.dumps(harmless) for harmless in harmless_values)
                detail = f" (only {allowed} is accepted)" if allowed else ""
                raise PydanticCustomError(
                    "unsupported_parameter",
                    "{field} is not supported by this server{detail}",
                    {"field": name, "detail": detail},
                )
        dropped = cls.ignored_fields | cls.unsupported_fields.keys()  # the latter hold harmless values now
        return {
            name: _integral(value) if name in cls._int_fields() else value
            for name, value in data.items()
            if value is not None and name not in dropped
        }

    @classmethod
    @functools.cache
    def _int_fields(cls) -> frozenset[str]:
        """Fields that hold integers (token ids among them), found once per model."""
        return frozenset(name for name, field in cls.model_fields.items() if _holds_ints(field.annotation))


def _holds_ints(annotation: Any) -> bool:
    """Whether int appears in a type (int | None, list[int], a union of lists of them, ...)."""
    return annotation is int or any(_holds_ints(argument) for argument in typing.get_args(annotation))


def _integral(value: Any) -> Any:
    """2.0 as 2, in lists too: JSON has one number type (JSON Schema's integer takes 2.0); 2.5 and "2"
    stay refused."""
    if type(value) is float and value.is_integer():
        return int(value)
    if type(value) is list:
        return [_integral(item) for item in value]
    return value


def _same_json(value: Any, harmless: Any) -> bool:
    # type-exact, so that 0 does not pass for False nor True for 1
    return type(value) is type(harmless) and value == harmless
