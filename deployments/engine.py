"""The engine deployment: one actor that owns the Engine and streams each request's outputs."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import torch
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.config import AppArgs
from deployments.engine_loop import EngineLoop
from deployments.metrics import render_speculation
from engine.engine import Engine, RequestOutput
from engine.loader import load_model
from engine.sampling import SamplingParams
from proposers.channel import ChannelCapacity
from proposers.factory import VERIFY_COST_PER_DRAFT
from proposers.remote import RemoteProposer

logger = logging.getLogger(__name__)

ATTACH_AT_START_S = 60.0  # the engine waits this long for its proposer before it serves without one
ATTACH_CALL_TIMEOUT_S = 30.0
PROPOSER_START_S = 600.0  # DFlash: the engine waits this long for the proposer to say what it reads
T = TypeVar("T")


def _off_the_event_loop(call: Callable[[], T]) -> T:
    """Run a blocking handle call on a thread of its own: a replica's constructor runs on its event loop,
    where Serve refuses a call that waits for a result."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(call).result()


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
    def __init__(
        self,
        args: AppArgs,
        device: str,
        dtype: str,
        proposer_handle: DeploymentHandle | None = None,
        draft_ahead: bool = False,
    ) -> None:
        """proposer_handle: the proposer deployment (deployments/proposer.py), when one runs beside;
        draft_ahead: it drafts while this engine verifies, so its drafts cost about nothing here."""
        if device == "cpu":
            torch.set_num_threads(os.cpu_count() or 1)  # Ray sets one thread per reserved CPU
        config = args.engine_config(device, dtype)
        if draft_ahead:
            config = dataclasses.replace(config, draft_cost=VERIFY_COST_PER_DRAFT)
        self.proposer: RemoteProposer | None = None
        if proposer_handle is not None:

            def attach(channel_name: str) -> None:  # on the RemoteProposer's own thread, never per step
                proposer_handle.attach.remote(channel_name).result(timeout_s=ATTACH_CALL_TIMEOUT_S)

            hidden = None
            if args.proposer == "dflash":  # the layers to capture: the engine must know them before it starts
                hidden = _off_the_event_loop(
                    lambda: proposer_handle.hidden_layout.remote().result(timeout_s=PROPOSER_START_S)
                )
            # a step carries at most max_num_batched_tokens hidden rows; a longer prompt's cross over several
            capacity = ChannelCapacity(
                max_requests=args.max_num_seqs, max_drafts=args.num_draft,
                max_step_rows=args.max_num_batched_tokens,
            )  # fmt: skip
            self.proposer = RemoteProposer(
                attach, capacity, args.proposer_timeout_s, hidden=hidden, device=config.torch_device(),
                use_ring=args.draft_ring,
            )  # fmt: skip
        model = load_model(args.model, dtype=config.torch_dtype(), device=config.torch_device())
        built = time.perf_counter()
        self.engine = Engine(model, config, proposer=self.proposer)
        built = time.perf_counter() - built
        if self.proposer is not None and not self.proposer.wait_attached(ATTACH_AT_START_S):
            logger.warning("the proposer has not attached yet; decoding without drafts until it does")
        # after the proposer attached, so that verify steps warm up too; Serve reports the app RUNNING
        # only once this constructor returns, so ready means nothing compiles while serving
        warm_up_s = self.engine.warm_up()
        logger.info("engine built in %.1f s (CUDA graph capture included); warmed up in %.1f s", built,
                    warm_up_s)  # fmt: skip
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
