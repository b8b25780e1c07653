"""Drives an Engine on a thread of its own and hands each step's outputs to asyncio subscribers.

Engine.step() is blocking work (the GPU's or, on the CPU, torch's), so it runs off the event loop.
Callers submit and abort through a locked list of commands. Outputs go back once per step, not once
per token: after a step the engine thread groups that step's outputs by subscriber (an ingress
replica's outputs stream, deployments/replicas/engine_replica.py) and hands every subscriber its batch with
one `call_soon_threadsafe` for the whole step. Host work per token on this thread is what bounded the
service under load (DESIGN.md, "Serving many users"), so a batch holds plain tuples (Delta), which
pickle far cheaper than dataclasses, and the engine here does no detokenizing (the ingress does).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time

from prometheus_client import Metric
from tileinfer.deployments.replicas.metrics import EngineMetrics
from tileinfer.engine.engine import Engine, RequestOutput
from tileinfer.engine.errors import CapacityError, InvalidRequestError, TileInferError
from tileinfer.engine.sampling.params import SamplingParams, TokenLogprob
from tileinfer.engine.spec_decode.speculator import SpeculationStats
from tileinfer.kernels.kv_cache import kv_cache_bytes

logger = logging.getLogger(__name__)

# A thread that wants the GIL gets it from a busy holder only after the switch interval (5 ms by
# default). The engine thread lets go of it at every torch call, so while the event loop's thread
# worked (Serve's streams, submits), each step could wait that long several times. On a GPU the
# deployment sets it shorter; TILEINFER_SWITCH_INTERVAL_S overrides it (for benchmarks).
ENGINE_SWITCH_INTERVAL_S = float(os.environ.get("TILEINFER_SWITCH_INTERVAL_S", "0.0005"))

# One request's share of a step: (request_id, new_token_ids, finish_reason, new_logprobs or None,
# error or None). finish_reason is "stop" (a stop token, the last of new_token_ids) or "length", or
# None while it runs; an error ends the request without a finish reason (the engine's finish_reason
# "error", a grammar that failed, is its error: GrammarFailedError).
Delta = tuple[str, list[int], str | None, list[TokenLogprob] | None, BaseException | None]


class UnknownSubscriberError(TileInferError):
    """A submit for a subscriber whose outputs stream is not open here (this engine replica restarted)."""


@dataclasses.dataclass(eq=False)
class _Subscriber:
    queue: asyncio.Queue  # of list[Delta], one list per step
    loop: asyncio.AbstractEventLoop
    request_ids: set[str] = dataclasses.field(default_factory=set)
    last_seen: float = dataclasses.field(default_factory=time.monotonic)  # its latest heartbeat


@dataclasses.dataclass(eq=False)
class _Stream:
    subscriber: _Subscriber
    arrival_time: float
    first_token_time: float | None = None
    num_tokens: int = 0


class EngineLoop:
    def __init__(
        self, engine: Engine, max_queue_len: int, model_name: str = "", engine_label: str = "0"
    ) -> None:
        """model_name and engine_label: the labels `model` and `engine` of its metrics."""
        self.engine = engine
        self.capacity = engine.config.max_num_seqs + max_queue_len
        self.metrics = EngineMetrics(model_name, engine_label)
        kv_cache, manager = engine.runner.kv_cache, engine.block_manager
        slots = manager.num_blocks * engine.config.block_size
        self._kv_bytes_per_token = kv_cache_bytes(kv_cache) // slots
        self._lock = threading.Lock()  # guards _commands, _streams, _subscribers and metrics
        self._commands: list[tuple] = []
        self._streams: dict[str, _Stream] = {}
        self._subscribers: dict[str, _Subscriber] = {}
        self._wakeup = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="tileinfer-engine", daemon=True)
        self._thread.start()

    # --- called from the event loop -------------------------------------------------------------

    def subscribe(self, subscriber_id: str) -> asyncio.Queue:
        """Open a subscriber's queue: every step puts one list of Delta on it for that step's outputs
        of the subscriber's requests."""
        subscriber = _Subscriber(asyncio.Queue(), asyncio.get_running_loop())
        with self._lock:
            previous = self._subscribers.get(subscriber_id)
            self._subscribers[subscriber_id] = subscriber
        if previous is not None:  # the same subscriber again (its old stream broke): its requests failed
            self._abort_all(previous)
        return subscriber.queue

    def unsubscribe(self, subscriber_id: str, queue: asyncio.Queue) -> None:
        """The subscriber's stream ended (its ingress replica stopped reading, died or restarted):
        abort all its requests."""
        with self._lock:
            subscriber = self._subscribers.get(subscriber_id)
            if subscriber is None or subscriber.queue is not queue:
                return  # replaced by a newer stream of the same subscriber
            del self._subscribers[subscriber_id]
        self._abort_all(subscriber)

    def heartbeat(self, subscriber_id: str) -> None:
        """The subscriber is alive; raises UnknownSubscriberError when its stream is not open here."""
        with self._lock:
            self._open_subscriber(subscriber_id).last_seen = time.monotonic()

    def subscriber_ids(self) -> set[str]:
        with self._lock:
            return set(self._subscribers)

    def lapsed(self, subscriber_id: str, lease_s: float) -> bool:
        """Whether the subscriber sent no heartbeat for lease_s (or is gone). Ray does not cancel a
        streaming call whose caller died (an ingress replica killed mid-stream kept its requests
        running to the end), so the lease is what frees a dead replica's requests."""
        with self._lock:
            subscriber = self._subscribers.get(subscriber_id)
            return subscriber is None or time.monotonic() - subscriber.last_seen > lease_s

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, subscriber_id: str
    ) -> None:
        """Queue a request whose outputs go to the subscriber; raises InvalidRequestError for a bad one
        and CapacityError when full."""
        self.engine.check_request(prompt_token_ids, params)
        with self._lock:
            subscriber = self._open_subscriber(subscriber_id)
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            if len(self._streams) >= self.capacity:
                self.metrics.requests_rejected.inc()
                raise CapacityError(
                    f"the server is at capacity ({self.capacity} requests running or queued); retry later"
                )
            self._streams[request_id] = _Stream(subscriber, time.monotonic())
            subscriber.request_ids.add(request_id)
            self._commands.append(("add", request_id, list(prompt_token_ids), params))
        self._wakeup.set()

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request: its client went away ("abort"), or the ingress found a stop string ("stop",
        counted as such). Its KV blocks are freed before the next step."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                return  # finished already
            stream.subscriber.request_ids.discard(request_id)
            self.metrics.count_finished(reason)
            self._commands.append(("abort", request_id))
        self._wakeup.set()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopped = True
        self._wakeup.set()

    def gauges(self) -> dict[str, tuple[float, str]]:
        """Read under the lock (metric_families), so the queued adds are counted once."""
        manager, scheduler = self.engine.block_manager, self.engine.scheduler
        used = manager.num_blocks - manager.num_free_blocks
        # the scheduler's waiting queue (new and preempted sequences) plus adds the engine thread has not
        # taken yet: never negative, unlike requests known here less those running
        queued = sum(1 for command in self._commands if command[0] == "add")
        return {
            "num_requests_running": (len(scheduler.running), "Sequences holding KV blocks."),
            "num_requests_waiting": (len(scheduler.waiting) + queued, "Requests waiting."),
            "kv_cache_used_blocks": (used, "KV cache blocks referenced by sequences."),
            "kv_cache_total_blocks": (manager.num_blocks, "KV cache blocks in all."),
            "kv_cache_usage_ratio": (used / manager.num_blocks, "Share of KV cache blocks in use."),
            "kv_cache_bytes_per_token": (self._kv_bytes_per_token, "KV cache bytes a token takes."),
        }

    def metric_families(
        self, stats: SpeculationStats | None = None, step_cost: float = 1.0, rows_in_gpu_memory: bool = False
    ) -> list[Metric]:
        """A snapshot of this engine's metrics (EngineMetrics.families), with the speculator's stats and
        step cost and whether DFlash's rows cross in GPU memory, which the deployment knows."""
        with self._lock:
            return self.metrics.families(
                self.gauges(), self.engine.scheduler.num_preemptions, stats, step_cost, rows_in_gpu_memory
            )

    def _open_subscriber(self, subscriber_id: str) -> _Subscriber:
        """The subscriber (under the lock); UnknownSubscriberError when its stream is not open here."""
        subscriber = self._subscribers.get(subscriber_id)
        if subscriber is None:
            raise UnknownSubscriberError(f"no outputs stream is open for subscriber {subscriber_id}")
        return subscriber

    def _abort_all(self, subscriber: _Subscriber) -> None:
        with self._lock:  # the engine thread discards finished ones
            request_ids = list(subscriber.request_ids)
        for request_id in request_ids:
            self.abort(request_id)

    # --- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            with self._lock:
                commands, self._commands = self._commands, []
            failed = [delta for command in commands if (delta := self._apply(command)) is not None]
            if failed:
                self._hand_over(failed)
            if not self.engine.has_unfinished():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:  # a bug or an out-of-memory: fail what is running, keep serving
                logger.exception("engine step failed")
                self._fail_all(error)
                continue
            self._hand_over(self._deltas(outputs))

    def _apply(self, command: tuple) -> tuple[_Subscriber, Delta] | None:
        """Apply one command; a request the engine refuses ends with its error."""
        if command[0] == "abort":
            self.engine.abort(command[1])
            return None
        _, request_id, prompt_token_ids, params = command
        if request_id not in self._streams:
            return None  # aborted before it started
        try:
            self.engine.add_request(prompt_token_ids, params, request_id)
        except TileInferError as error:
            return self._end_with(request_id, error)
        with self._lock:
            self.metrics.prompt_tokens.inc(len(prompt_token_ids))
        return None

    def _deltas(self, outputs: list[RequestOutput]) -> list[tuple[_Subscriber, Delta]]:
        """The step's outputs as Deltas for their subscribers, with the serving metrics they update; the
        outputs of requests aborted while the step ran are dropped."""
        now = time.monotonic()
        metrics = self.metrics
        deltas: list[tuple[_Subscriber, Delta]] = []
        generated = cached = 0  # the step's, counted once: an increment takes a lock
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                if stream.first_token_time is None:
                    stream.first_token_time = now
                    metrics.time_to_first_token.observe(now - stream.arrival_time)
                    cached += output.num_cached_tokens
                stream.num_tokens += len(output.new_token_ids)
                generated += len(output.new_token_ids)
                if output.finished:
                    del self._streams[output.request_id]
                    stream.subscriber.request_ids.discard(output.request_id)
                    metrics.count_finished(output.finish_reason or "stop")
                    if stream.num_tokens > 1:
                        metrics.time_per_output_token.observe(
                            (now - stream.first_token_time) / (stream.num_tokens - 1)
                        )
                logprobs = output.new_logprobs or None
                error = output.error
                finish_reason = output.finish_reason if error is None else None
                deltas.append(
                    (
                        stream.subscriber,
                        (output.request_id, output.new_token_ids, finish_reason, logprobs, error),
                    )
                )
            metrics.generation_tokens.inc(generated)
            metrics.prefix_cache_hit_tokens.inc(cached)
        return deltas

    @staticmethod
    def _hand_over(deltas: list[tuple[_Subscriber, Delta]]) -> None:
        """Group the deltas by subscriber and put each group on its queue: one call_soon_threadsafe per
        event loop (in a Serve replica, one in all) for the whole step."""
        by_loop: dict[asyncio.AbstractEventLoop, dict[asyncio.Queue, list[Delta]]] = {}
        for subscriber, delta in deltas:
            by_loop.setdefault(subscriber.loop, {}).setdefault(subscriber.queue, []).append(delta)
        for loop, batches in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: its subscribers are gone with it
                loop.call_soon_threadsafe(_put_batches, batches)

    def _end_with(self, request_id: str, error: TileInferError) -> tuple[_Subscriber, Delta] | None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                return None
            stream.subscriber.request_ids.discard(request_id)
        return stream.subscriber, (request_id, [], None, None, error)

    def _fail_all(self, error: Exception) -> None:
        failure = TileInferError(f"the engine failed while running this request: {error}")
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.engine.abort(request_id)
        self._hand_over([ended for id_ in request_ids if (ended := self._end_with(id_, failure)) is not None])


def _put_batches(batches: dict[asyncio.Queue, list[Delta]]) -> None:
    for queue, batch in batches.items():
        queue.put_nowait(batch)
