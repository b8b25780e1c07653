"""OpenAI's response bodies and stream chunks, built from the request they answer and its outputs.

Plain dicts, in OpenAI's field order (a client that compares bytes sees the same ones each time); the
ingress (deployments/openai_api/ingress.py) collects the outputs and sends what these build.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

from tileinfer.deployments.openai_api.chat_output import ChatOutputPlan
from tileinfer.deployments.openai_api.chat_request import ChatCompletionRequest
from tileinfer.deployments.openai_api.completion_request import CompletionRequest
from tileinfer.deployments.openai_api.logprobs import chat_logprobs_content, completion_logprobs
from tileinfer.engine.sampling.params import TokenLogprob
from tileinfer.engine.text.tokenizer import Tokenizer


@dataclasses.dataclass
class ChoiceResult:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" or "length" (a chat's answer: "tool_calls" too); None while streaming
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def echo_text(prompt: str | list[int], tokenizer: Tokenizer) -> str:
    """The text a completion with echo starts with: the prompt, decoded when it came as token ids."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


@dataclasses.dataclass(frozen=True)
class _Response:
    """What the body or every chunk of one response shares: its id and time, the request it answers
    (the model, whether usage and logprobs were asked for) and the tokenizer that spells the logprobs."""

    id: str
    created: int  # Unix seconds, as OpenAI's `created`
    request: ChatCompletionRequest | CompletionRequest
    tokenizer: Tokenizer

    body_object: ClassVar[str]
    chunk_object: ClassVar[str]

    @property
    def wants_logprobs(self) -> bool:
        return self.request.logprobs_count is not None

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """The last chunk of a stream with include_usage: no choices, the whole request's usage."""
        chunk = self._envelope(self.chunk_object, [])
        chunk["usage"] = usage
        return chunk

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """What every body and chunk holds, in OpenAI's order."""
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.request.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def _body(self, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        body = self._envelope(self.body_object, choices)
        body["usage"] = usage
        return body

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object, [choice])
        if self.request.include_usage:
            chunk["usage"] = None  # OpenAI: every chunk but the last carries a null usage
        return chunk


@dataclasses.dataclass(frozen=True)
class ChatResponse(_Response):
    # what an answer may hold beyond its text (reasoning, tool calls); None: text only
    plan: ChatOutputPlan | None = None

    body_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def body(self, choices: Sequence[ChoiceResult], usage: dict[str, int]) -> dict[str, Any]:
        return self._body([self._choice(choice) for choice in choices], usage)

    def _choice(self, choice: ChoiceResult) -> dict[str, Any]:
        message, finish_reason = {"role": "assistant", "content": choice.text}, choice.finish_reason
        if self.plan is not None:
            message, finish_reason = self.plan.message(choice.text, finish_reason)
        logprobs = None
        if self.wants_logprobs:
            logprobs = {"content": chat_logprobs_content(self.tokenizer, choice.logprobs)}
        return {
            "index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
        }  # fmt: skip

    def chunk(
        self,
        index: int,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        logprobs: Sequence[TokenLogprob] = (),
    ) -> dict[str, Any]:
        """One streamed choice update; its logprobs object only when it has logprobs and they were asked for.

        `delta` is {"role": "assistant", "content": ""} in a choice's first chunk, then {"content": text}.
        """
        formatted = None
        if self.wants_logprobs and logprobs:
            formatted = {"content": chat_logprobs_content(self.tokenizer, logprobs)}
        return self._chunk(
            {"index": index, "delta": delta, "logprobs": formatted, "finish_reason": finish_reason}
        )


class CompletionResponse(_Response):
    body_object = chunk_object = "text_completion"

    def body(self, choices: Sequence[ChoiceResult], usage: dict[str, int]) -> dict[str, Any]:
        """With echo, each ChoiceResult.text already starts with the prompt (see echo_text)."""
        return self._body(
            [
                {
                    "index": choice.index,
                    "text": choice.text,
                    "logprobs": self._logprobs(choice.logprobs) if self.wants_logprobs else None,
                    "finish_reason": choice.finish_reason,
                }
                for choice in choices
            ],
            usage,
        )

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
        text_offset: int = 0,
    ) -> dict[str, Any]:
        """One streamed completion update; `logprobs` None: text without tokens (an echoed prompt).

        `text_offset` is the length of this choice's text sent before `text`, so logprobs offsets index the
        whole text, as in a non-streamed response.
        """
        formatted = None
        if self.wants_logprobs and logprobs is not None:
            formatted = self._logprobs(logprobs, text_offset)
        return self._chunk(
            {"index": index, "text": text, "logprobs": formatted, "finish_reason": finish_reason}
        )

    def _logprobs(self, logprobs: Sequence[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
        return completion_logprobs(
            self.tokenizer,
            logprobs,
            skip_special_tokens=self.request.skip_special_tokens,
            text_offset=text_offset,
        )
