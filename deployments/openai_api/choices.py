"""A request's choices at the ingress: one engine request each, all accepted or none run; the token ids that
come back read into text here (tileinfer.engine.text.detokenizer.TextStream, which finds stop strings), and
each choice's outputs joined into one per response chunk.

A stop string ends its choice at once (finish_reason "stop"): no text, token or logprob past the token that
completed it is returned or counted, and the engine request is aborted (it stops within a step). A stream's
chunks are paced: all the streams of the ingress replicas together send at most max_stream_events_per_s
events, each carrying every token of its choice that arrived meanwhile, with no batching timer before the
first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from tileinfer.deployments.launch.app_args import AppArgs
from tileinfer.deployments.openai_api.chat_output import ChatOutputPlan
from tileinfer.deployments.openai_api.errors import openai_error_from
from tileinfer.deployments.openai_api.generation_request import GenerationRequest
from tileinfer.deployments.openai_api.request_to_engine import max_tokens_for, sampling_params_for
from tileinfer.deployments.openai_api.responses import ChoiceResult
from tileinfer.deployments.replicas.engine_client import EngineClient, Inbox
from tileinfer.deployments.replicas.engine_loop import Delta
from tileinfer.deployments.replicas.routing import block_keys
from tileinfer.engine.engine import RequestOutput
from tileinfer.engine.text.detokenizer import TextStream
from tileinfer.engine.text.tokenizer import Tokenizer


@dataclasses.dataclass(eq=False)
class Choice:
    index: int
    prompt_index: int
    num_prompt_tokens: int
    text: TextStream
    engine_request_id: str = ""
    finished: bool = False


@dataclasses.dataclass
class PreparedRequest:
    """A validated request, tokenized, with one engine request per choice; their Deltas arrive on
    `outputs` as (choice, delta)."""

    request_id: str
    created: int
    prompts: list[list[int]]
    choices: list[Choice]
    outputs: Inbox
    plan: ChatOutputPlan | None = None  # a chat's: the reasoning and tool calls its answers may hold


class ChoiceRunner:
    """Runs requests' choices on the engine replicas through this ingress replica's EngineClient."""

    def __init__(self, client: EngineClient, tokenizer: Tokenizer, args: AppArgs) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.args = args
        self.open_streams = 0  # streamed responses being sent (paced: merged)

    async def submit(
        self,
        request: GenerationRequest,
        prompts: list[list[int]],
        max_model_len: int,
        kind: str,
        plan: ChatOutputPlan | None = None,
    ) -> PreparedRequest:
        """Start one engine request per choice; every one must be accepted, or none runs."""
        outputs = Inbox()
        choices: list[Choice] = []
        try:
            for prompt_index, prompt in enumerate(prompts):
                keys = block_keys(prompt, self.args.block_size) if self.client.policy.uses_prefixes() else []
                max_tokens = max_tokens_for(request, len(prompt), max_model_len)
                for sample_index in range(request.n):
                    params = sampling_params_for(request, sample_index, max_tokens)
                    if plan is not None:
                        params = plan.constrain(params)
                    outputs.eager |= bool(params.stop)  # stop strings: read each token as it comes
                    text = TextStream(self.tokenizer, params.stop, params.skip_special_tokens)
                    choice = Choice(len(choices), prompt_index, len(prompt), text)
                    # stop strings are found here, as the text is made
                    engine_params = dataclasses.replace(params, stop=())
                    choice.engine_request_id = await self.client.submit(
                        prompt, engine_params, outputs, choice, keys
                    )
                    choices.append(choice)
        except BaseException as error:
            for choice in choices:
                self.client.abort(choice.engine_request_id)
            if isinstance(error, asyncio.CancelledError):
                raise
            raise openai_error_from(error, prompt_param=request.prompt_field) from None
        return PreparedRequest(
            f"{kind}-{uuid.uuid4().hex}", int(time.time()), prompts, choices, outputs, plan
        )

    async def merged(
        self, prepared: PreparedRequest, paced: bool = False
    ) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Each choice's output that is ready, all its Deltas so far joined into one, in the order the
        choices' first Deltas arrived; aborts what still runs when left early.

        paced (a stream): the next outputs come no sooner than event_interval_s() after the last, and
        carry every token that arrived meanwhile. Deltas are read (and stop strings found) as they
        arrive; only the yield waits. The first output, and the one that ends the request, never wait."""
        remaining = len(prepared.choices)
        loop = asyncio.get_running_loop()
        joined: dict[Choice, RequestOutput] = {}
        next_yield = None  # loop time; None: the next output goes out as soon as it arrives
        self.open_streams += paced
        try:
            while remaining:
                for choice, delta in await prepared.outputs.take(next_yield if joined else None):
                    if choice.finished:
                        continue  # past its stop string
                    output = self._text_of(choice, delta)
                    if choice in joined:
                        _join(joined[choice], output)
                    else:
                        joined[choice] = output
                    remaining -= output.finished
                if joined and (next_yield is None or not remaining or loop.time() >= next_yield):
                    for item in joined.items():
                        yield item
                    joined = {}
                    next_yield = loop.time() + self.event_interval_s() if paced else None
        finally:
            self.open_streams -= paced
            for choice in prepared.choices:
                if not choice.finished:
                    self.client.abort(choice.engine_request_id)

    def event_interval_s(self) -> float:
        """The least time between one stream's events: all streams' events together (this replica's open
        streams, as many in each ingress replica) stay within max_stream_events_per_s."""
        rate = self.args.max_stream_events_per_s
        return self.open_streams * self.args.num_ingress_replicas / rate if rate else 0.0

    async def collect(self, prepared: PreparedRequest) -> list[ChoiceResult]:
        """Every choice's whole result, for a response that is not streamed."""
        results = [ChoiceResult(choice.index, "", [], None, []) for choice in prepared.choices]
        async for choice, output in self.merged(prepared):
            result = results[choice.index]
            result.text += output.new_text
            result.token_ids += output.new_token_ids
            result.logprobs += output.new_logprobs
            result.finish_reason = output.finish_reason or result.finish_reason
        return results

    def _text_of(self, choice: Choice, delta: Delta) -> RequestOutput:
        """A Delta's text; cut at a stop string, which ends the choice (and aborts its engine request)."""
        request_id, token_ids, finish_reason, logprobs, error = delta
        if error is not None:
            raise openai_error_from(error)
        text = choice.text
        parts: list[str] = []
        # an engine's "stop" is a stop token, the last; it shows no text
        num_with_text = len(token_ids) - (finish_reason == "stop")
        for position in range(num_with_text):
            parts.append(text.push(token_ids[position]))
            if text.stopped:
                self.client.abort(request_id, "stop")  # a no-op when the engine has ended it too
                token_ids, finish_reason = token_ids[: position + 1], "stop"
                logprobs = logprobs[: position + 1] if logprobs else None
                break
        else:
            if finish_reason is not None:
                parts.append(text.finish(flush=finish_reason == "length"))
        choice.finished = finish_reason is not None
        return RequestOutput(
            request_id, token_ids, "".join(parts), choice.finished, finish_reason,
            choice.num_prompt_tokens, 0, logprobs or [],
        )  # fmt: skip


def _join(output: RequestOutput, later: RequestOutput) -> None:
    """Append a later output of the same choice to `output`."""
    output.new_token_ids = output.new_token_ids + later.new_token_ids
    output.new_text += later.new_text
    output.new_logprobs = output.new_logprobs + later.new_logprobs
    output.finished, output.finish_reason = later.finished, later.finish_reason
