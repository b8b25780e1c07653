"""Warm-up: every kernel variant the engine can launch compiled before it serves, by throwaway requests run
through Engine.add_request/step to the end; the step-cost model's first fit; then the engine as built."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.sampling.params import GrammarSpec, SamplingParams
from tileinfer.kernels.triton_common import specialization_sizes

if TYPE_CHECKING:
    from tileinfer.engine.engine import Engine

_WARM_UP_GRAMMAR = GrammarSpec("regex", "[a-z]+")


def warm_up_engine(engine: Engine, force: bool = False) -> float:
    """Compile every kernel variant the engine can launch, before it serves: run throwaway requests
    through add_request/step to the end, then leave the engine as built (no requests, every block
    free, nothing in the prefix cache, no preemptions, no speculation stats). Returns the seconds.

    The CUDA graphs compiled their kernels at capture; what compiles later are eager launches. Those
    sized by a step's row count (prefills, verify steps' plain rows, DFlash decodes) compile one
    variant per specialization of it (kernels/triton_common.py), so one batch runs per variant;
    sampling parameters are per-row values there, but each variant (greedy, temperature, top-k/p,
    min-p, seeds, penalties, logprobs) takes its own host path, so each runs alone once; a prompt
    longer than the token budget has chunks without logits, which run eagerly, and those cut to the
    time budget run at each step size (_cut_chunks, which also gives the step-cost model its
    first fit); and with a speculator, steps verify greedy and sampled drafts. Its steps are chunked by
    tokens only, and the others teach the step-cost model nothing (they compile). Skipped on the CPU
    (no Triton) unless forced (tests)."""
    if engine.device.type == "cpu" and not force:
        return 0.0
    if engine.has_unfinished():
        raise InvalidRequestError("warm_up runs on an idle engine only")
    started = time.perf_counter()
    config, vocab_size = engine.config, engine.logit_vocab_size  # the ids a prompt may hold and logits have
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    sampled = dataclasses.replace(greedy, temperature=0.8)
    variants = [
        greedy, dataclasses.replace(greedy, logprobs=2), dataclasses.replace(sampled, seed=1),
        dataclasses.replace(sampled, top_k=5), dataclasses.replace(sampled, top_p=0.9),
        dataclasses.replace(sampled, min_p=0.1),
        dataclasses.replace(sampled, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
        dataclasses.replace(greedy, repetition_penalty=1.2, logprobs=1),
    ]  # fmt: skip
    # (prompt length, params) per request; a negative length: one phrase repeated (n-gram drafts)
    batches: list[list[tuple[int, SamplingParams]]] = [[(1, params)] for params in variants]
    # More rows at once: a batch for each other variant Triton compiles for a row count (1 ran above).
    most_rows = min(config.max_num_seqs, engine.max_num_batched_tokens)
    for rows in specialization_sizes(most_rows)[1:]:
        batches.append([(1, variants[row % len(variants)]) for row in range(rows)])
    long_prompt = engine.max_num_batched_tokens + 1  # first chunks of the whole budget, and of it less 2
    if long_prompt <= engine.max_prompt_tokens:
        batches += [[(long_prompt, greedy)], [(2, greedy), (long_prompt, greedy)]]
    if engine.grammars is not None:  # the mask kernel, and llguidance's tokenizer built before serving
        batches.append([(1, dataclasses.replace(greedy, grammar=_WARM_UP_GRAMMAR)), (1, greedy)])
    if engine.speculator is not None:
        drafting = dataclasses.replace(greedy, max_tokens=2 * config.num_draft + 2)
        sampled_drafting = dataclasses.replace(drafting, temperature=0.8, seed=1)
        batches += [[(-16, drafting)], [(-16, drafting), (-16, sampled_drafting), (2, variants[1])]]

    def prompt(index: int, length: int) -> list[int]:
        """Distinct per request, so that none reuses another's KV (the prefix cache is emptied after)."""
        tokens = [(index * 7919 + position * 104729 + 1) % vocab_size for position in range(abs(length))]
        return tokens if length > 0 else [tokens[position % 4] for position in range(-length)]

    count = itertools.count()

    def run(batch: list[tuple[int, SamplingParams]]) -> None:
        request_ids = []
        try:
            for length, params in batch:
                index = next(count)
                tokens = prompt(index, length)[: engine.max_prompt_tokens]
                request_ids.append(engine.add_request(tokens, params, request_id=f"warm-up-{index}"))
            while engine.has_unfinished():
                engine.step()
        finally:
            for request_id in request_ids:  # only when a step raised: finished requests are gone
                engine.abort(request_id)

    scheduler, measuring = engine.scheduler, engine.measuring_steps
    budget_s, scheduler.step_budget_s, engine.measuring_steps = scheduler.step_budget_s, None, False
    try:
        for batch in batches:
            run(batch)
        engine.step_cost.reset()
        if budget_s is not None:
            _cut_chunks(engine, lambda length: prompt(next(count), length), greedy)
    finally:
        scheduler.step_budget_s, engine.measuring_steps = budget_s, measuring
    engine.block_manager.reset_prefix_cache()
    engine.scheduler.num_preemptions = 0
    if engine.speculator is not None:
        engine.speculator.reset_measurements()
    return time.perf_counter() - started


def _cut_chunks(engine: Engine, prompt: Callable[[int], list[int]], params: SamplingParams) -> None:
    """Warm-up's eager chunks of each step size below the token budget, as a long prompt's chunks cut to
    the time budget run them: deep in a prompt (after two whole-budget chunks: at a 2,048-token budget
    4,096 keys, where the prefill kernel splits the keys as it does for chunks deeper still), each
    once to compile its kernels, then all once more, measured: the step-cost model's first fit, so
    that serving starts with chunks cut to the budget. prompt(length): a fresh prompt."""
    scheduler, whole = engine.scheduler, engine.max_num_batched_tokens
    try:
        for measured in (False, True):
            engine.measuring_steps = measured
            for size in scheduler.step_sizes:
                if size >= whole or 2 * whole + size >= engine.max_prompt_tokens:
                    continue
                request_id = engine.add_request(prompt(2 * whole + size + 1), params)
                for chunk in (whole, whole, size):
                    scheduler.max_num_batched_tokens = chunk
                    engine.step()
                engine.abort(request_id)
                while engine.has_unfinished():  # a step launched ahead
                    engine.step()
    finally:
        scheduler.max_num_batched_tokens = whole
