"""The engine deployment: one actor that owns the Engine, and its client in each ingress replica.

Outputs cross once per step per ingress replica, not once per token per request. Each ingress replica
(EngineClient) opens ONE long-lived Serve streaming call, `outputs(subscriber_id)`, and submits and
aborts requests with plain calls. After each step the engine thread puts one list of Delta tuples per
subscriber on that subscriber's queue (deployments/engine_loop.py); the stream yields whatever lists
are ready, joined into one item. So the Ray items per second through this actor follow the step rate
times the number of ingress replicas, where a stream per request made them the step rate times the
number of requests (ray#52746: Serve's per-item cost compounds past ~32 streams), competing for the
GIL with the engine thread.

The engine here runs without text work (EngineConfig.detokenize False): it ends requests on stop
tokens and max_tokens, and the ingress replicas, which scale with num_ingress_replicas, detokenize
and find stop strings (engine.detokenizer.TextStream), aborting a request once its stop string shows.

Failures: a subscriber's stream that ends aborts all its requests here. Serve cancels it when the
ingress replica stops reading or shuts down; Ray does not when the caller's process dies (measured:
a killed ingress replica's requests ran to their end), so a stream whose heartbeats (every
HEARTBEAT_S) stop for SUBSCRIBER_LEASE_S ends too. An engine replica that dies or restarts ends the
ingress's stream, which fails that replica's requests in flight (an OpenAI error, in band once
streaming) and subscribes again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import torch
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.config import AppArgs
from deployments.engine_loop import ENGINE_SWITCH_INTERVAL_S, Delta, EngineLoop, UnknownSubscriberError
from deployments.metrics import render_speculation
from deployments.protocol import OpenAIError
from deployments.serve_logs import route_to_serve
from engine.engine import Engine, EngineConfig
from engine.loader import load_model
from engine.sampling import SamplingParams
from proposers.channel import ChannelCapacity
from proposers.factory import VERIFY_COST_PER_DRAFT
from proposers.remote import RemoteProposer

logger = logging.getLogger(__name__)

ATTACH_AT_START_S = 60.0  # the engine waits this long for its proposer before it serves without one
ATTACH_CALL_TIMEOUT_S = 30.0
PROPOSER_START_S = 600.0  # DFlash: the engine waits this long for the proposer to say what it reads
HEARTBEAT_S = 2.0  # an ingress replica tells the engine this often that it still reads its stream
SUBSCRIBER_LEASE_S = 20.0  # a stream without a heartbeat for this long ends, aborting its requests
T = TypeVar("T")


def _on_loop(loop: asyncio.AbstractEventLoop, call: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    """Make a handle call from a thread other than the replica's: on the replica's event loop, where
    Serve wants its handles used (its throughput-optimized mode runs their router there), waiting here."""

    async def on_the_loop() -> T:
        return await call()

    future = asyncio.run_coroutine_threadsafe(on_the_loop(), loop)
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    model_name: str
    max_model_len: int
    max_prompt_tokens: int
    vocab_size: int
    device: str
    dtype: str
    quantization: str | None
    kv_cache_dtype: str


@serve.deployment(name="Engine", health_check_period_s=10)
class EngineDeployment:
    async def __init__(
        self,
        args: AppArgs,
        device: str,
        dtype: str,
        proposer_handle: DeploymentHandle | None = None,
        draft_ahead: bool = False,
    ) -> None:
        """proposer_handle: the proposer deployment (deployments/proposer.py), when one runs beside;
        draft_ahead: it drafts while this engine verifies, so its drafts cost about nothing here.

        The model loads, and the engine builds and warms up, on a worker thread: the replica's event
        loop stays free for the proposer's attach call (made on that loop) and for Serve's own calls."""
        route_to_serve()
        if device == "cpu":
            torch.set_num_threads(os.cpu_count() or 1)  # Ray sets one thread per reserved CPU
        config = dataclasses.replace(args.engine_config(device, dtype), detokenize=False)  # the ingress does
        if draft_ahead:
            config = dataclasses.replace(config, draft_cost=VERIFY_COST_PER_DRAFT)
        self.proposer: RemoteProposer | None = None
        if proposer_handle is not None:
            loop = asyncio.get_running_loop()

            def attach(channel_name: str) -> None:  # on the RemoteProposer's own thread, never per step
                _on_loop(loop, lambda: proposer_handle.attach.remote(channel_name), ATTACH_CALL_TIMEOUT_S)

            hidden = None
            if args.proposer == "dflash":  # the layers to capture: the engine must know them before it starts
                hidden = await asyncio.wait_for(proposer_handle.hidden_layout.remote(), PROPOSER_START_S)
            # a step carries at most max_num_batched_tokens hidden rows; a longer prompt's cross over several
            capacity = ChannelCapacity(
                max_requests=args.max_num_seqs, max_drafts=args.num_draft,
                max_step_rows=args.max_num_batched_tokens,
            )  # fmt: skip
            self.proposer = RemoteProposer(
                attach, capacity, args.proposer_timeout_s, hidden=hidden, device=config.torch_device(),
                use_ring=args.draft_ring,
            )  # fmt: skip
        self.engine = await asyncio.to_thread(self._build_engine, args.model, config)
        if device != "cpu":  # the engine thread is host-bound there: it must not wait for the GIL
            sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
        self.loop = EngineLoop(self.engine, args.max_queue_len)
        self.info_value = EngineInfo(
            model_name=args.model_name,
            max_model_len=self.engine.max_model_len,
            max_prompt_tokens=self.engine.max_prompt_tokens,
            vocab_size=self.engine.spec.vocab_size,
            device=device,
            dtype=dtype,
            quantization=self.engine.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
        )

    def _build_engine(self, model_source: str, config: EngineConfig) -> Engine:
        """Load, build and warm up (after the proposer attached, so that verify steps warm up too).
        Serve reports the app RUNNING only once the constructor returns, so ready means nothing
        compiles while serving."""
        started = time.perf_counter()
        model = load_model(model_source, config.torch_dtype(), config.torch_device(), config.quantization)
        loaded = time.perf_counter()
        engine = Engine(model, config, proposer=self.proposer)
        built = time.perf_counter()
        if self.proposer is not None and not self.proposer.wait_attached(ATTACH_AT_START_S):
            logger.warning("the proposer has not attached yet; decoding without drafts until it does")
        warm_up_s = engine.warm_up()
        logger.info(
            "model loaded in %.1f s; engine built in %.1f s (CUDA graphs captured); warmed up in %.1f s",
            loaded - started, built - loaded, warm_up_s,
        )  # fmt: skip
        return engine

    def info(self) -> EngineInfo:
        return self.info_value

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, subscriber_id: str
    ) -> None:
        """Queue a request whose outputs go to the subscriber's outputs stream. Raises InvalidRequestError,
        CapacityError, or UnknownSubscriberError when that stream is not open here (this replica
        restarted)."""
        self.loop.submit(request_id, prompt_token_ids, params, subscriber_id)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request: its client went away, or ("stop") its ingress found a stop string."""
        self.loop.abort(request_id, reason)

    async def outputs(self, subscriber_id: str) -> AsyncIterator[list[Delta]]:
        """The subscriber's outputs, one list of Delta per item: an empty list first (the subscription
        is open; submit may follow), then every step's lists that are ready, joined. Ends when the caller
        cancels it or its heartbeats stop, which aborts the subscriber's requests."""
        queue = self.loop.subscribe(subscriber_id)
        watchdog = asyncio.get_running_loop().create_task(self._watch(subscriber_id, queue))
        try:
            yield []
            while True:
                ready = await queue.get()
                while ready is not None and not queue.empty():
                    more = queue.get_nowait()
                    if more is None:
                        ready = None
                    else:
                        ready += more
                if ready is None:  # the watchdog: no heartbeat
                    logger.warning(
                        "subscriber %s sent no heartbeat for %.0f s", subscriber_id, SUBSCRIBER_LEASE_S
                    )
                    return
                yield ready
        finally:
            watchdog.cancel()
            self.loop.unsubscribe(subscriber_id, queue)

    def heartbeat(self, subscriber_id: str) -> None:
        self.loop.heartbeat(subscriber_id)

    async def _watch(self, subscriber_id: str, queue: asyncio.Queue) -> None:
        """Ends the subscriber's stream (a None on its queue) once its heartbeats stop."""
        while not self.loop.lapsed(subscriber_id, SUBSCRIBER_LEASE_S):
            await asyncio.sleep(HEARTBEAT_S)
        queue.put_nowait(None)

    def metrics(self) -> str:
        speculator = self.engine.speculator
        stats, step_cost = (speculator.stats, speculator.step_cost) if speculator else (None, 1.0)
        rows_in_gpu_memory = self.proposer is not None and self.proposer.rows_in_gpu_memory
        speculation = render_speculation(stats, step_cost, rows_in_gpu_memory)
        return self.loop.render_metrics(self.info_value.model_name) + speculation

    def check_health(self) -> None:
        if not self.loop.is_alive():
            raise RuntimeError("the engine thread has stopped")

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
        proposer = getattr(self, "proposer", None)
        if proposer is not None:
            proposer.close()


class EngineClient:
    """An ingress replica's side of the engine: one outputs stream for all of this replica's requests,
    demultiplexed to the queue each request was submitted with, as (tag, Delta) pairs."""

    def __init__(self, engine: DeploymentHandle) -> None:
        self.engine = engine
        self.subscriber_id = uuid.uuid4().hex
        self._routes: dict[str, tuple[asyncio.Queue, Any]] = {}  # request_id -> (queue, tag), while it runs
        self._pump: asyncio.Task | None = None
        self._subscribed: asyncio.Future | None = None
        self._calls: set[asyncio.Task] = set()  # fire-and-forget aborts, kept until sent

    async def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, queue: asyncio.Queue, tag: Any
    ) -> str:
        """Start a request; its Deltas arrive on `queue` as (tag, delta) until one ends it. Raises what
        the engine's submit raises."""
        request_id = uuid.uuid4().hex  # chosen here, so that no output can arrive before its route
        for attempt in range(2):
            await self._subscribe()
            self._routes[request_id] = (queue, tag)
            try:
                await self.engine.submit.remote(request_id, prompt_token_ids, params, self.subscriber_id)
                return request_id
            except UnknownSubscriberError:
                # the engine restarted before this stream noticed: subscribe to the new one, once
                self._routes.pop(request_id, None)
                if attempt or self._pump is None:
                    raise
                self._pump.cancel()
                await asyncio.gather(self._pump, return_exceptions=True)
            except BaseException:  # refused, or cancelled (the engine may have queued it)
                self._routes.pop(request_id, None)
                self._call(lambda: self.engine.abort.remote(request_id))
                raise
        raise AssertionError("unreachable")

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request that has not ended; returns at once (the call goes out in the background)."""
        if self._routes.pop(request_id, None) is not None:
            self._call(lambda: self.engine.abort.remote(request_id, reason))

    def close(self) -> None:
        """End the outputs stream (the engine aborts this replica's requests); from any thread."""
        pump = self._pump
        if pump is not None:
            with contextlib.suppress(RuntimeError):  # its loop has closed: the stream is gone already
                pump.get_loop().call_soon_threadsafe(pump.cancel)

    def _call(self, send: Callable[[], Any]) -> None:
        """Make a handle call that outlives the request it is made for, in an empty context: Serve cancels
        the calls made in a request's context when that request is cancelled (its client went away), and
        an abort cancelled with it left the sequence running to its end (seen in a test run: "CALL abort
        CANCELLED")."""
        response = contextvars.Context().run(send)

        async def wait() -> None:
            with contextlib.suppress(Exception):  # best effort: a dead engine has dropped the request
                await response

        task = asyncio.get_running_loop().create_task(wait())
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _subscribe(self) -> None:
        if self._pump is None or self._pump.done():
            self._subscribed = asyncio.get_running_loop().create_future()
            self._pump = asyncio.get_running_loop().create_task(self._read(self._subscribed))
        await asyncio.shield(self._subscribed)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            # a failure here shows in the outputs stream too (it ends or errors), and is handled there
            with contextlib.suppress(Exception):
                await self.engine.heartbeat.remote(self.subscriber_id)

    async def _read(self, subscribed: asyncio.Future) -> None:
        """Route the outputs stream's Deltas until it ends; then fail the requests it carried."""
        stream = self.engine.options(stream=True).outputs.remote(self.subscriber_id)
        beating = asyncio.get_running_loop().create_task(self._beat())
        error: BaseException = OpenAIError.service_unavailable(
            "the engine stopped while running this request (it restarts); please retry"
        )
        try:
            async for batch in stream:
                if not subscribed.done():
                    subscribed.set_result(None)
                routes = self._routes
                for delta in batch:
                    route = routes.get(delta[0])
                    if route is None:
                        continue  # aborted here
                    if delta[2] is not None or delta[4] is not None:
                        del routes[delta[0]]  # its last
                    route[0].put_nowait((route[1], delta))
        except Exception as failure:  # noqa: BLE001 - the engine replica died or restarted
            logger.warning("the engine's outputs stream failed: %s", failure)
            if not subscribed.done():
                error = failure  # the subscription itself failed: the submit that waits gets the cause
        finally:
            beating.cancel()
            stream.cancel()  # if this task was cancelled: the engine aborts this replica's requests
            routes, self._routes = self._routes, {}
            for request_id, (queue, tag) in routes.items():
                queue.put_nowait((tag, (request_id, [], None, None, error)))
            if not subscribed.done():
                subscribed.set_exception(error)
