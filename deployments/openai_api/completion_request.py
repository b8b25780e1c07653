"""The legacy completions request (`POST /v1/completions`): a prompt or a batch of them, as text or token
ids, with the fields chat shares (generation_request.py)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator
from tileinfer.deployments.openai_api.errors import OpenAIError
from tileinfer.deployments.openai_api.generation_request import MAX_CHOICES, GenerationRequest
from tileinfer.deployments.openai_api.request_model import TOKEN_ID_SCHEMA, field_given

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions endpoint

# The prompt's schema says what _non_empty_prompts checks: no empty text or list, no negative token id (and
# what the engine checks: none past the vocabulary); and that a batch (texts, or lists of token ids) holds
# at most MAX_CHOICES prompts. prompts x n <= MAX_CHOICES (_consistent_fields) it says in words: JSON Schema
# cannot multiply, and spelling out each n's batch size (about 20 if/then pairs) is more than schemathesis'
# generator can take.
_TEXT_SCHEMA = {"type": "string", "minLength": 1}
_TOKEN_IDS_SCHEMA = {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1}
_PROMPT_SCHEMA = {
    "description": f"a text, token ids, or a batch of either; prompts x n at most {MAX_CHOICES}",
    "anyOf": [
        _TEXT_SCHEMA,
        {"type": "array", "items": _TEXT_SCHEMA, "minItems": 1, "maxItems": MAX_CHOICES},
        _TOKEN_IDS_SCHEMA,
        {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1, "maxItems": MAX_CHOICES},
    ],
}


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        json_schema_extra=lambda schema: schema.update(_PROMPT_SCHEMA)
    )
    max_tokens: int = Field(16, ge=1)  # OpenAI's default for this endpoint
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False

    prompt_field: ClassVar[str] = "prompt"
    # best_of: only 1 (one candidate per choice), as vLLM's V1 engine takes it
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "logit_bias": ({},), "suffix": ("",), "best_of": (1,),
    }  # fmt: skip
    ignored_fields: ClassVar[frozenset[str]] = frozenset({"user"})
    # _consistent_fields: no logprobs with echo
    schema_constraints: ClassVar[tuple[dict[str, Any], ...]] = (
        *GenerationRequest.schema_constraints,
        {"if": field_given("echo", {"const": True}), "then": {"properties": {"logprobs": {"type": "null"}}}},
    )

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompts(
        cls, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        # An empty text is refused whatever the tokenizer: vLLM refuses an empty prompt (unless its
        # tokenizer adds a BOS token), and this way the answer and the schema do not depend on the model.
        if not prompt or (not isinstance(prompt, str) and any(part in ("", []) for part in prompt)):
            raise ValueError("a prompt must not be empty")
        if isinstance(prompt, str):
            return prompt
        token_ids = [part for part in prompt if isinstance(part, int)]
        token_ids += [token_id for part in prompt if isinstance(part, list) for token_id in part]
        if any(token_id < 0 for token_id in token_ids):
            raise ValueError("token ids must not be negative")
        return prompt

    @model_validator(mode="after")
    def _consistent_fields(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise OpenAIError.unsupported("echo", " together with logprobs (prompt logprobs)")
        if len(self.prompt_list()) * self.n > MAX_CHOICES:
            raise OpenAIError.invalid_request(
                f"prompts x n must be at most {MAX_CHOICES}, got {len(self.prompt_list())} x {self.n}",
                param="n",
            )
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """The batch of prompts, each text or token ids; the choices are n per prompt, in this order."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs
