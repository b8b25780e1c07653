"""A request's sampling parameters and their validation, and a sampled token's logprobs (the sampler itself:
engine/sampling/sampler.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from tileinfer.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
# The seeds accepted: any 64-bit integer, signed or not (Philox is keyed by its low 64 bits).
_SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What a constrained request's output must match (compiled by llguidance, engine/sampling/grammar.py).

    json: a JSON Schema as JSON text (`{"type": "object"}` for any JSON object); regex: a regular expression;
    choice: a JSON list of strings; lark: a Lark grammar as llguidance takes it (it may embed `%json {...}`).
    Hashable, so it keys the compile cache."""

    kind: Literal["json", "regex", "choice", "lark"]
    source: str


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF/CTRL semantics, over prompt + generated tokens
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; N = the sampled token's logprob and the top N (0..20)
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None  # None = unconstrained

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field outside its allowed range."""
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature, 0.0, 2.0)  # OpenAI's range
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, low=-1, note="-1 or 0 turns it off")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, low=_SEED_RANGE[0], high=_SEED_RANGE[1])
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if isinstance(self.stop, str) or not all(isinstance(text, str) and text for text in self.stop):
            raise InvalidRequestError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0)


def _check_int(name: str, value: object, low: int, high: int | None = None, note: str = "") -> None:
    allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    in_range = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if not in_range or (high is not None and value > high):
        extra = f" ({note})" if note else ""
        raise InvalidRequestError(f"{name} must be {allowed}{extra}, got {value!r}")


def _check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    bracket = "(" if low_open else "["
    allowed = f"> {low:g}" if math.isinf(high) else f"in {bracket}{low:g}, {high:g}]"
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    # NaN fails every comparison and isfinite rejects inf, so neither passes.
    above_low = is_number and (low < value if low_open else low <= value)
    if not (above_low and math.isfinite(value) and value <= high):
        raise InvalidRequestError(f"{name} must be a finite number {allowed}, got {value!r}")


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the N most likely (token_id, logprob), best first
