"""The fields chat and completions share (GenerationRequest): sampling, stop, streaming, and the answer's
structure (OpenAI's response_format, vLLM's structured_outputs:
deployments/openai_api/structured_output.py turns them into the engine's grammar).

Extensions (vLLM's names and meanings): top_k, min_p, repetition_penalty, ignore_eos,
skip_special_tokens, stop_token_ids, structured_outputs.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, TypeVar

from pydantic import Field, field_validator, model_validator
from tileinfer.deployments.openai_api.errors import OpenAIError
from tileinfer.deployments.openai_api.request_model import TOKEN_ID_SCHEMA, RequestModel, field_given

MAX_CHOICES = 128  # OpenAI's limit on n (for completions: prompts x n)
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_TOP_K = 2**31 - 1  # the engine's buffers hold top_k as int32; any k past the vocabulary means "off"


class StreamOptions(RequestModel):
    include_usage: bool = False
    ignored_fields: ClassVar[frozenset[str]] = frozenset({"include_obfuscation"})


class JsonSchemaFormat(RequestModel):
    name: str
    description: str | None = None
    # a JSON Schema; "schema" shadows a BaseModel attribute, so the field is named schema_
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool = False  # the grammar is enforced either way

    model_config = {**RequestModel.model_config, "populate_by_name": True}


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    schema_constraints: ClassVar[tuple[dict[str, Any], ...]] = (
        {
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}},
            "else": {"properties": {"json_schema": {"type": "null"}}},
        },
    )

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise OpenAIError.invalid_request(
                "response_format.json_schema is required with type 'json_schema', and only with it",
                param="response_format",
            )
        return self


_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs`: exactly one of the constraints."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: Literal[True] | None = None

    model_config = {**RequestModel.model_config, "populate_by_name": True}
    # vLLM's options of its own grammar back-ends: no effect here
    ignored_fields: ClassVar[frozenset[str]] = frozenset(
        {"disable_fallback", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}
    )
    # _exactly_one: one constraint is given (not null)
    schema_constraints: ClassVar[tuple[dict[str, Any], ...]] = (
        {"oneOf": [field_given(kind, {"not": {"type": "null"}}) for kind in _KINDS]},
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [kind for kind in _KINDS if self._value(kind) is not None]
        if len(given) != 1:
            raise OpenAIError.invalid_request(
                f"structured_outputs takes exactly one of {', '.join(_KINDS)}, got {given or 'none'}",
                param="structured_outputs",
            )
        return self

    def kind(self) -> str:
        """The one constraint given."""
        return next(kind for kind in _KINDS if self._value(kind) is not None)

    def _value(self, kind: str) -> Any:
        return self.json_ if kind == "json" else getattr(self, kind)


# What GenerationRequest._stop_sequences checks, in its schema
_STOP_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_SEQUENCES},
        {"type": "null"},
    ]
}


class GenerationRequest(RequestModel):
    """The fields chat and completions share."""

    model: str
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, json_schema_extra=lambda schema: schema.update(_STOP_SCHEMA))
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    # extensions, as vLLM names them
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)  # 0 or -1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] = Field(default_factory=list, json_schema_extra={"items": TOKEN_ID_SCHEMA})
    # structured output: OpenAI's response_format, and vLLM's structured_outputs (one of the two)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    # the field a context-length error names
    prompt_field: ClassVar[str]
    # _usage_needs_stream
    schema_constraints: ClassVar[tuple[dict[str, Any], ...]] = (
        {
            "if": field_given("stream_options", field_given("include_usage", {"const": True})),
            "then": field_given("stream", {"const": True}),
        },
        {  # a constraining response_format, or structured_outputs, not both
            "if": field_given(
                "response_format", field_given("type", {"enum": ["json_object", "json_schema"]})
            ),
            "then": {"properties": {"structured_outputs": {"type": "null"}}},
        },
    )

    @field_validator("stop")
    @classmethod
    def _stop_sequences(cls, stop: str | list[str] | None) -> str | list[str] | None:
        sequences = [stop] if isinstance(stop, str) else stop or []
        if len(sequences) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(sequences)}")
        if any(sequence == "" for sequence in sequences):
            raise ValueError("a stop sequence must not be empty")
        return stop

    @model_validator(mode="after")
    def _usage_needs_stream(self) -> GenerationRequest:
        if (
            self.response_format is not None
            and self.response_format.type != "text"
            and self.structured_outputs
        ):
            raise OpenAIError.invalid_request(
                "response_format cannot be combined with structured_outputs: give one of them",
                param="response_format",
            )
        if self.include_usage and not self.stream:
            raise OpenAIError.invalid_request(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                param="stream_options",
            )
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    @property
    def logprobs_count(self) -> int | None:
        """How many top alternatives the engine reports per token; None: no logprobs."""
        raise NotImplementedError


RequestT = TypeVar("RequestT", bound=GenerationRequest)
