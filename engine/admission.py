"""Whether the engine can run a request at all: checked when it is added, before it takes any room."""

from __future__ import annotations

from tileinfer.engine.errors import ContextLengthExceededError, InvalidRequestError
from tileinfer.engine.sampling.grammar import Grammars
from tileinfer.engine.sampling.params import SamplingParams


def check_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    has_tokenizer: bool,
    grammars: Grammars | None,
    logit_vocab_size: int,
    max_prompt_tokens: int,
    kv_cache_tokens: int,
) -> None:
    """Raise InvalidRequestError (or ContextLengthExceededError) for a request an engine with these limits
    cannot run: bad parameters, stop strings or a grammar without a tokenizer (the grammar compiled, or
    refused), an empty prompt, token ids past the logits' width, a prompt past the context, or a prompt
    plus max_tokens past the whole KV cache."""
    params.validate()
    if params.stop and not has_tokenizer:
        raise InvalidRequestError("stop strings need a tokenizer, and this engine has none")
    if params.grammar is not None:
        if grammars is None:
            raise InvalidRequestError(
                "structured output needs the model's tokenizer, and this engine has none"
            )
        grammars.check(params.grammar)  # waits for its compile (a worker thread's), at most 10 s
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty")
    # the ids that get logits: a penalty counts each prompt token in a row of that width, and a stop id
    # past them is never generated (the HTTP API's schema publishes this bound:
    # deployments/openai_api/openapi.py)
    checked = (("prompt token ids", prompt_token_ids), ("stop_token_ids", params.stop_token_ids))
    for name, token_ids in checked:
        if any(not 0 <= token < logit_vocab_size for token in token_ids):
            raise InvalidRequestError(f"{name} must be in [0, {logit_vocab_size})")
    num_prompt_tokens = len(prompt_token_ids)
    if num_prompt_tokens > max_prompt_tokens:
        raise ContextLengthExceededError(
            f"the prompt has {num_prompt_tokens} tokens; this model's context holds at most "
            f"{max_prompt_tokens} prompt tokens plus one generated token"
        )
    # Run to max_tokens, a sequence holds prompt + max_tokens tokens at most: the speculator asks for no
    # draft past a request's max_tokens or max_model_len, so drafts add none. More than the whole cache
    # could never finish (it would preempt itself forever), so it is refused here.
    if num_prompt_tokens + params.max_tokens > kv_cache_tokens:
        raise ContextLengthExceededError(
            f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) need "
            f"{num_prompt_tokens + params.max_tokens} tokens, but the KV cache holds {kv_cache_tokens} "
            f"tokens; ask for at most {kv_cache_tokens - num_prompt_tokens} tokens"
        )
