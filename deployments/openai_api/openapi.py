"""The HTTP API's OpenAPI schema (`/openapi.json`): the request bodies the routes read and the responses
they send, so that clients and schema-driven tools (client generators, schemathesis) can use it.

The routes read their bodies themselves (deployments/openai_api/request_parsing.py parses them, with OpenAI's
errors), so FastAPI knows no request model: the request schemas are added to the components here, with the
served model's name as the one `model` they take, its vocabulary as the range of a token id (both as the
engine tells them: its name, and the bound it checks token ids against), and the API key as a Bearer security
scheme. The response models describe what deployments/openai_api/responses.py builds; the hot path builds
plain dicts, not these models. A test (tests/test_openapi.py) sends schemathesis' requests to the running app
and checks that the app accepts what the schema allows, refuses what it does not, and answers as it says.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from tileinfer.deployments.openai_api.chat_request import ChatCompletionRequest
from tileinfer.deployments.openai_api.completion_request import CompletionRequest
from tileinfer.deployments.openai_api.request_model import TOKEN_ID_SCHEMA
from tileinfer.engine.config import KVCacheDtype, Quantization

if TYPE_CHECKING:
    from tileinfer.deployments.replicas.engine_replica import EngineInfo

_REF = "#/components/schemas/{model}"
API_KEY_SCHEME = "ApiKey"
_SECURITY_SCHEMES = {
    API_KEY_SCHEME: {
        "type": "http",
        "scheme": "bearer",
        "description": "the server's API key (api_key, api_key_file or TILEINFER_API_KEY), as "
        "`Authorization: Bearer <key>`; a server without one takes any key or none",
    }
}


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str  # its text, or "bytes:\\x.." where it holds part of a UTF-8 character
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str  # call_...
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # null: only tool calls (or only reasoning)
    reasoning_content: str | None = None  # a thinking model's think block (vLLM's field); absent otherwise
    tool_calls: list[ToolCall] | None = None  # absent without calls


ChatFinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[CompletionChoice]
    usage: Usage


class CalledFunctionDelta(BaseModel):
    name: str | None = None  # in a call's first delta
    arguments: str | None = None  # the arguments' JSON text, in pieces


class ToolCallDelta(BaseModel):
    index: int  # the call's place among the choice's calls
    id: str | None = None  # in a call's first delta, with its type and name
    type: Literal["function"] | None = None
    function: CalledFunctionDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None  # in a choice's first chunk
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[ChatChunkChoice]  # empty in the last chunk with include_usage
    usage: Usage | None = None  # with include_usage: null, then the whole request's in the last chunk


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    quantization: Quantization | None  # weight-only INT8 linears; None: the weights' dtype
    kv_cache_dtype: KVCacheDtype  # int8: the INT8 KV cache; auto: the dtype's


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class EngineState(BaseModel):
    replica: str | None = Field(description="Serve's id of the engine replica")
    engine: str | None = Field(None, description="its rank: the `engine` label of its metrics")
    node: str | None = Field(None, description="the Ray node it runs on")
    state: Literal["ready", "unavailable"]
    error: str | None = Field(None, description="why it is unavailable")
    num_requests_running: int | None = None
    num_requests_waiting: int | None = None


class Health(BaseModel):
    status: Literal["ok"]
    engines: list[EngineState] = Field(description="every engine replica that Serve runs")


ERRORS = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "a bad request: OpenAI's error object, with the parameter at fault"),
        (401, "a missing or wrong API key"),
        (404, "no such model"),
        (413, "a body over max_request_bytes"),
        (503, "the queue is full or the engine restarts; Retry-After says when to try again"),
    )
}


# Models that FastAPI does not place in the components itself: the bodies the routes read, and the
# chunks their event streams carry. As accepted (validation mode): a chunk field with a default may be
# absent.
REQUEST_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest)
COMPONENT_MODELS: tuple[type[BaseModel], ...] = (*REQUEST_MODELS, ChatCompletionChunk, CompletionChunk)


def security(key_required: bool) -> dict[str, Any]:
    """A route's OpenAPI arguments for the API key: required, or (no key to check) a key or none."""
    requirements: list[dict[str, list[str]]] = [{API_KEY_SCHEME: []}]
    return {"openapi_extra": {"security": requirements if key_required else [{}, *requirements]}}


def _events(chunk: type[BaseModel]) -> dict[str, Any]:
    """A server-sent event of the stream: `data` holds a chunk (or, once the stream had begun, an error
    object) as JSON, and the last event's is [DONE]."""
    payload = {
        "anyOf": [{"$ref": _REF.format(model=chunk.__name__)}, {"$ref": _REF.format(model="ErrorResponse")}]
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
        "if": {"properties": {"data": {"const": "[DONE]"}}},
        "else": {
            "properties": {
                "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}
            }
        },
    }


def generation_route(
    request_model: type[BaseModel],
    response_model: type[BaseModel],
    chunk: type[BaseModel],
    key_required: bool,
) -> dict:
    """A POST route's OpenAPI arguments: its JSON body, its JSON response or (stream: true) its events, and
    its API key."""
    return {
        "openapi_extra": {
            **security(key_required)["openapi_extra"],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=request_model.__name__)}}
                },
            },
        },
        "responses": {
            200: {
                "model": response_model,
                "description": f"the {response_model.__name__}; with stream: true, server-sent events, each "
                f"a {chunk.__name__}, then [DONE]",
                "content": {"text/event-stream": {"schema": _events(chunk)}},
            },
            **ERRORS,
        },
    }


def install(app: FastAPI, engine_info: Callable[[], Awaitable[EngineInfo]]) -> None:
    """Serve `app`'s schema at /openapi.json (make the app with openapi_url=None): COMPONENT_MODELS too
    (FastAPI adds the response models itself), requests that name the served model (another gets a 404)
    and token ids in its vocabulary (others get a 400), and the API key's security scheme. Built once, at
    the first request, from what the engine tells (engine_info: a 503 while no engine replica answers)."""

    async def openapi_json(_: Request) -> JSONResponse:
        if app.openapi_schema is None:
            app.openapi_schema = _schema(app, await engine_info())
        return JSONResponse(app.openapi_schema)

    app.add_route("/openapi.json", openapi_json, include_in_schema=False)


def _schema(app: FastAPI, info: EngineInfo) -> dict[str, Any]:
    """`app`'s routes, COMPONENT_MODELS and the TokenId component, for the model that `info` describes."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {})
    components["securitySchemes"] = _SECURITY_SCHEMES
    schemas = components.setdefault("schemas", {})
    for model in COMPONENT_MODELS:
        model_schema = model.model_json_schema(ref_template=_REF)
        schemas.update(model_schema.pop("$defs", {}))
        if model in REQUEST_MODELS:
            model_schema["properties"]["model"]["enum"] = [info.model_name]
        schemas[model.__name__] = model_schema
    token_id = TOKEN_ID_SCHEMA["title"]
    schemas.update(_with_token_id_refs(schemas))
    schemas[token_id] = {**TOKEN_ID_SCHEMA, "maximum": info.vocab_size - 1,
                         "description": "a token id of the served model's vocabulary"}  # fmt: skip
    return schema


def _with_token_id_refs(node: Any) -> Any:
    """`node` with each token id's schema (TOKEN_ID_SCHEMA) a reference to its component."""
    if node == TOKEN_ID_SCHEMA:
        return {"$ref": _REF.format(model=TOKEN_ID_SCHEMA["title"])}
    if isinstance(node, dict):
        return {key: _with_token_id_refs(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_with_token_id_refs(item) for item in node]
    return node
