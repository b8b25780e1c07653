"""The engine deployment: one actor that owns the Engine and streams each request's outputs."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator

import torch
from ray import serve

from deployments.config import AppArgs
from deployments.engine_loop import EngineLoop
from engine.engine import Engine, EngineConfig, RequestOutput
from engine.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Accepted:
    """The first item of every stream: the request passed validation and is queued."""

    request_id: str
    num_prompt_tokens: int


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    model_name: str
    max_model_len: int
    max_prompt_tokens: int
    vocab_size: int
    device: str
    dtype: str


@serve.deployment(name="Engine", health_check_period_s=10)
class EngineDeployment:
    def __init__(self, args: AppArgs, device: str, dtype: str) -> None:
        if device == "cpu":
            torch.set_num_threads(os.cpu_count() or 1)  # Ray sets one thread per reserved CPU
        config = EngineConfig(
            block_size=args.block_size,
            kv_cache_tokens=args.kv_cache_tokens,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            dtype=dtype,
            device=device,
        )
        self.engine = Engine.load(args.model, config)
        self.loop = EngineLoop(self.engine, args.max_queue_len)
        self.info_value = EngineInfo(
            model_name=args.model_name,
            max_model_len=self.engine.max_model_len,
            max_prompt_tokens=self.engine.max_prompt_tokens,
            vocab_size=self.engine.spec.vocab_size,
            device=device,
            dtype=dtype,
        )

    def info(self) -> EngineInfo:
        return self.info_value

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[Accepted | list[RequestOutput]]:
        """Stream one request: Accepted, then lists of RequestOutput (one per generated token).

        Each list holds what is ready when the caller asks: the first token goes alone and at once;
        a caller that falls behind gets the tokens that piled up in one item, not one item each.
        Raises InvalidRequestError or CapacityError before the first item. A caller that stops
        reading (its client went away) cancels this generator, which aborts the request.
        """
        request_id, outputs = self.loop.submit(prompt_token_ids, params)
        try:
            yield Accepted(request_id, len(prompt_token_ids))
            finished = False
            while not finished:
                ready = [await outputs.get()]
                while not outputs.empty():
                    ready.append(outputs.get_nowait())
                for output in ready:
                    if isinstance(output, BaseException):
                        raise output
                finished = ready[-1].finished
                yield ready
        finally:
            self.loop.abort(request_id)

    def metrics(self) -> str:
        return self.loop.render_metrics(self.info_value.model_name)

    def check_health(self) -> None:
        if not self.loop.is_alive():
            raise RuntimeError("the engine thread has stopped")

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
