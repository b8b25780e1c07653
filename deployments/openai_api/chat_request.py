"""The chat completions request (`POST /v1/chat/completions`): its messages, its tools and how the model
may call them (deployments/openai_api/tool_calls.py), and the chat template's extra variables.

Extensions beside generation_request.py's (vLLM's names and meanings): chat_template_kwargs and
add_generation_prompt.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from tileinfer.deployments.openai_api.errors import OpenAIError
from tileinfer.deployments.openai_api.generation_request import GenerationRequest
from tileinfer.deployments.openai_api.request_model import RequestModel, field_given
from tileinfer.deployments.openai_api.tool_calls import schema_problem
from tileinfer.engine.sampling.params import MAX_LOGPROBS


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(RequestModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class AssistantToolCall(RequestModel):
    """A call an assistant message made, as a client sends a previous response's message back."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


# What ChatCompletionRequest._tool_fields checks of each message (_check_message_fields): content is
# required but for an assistant's tool calls, and a tool message names the call it answers (null: not given).
_PRESENT = {"not": {"type": "null"}}
_MESSAGE_CONSTRAINTS = (
    {"if": {"properties": {"role": {"enum": ["system", "developer", "user", "tool"]}}},
     "then": field_given("content", _PRESENT)},
    {"if": {"properties": {"role": {"const": "assistant"}},
            "not": field_given("tool_calls", {"type": "array"})},
     "then": field_given("content", _PRESENT)},
    {"if": {"properties": {"role": {"const": "tool"}}},
     "then": field_given("tool_call_id", {"type": "string"})},
    {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
     "then": {"properties": {"tool_calls": {"type": "null"}}}},
)  # fmt: skip


class ChatMessage(RequestModel):
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


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="a JSON Schema of the arguments object, in the keywords llguidance implements; "
        "none: no arguments",
    )  # fmt: skip
    strict: bool | None = None  # the arguments of a forced call always validate here


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice

# What ChatCompletionRequest._tool_fields checks in its schema: a call can be forced only among tools, and
# not beside a format for the answer's text. That a named function is among the tools, and that a tool
# message answers an earlier call, the fields' descriptions say in words (JSON Schema cannot compare values).
_FORCED_CALL_ALONE = {
    "if": {
        "anyOf": [
            field_given("tool_choice", {"const": "required"}),
            field_given("tool_choice", {"type": "object"}),
        ]
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
            "if": field_given("top_logprobs", {"type": "integer", "minimum": 1}),
            "then": field_given("logprobs", {"const": True}),
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
