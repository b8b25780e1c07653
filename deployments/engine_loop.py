"""Drives an Engine on a thread of its own and hands each request's outputs to asyncio callers.

Engine.step() is blocking work (the GPU's or, on the CPU, torch's), so it runs off the event
loop. Callers submit and abort through a locked list of commands; outputs go back through each
request's asyncio.Queue, flushed as soon as the step that made them ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid

from deployments.metrics import ServingMetrics
from engine.engine import Engine, RequestOutput
from engine.errors import CapacityError, TileInferError
from engine.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival_time: float
    first_token_time: float | None = None
    num_tokens: int = 0

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineLoop:
    def __init__(self, engine: Engine, max_queue_len: int) -> None:
        self.engine = engine
        self.capacity = engine.config.max_num_seqs + max_queue_len
        self.metrics = ServingMetrics()
        self._lock = threading.Lock()  # guards _commands, _streams and metrics
        self._commands: list[tuple] = []
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="tileinfer-engine", daemon=True)
        self._thread.start()

    # --- called from the event loop -------------------------------------------------------------

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        """Queue a request; raises InvalidRequestError for a bad one and CapacityError when full."""
        self.engine.check_request(prompt_token_ids, params)
        request_id = uuid.uuid4().hex
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop(), time.monotonic())
        with self._lock:
            if len(self._streams) >= self.capacity:
                self.metrics.requests_rejected += 1
                raise CapacityError(
                    f"the server is at capacity ({self.capacity} requests running or queued); retry later"
                )
            self._streams[request_id] = stream
            self._commands.append(("add", request_id, list(prompt_token_ids), params))
        self._wakeup.set()
        return request_id, stream.queue

    def abort(self, request_id: str) -> None:
        """Stop a request (its client went away); its KV blocks are freed before the next step."""
        with self._lock:
            if self._streams.pop(request_id, None) is None:
                return  # finished already
            self.metrics.count_finished("abort")
            self._commands.append(("abort", request_id))
        self._wakeup.set()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopped = True
        self._wakeup.set()

    def gauges(self) -> dict[str, tuple[float, str]]:
        manager, scheduler = self.engine.block_manager, self.engine.scheduler
        used = manager.num_blocks - manager.num_free_blocks
        return {
            "num_requests_running": (len(scheduler.running), "Sequences holding KV blocks."),
            "num_requests_waiting": (len(self._streams) - len(scheduler.running), "Requests waiting."),
            "kv_cache_used_blocks": (used, "KV cache blocks referenced by sequences."),
            "kv_cache_total_blocks": (manager.num_blocks, "KV cache blocks in all."),
            "kv_cache_usage_ratio": (used / manager.num_blocks, "Share of KV cache blocks in use."),
        }

    def render_metrics(self, model_name: str) -> str:
        with self._lock:
            return self.metrics.render(self.gauges(), model_name, self.engine.scheduler.num_preemptions)

    # --- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            with self._lock:
                commands, self._commands = self._commands, []
            for command in commands:
                self._apply(command)
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
            self._deliver(outputs)

    def _apply(self, command: tuple) -> None:
        if command[0] == "abort":
            self.engine.abort(command[1])
            return
        _, request_id, prompt_token_ids, params = command
        if request_id not in self._streams:
            return  # aborted before it started
        try:
            self.engine.add_request(prompt_token_ids, params, request_id)
        except TileInferError as error:
            with self._lock:
                stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(error)
            return
        with self._lock:
            self.metrics.prompt_tokens += len(prompt_token_ids)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        metrics = self.metrics
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue  # aborted while the step ran
                if stream.first_token_time is None:
                    stream.first_token_time = now
                    metrics.time_to_first_token.observe(now - stream.arrival_time)
                    metrics.prefix_cache_hit_tokens += output.num_cached_tokens
                stream.num_tokens += len(output.new_token_ids)
                metrics.generation_tokens += len(output.new_token_ids)
                if output.finished:
                    del self._streams[output.request_id]
                    metrics.count_finished(output.finish_reason or "stop")
                    if stream.num_tokens > 1:
                        metrics.time_per_output_token.observe(
                            (now - stream.first_token_time) / (stream.num_tokens - 1)
                        )
                stream.put(output)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self.engine.abort(request_id)
            stream.put(TileInferError(f"the engine failed while running this request: {error}"))
