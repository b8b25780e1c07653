"""A validated request in the engine's terms: the messages its chat template renders, the tokens to
generate, and one SamplingParams per choice."""

from __future__ import annotations

from typing import Any

from deployments.errors import OpenAIError
from deployments.requests import ChatCompletionRequest, GenerationRequest
from deployments.structured_output import grammar_for
from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams


def max_tokens_for(request: GenerationRequest, num_prompt_tokens: int, max_model_len: int) -> int:
    """The tokens to generate: as requested, or what is left of the context; 400 when it does not fit."""
    where = request.prompt_field
    if num_prompt_tokens >= max_model_len:
        raise OpenAIError.context_length_exceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, your {where} "
            f"resulted in {num_prompt_tokens} tokens, which leaves no room for the completion. "
            f"Please reduce the length of the {where}.",
            param=where,
        )
    requested = request.requested_max_tokens
    if requested is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + requested > max_model_len:
        raise OpenAIError.context_length_exceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {where}, {requested} in "
            f"the completion). Please reduce the length of the {where} or completion.",
            param=where,
        )
    return requested


def sampling_params_for(request: GenerationRequest, choice_index: int, max_tokens: int) -> SamplingParams:
    """The engine's parameters for one choice; `choice_index` counts the n choices of one prompt.

    With a seed, choice i uses seed + i: the n choices differ, and each is reproducible.
    """
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        seed=None if request.seed is None else request.seed + choice_index,
        stop=request.stop_sequences,
        stop_token_ids=tuple(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        logprobs=request.logprobs_count,
        skip_special_tokens=request.skip_special_tokens,
        grammar=grammar_for(request.response_format, request.structured_outputs),
    )
    try:
        params.validate()
    except InvalidRequestError as error:
        # SamplingParams.validate() starts each message with the field's name
        field_name = str(error).split(" ", 1)[0]
        if field_name == "logprobs" and isinstance(request, ChatCompletionRequest):
            field_name = "top_logprobs"
        raise OpenAIError.invalid_request(str(error), param=field_name) from None
    return params


def chat_messages_for_template(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as plain dicts for a chat template, which knows "system" but not "developer"."""
    messages = []
    for message in request.messages:
        as_dict: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": message.text,
        }
        if message.name is not None:
            as_dict["name"] = message.name
        messages.append(as_dict)
    return messages
