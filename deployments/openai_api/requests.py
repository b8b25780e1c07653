"""The OpenAI request models, field by field as the OpenAI API reference has them.

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

Extensions (vLLM's names and meanings): top_k, min_p, repetition_penalty, ignore_eos,
skip_special_tokens, stop_token_ids, structured_outputs; for chat also chat_template_kwargs and
add_generation_prompt.
"""

from __future__ import annotations

import functools
import json
import typing
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from tileinfer.deployments.openai_api.errors import OpenAIError
from tileinfer.deployments.openai_api.tool_calls import schema_problem
from tileinfer.engine.sampling.params import MAX_LOGPROBS

MAX_CHOICES = 128  # OpenAI's limit on n (for completions: prompts x n)
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions endpoint
MAX_TOP_K = 2**31 - 1  # the engine's buffers hold top_k as int32; any k past the vocabulary means "off"
# A token id's schema; /openapi.json makes it the component of its title, with the served model's bound too
# (deployments/openai_api/openapi.py: [0, the vocabulary size that the engine checks ids against)).
TOKEN_ID_SCHEMA = {"title": "TokenId", "type": "integer", "minimum": 0}


def _accepted_in_schema(schema: dict[str, Any], model: type[_OpenAIModel]) -> None:
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


def _given(field: str, value_schema: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema for "`field` is in the body and matches value_schema" (null matches no value_schema
    here that names a type, nor a nested _given: an object), the `if` of a schema constraint."""
    if "required" in value_schema:  # JSON Schema's `required` holds for any value that is not an object
        value_schema = {"type": "object", **value_schema}
    return {"required": [field], "properties": {field: value_schema}}


class _OpenAIModel(BaseModel):
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


class StreamOptions(_OpenAIModel):
    include_usage: bool = False
    ignored_fields: ClassVar[frozenset[str]] = frozenset({"include_obfuscation"})


class TextPart(_OpenAIModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(_OpenAIModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class AssistantToolCall(_OpenAIModel):
    """A call an assistant message made, as a client sends a previous response's message back."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


# What ChatCompletionRequest._tool_fields checks of each message (_check_message_fields): content is
# required but for an assistant's tool calls, and a tool message names the call it answers (null: not given).
_PRESENT = {"not": {"type": "null"}}
_MESSAGE_CONSTRAINTS = (
    {"if": {"properties": {"role": {"enum": ["system", "developer", "user", "tool"]}}},
     "then": _given("content", _PRESENT)},
    {"if": {"properties": {"role": {"const": "assistant"}}, "not": _given("tool_calls", {"type": "array"})},
     "then": _given("content", _PRESENT)},
    {"if": {"properties": {"role": {"const": "tool"}}}, "then": _given("tool_call_id", {"type": "string"})},
    {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
     "then": {"properties": {"tool_calls": {"type": "null"}}}},
)  # fmt: skip


class ChatMessage(_OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call whose result it carries

    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {"function_call": (), "audio": ()}
    # what a previous response's message carries back when a client resends it as is
    ignored_fields: ClassVar[frozenset[str]] = frozenset({"refusal", "annotations", "reasoning_content"})
    schema_constraints: ClassVar[tuple[dict[str, Any], ...]] = _MESSAGE_CONSTRAINTS

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, content: Any) -> Any:
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") != "text":
                    raise PydanticCustomError(
                        "unsupported_content",
                        "content parts of type {part_type} are not supported by this server (only 'text')",
                        {"part_type": repr(part.get("type"))},
                    )
        return content

    @property
    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # vLLM joins text parts the same way


# --- structured output (deployments/openai_api/structured_output.py turns these into the engine's grammar)
# ---


class JsonSchemaFormat(_OpenAIModel):
    name: str
    description: str | None = None
    # a JSON Schema; "schema" shadows a BaseModel attribute, so the field is named schema_
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool = False  # the grammar is enforced either way

    model_config = {**_OpenAIModel.model_config, "populate_by_name": True}


class ResponseFormat(_OpenAIModel):
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


class StructuredOutputs(_OpenAIModel):
    """vLLM's `structured_outputs`: exactly one of the constraints."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: Literal[True] | None = None

    model_config = {**_OpenAIModel.model_config, "populate_by_name": True}
    # vLLM's options of its own grammar back-ends: no effect here
    ignored_fields: ClassVar[frozenset[str]] = frozenset(
        {"disable_fallback", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}
    )
    # _exactly_one: one constraint is given (not null)
    schema_constraints: ClassVar[tuple[dict[str, Any], ...]] = (
        {
            "oneOf": [
                _given(kind, {"not": {"type": "null"}})
                for kind in ("json", "regex", "choice", "grammar", "json_object")
            ]
        },
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


class GenerationRequest(_OpenAIModel):
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
            "if": _given("stream_options", _given("include_usage", {"const": True})),
            "then": _given("stream", {"const": True}),
        },
        {  # a constraining response_format, or structured_outputs, not both
            "if": _given("response_format", _given("type", {"enum": ["json_object", "json_schema"]})),
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


class FunctionDefinition(_OpenAIModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="a JSON Schema of the arguments object, in the keywords llguidance implements; "
        "none: no arguments",
    )  # fmt: skip
    strict: bool | None = None  # the arguments of a forced call always validate here


class Tool(_OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_OpenAIModel):
    name: str


class NamedToolChoice(_OpenAIModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice

# What ChatCompletionRequest._tool_fields checks in its schema: a call can be forced only among tools, and
# not beside a format for the answer's text. That a named function is among the tools, and that a tool
# message answers an earlier call, the fields' descriptions say in words (JSON Schema cannot compare values).
_FORCED_CALL_ALONE = {
    "if": {
        "anyOf": [_given("tool_choice", {"const": "required"}), _given("tool_choice", {"type": "object"})]
    },
    "then": {
        "required": ["tools"],
        "properties": {
            "tools": {"type": "array", "minItems": 1},
            "response_format": {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]},
            "structured_outputs": {"type": "null"},
        },
    },
}


# Template variables that come from the request's own fields.
_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools"})


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(
        min_length=1,
        description="a tool message's tool_call_id is the id of a call of an earlier assistant message",
    )
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_LOGPROBS)
    # extensions: extra variables for the chat template (e.g. enable_thinking), and vLLM's switch
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        json_schema_extra={"propertyNames": {"not": {"enum": sorted(_RESERVED_TEMPLATE_VARIABLES)}}},
    )
    add_generation_prompt: bool = True
    # tool calling (deployments/openai_api/tool_calls.py): the functions the model may call, whether it must
    # (default: auto with tools, none without), and whether it may call several at once
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice | None = Field(None, description="a named function is one of the tools")
    parallel_tool_calls: bool = True

    prompt_field: ClassVar[str] = "messages"
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "functions": ([],),
        "function_call": ("none", "auto"),
        "logit_bias": ({},),
        "audio": (),
        "modalities": (["text"],),
        "prediction": (),
        "web_search_options": (),
        "reasoning_effort": (),
        "verbosity": (),
        "moderation": (),
    }
    ignored_fields: ClassVar[frozenset[str]] = frozenset(
        {
            "user",
            "metadata",
            "store",
            "service_tier",
            "prompt_cache_key",
            "prompt_cache_retention",
            "prompt_cache_options",
            "safety_identifier",
        }
    )
    # _consistent_fields: top_logprobs above 0 needs logprobs
    schema_constraints: ClassVar[tuple[dict[str, Any], ...]] = (
        *GenerationRequest.schema_constraints,
        {
            "if": _given("top_logprobs", {"type": "integer", "minimum": 1}),
            "then": _given("logprobs", {"const": True}),
        },
        _FORCED_CALL_ALONE,
    )

    @model_validator(mode="after")
    def _consistent_fields(self) -> ChatCompletionRequest:
        if reserved := sorted(_RESERVED_TEMPLATE_VARIABLES & self.chat_template_kwargs.keys()):
            raise OpenAIError.invalid_request(
                f"chat_template_kwargs must not set {reserved[0]!r}; the request itself sets it",
                param=f"chat_template_kwargs.{reserved[0]}",
            )
        if self.top_logprobs > 0 and not self.logprobs:
            raise OpenAIError.invalid_request("top_logprobs needs logprobs to be true", param="top_logprobs")
        return self

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatCompletionRequest:
        """The 400s of tool calling: tools whose parameters are no JSON Schema, a tool_choice that names
        no tool, a tool message that answers no earlier call, a forced call beside a response format."""
        names = [tool.function.name for tool in self.tools]
        for index, tool in enumerate(self.tools):
            param = f"tools[{index}].function.parameters"
            if (problem := schema_problem(tool.function.parameters)) is not None:
                raise OpenAIError.invalid_request(f"{param} is not a JSON Schema: {problem}", param=param)
        if self.tool_choice == "required" and not self.tools:
            raise OpenAIError.invalid_request("tool_choice 'required' needs tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            known = ", ".join(names) or "none"
            raise OpenAIError.invalid_request(
                f"tool_choice.function.name {self.tool_choice.function.name!r} is not among the tools "
                f"(given: {known})",
                param="tool_choice.function.name",
            )
        called: set[str] = set()
        for index, message in enumerate(self.messages):
            _check_message_fields(message, f"messages[{index}]")
            called.update(call.id for call in message.tool_calls or ())
            if message.role == "tool" and message.tool_call_id not in called:
                raise OpenAIError.invalid_request(
                    f"messages[{index}].tool_call_id {message.tool_call_id!r} matches no call of an earlier "
                    "assistant message",
                    param=f"messages[{index}].tool_call_id",
                )
        if self.forces_tool_call and (format_field := self._output_format_field()) is not None:
            raise OpenAIError.invalid_request(
                f"{format_field} cannot be honoured together with a forced tool call (tool_choice "
                f"{self.tool_choice if isinstance(self.tool_choice, str) else 'naming a function'}): the "
                "output is the call; use tool_choice 'auto' or leave out " + format_field,
                param=format_field,
            )
        return self

    def _output_format_field(self) -> str | None:
        """The field that constrains the answer's text (response_format other than text, or vLLM's
        structured_outputs), if the request has one."""
        for name in ("response_format", "structured_outputs"):
            value = getattr(self, name, None)
            if value is None:
                continue
            kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
            if kind != "text":
                return name
        return None

    @property
    def effective_tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice:
        """tool_choice, or OpenAI's default: auto with tools, none without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, OpenAI's current name, where both are given (as vLLM takes them)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return self.top_logprobs if self.logprobs else None


def _check_message_fields(message: ChatMessage, where: str) -> None:
    """Content (but for an assistant's calls), a tool message's tool_call_id, calls only by an assistant."""
    if message.content is None and not (message.role == "assistant" and message.tool_calls is not None):
        param = f"{where}.content"
        raise OpenAIError.invalid_request(f"Missing required parameter: '{param}'.", param=param)
    if message.role == "tool" and message.tool_call_id is None:
        param = f"{where}.tool_call_id"
        raise OpenAIError.invalid_request(f"Missing required parameter: '{param}'.", param=param)
    if message.tool_calls is not None and message.role != "assistant":
        param = f"{where}.tool_calls"
        raise OpenAIError.invalid_request(f"{param}: only an assistant message makes calls", param=param)


# The prompt's schema says what _non_empty_prompts checks: no empty text or list, no negative token id (and
# what the engine checks: none past the vocabulary); and that a batch (texts, or lists of token ids) holds
# at most MAX_CHOICES prompts. prompts x n <= MAX_CHOICES (_consistent_fields) it says in words: JSON Schema
# cannot multiply, and spelling out each n's batch size (about 20 if/then pairs) is more than schemathesis'
# generator can take.
_TEXT_SCHEMA = {"type": "string", "minLength": 1}
_TOKEN_IDS_SCHEMA = {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1}
_PROMPT_SCHEMA = {
    "description": f"a text, token ids, or a batch of either; prompts x n at most {MAX_CHOICES}",
    "anyOf": [
        _TEXT_SCHEMA,
        {"type": "array", "items": _TEXT_SCHEMA, "minItems": 1, "maxItems": MAX_CHOICES},
        _TOKEN_IDS_SCHEMA,
        {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1, "maxItems": MAX_CHOICES},
    ],
}


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        json_schema_extra=lambda schema: schema.update(_PROMPT_SCHEMA)
    )
    max_tokens: int = Field(16, ge=1)  # OpenAI's default for this endpoint
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False

    prompt_field: ClassVar[str] = "prompt"
    # best_of: only 1 (one candidate per choice), as vLLM's V1 engine takes it
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "logit_bias": ({},), "suffix": ("",), "best_of": (1,),
    }  # fmt: skip
    ignored_fields: ClassVar[frozenset[str]] = frozenset({"user"})
    # _consistent_fields: no logprobs with echo
    schema_constraints: ClassVar[tuple[dict[str, Any], ...]] = (
        *GenerationRequest.schema_constraints,
        {"if": _given("echo", {"const": True}), "then": {"properties": {"logprobs": {"type": "null"}}}},
    )

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompts(
        cls, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        # An empty text is refused whatever the tokenizer: vLLM refuses an empty prompt (unless its
        # tokenizer adds a BOS token), and this way the answer and the schema do not depend on the model.
        if not prompt or (not isinstance(prompt, str) and any(part in ("", []) for part in prompt)):
            raise ValueError("a prompt must not be empty")
        if isinstance(prompt, str):
            return prompt
        token_ids = [part for part in prompt if isinstance(part, int)]
        token_ids += [token_id for part in prompt if isinstance(part, list) for token_id in part]
        if any(token_id < 0 for token_id in token_ids):
            raise ValueError("token ids must not be negative")
        return prompt

    @model_validator(mode="after")
    def _consistent_fields(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise OpenAIError.unsupported("echo", " together with logprobs (prompt logprobs)")
        if len(self.prompt_list()) * self.n > MAX_CHOICES:
            raise OpenAIError.invalid_request(
                f"prompts x n must be at most {MAX_CHOICES}, got {len(self.prompt_list())} x {self.n}",
                param="n",
            )
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """The batch of prompts, each text or token ids; the choices are n per prompt, in this order."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs


RequestT = TypeVar("RequestT", bound=GenerationRequest)
