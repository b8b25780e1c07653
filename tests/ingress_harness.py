"""The ingress's HTTP app without Ray: OpenAIIngress's own class, built with a stand-in for the engine's
DeploymentHandle, served in process through httpx's ASGI transport (tests/test_hardening.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
from prometheus_client.core import GaugeMetricFamily
from tileinfer.deployments.launch.app_args import AppArgs
from tileinfer.deployments.openai_api import ingress as ingress_module
from tileinfer.deployments.replicas.engine_loop import Delta
from tileinfer.deployments.replicas.engine_replica import EngineInfo
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.sampling.params import SamplingParams, TokenLogprob
from tileinfer.engine.text.tokenizer import Tokenizer

MODEL = "smollm2-135m"
INFO = EngineInfo(MODEL, max_model_len=512, max_prompt_tokens=511, vocab_size=49152, device="cpu",
                  dtype="float32", quantization=None, kv_cache_dtype="auto")  # fmt: skip


class _Response:
    """What a handle call returns: awaitable once, cancellable (like Serve's DeploymentResponse)."""

    def __init__(self, call: Any) -> None:
        self._task = asyncio.get_running_loop().create_task(call)
        self.cancelled = False

    def __await__(self):  # noqa: ANN204
        return self._task.__await__()

    def cancel(self) -> None:
        self.cancelled = True
        self._task.cancel()


class _Stream:
    def __init__(self, items: AsyncIterator[list[Delta]]) -> None:
        self._items = items

    def __aiter__(self) -> AsyncIterator[list[Delta]]:
        return self._items

    def cancel(self) -> None:
        pass


class _Method:
    def __init__(self, function: Any, stream: bool = False) -> None:
        self.function, self.stream = function, stream

    def remote(self, *args: Any, replica_id: str | None = None, **kwargs: Any) -> Any:
        # one engine replica, "fake": a call pinned to another would be refused (WrongReplicaError)
        assert replica_id in (None, FakeEngine.REPLICA_ID), replica_id
        call = self.function(*args, **kwargs)
        return _Stream(call) if self.stream else _Response(call)


class FakeEngine:
    """The engine deployment's calls, as an EngineClient and the ingress make them. A request gets the
    tokens of `reply` (one token unless set; at most max_tokens) in one output (piecewise: one a token) and
    ends (finish_reason: "length" unless set), with
    made-up logprobs when it asks for them; `stalled` makes every call wait for ever (an engine replica
    restarting)."""

    REPLICA_ID = "fake"

    def __init__(self, token_id: int) -> None:
        self.reply = [token_id]
        self.finish_reason = "length"  # how each request ends ("stop": the reply ended with a stop token)
        self.piecewise = False  # True: one output per token of the reply, a few milliseconds apart
        self._pieces: list[asyncio.Task] = []
        self.stalled = asyncio.Event()
        self.stalled.set()  # set: not stalled
        self.outputs_queue: asyncio.Queue[list[Delta]] = asyncio.Queue()
        self.submitted: list[tuple[list[int], SamplingParams]] = []

    def options(self, stream: bool = False) -> FakeEngine:
        return _Streaming(self) if stream else self

    async def _wait(self) -> None:
        await self.stalled.wait()

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self, "_" + name))

    async def _info(self) -> EngineInfo:
        await self._wait()
        return INFO

    async def _status(self) -> dict[str, Any]:
        await self._wait()
        return {"replica": self.REPLICA_ID, "engine": "0", "node": "", "state": "ready"}

    async def _metrics(self) -> tuple[list[GaugeMetricFamily], dict]:
        await self._wait()
        waiting = GaugeMetricFamily("tileinfer_num_requests_waiting", "Requests waiting.", labels=["engine"])
        waiting.add_metric(["0"], 0)
        return [waiting], {}  # the families, and the routing counts of the ingress replicas it knows

    async def _submit(
        self, requests: list[tuple[str, list[int], SamplingParams]], _: str
    ) -> list[Exception | None]:
        await self._wait()
        refused: list[Exception | None] = []
        for request_id, prompt, params in requests:
            try:
                params.validate()
                if not prompt or any(not 0 <= token < INFO.vocab_size for token in prompt):
                    raise InvalidRequestError(f"prompt token ids must be in [0, {INFO.vocab_size})")
            except Exception as error:  # noqa: BLE001 - returned, as the engine does
                refused.append(error)
                continue
            refused.append(None)
            self.submitted.append((prompt, params))
            token_ids = self.reply[: params.max_tokens]
            logprobs = None
            if params.logprobs is not None:
                logprobs = [_logprob(token_id, params.logprobs) for token_id in token_ids]
            if self.piecewise:
                delivery = self._deliver_piecewise(request_id, token_ids, logprobs)
                self._pieces.append(asyncio.create_task(delivery))
            else:
                self.outputs_queue.put_nowait([(request_id, token_ids, self.finish_reason, logprobs, None)])
        return refused

    async def _deliver_piecewise(
        self, request_id: str, token_ids: list[int], logprobs: list[TokenLogprob] | None
    ) -> None:
        """A token an output, a few milliseconds apart, as decoding steps deliver them."""
        for position, token_id in enumerate(token_ids):
            await asyncio.sleep(0.005)
            piece = logprobs[position : position + 1] if logprobs else None
            finish_reason = self.finish_reason if position == len(token_ids) - 1 else None
            self.outputs_queue.put_nowait([(request_id, [token_id], finish_reason, piece, None)])

    async def _abort(self, request_id: str, reason: str = "abort") -> None:
        pass

    async def _heartbeat(self, subscriber_id: str, decisions: dict[str, int] | None = None) -> None:
        pass

    async def _outputs(self, subscriber_id: str) -> AsyncIterator[str | list[Delta]]:
        await self._wait()
        yield self.REPLICA_ID
        while True:
            yield await self.outputs_queue.get()


def _logprob(token_id: int, num_top: int) -> TokenLogprob:
    """Made up: the token was the likeliest, at -1.0; the ids after it follow, each 1.0 less likely."""
    return TokenLogprob(token_id, -1.0, top=[(token_id + rank, -1.0 - rank) for rank in range(num_top)])


class _Streaming:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.engine, "_" + name), stream=True)


def make_ingress(tokenizer: Tokenizer, monkeypatch: Any, **args: Any) -> tuple[Any, FakeEngine]:
    """An OpenAIIngress (its own class, not Serve's wrapper) on a FakeEngine, with the args given."""
    monkeypatch.setattr(ingress_module, "load_tokenizer", lambda model: tokenizer)
    engine = FakeEngine(tokenizer.encode("a", add_special_tokens=False)[0])
    cls = ingress_module.OpenAIIngress.func_or_class.__mro__[1]  # the class under Serve's wrapper
    ingress = cls.__new__(cls)
    cls.__init__(
        ingress,
        AppArgs.model_validate({"served_model_name": MODEL, "num_ingress_replicas": 1, **args}),
        engine,
    )
    return ingress, engine


def build(tokenizer: Tokenizer, monkeypatch: Any, **args: Any) -> tuple[httpx.AsyncClient, FakeEngine]:
    """An httpx client of an OpenAIIngress's ASGI app (no Serve), with the args given; call in a loop."""
    ingress, engine = make_ingress(tokenizer, monkeypatch, **args)
    transport = httpx.ASGITransport(app=ingress.__serve_build_asgi_app__(), raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://ingress.test", timeout=30), engine


def openapi_schema(tokenizer: Tokenizer, monkeypatch: Any, **args: Any) -> dict[str, Any]:
    """The /openapi.json an OpenAIIngress with the args given serves (no Serve), its engine's INFO."""

    async def fetch() -> dict[str, Any]:
        client, _ = build(tokenizer, monkeypatch, **args)
        async with client:
            response = await client.get("/openapi.json")
        assert response.status_code == 200, response.text
        return response.json()

    return asyncio.run(fetch())
