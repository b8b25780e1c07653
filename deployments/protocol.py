"""The OpenAI HTTP protocol: request models, their conversion to SamplingParams, response shapes, errors.

Pure data and functions, no Ray and no FastAPI: the ingress (deployments/ingress.py) does the I/O.

Requests follow the OpenAI API reference field by field. A field is either
- honoured (it changes the output as OpenAI documents),
- accepted and ignored (it has no effect on the output: `user`, `metadata`, `store`, ...),
- rejected with a 400 naming it unless it carries its no-effect value (`tools`, `logit_bias`, ...), or
- unknown: rejected as OpenAI does ("Unrecognized request argument supplied: X").
JSON null means "not given", as in OpenAI's API.

Extensions (vLLM's names and meanings): top_k, min_p, repetition_penalty, ignore_eos,
skip_special_tokens, stop_token_ids; for chat also chat_template_kwargs and add_generation_prompt.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import time
import typing
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, TypeVar

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import CapacityError, ContextLengthExceededError, InvalidRequestError
from engine.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprob
from engine.tokenizer import Tokenizer

MAX_CHOICES = 128  # OpenAI's limit on n (for completions: prompts x n)
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions endpoint
# What OpenAI reports for a logprob too small to matter; JSON has no -Infinity.
LOWEST_LOGPROB = -9999.0
MAX_TOP_K = 2**31 - 1  # the engine's buffers hold top_k as int32; any k past the vocabulary means "off"
RETRY_AFTER_S = 1  # every 503 (overloaded, or the engine restarting) tells the client to retry this soon

SSE_DONE = b"data: [DONE]\n\n"


# ---- errors ------------------------------------------------------------------------------------


class OpenAIError(Exception):
    """An error the ingress returns as OpenAI's error object with its HTTP status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        # crosses Ray actor boundaries by pickle, which would otherwise call __init__(message) alone
        return (type(self), (self.status_code, self.message, self.type, self.param, self.code))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """The HTTP headers of this error's response: Retry-After on a 503 (RFC 9110 15.6.4)."""
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status_code == 503 else {}

    @classmethod
    def invalid_request(cls, message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def unsupported(cls, field_name: str, detail: str = "") -> OpenAIError:
        message = f"{field_name} is not supported by this server{detail}"
        return cls(400, message, param=field_name, code="unsupported_parameter")

    @classmethod
    def context_length_exceeded(cls, message: str, param: str | None) -> OpenAIError:
        return cls(400, message, param=param, code="context_length_exceeded")

    @classmethod
    def invalid_api_key(cls, provided: bool = True) -> OpenAIError:
        if provided:
            message = "Incorrect API key provided."
        else:
            # OpenAI's own words
            message = (
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        return cls(401, message, code="invalid_api_key")

    @classmethod
    def model_not_found(cls, model: str, served_model: str | None = None) -> OpenAIError:
        message = f"The model `{model}` does not exist or you do not have access to it."
        if served_model is not None:
            message += f" This server serves `{served_model}`."
        return cls(404, message, param="model", code="model_not_found")

    @classmethod
    def request_too_large(cls, limit_bytes: int) -> OpenAIError:
        message = f"The request body is larger than this server's limit of {limit_bytes} bytes."
        return cls(413, message, code="request_too_large")

    @classmethod
    def queue_full(cls) -> OpenAIError:
        # OpenAI answers overload with 503 and type server_error
        message = "The server is currently overloaded with other requests; please retry later."
        return cls(503, message, type="server_error", code="queue_full")

    @classmethod
    def service_unavailable(cls, message: str) -> OpenAIError:
        return cls(503, message, type="server_error")

    @classmethod
    def internal(cls) -> OpenAIError:
        return cls(500, "The server had an error while processing your request.", type="server_error")


def openai_error_from(exc: BaseException, prompt_param: str | None = None) -> OpenAIError:
    """The OpenAI error for an exception, also one raised in a Ray actor (unwrapped to its cause).

    `prompt_param` ("messages" or "prompt") is the field a context-length error names. Errors the user did
    not cause become a generic 500, so internals never reach the client.
    """
    exc = original_exception(exc)
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ContextLengthExceededError):
        return OpenAIError.context_length_exceeded(str(exc), prompt_param)
    if isinstance(exc, InvalidRequestError):
        return OpenAIError.invalid_request(str(exc))
    if isinstance(exc, CapacityError):
        return OpenAIError.queue_full()
    return OpenAIError.internal()


def original_exception(exc: BaseException) -> BaseException:
    # Ray re-raises an actor's exception as a RayTaskError subclass that is also an instance of the
    # original class and keeps it in `.cause`; its str() is a traceback, so take the cause's message.
    cause = getattr(exc, "cause", None)
    while isinstance(cause, BaseException) and cause is not exc and isinstance(exc, type(cause)):
        exc, cause = cause, getattr(cause, "cause", None)
    return exc


# ---- request models ----------------------------------------------------------------------------


class _OpenAIModel(BaseModel):
    """Strict JSON types (no "1" for 1; 1.0 is 1, as in JSON), unknown fields rejected, null taken as "not
    given"."""

    # allow_inf_nan: JSON has no NaN or Infinity, but 1e999 parses as inf
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    # field -> the values that leave the output unchanged; any other value is rejected as unsupported
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {}
    # fields accepted and dropped: they have no effect on the output
    ignored_fields: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls_and_check_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, harmless_values in cls.unsupported_fields.items():
            value = data.get(name)
            if value is not None and not any(_same_json(value, harmless) for harmless in harmless_values):
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


class ChatMessage(_OpenAIModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    # Tool calling is not supported, so neither are the message fields that carry it.
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "tool_calls": ([],),
        "function_call": (),
        "tool_call_id": (),
        "audio": (),
    }
    # what a previous response's message carries back when a client resends it as is
    ignored_fields: ClassVar[frozenset[str]] = frozenset({"refusal", "annotations"})

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
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # vLLM joins text parts the same way


# What _GenerationRequest._stop_sequences checks, in its schema
_STOP_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_SEQUENCES},
        {"type": "null"},
    ]
}


class _GenerationRequest(_OpenAIModel):
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
    stop_token_ids: list[int] = Field(
        default_factory=list, json_schema_extra={"items": {"type": "integer", "minimum": 0}}
    )

    # the field a context-length error names
    prompt_field: ClassVar[str]

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
    def _usage_needs_stream(self) -> _GenerationRequest:
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


# Template variables that come from the request's own fields (tools: unsupported, see above).
_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools"})


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_LOGPROBS)
    # extensions: extra variables for the chat template (e.g. enable_thinking), and vLLM's switch
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    add_generation_prompt: bool = True

    prompt_field: ClassVar[str] = "messages"
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "tools": ([],),
        "tool_choice": ("none", "auto"),  # with no tools, both mean plain text
        "functions": ([],),
        "function_call": ("none", "auto"),
        "response_format": ({"type": "text"},),
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
            "parallel_tool_calls",
            "prompt_cache_key",
            "prompt_cache_retention",
            "prompt_cache_options",
            "safety_identifier",
        }
    )

    @model_validator(mode="after")
    def _consistent_fields(self) -> ChatCompletionRequest:
        both_limits = self.max_tokens is not None and self.max_completion_tokens is not None
        if both_limits and self.max_tokens != self.max_completion_tokens:
            raise OpenAIError.invalid_request(
                "max_tokens and max_completion_tokens differ; send only max_completion_tokens",
                param="max_completion_tokens",
            )
        if reserved := sorted(_RESERVED_TEMPLATE_VARIABLES & self.chat_template_kwargs.keys()):
            raise OpenAIError.invalid_request(
                f"chat_template_kwargs must not set {reserved[0]!r}; the request itself sets it",
                param=f"chat_template_kwargs.{reserved[0]}",
            )
        if self.top_logprobs > 0 and not self.logprobs:
            raise OpenAIError.invalid_request("top_logprobs needs logprobs to be true", param="top_logprobs")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return self.top_logprobs if self.logprobs else None


# The prompt's schema says what _non_empty_prompts checks: no empty list, no negative token id.
_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        _TOKEN_IDS_SCHEMA,
        {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1},
    ]
}


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        json_schema_extra=lambda schema: schema.update(_PROMPT_SCHEMA)
    )
    max_tokens: int = Field(16, ge=1)  # OpenAI's default for this endpoint
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    best_of: int | None = None

    prompt_field: ClassVar[str] = "prompt"
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {"logit_bias": ({},), "suffix": ("",)}
    ignored_fields: ClassVar[frozenset[str]] = frozenset({"user"})

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompts(
        cls, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(prompt, str):
            return prompt
        if not prompt or any(part == [] for part in prompt):
            raise ValueError("a prompt must not be empty")
        token_ids = [part for part in prompt if isinstance(part, int)]
        token_ids += [token_id for part in prompt if isinstance(part, list) for token_id in part]
        if any(token_id < 0 for token_id in token_ids):
            raise ValueError("token ids must not be negative")
        return prompt

    @model_validator(mode="after")
    def _consistent_fields(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError.unsupported("best_of", " unless it equals n")
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


RequestT = TypeVar("RequestT", bound=_GenerationRequest)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """An HTTP request body as a dict; 400 for what is not a JSON object.

    pydantic's JSON parser (jiter), not json.loads: it refuses lone surrogates ("\\ud800", which the
    tokenizer cannot take), NaN and Infinity (not JSON), and nesting past 200 levels, where json.loads
    raised RecursionError (a 500) past about 1,000.
    """
    try:
        body = pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as error:
        raise OpenAIError.invalid_request(f"The request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise OpenAIError.invalid_request("The request body must be a JSON object.")
    return body


def json_body_of(body: Any) -> dict[str, Any]:
    """A Python handle's request dict held to what an HTTP body may be (parse_json_body): it goes through
    JSON, so a lone surrogate, NaN, a non-JSON type or deep nesting gets the same 400."""
    try:
        raw = json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except UnicodeEncodeError as error:
        raise OpenAIError.invalid_request(f"The request's text is not valid Unicode: {error}") from None
    except RecursionError:
        raise OpenAIError.invalid_request("The request is nested too deeply.") from None
    except (TypeError, ValueError) as error:
        raise OpenAIError.invalid_request(f"The request is not what a JSON body can hold: {error}") from None
    return parse_json_body(raw)


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


# ---- request -> engine -------------------------------------------------------------------------


def max_tokens_for(request: _GenerationRequest, num_prompt_tokens: int, max_model_len: int) -> int:
    """The tokens to generate: as requested, or what is left of the context; 400 when it does not fit."""
    where = request.prompt_field
    if num_prompt_tokens >= max_model_len:
        raise OpenAIError.context_length_exceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, your {where} "
            f"resulted in {num_prompt_tokens} tokens, which leaves no room for the completion. "
            f"Please reduce the length of the {where}.",
            param=where,
        )
    requested = request.requested_max_tokens
    if requested is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + requested > max_model_len:
        raise OpenAIError.context_length_exceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {where}, {requested} in "
            f"the completion). Please reduce the length of the {where} or completion.",
            param=where,
        )
    return requested


def sampling_params_for(request: _GenerationRequest, choice_index: int, max_tokens: int) -> SamplingParams:
    """The engine's parameters for one choice; `choice_index` counts the n choices of one prompt.

    With a seed, choice i uses seed + i: the n choices differ, and each is reproducible.
    """
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        seed=None if request.seed is None else request.seed + choice_index,
        stop=request.stop_sequences,
        stop_token_ids=tuple(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        logprobs=request.logprobs_count,
        skip_special_tokens=request.skip_special_tokens,
    )
    try:
        params.validate()
    except InvalidRequestError as error:
        # SamplingParams.validate() starts each message with the field's name
        field_name = str(error).split(" ", 1)[0]
        if field_name == "logprobs" and isinstance(request, ChatCompletionRequest):
            field_name = "top_logprobs"
        raise OpenAIError.invalid_request(str(error), param=field_name) from None
    return params


def chat_messages_for_template(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as plain dicts for a chat template, which knows "system" but not "developer"."""
    messages = []
    for message in request.messages:
        as_dict: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": message.text,
        }
        if message.name is not None:
            as_dict["name"] = message.name
        messages.append(as_dict)
    return messages


def echo_text(prompt: str | list[int], tokenizer: Tokenizer) -> str:
    """The text a completion with echo starts with: the prompt, decoded when it came as token ids."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


# ---- responses ---------------------------------------------------------------------------------


@dataclasses.dataclass
class ChoiceResult:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" or "length"; None while streaming
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def created_now() -> int:
    return int(time.time())  # Unix seconds, as OpenAI's `created`


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_completion_response(
    request_id: str,
    model: str,
    created: int,
    choices: Sequence[ChoiceResult],
    usage: dict[str, int],
    tokenizer: Tokenizer,
    want_logprobs: bool,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": choice.index,
                "message": {"role": "assistant", "content": choice.text},
                "logprobs": (
                    {"content": chat_logprobs_content(tokenizer, choice.logprobs)} if want_logprobs else None
                ),
                "finish_reason": choice.finish_reason,
            }
            for choice in choices
        ],
        "usage": usage,
    }


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    logprobs_content: list[dict[str, Any]] | None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """One streamed choice update.

    `delta` is {"role": "assistant", "content": ""} in a choice's first chunk, then {"content": text}.
    """
    chunk = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": None if logprobs_content is None else {"content": logprobs_content},
                "finish_reason": finish_reason,
            }
        ],
    }
    if include_usage:
        chunk["usage"] = None  # OpenAI: every chunk but the last carries a null usage
    return chunk


def usage_chunk(
    request_id: str,
    model: str,
    created: int,
    usage: dict[str, int],
    object_name: Literal["chat.completion.chunk", "text_completion"],
) -> dict[str, Any]:
    """The last chunk of a stream with include_usage: no choices, the whole request's usage."""
    return {
        "id": request_id,
        "object": object_name,
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [],
        "usage": usage,
    }


def completion_response(
    request_id: str,
    model: str,
    created: int,
    choices: Sequence[ChoiceResult],
    usage: dict[str, int],
    tokenizer: Tokenizer,
    want_logprobs: bool,
    skip_special_tokens: bool = True,
) -> dict[str, Any]:
    """With echo, each ChoiceResult.text already starts with the prompt (see echo_text)."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": choice.index,
                "text": choice.text,
                "logprobs": (
                    completion_logprobs(tokenizer, choice.logprobs, skip_special_tokens=skip_special_tokens)
                    if want_logprobs
                    else None
                ),
                "finish_reason": choice.finish_reason,
            }
            for choice in choices
        ],
        "usage": usage,
    }


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: Sequence[TokenLogprob] | None,
    tokenizer: Tokenizer,
    include_usage: bool = False,
    text_offset: int = 0,
    skip_special_tokens: bool = True,
) -> dict[str, Any]:
    """One streamed completion update; `logprobs` None: not asked for.

    `text_offset` is the length of this choice's text sent before `text`, so logprobs offsets index the
    whole text, as in a non-streamed response.
    """
    formatted = None
    if logprobs is not None:
        formatted = completion_logprobs(tokenizer, logprobs, text_offset, skip_special_tokens)
    chunk = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": index, "text": text, "logprobs": formatted, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


# ---- logprobs ----------------------------------------------------------------------------------


def token_text(token_bytes: bytes) -> str:
    """A token as a JSON string: its text, or "bytes:\\xe2\\x80" when it holds part of a UTF-8 character.

    The exact bytes are always in the `bytes` field; this spelling (OpenAI's) keeps the string honest
    instead of a replacement character that looks like real text.
    """
    try:
        return token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in token_bytes)


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)  # -inf becomes OpenAI's "very unlikely" value


def chat_logprobs_content(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's `logprobs.content`: per token its text, logprob, bytes and top alternatives."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        raw = tokenizer.token_bytes(token_id)
        return {"token": token_text(raw), "logprob": _finite(logprob), "bytes": list(raw)}

    return [
        {
            **entry(item.token_id, item.logprob),
            "top_logprobs": [entry(*alternative) for alternative in item.top],
        }
        for item in logprobs
    ]


def completion_logprobs(
    tokenizer: Tokenizer,
    logprobs: Sequence[TokenLogprob],
    text_offset: int = 0,
    skip_special_tokens: bool = True,
) -> dict[str, Any]:
    """The legacy completions `logprobs` object; text_offset[i] is where token i starts in the text.

    `text_offset` is where these tokens' text starts (the length of the text already sent, in a stream).
    Offsets follow the engine's own detokenizer, so they index the returned text exactly.
    """
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for item in logprobs:
        offsets.append(text_offset + len(detokenizer.text))
        detokenizer.push(item.token_id)
        tokens.append(token_text(tokenizer.token_bytes(item.token_id)))
        token_logprobs.append(_finite(item.logprob))
        top = {token_text(tokenizer.token_bytes(token_id)): _finite(value) for token_id, value in item.top}
        # OpenAI lists the top N and always the sampled token too: up to N + 1 entries
        top.setdefault(tokens[-1], token_logprobs[-1])
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


# ---- server-sent events ------------------------------------------------------------------------


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying a JSON object (or a ready string)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
