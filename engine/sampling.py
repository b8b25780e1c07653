"""Sampling parameters and the torch reference sampler (penalties, temperature, top-k/p, min-p, logprobs)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
# The seeds torch.Generator.manual_seed accepts.
_SEED_RANGE = (-(2**63), 2**64 - 1)


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


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A request's own generator, so its draws do not depend on which requests share its batch."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick the next token of each sequence from its last-position logits [num_seqs, vocab] (float32).

    Order: penalties (repetition, then frequency/presence) -> greedy argmax when temperature == 0 ->
    temperature -> top-k -> top-p -> min-p -> sample. Logprobs describe the raw logits.
    """
    logits = logits.float()
    # vLLM's default: logprobs are the model's own distribution, before penalties and temperature.
    raw_logprobs = torch.log_softmax(logits, dim=-1)

    if any(request.has_penalties for request in params):
        logits = apply_penalties(logits, params, prompt_token_ids, output_token_ids)

    token_ids = logits.argmax(dim=-1)  # the greedy rows' answer; sampled rows are overwritten below
    sampled_rows = [row for row, request in enumerate(params) if not request.is_greedy]
    if sampled_rows:
        row_index = torch.tensor(sampled_rows, device=logits.device)
        probs = filtered_probs(logits[row_index], [params[row] for row in sampled_rows])
        noise = exponential_noise(probs.shape, [generators[row] for row in sampled_rows], logits.device)
        token_ids[row_index] = exponential_race(probs, noise)

    token_id_list = token_ids.tolist()
    return token_id_list, gather_logprobs(raw_logprobs, token_id_list, params)


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Return penalized logits [num_seqs, vocab] (vLLM's semantics, which agree with HF's for repetition)."""
    vocab_size = logits.shape[1]
    output_counts = token_counts(output_token_ids, vocab_size, logits.device)  # [num_seqs, vocab]
    in_prompt = token_counts(prompt_token_ids, vocab_size, logits.device) > 0
    seen = in_prompt | (output_counts > 0)

    def per_row(field: str) -> torch.Tensor:  # [num_seqs, 1]
        values = [getattr(request, field) for request in params]
        return torch.tensor(values, dtype=logits.dtype, device=logits.device).unsqueeze(1)

    # CTRL / HF: a seen token's logit moves toward "less likely" whatever its sign.
    repetition = per_row("repetition_penalty")
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    # OpenAI: frequency scales with how often a token was generated, presence counts it once.
    logits = logits - per_row("frequency_penalty") * output_counts
    logits = logits - per_row("presence_penalty") * (output_counts > 0).to(logits.dtype)
    return logits


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each vocab entry occurs in each row: [num_seqs, vocab] float32."""
    longest = max((len(row) for row in token_ids), default=0)
    # Pad with an extra column (index vocab_size) that is dropped after counting.
    padded = torch.full((len(token_ids), longest), vocab_size, dtype=torch.long)
    for row, ids in enumerate(token_ids):
        padded[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    padded = padded.to(device)
    counts = torch.zeros(len(token_ids), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab_size]


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p: the distribution to sample from, [num_seqs, vocab]."""
    device = logits.device
    temperature = torch.tensor([request.temperature for request in params], device=device).unsqueeze(1)
    logits = logits / temperature
    vocab_size = logits.shape[1]
    # The sort costs more than all the rest on a CPU, so skip it when no row needs it.
    if any(0 < request.top_k < vocab_size or request.top_p < 1 for request in params):
        logits = apply_top_k_top_p(logits, params)
    probs = logits.softmax(dim=-1)

    # min-p drops tokens less likely than min_p times the best one. It comes last as in HF; vLLM applies it
    # before top-k/top-p, which differs only when min-p and top-p are both set.
    min_p = torch.tensor([request.min_p for request in params], device=device).unsqueeze(1)
    probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set the logits that top-k or top-p filter out to -inf; [num_seqs, vocab] in and out."""
    device = logits.device
    vocab_size = logits.shape[1]
    # One descending sort serves both. top-k keeps every token at least as likely as the k-th, ties
    # included (HF and vLLM both do); off (0/-1) or larger than the vocab keeps them all.
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
    top_k = [request.top_k if 0 < request.top_k < vocab_size else vocab_size for request in params]
    kth_logit = sorted_logits.gather(1, torch.tensor(top_k, device=device).unsqueeze(1) - 1)  # [num_seqs, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_logit, -math.inf)

    # top-p keeps the smallest prefix whose mass (within top-k) reaches p; the best token always stays.
    # Rows with top_p == 1 are left alone so float rounding in the cumsum cannot drop their tail.
    top_p = torch.tensor([request.top_p for request in params], device=device).unsqueeze(1)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill((mass_before >= top_p) & (top_p < 1), -math.inf)
    return torch.empty_like(logits).scatter_(1, sorted_index, sorted_logits)


def exponential_noise(
    shape: torch.Size, generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """Exponential(1) noise [num_seqs, vocab]: each seeded row from its own generator, the rest together."""
    noise = torch.empty(shape, device=device)
    unseeded_rows = [row for row, generator in enumerate(generators) if generator is None]
    if unseeded_rows:
        unseeded_index = torch.tensor(unseeded_rows, device=device)
        noise[unseeded_index] = torch.empty(len(unseeded_rows), shape[1], device=device).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return noise


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(p / E) with E ~ Exponential(1) draws token i with probability p_i, with no host sync."""
    # A zero draw would turn a filtered-out token's 0/0 into NaN; the smallest float keeps it at 0.
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: list[int], params: Sequence[SamplingParams]
) -> list[TokenLogprob | None]:
    """The sampled token's logprob and the top N for each row that asked; None for the others."""
    wanted = [request.logprobs for request in params if request.logprobs is not None]
    if not wanted:
        return [None] * len(params)
    top_values, top_ids = logprobs.topk(max(wanted), dim=-1)  # [num_seqs, max N], best first
    sampled = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device).unsqueeze(1)).squeeze(1)
    top_values, top_ids, sampled = top_values.tolist(), top_ids.tolist(), sampled.tolist()

    results: list[TokenLogprob | None] = []
    for row, (request, token_id) in enumerate(zip(params, token_ids, strict=True)):
        if request.logprobs is None:
            results.append(None)
            continue
        top = list(zip(top_ids[row][: request.logprobs], top_values[row][: request.logprobs], strict=True))
        results.append(TokenLogprob(token_id=token_id, logprob=sampled[row], top=top))
    return results
