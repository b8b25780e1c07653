"""A long prompt's chunks follow what a step costs (engine/scheduler.py's time budget, engine/step_cost.py):
the step-cost model fitted to measured steps, the chunks it allows alone, deep in a prompt and beside other
prompts, its slow start; then the engine with the app's CPU settings on the real SmolLM2-135M, where a short
request sent during a long prefill gets its first token within a few of its own step times."""

from __future__ import annotations

import statistics
import time

import pytest
from test_scheduler_partial_prefill import _run, _seq, _split  # the scheduler's tests' own steps
from tileinfer.deployments.launch.app_args import AppArgs, parse_app_args
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.graph_buckets import step_sizes
from tileinfer.engine.kv.block_manager import BlockManager
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.scheduler import Batch, Scheduler
from tileinfer.engine.step import StepWork
from tileinfer.engine.step_cost import StepCostModel

BUDGET_S = 0.050


def _seconds(work: StepWork) -> float:
    """A device where a step costs 10 ms, 0.1 ms a token and 20 ns a (query, key) pair."""
    return 0.010 + 1e-4 * work.tokens + 2e-8 * work.attended


def _trained() -> StepCostModel:
    """A model that has measured steps of several sizes and contexts on that device."""
    model = StepCostModel()
    for tokens in (1, 16, 256, 2048):
        for context in (0, 4096, 12288):
            work = StepWork().plus_row(context, tokens)
            model.observe(work, _seconds(work))
    return model


def _scheduler(cost: StepCostModel, budget_s: float | None = BUDGET_S) -> Scheduler:
    """make run's token settings (2,048 a step, long above 512), with a time budget."""
    return Scheduler(
        BlockManager(num_blocks=2048, block_size=16), 8, 2048, max_model_len=1 << 15,
        step_budget_s=budget_s, step_cost=cost, step_sizes=step_sizes(2048),
    )  # fmt: skip


def test_the_model_fits_the_measured_steps() -> None:
    model = _trained()
    for context, tokens in ((0, 64), (8000, 512), (15000, 2048)):
        work = StepWork().plus_row(context, tokens)
        assert model.predict(work) == pytest.approx(_seconds(work), rel=1e-3)
    assert StepCostModel().predict(StepWork(1, 1, 1)) is None  # nothing measured: no prediction


def test_one_slow_step_does_not_undo_the_fit() -> None:
    model = _trained()
    work = StepWork().plus_row(100, 512)
    model.observe(work, 100 * _seconds(work))  # a kernel compiled in it
    assert model.predict(work) == pytest.approx(_seconds(work), rel=0.25)


def test_a_long_prompt_alone_takes_the_chunk_that_fits_the_budget() -> None:
    """Without a time budget the whole step budget; with one, the largest step size whose step is predicted
    to end within it, smaller deeper in the prompt, where each token attends to more keys."""
    long = _seq("long", 16384)
    untimed = _scheduler(_trained(), budget_s=None)
    untimed.add(long)
    assert _split(untimed.schedule()) == [("long", 2048)]

    scheduler = _scheduler(_trained())
    scheduler.add(_seq("long", 16384, first_token=1))
    # 0.01 + 1e-4 x + 1e-8 x (x + 1) <= 0.05: x <= 385 tokens, so 256
    assert _split(scheduler.schedule()) == [("long", 256)]
    scheduler.running[0].num_computed_tokens = 12288
    # ... + 2e-8 * 12288 x: x <= 112, so 64
    batch = scheduler.schedule()
    assert _split(batch) == [("long", 64)]
    assert _seconds(StepWork.of(batch.scheduled)) <= BUDGET_S


def test_a_long_prompts_last_chunk_is_cut_too() -> None:
    """The last 400 tokens of a 16k prompt (fewer than the 512 that make a prompt long) cost 0.01 + 0.04 +
    0.13 s: they are cut too, where a short prompt of 400 runs whole (and the long one sits that out)."""
    scheduler = _scheduler(_trained())
    long = _seq("long", 16384)
    scheduler.add(long)
    _run(scheduler.schedule())
    long.num_computed_tokens = 16384 - 400
    batch = scheduler.schedule()
    assert _split(batch) == [("long", 64)]
    _run(batch)
    scheduler.add(_seq("short", 400, first_token=2))
    assert _split(scheduler.schedule()) == [("short", 400)]


def test_prompts_beside_a_long_one_leave_it_what_the_budget_holds() -> None:
    """A short prompt sent during a long prefill runs whole in the next step; the long prompt takes what
    the step's time budget has left, the step ending on a step size."""
    scheduler = _scheduler(_trained())
    long = _seq("long", 16384)
    scheduler.add(long)
    _run(scheduler.schedule())
    scheduler.add(_seq("short", 100, first_token=2))
    batch = scheduler.schedule()
    # the short prompt costs 0.01 + 0.01 + ...: the long one gets 156, the step 256 tokens
    assert _split(batch) == [("long", 156), ("short", 100)]
    assert _seconds(StepWork.of(batch.scheduled)) <= BUDGET_S


def test_prompts_that_spend_the_budget_leave_the_long_one_out_once_then_an_efficient_chunk() -> None:
    """Prompts that spend the whole budget start without the long prompt; in the next such step it takes
    the fewest tokens that cost what its step costs anyway (the 10 ms fixed cost): it sits out no two steps
    running, and progresses at half its best speed or more."""
    scheduler = _scheduler(_trained())
    long = _seq("long", 16384)
    scheduler.add(long)
    _run(scheduler.schedule())
    shorts = [_seq(f"short-{index}", 500, first_token=3 + index) for index in range(6)]
    for seq in shorts[:3]:
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert _split(batch) == [("short-0", 500), ("short-1", 500), ("short-2", 500)]
    _run(batch)
    for seq in shorts[3:]:
        scheduler.add(seq)
    batch = scheduler.schedule()
    chunk = batch.scheduled[3].num_new_tokens
    decodes = [(seq.request_id, 1) for seq in shorts[:3]]
    assert _split(batch) == [*decodes, ("long", chunk), *((seq.request_id, 500) for seq in shorts[3:])]

    def chunk_cost(tokens: int) -> float:
        return _seconds(StepWork().plus_row(long.num_computed_tokens, tokens)) - _seconds(StepWork())

    assert chunk_cost(chunk - 1) < 0.010 <= chunk_cost(chunk)


def test_a_fresh_engine_starts_a_long_prompt_with_chunks_that_double() -> None:
    """Before the model has measured anything, a step takes at most twice the most tokens measured yet."""
    cost = StepCostModel()
    scheduler = _scheduler(cost)
    scheduler.add(_seq("long", 16384))
    chunks = []
    for _ in range(6):
        batch = scheduler.schedule()
        chunks.append(batch.scheduled[0].num_new_tokens)
        work = StepWork.of(batch.scheduled)
        _run(batch)
        cost.observe(work, _seconds(work))
    assert chunks == [16, 32, 64, 128, 256, 256]  # then what the budget holds (at this context: 256)


# --- the engine, with the app's settings on the CPU, on the real SmolLM2-135M ---------------------------

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _timed_step(engine: Engine) -> tuple[float, set[str]]:
    """One engine step: its seconds, and the requests it gave a token."""
    started = time.perf_counter()
    outputs = engine.step()
    return time.perf_counter() - started, {output.request_id for output in outputs}


def test_a_short_request_sent_during_a_long_prefill_gets_its_first_token_within_a_few_of_its_steps(
    smollm2_model: LoadedModel,
) -> None:
    """make run's scheduling on the CPU (2,048 tokens a step, the CPU's time budget). A request sent as a
    step of a long prefill starts waits for that whole step, then gets its first token from its own. The
    long prompt's chunks are cut to the budget (and no smaller than an efficient chunk, which costs about
    the step's fixed cost), and it sits out a step that starts a prompt and cannot also hold its chunk: so
    the two steps together cost a few of what the request's own step costs alone, where 2,048-token
    chunks cost a hundred and more. Three requests, one a few steps after the other (the machine is
    shared: each gets a wide margin, their median a narrower one)."""
    config = AppArgs(kv_cache_tokens=4096).engine_config("cpu", "float32")
    assert config.max_num_batched_tokens == 2048
    engine = Engine(smollm2_model, config)
    tokenizer = smollm2_model.tokenizer
    names = ("Ann", "Bo", "Cy", "Di", "Ed", "Flo")  # ten tokens or so each, none in the prefix cache
    shorts = [tokenizer.encode(f"{name}: name a colour of the sky.") for name in names]
    alone = []
    for index, short in enumerate(shorts[:3]):
        engine.add_request(short, FIRST_TOKEN, request_id=f"alone-{index}")
        seconds, answered = _timed_step(engine)
        assert answered == {f"alone-{index}"}
        alone.append(seconds)
    step_alone = statistics.median(alone)

    text = "The river valley, told season by season, from the first farms to the mills. "
    engine.add_request(tokenizer.encode(text * 250)[:3000], FIRST_TOKEN, request_id="long")
    _timed_step(engine)
    ttfts = []
    for index, short in enumerate(shorts[3:]):
        in_flight, _ = _timed_step(engine)  # the request is sent as this step starts
        engine.add_request(short, FIRST_TOKEN, request_id=f"beside-{index}")
        own, answered = _timed_step(engine)
        assert f"beside-{index}" in answered
        ttfts.append(in_flight + own)
        for _ in range(2):  # further into the prefill: chunks cut by the fitted step-cost model
            _timed_step(engine)
    assert max(ttfts) <= 12 * step_alone, (ttfts, alone)
    assert statistics.median(ttfts) <= 6 * step_alone, (ttfts, alone)
    (long,) = engine.scheduler.running
    assert long.num_computed_tokens < 1024  # a dozen steps of it, each cut to the budget
    engine.abort("long")


def test_the_budget_is_the_devices_default_and_is_checked() -> None:
    assert AppArgs().for_device("cpu").long_prefill_step_ms == 100.0
    assert AppArgs().for_device("cuda").long_prefill_step_ms == 0.0  # not measured on a GPU yet
    assert AppArgs(long_prefill_step_ms=0).engine_config("cpu", "float32").long_prefill_step_ms == 0
    with pytest.raises(ValueError, match="long_prefill_step_ms"):
        parse_app_args({"long_prefill_step_ms": -1})
    with pytest.raises(InvalidRequestError, match="long_prefill_step_ms must be at least 0"):
        EngineConfig(long_prefill_step_ms=-1.0).validate()


def test_warm_up_runs_each_cut_chunk_deep_in_a_prompt_and_fits_the_model(smollm2_model: LoadedModel) -> None:
    """Warm-up's other steps compile kernels and teach the step-cost model nothing. Then an eager chunk of
    each step size below the budget runs after two whole-budget chunks (where the prefill kernel splits
    the keys as for deeper chunks), twice: once to compile, once measured, so serving starts with a fit."""
    engine = Engine(smollm2_model, EngineConfig(max_num_batched_tokens=64, long_prefill_step_ms=50))
    deep_chunks = []
    schedule = engine.scheduler.schedule

    def recording(*args: object, **kwargs: object) -> Batch:
        batch = schedule(*args, **kwargs)
        deep = [row.num_new_tokens for row in batch.scheduled if row.seq.num_computed_tokens == 2 * 64]
        deep_chunks.extend(deep)
        return batch

    engine.scheduler.schedule = recording
    engine.warm_up(force=True)
    assert deep_chunks == [16, 32, 16, 32]
    assert engine.scheduler.step_budget_s == 0.05 and engine.scheduler.max_num_batched_tokens == 64
    assert engine.step_cost.largest_tokens == 64 and engine.step_cost.coefficients() is not None
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
