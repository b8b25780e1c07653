"""One request's state: its tokens, its place in the KV cache, and how it is to be sampled."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from tileinfer.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from tileinfer.engine.sampling.grammar import SequenceGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = dataclasses.field(default_factory=list)  # prompt + generated
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = dataclasses.field(default_factory=list)
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)  # chain hashes of its full blocks
    num_computed_tokens: int = 0  # tokens whose keys and values are in the cache
    num_cached_prompt_tokens: int = 0  # of the prompt, reused from the prefix cache
    finish_reason: str | None = None
    grammar: SequenceGrammar | None = (
        None  # params.grammar's matcher (structured output), at its committed tokens
    )

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose keys and values are not in the cache yet."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
