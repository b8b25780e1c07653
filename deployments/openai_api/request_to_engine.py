"""A validated request in the engine's terms: the messages its chat template renders, the tokens to
generate, and one SamplingParams per choice."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tileinfer.deployments.openai_api.chat_request import ChatCompletionRequest
from tileinfer.deployments.openai_api.errors import OpenAIError
from tileinfer.deployments.openai_api.generation_request import GenerationRequest
from tileinfer.deployments.openai_api.structured_output import grammar_for
from tileinfer.deployments.openai_api.tool_calls import fallback_messages, format_for_template
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.sampling.params import SamplingParams


def prompt_too_long(
    request: GenerationRequest, num_prompt_tokens: int, max_model_len: int, at_least: bool = False
) -> OpenAIError:
    """The 400 for a prompt that leaves no room for the completion; at_least: num_prompt_tokens is a
    bound, found without tokenizing the prompt."""
    where = request.prompt_field
    return OpenAIError.context_length_exceeded(
        f"This model's maximum context length is {max_model_len} tokens. However, your {where} "
        f"resulted in {'at least ' if at_least else ''}{num_prompt_tokens} tokens, which leaves no room for "
        f"the completion. Please reduce the length of the {where}.",
        param=where,
    )


def max_tokens_for(request: GenerationRequest, num_prompt_tokens: int, max_model_len: int) -> int:
    """The tokens to generate: as requested, or what is left of the context; 400 when it does not fit."""
    where = request.prompt_field
    if num_prompt_tokens >= max_model_len:
        raise prompt_too_long(request, num_prompt_tokens, max_model_len)
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


def chat_messages_for_template(
    request: ChatCompletionRequest, call_id: Callable[[str], str] = str
) -> list[dict[str, Any]]:
    """The messages as plain dicts for a chat template, which knows "system" but not "developer";
    `call_id` spells a tool call's id as the template wants it."""
    messages = []
    for message in request.messages:
        as_dict: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": message.text if message.text is not None else "",  # an assistant's calls alone
        }
        if message.name is not None:
            as_dict["name"] = message.name
        if message.tool_calls is not None:
            as_dict["tool_calls"] = [
                {"id": call_id(call.id), "type": call.type,
                 "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in message.tool_calls
            ]  # fmt: skip
        if message.tool_call_id is not None:
            as_dict["tool_call_id"] = call_id(message.tool_call_id)
        messages.append(as_dict)
    return messages


def chat_template_input(
    request: ChatCompletionRequest, template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools a chat template renders: tools go to a template that renders them, and into
    a system message (Hermes' format) for one that ignores them."""
    tool_format, renders_tools = format_for_template(template)
    messages = chat_messages_for_template(request, tool_format.template_call_id)
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] or None
    if tools is not None and not renders_tools:
        return fallback_messages(messages, tools), None
    return messages, tools


def _arguments(arguments: str) -> Any:
    """A call's arguments as templates take them: the object (they write it with tojson), or the text
    as sent where it is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
