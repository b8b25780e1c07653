"""The OpenAI-compatible ingress: HTTP (FastAPI under Serve) and the same calls for Python handles.

It validates a request, renders the chat template (with the request's tools), tokenizes, and submits
one engine request per choice (a chat's with the grammar that forces its tool call, if any:
deployments/openai_api/chat_output.py, which also reads reasoning and tool calls out of the answer's text).
Token ids come back through this replica's one outputs stream from the engine
(deployments/replicas/engine_replica.py, EngineClient), once per engine step; this replica detokenizes them
and finds stop strings (deployments/openai_api/choices.py: TextStream, the same code the engine runs in
process). A body over OFF_LOOP_BYTES is parsed, validated, rendered and tokenized on a worker thread, so that
the streams this replica sends meanwhile keep their pace, and a prompt too long for any context is refused
before it is tokenized (Tokenizer.fewest_tokens). A client that goes away cancels its request, which aborts
its engine requests (deployments/openai_api/disconnects.py).

Each SSE event carries everything of a choice that is ready when it is written: the first token goes out
at once (no batching timer), and a client or step that outpaces the writer gets the tokens that piled up in
one event rather than one event each.

The API key (AppArgs.resolve_api_key: args, a file or TILEINFER_API_KEY, read here) guards the
completions and /v1/models. /health and /openapi.json answer without it, and so does /metrics unless
metrics_require_key (vLLM's convention). Calls to the engine beyond requests (/health, /v1/models,
/metrics) answer 503 within a second or two while the engine replica restarts, rather than hang.
"""

import asyncio
import collections
import copy
import hmac
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException
from tileinfer.deployments.launch.app_args import AppArgs
from tileinfer.deployments.openai_api import openapi
from tileinfer.deployments.openai_api.body_size_limit import BodySizeLimit
from tileinfer.deployments.openai_api.chat_output import ChatOutputPlan
from tileinfer.deployments.openai_api.chat_request import ChatCompletionRequest
from tileinfer.deployments.openai_api.choices import Choice, ChoiceRunner, PreparedRequest
from tileinfer.deployments.openai_api.completion_request import CompletionRequest
from tileinfer.deployments.openai_api.disconnects import CancelOnDisconnect
from tileinfer.deployments.openai_api.errors import OpenAIError, openai_error_from, original_exception
from tileinfer.deployments.openai_api.generation_request import GenerationRequest, RequestT
from tileinfer.deployments.openai_api.reasoning import prompt_opens_thinking
from tileinfer.deployments.openai_api.request_parsing import json_bytes_of, parse_body
from tileinfer.deployments.openai_api.request_to_engine import chat_template_input, prompt_too_long
from tileinfer.deployments.openai_api.responses import ChatResponse, CompletionResponse, echo_text, usage
from tileinfer.deployments.openai_api.sse import SSE_DONE, sse
from tileinfer.deployments.replicas.engine_client import EngineClient
from tileinfer.deployments.replicas.engine_replica import EngineInfo
from tileinfer.deployments.replicas.metrics import exposition, router_families
from tileinfer.deployments.replicas.routing import ROUTE_KWARG, RoutingPolicy, policy_for
from tileinfer.deployments.replicas.serve_logs import route_to_serve
from tileinfer.engine.models.loader import load_tokenizer
from tileinfer.engine.text.chat_template import load_chat_template

HEALTH_TIMEOUT_S = 1.0  # /health: the engine answers its health check within this, or is not healthy
# A request body larger than this is parsed, validated, rendered and tokenized on a worker thread, so that the
# streams this replica sends meanwhile keep going (tokenizing and llguidance's schema checks run without the
# GIL). A hop there and back costs tens of microseconds; 8 KiB of prompt takes milliseconds to tokenize.
OFF_LOOP_BYTES = 8 * 1024
PREPARE_THREADS = 2  # larger requests prepared at once; more wait their turn
T = TypeVar("T")
CONTROL_CALL_TIMEOUT_S = 2.0  # /v1/models and /metrics: 503 when the engine does not answer within this


@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress:
    def __init__(self, args: AppArgs, engine: DeploymentHandle) -> None:
        route_to_serve()
        self.args = args
        self.engine = engine
        self.client = EngineClient(engine, _routing_policy(args, engine))
        self.api_key = args.resolve_api_key()  # here, where the replica runs: never in the args' logs
        self.tokenizer = load_tokenizer(args.model)
        if args.chat_template is not None:  # the user's template in place of the model's
            self.tokenizer = copy.copy(self.tokenizer)
            self.tokenizer.chat_template = load_chat_template(args.chat_template)
        self.runner = ChoiceRunner(self.client, self.tokenizer, args)
        self.info: EngineInfo | None = None
        self.created = int(time.time())
        self._preparing = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")  # _off_loop

    def __del__(self) -> None:  # Serve calls it when it stops this replica
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        preparing = getattr(self, "_preparing", None)
        if preparing is not None:
            preparing.shutdown(wait=False, cancel_futures=True)

    async def _engine_info(self) -> EngineInfo:
        if self.info is None:
            self.info = await _control_call(self.engine.info.remote(), "info call", CONTROL_CALL_TIMEOUT_S)
        return self.info

    # --- calls for Python handles (serve.get_app_handle): OpenAI request dicts in, dicts out ------

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """A chat completion, as the HTTP API returns it (stream is ignored)."""
        request, prepared = await self._from_handle(ChatCompletionRequest, body, stream=False)
        return await self._chat_response(prepared, request)

    async def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The chunks of a streamed chat completion (call with handle.options(stream=True))."""
        request, prepared = await self._from_handle(ChatCompletionRequest, body, stream=True)
        async for chunk in self._chat_chunks(prepared, request):
            yield chunk

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        request, prepared = await self._from_handle(CompletionRequest, body, stream=False)
        return await self._completion_response(prepared, request)

    async def complete_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        request, prepared = await self._from_handle(CompletionRequest, body, stream=True)
        async for chunk in self._completion_chunks(prepared, request):
            yield chunk

    # --- the HTTP app ---------------------------------------------------------------------------

    def __serve_build_asgi_app__(self) -> Any:
        app = FastAPI(title="TileInfer", docs_url=None, redoc_url=None, openapi_url=None)  # openapi.install
        key_required = self.api_key is not None  # by the routes that _authorize

        @app.exception_handler(OpenAIError)
        async def openai_error(_: Request, error: OpenAIError) -> JSONResponse:
            return _error_response(error)

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, error: HTTPException) -> JSONResponse:
            # the router's own: no such path (404), or not this method (405)
            message = f"{request.method} {request.url.path}: {error.detail}"
            body = OpenAIError(error.status_code, message).body()
            return JSONResponse(body, status_code=error.status_code, headers=error.headers)

        @app.exception_handler(Exception)
        async def unexpected_error(_: Request, error: Exception) -> JSONResponse:
            return _error_response(openai_error_from(error))

        @app.post(
            "/v1/chat/completions",
            **openapi.generation_route(
                ChatCompletionRequest, openapi.ChatCompletion, openapi.ChatCompletionChunk, key_required
            ),
        )
        async def chat_completions(request: Request) -> Response:
            parsed, prepared = await self._from_http(ChatCompletionRequest, request)
            if parsed.stream:
                return self._sse_response(self._chat_chunks(prepared, parsed))
            return JSONResponse(await self._chat_response(prepared, parsed))

        @app.post(
            "/v1/completions",
            **openapi.generation_route(
                CompletionRequest, openapi.Completion, openapi.CompletionChunk, key_required
            ),
        )
        async def completions(request: Request) -> Response:
            parsed, prepared = await self._from_http(CompletionRequest, request)
            if parsed.stream:
                return self._sse_response(self._completion_chunks(prepared, parsed))
            return JSONResponse(await self._completion_response(prepared, parsed))

        @app.get("/v1/models", responses={200: {"model": openapi.ModelList}, 401: openapi.ERRORS[401],
                                          503: openapi.ERRORS[503]},
                 **openapi.security(key_required))  # fmt: skip
        async def models(request: Request) -> JSONResponse:
            self._authorize(request)
            info = await self._engine_info()
            model = {
                "id": info.model_name,
                "object": "model",
                "created": self.created,
                "owned_by": "tileinfer",
                "max_model_len": info.max_model_len,
                "quantization": info.quantization,
                "kv_cache_dtype": info.kv_cache_dtype,
            }
            return JSONResponse({"object": "list", "data": [model]})

        @app.get("/health", responses={200: {"model": openapi.Health}, 503: openapi.ERRORS[503]})
        async def health() -> JSONResponse:  # no key: a load balancer's probe
            engines = await self._engine_states()
            if not any(engine["state"] == "ready" for engine in engines):
                detail = "; ".join(engine.get("error", "") for engine in engines) or "no engine replica runs"
                error = OpenAIError.service_unavailable(f"No engine replica is ready ({detail}).")
                return JSONResponse({**error.body(), "engines": engines}, 503, headers=error.headers())
            return JSONResponse({"status": "ok", "engines": engines})

        @app.get(
            "/metrics", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}},
                       401: openapi.ERRORS[401], 503: openapi.ERRORS[503]},
            **openapi.security(key_required and self.args.metrics_require_key),
        )  # fmt: skip
        async def metrics(request: Request) -> PlainTextResponse:
            if self.args.metrics_require_key:
                self._authorize(request)
            text = await self._metrics_text()
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

        openapi.install(app, self._engine_info)
        return BodySizeLimit(CancelOnDisconnect(app), self.args.max_request_bytes)

    async def _per_replica(self, method: str, what: str, timeout_s: float) -> list[tuple[str | None, Any]]:
        """Call a method on every engine replica that Serve runs (on the one Serve picks when this
        ingress has no view of them yet): (replica id, result or the OpenAIError it failed with)."""
        replica_ids: list[str | None] = sorted(self.client.policy.replica_ids()) or [None]

        async def call(replica_id: str | None) -> Any:
            response = getattr(self.engine, method).remote(**{ROUTE_KWARG: replica_id})
            try:
                return await _control_call(response, what, timeout_s)
            except OpenAIError as error:
                return error

        results = await asyncio.gather(*(call(replica_id) for replica_id in replica_ids))
        return list(zip(replica_ids, results, strict=True))

    async def _engine_states(self) -> list[dict[str, Any]]:
        """Each engine replica's status ("ready"), or why it is not."""
        states = []
        for replica_id, status in await self._per_replica("status", "health check", HEALTH_TIMEOUT_S):
            if isinstance(status, OpenAIError):
                states.append({"replica": replica_id, "state": "unavailable", "error": status.message})
            else:
                states.append(status)
        return states

    async def _metrics_text(self) -> str:
        """Every engine replica's metrics that answered, and this ingress's routing decisions; a 503 when
        no engine answered."""
        answers = await self._per_replica("metrics", "metrics call", CONTROL_CALL_TIMEOUT_S)
        answered = [answer for _, answer in answers if not isinstance(answer, OpenAIError)]
        if not answered:
            raise answers[0][1]
        # each ingress replica's latest counts as an engine passed them on (its heartbeats), this one's own
        by_ingress: dict[str, dict[str, int]] = {}
        for _, decisions in answered:
            for subscriber_id, counts in decisions.items():
                if sum(counts.values()) >= sum(by_ingress.get(subscriber_id, {}).values()):
                    by_ingress[subscriber_id] = counts
        by_ingress[self.client.subscriber_id] = dict(self.client.policy.decisions)
        totals: collections.Counter[str] = collections.Counter()
        for counts in by_ingress.values():
            totals.update(counts)
        return exposition([families for families, _ in answered], router_families(totals))

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key.strip()
        # RFC 7235: the auth scheme is case-insensitive, so "bearer" is Bearer too
        if scheme.lower() != "bearer" or not key:
            raise OpenAIError.invalid_api_key(provided=False)
        # bytes: compare_digest refuses str with non-ASCII characters (a TypeError, a 500); Starlette
        # decoded the header as Latin-1, so this is the header's own bytes
        if not hmac.compare_digest(key.encode("latin-1"), self.api_key.encode("utf-8")):
            raise OpenAIError.invalid_api_key()

    async def _from_http(self, model: type[RequestT], request: Request) -> tuple[RequestT, PreparedRequest]:
        """An HTTP request, authorized, validated and prepared."""
        self._authorize(request)
        body = await request.body()
        parsed = await self._parse(model, body)
        return parsed, await self._prepare(parsed, len(body))

    @staticmethod
    def _sse_response(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks:
                    yield sse(chunk)
            except OpenAIError as error:  # the stream had begun: report in band, as OpenAI does
                yield sse(error.body())
            yield SSE_DONE

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    # --- shared by HTTP and handles -------------------------------------------------------------

    async def _from_handle(
        self, model: type[RequestT], body: dict[str, Any], stream: bool
    ) -> tuple[RequestT, PreparedRequest]:
        """A Python handle's request, validated as the JSON body it stands for, and prepared."""
        raw = json_bytes_of(body)
        request = await self._parse(model, raw, stream)
        return request, await self._prepare(request, len(raw))

    async def _off_loop(self, num_bytes: int, work: Callable[..., T], *args: Any) -> T:
        """work(*args) for a request of num_bytes: here for a small one, on a worker thread for a larger one
        (OFF_LOOP_BYTES)."""
        if num_bytes <= OFF_LOOP_BYTES:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self._preparing, work, *args)

    async def _parse(self, model: type[T], raw: bytes, stream: bool | None = None) -> T:
        return await self._off_loop(len(raw), parse_body, model, raw, stream)

    async def _check_model(self, model: str) -> EngineInfo:
        info = await self._engine_info()
        if model != info.model_name:
            raise OpenAIError.model_not_found(model, info.model_name)
        return info

    async def _prepare(self, request: GenerationRequest, num_bytes: int) -> PreparedRequest:
        """The request's prompts tokenized (_off_loop), and its choices submitted to the engine."""
        info = await self._check_model(request.model)
        if isinstance(request, ChatCompletionRequest):
            prompt, plan = await self._off_loop(num_bytes, self._chat_prompt, request, info)
            return await self.runner.submit(request, [prompt], info.max_model_len, "chatcmpl", plan)
        assert isinstance(request, CompletionRequest)
        prompts = await self._off_loop(num_bytes, self._completion_prompts, request, info)
        return await self.runner.submit(request, prompts, info.max_model_len, "cmpl")

    def _chat_prompt(
        self, request: ChatCompletionRequest, info: EngineInfo
    ) -> tuple[list[int], ChatOutputPlan]:
        """The chat's prompt (its template rendered, with its tools) and what its answers may hold."""
        template = self.tokenizer.chat_template
        try:
            messages, tools = chat_template_input(request, template)
            text = self.tokenizer.render_chat(
                messages,
                add_generation_prompt=request.add_generation_prompt,
                tools=tools,
                **(request.chat_template_kwargs or {}),
            )
            # the template writes BOS itself where the model wants it
            prompt = self._tokens(request, text, info, add_special_tokens=False)
        except Exception as error:  # a template's raise_exception, or a bad message
            raise openai_error_from(error, prompt_param=request.prompt_field) from None
        opened = prompt_opens_thinking(text, template)
        return prompt, ChatOutputPlan.for_request(request, template, self.tokenizer.single_token_id, opened)

    def _completion_prompts(self, request: CompletionRequest, info: EngineInfo) -> list[list[int]]:
        return [
            self._tokens(request, prompt, info) if isinstance(prompt, str) else list(prompt)
            for prompt in request.prompt_list()
        ]

    def _tokens(
        self, request: Any, text: str, info: EngineInfo, add_special_tokens: bool = True
    ) -> list[int]:
        """A prompt's tokens; one that cannot fit the context is refused before it is tokenized (a 3 MB
        prompt's tokens took seconds of a core)."""
        fewest = self.tokenizer.fewest_tokens(text)
        if fewest >= info.max_model_len:
            raise prompt_too_long(request, fewest, info.max_model_len, at_least=True)
        return self.tokenizer.encode(text, add_special_tokens)

    @staticmethod
    def _usage(prepared: PreparedRequest, num_completion_tokens: int) -> dict[str, int]:
        return usage(sum(len(prompt) for prompt in prepared.prompts), num_completion_tokens)

    async def _chat_response(
        self, prepared: PreparedRequest, request: ChatCompletionRequest
    ) -> dict[str, Any]:
        results = await self.runner.collect(prepared)
        usage = self._usage(prepared, sum(len(result.token_ids) for result in results))
        response = ChatResponse(prepared.request_id, prepared.created, request, self.tokenizer, prepared.plan)
        return response.body(results, usage)

    async def _chat_chunks(
        self, prepared: PreparedRequest, request: ChatCompletionRequest
    ) -> AsyncIterator[dict[str, Any]]:
        response = ChatResponse(prepared.request_id, prepared.created, request, self.tokenizer, prepared.plan)
        assert prepared.plan is not None
        answers = {choice.index: prepared.plan.stream() for choice in prepared.choices}
        for choice in prepared.choices:
            yield response.chunk(choice.index, {"role": "assistant", "content": ""})
        num_tokens = 0
        async for choice, output in self.runner.merged(prepared, paced=True):
            num_tokens += len(output.new_token_ids)
            answer = answers[choice.index]
            # the text's reasoning, content and tool calls
            delta = answer.push(output.new_text, output.finished, output.finish_reason)
            if delta or (request.logprobs and output.new_logprobs):
                yield response.chunk(choice.index, delta or {"content": ""}, logprobs=output.new_logprobs)
            if output.finished:
                yield response.chunk(choice.index, {}, answer.finish_reason(output.finish_reason))
        if request.include_usage:
            yield response.usage_chunk(self._usage(prepared, num_tokens))

    async def _completion_response(
        self, prepared: PreparedRequest, request: CompletionRequest
    ) -> dict[str, Any]:
        results = await self.runner.collect(prepared)
        if request.echo:
            for choice, result in zip(prepared.choices, results, strict=True):
                result.text = self._echo(request, choice) + result.text
        usage = self._usage(prepared, sum(len(result.token_ids) for result in results))
        response = CompletionResponse(prepared.request_id, prepared.created, request, self.tokenizer)
        return response.body(results, usage)

    async def _completion_chunks(
        self, prepared: PreparedRequest, request: CompletionRequest
    ) -> AsyncIterator[dict[str, Any]]:
        response = CompletionResponse(prepared.request_id, prepared.created, request, self.tokenizer)
        text_offsets = [0] * len(prepared.choices)  # characters of each choice's text sent so far
        if request.echo:
            for choice in prepared.choices:
                text = self._echo(request, choice)
                yield response.chunk(choice.index, text)
                text_offsets[choice.index] = len(text)
        num_tokens = 0
        async for choice, output in self.runner.merged(prepared, paced=True):
            num_tokens += len(output.new_token_ids)
            logprobs, text_offset = output.new_logprobs, text_offsets[choice.index]
            yield response.chunk(choice.index, output.new_text, output.finish_reason, logprobs, text_offset)
            text_offsets[choice.index] += len(output.new_text)
        if request.include_usage:
            yield response.usage_chunk(self._usage(prepared, num_tokens))

    def _echo(self, request: CompletionRequest, choice: Choice) -> str:
        return echo_text(request.prompt_list()[choice.prompt_index], self.tokenizer)


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers())


async def _control_call(response: Any, what: str, timeout_s: float) -> Any:
    """The result of an engine call beyond a request's own (health, info, metrics), or a 503 when the
    engine does not answer within timeout_s: while its replica restarts, Serve holds the call until a new
    one is up (seconds: loading and warm-up), and these must not hang that long."""

    async def result() -> Any:
        return await response

    try:
        return await asyncio.wait_for(result(), timeout_s)
    except TimeoutError:
        response.cancel()
        raise OpenAIError.service_unavailable(
            f"The engine did not answer the {what} within {timeout_s:g} s (it may be restarting); "
            "please retry."
        ) from None
    except Exception as error:  # noqa: BLE001 - the engine replica died, or its check failed
        cause = original_exception(error)
        detail = (str(cause).strip().splitlines() or [""])[0][:200]
        raise OpenAIError.service_unavailable(
            f"The engine is not healthy ({type(cause).__name__}: {detail}); please retry."
        ) from None


def _routing_policy(args: AppArgs, engine: DeploymentHandle) -> RoutingPolicy:
    """This replica's policy for choosing engine replicas, shared with Serve's router of the engine
    handle (deployments/replicas/routing.py); outside Serve (tests), a policy of its own that knows no
    replica, so that Serve, or the stand-in, picks."""
    try:
        app_name = serve.get_replica_context().app_name
    except RayServeException:
        policy = RoutingPolicy()
    else:
        policy = policy_for(app_name, engine.deployment_name)
    policy.configure(
        prefix_aware=args.engine_router == "prefix",
        num_ingress_replicas=args.num_ingress_replicas,
        balance_abs_threshold=max(1, (args.max_num_seqs or 1) // 4),
    )
    return policy
