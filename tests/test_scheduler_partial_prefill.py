"""Prompts share a step's budget (engine/scheduler.py): a long prompt takes at most
long_prefill_token_threshold tokens until the others have theirs, so a short prompt sent during a long
prefill samples its first token first; decodes go before prompts; at most max_long_partial_prefills long
prompts are prefilled at once. The scheduler alone first, then the engine on the real SmolLM2-135M."""

from __future__ import annotations

import pytest
from tileinfer.deployments.replicas.proposer_build import build_engine
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.kv.block_manager import BlockManager
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.scheduler import MAX_TIMES_PASSED_OVER, Batch, Scheduler
from tileinfer.engine.sequence import Sequence, SequenceStatus
from tileinfer.engine.step import Drafts

PARAMS = SamplingParams(max_tokens=8)


def _seq(name: str, length: int, first_token: int = 0) -> Sequence:
    """Distinct first tokens: no two prompts share a cached block."""
    return Sequence(name, [first_token] + list(range(1, length)), PARAMS)


def _split(batch: Batch) -> list[tuple[str, int]]:
    return [(item.seq.request_id, item.num_tokens) for item in batch.scheduled]


def _run(batch: Batch) -> None:
    """What a step does: the scheduled tokens are computed, and a sequence with all of them samples one."""
    for item in batch.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            item.seq.token_ids.append(7)


def _scheduler(budget: int = 64, threshold: int | None = 16, max_long: int = 1) -> Scheduler:
    return Scheduler(BlockManager(num_blocks=256, block_size=4), 8, budget, threshold, max_long)


def test_decodes_first_then_a_long_prompt_capped_beside_short_ones() -> None:
    scheduler = _scheduler()
    decoding = _seq("decoding", 5, first_token=100)
    scheduler.add(decoding)
    _run(scheduler.schedule())  # its whole prompt; it samples
    long = _seq("long", 200, first_token=200)
    scheduler.add(long)
    _run(scheduler.schedule())
    assert long.num_computed_tokens == 63  # alone beside the decode, it takes the rest of the budget
    shorts = [_seq(f"short-{n}", length, first_token=300 + n) for n, length in enumerate((15, 16, 16))]
    for seq in shorts:
        scheduler.add(seq)
    # the decode, then the long prompt at its threshold and the short ones whole: the budget is spent
    assert _split(scheduler.schedule()) == [
        ("decoding", 1), ("long", 16), ("short-0", 15), ("short-1", 16), ("short-2", 16),
    ]  # fmt: skip


def test_what_short_prompts_leave_goes_back_to_the_long_one() -> None:
    scheduler = _scheduler()
    long = _seq("long", 200, first_token=200)
    scheduler.add(long)
    batch = scheduler.schedule()
    assert _split(batch) == [("long", 64)]  # alone: the whole budget, as without a cap
    _run(batch)
    scheduler.add(_seq("short", 5, first_token=300))
    assert _split(scheduler.schedule()) == [("long", 59), ("short", 5)]  # 16, then the 43 left over


def test_a_decode_admitted_after_a_long_prompt_still_goes_first() -> None:
    """A short prompt started beside a long one decodes while the long one is prefilled: its token
    goes before the older prompt's chunk."""
    scheduler = _scheduler()
    long, short = _seq("long", 300, first_token=200), _seq("short", 6, first_token=300)
    scheduler.add(long)
    scheduler.add(short)
    batch = scheduler.schedule()
    assert _split(batch) == [("long", 58), ("short", 6)]
    _run(batch)
    assert scheduler.running == [long, short] and short.num_tokens == 7  # short sampled its first token
    assert _split(scheduler.schedule()) == [("short", 1), ("long", 63)]


def test_drafts_are_scheduled_whole_before_prompts() -> None:
    scheduler = _scheduler()
    long, drafting = _seq("long", 300, first_token=200), _seq("drafting", 6, first_token=300)
    scheduler.add(long)
    scheduler.add(drafting)
    _run(scheduler.schedule())
    drafts = Drafts(ids={drafting: [11, 12, 13]})  # the speculator's, before the step is scheduled
    assert _split(scheduler.schedule(drafts=drafts)) == [("drafting", 4), ("long", 60)]


def test_one_long_prompt_is_prefilled_at_a_time_and_short_ones_pass_the_next() -> None:
    scheduler = _scheduler()
    first, second = _seq("first", 200, first_token=200), _seq("second", 100, first_token=300)
    short = _seq("short", 10, first_token=400)
    for seq in (first, second, short):
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert _split(batch) == [("first", 54), ("short", 10)]
    assert second.status is SequenceStatus.WAITING
    _run(batch)
    first.num_computed_tokens = 200 - 16  # its last chunk is the threshold: it is short now
    assert _split(scheduler.schedule()) == [("short", 1), ("first", 16), ("second", 47)]


def test_a_long_prompt_that_reserves_the_cache_still_lets_short_ones_pass_while_it_waits() -> None:
    """A preempted long prompt resumes before anything new would start, but while another long prompt is
    prefilled it waits, and a short one behind it starts (the cache has room for both)."""
    scheduler = _scheduler()
    first, resumed = _seq("first", 200, first_token=200), _seq("resumed", 100, first_token=300)
    scheduler.add(first)
    _run(scheduler.schedule())
    scheduler.add(resumed)
    scheduler.times_passed_over[resumed] = MAX_TIMES_PASSED_OVER  # as Scheduler._preempt leaves it
    scheduler.add(_seq("short", 10, first_token=400))
    assert _split(scheduler.schedule()) == [("first", 54), ("short", 10)]
    assert resumed.status is SequenceStatus.WAITING
    first.num_computed_tokens = 200 - 1
    assert [name for name, _ in _split(scheduler.schedule())] == ["first", "short", "resumed"]


def test_two_long_prompts_at_once_share_the_step_when_allowed() -> None:
    scheduler = _scheduler(max_long=2)
    first, second = _seq("first", 200, first_token=200), _seq("second", 100, first_token=300)
    scheduler.add(first)
    scheduler.add(second)
    assert _split(scheduler.schedule()) == [("first", 48), ("second", 16)]


def test_the_default_threshold_is_a_quarter_of_the_budget() -> None:
    assert _scheduler(budget=2048, threshold=None).long_prefill_token_threshold == 512
    assert _scheduler(budget=3, threshold=None).long_prefill_token_threshold == 1


# --- the engine, on the real SmolLM2-135M -----------------------------------------------------------

LONG_PROMPT_TOKENS = 640
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
REPEATING = "one two three four one two three four one two three four one two"  # n-gram drafts match
DRAFTED = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(smollm2_model: LoadedModel) -> LoadedModel:
    return smollm2_model  # loaded once for the session (tests/conftest.py)


def _config(**settings: object) -> EngineConfig:
    # the long prompt takes five steps of 128 tokens; the prompts beside it get 96 of a shared one
    return EngineConfig(block_size=16, kv_cache_tokens=2048, max_num_batched_tokens=128, **settings)


@pytest.fixture(scope="module")
def prompts(model: LoadedModel) -> dict[str, list[int]]:
    text = "The history of the river valley, told season by season, from the first farms to the mills. "
    long = model.tokenizer.encode(text * 40)
    assert len(long) >= LONG_PROMPT_TOKENS
    short = model.tokenizer.encode("Name a colour.")
    return {"long": long[:LONG_PROMPT_TOKENS], "short": short, "repeating": model.tokenizer.encode(REPEATING)}


@pytest.fixture(scope="module")
def alone(model: LoadedModel, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each prompt's greedy tokens run alone, with the same settings."""
    engine = Engine(model, _config())
    return {
        name: engine.generate(prompt, DRAFTED if name == "repeating" else GREEDY)[0]
        for name, prompt in prompts.items()
    }


@pytest.mark.parametrize("run_ahead", [False, True], ids=["step-by-step", "run-ahead"])
def test_a_short_request_sent_during_a_long_prefill_gets_its_first_token_first(
    model: LoadedModel, prompts: dict[str, list[int]], alone: dict[str, list[int]], run_ahead: bool
) -> None:
    engine = Engine(model, _config(run_ahead=run_ahead))
    ids = {"long": engine.add_request(prompts["long"], GREEDY)}
    tokens: dict[str, list[int]] = {ids["long"]: []}
    first_token_step: dict[str, int] = {}
    for step in range(40):
        if step == 1:  # the long prompt's first chunk has run
            ids["short"] = engine.add_request(prompts["short"], GREEDY)
            tokens[ids["short"]] = []
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
            first_token_step.setdefault(output.request_id, step)
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    # sampled in the step it was sent in (run ahead, read a step later), long before the long prompt's
    assert first_token_step[ids["short"]] == 1 + run_ahead
    assert first_token_step[ids["long"]] >= 4 + run_ahead
    # the chunks beside the short prompt change nothing in either output
    assert {name: tokens[request_id] for name, request_id in ids.items()} == {
        "long": alone["long"], "short": alone["short"],
    }  # fmt: skip
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_speculation_beside_a_long_prefill_equals_plain_decoding(
    model: LoadedModel, prompts: dict[str, list[int]], alone: dict[str, list[int]]
) -> None:
    """A request verifying n-gram drafts decodes while a long prompt is prefilled in chunks beside it."""
    engine = build_engine(model, _config(proposer="ngram", num_draft=4))
    engine.speculator.adaptive = False
    ids = {
        "repeating": engine.add_request(prompts["repeating"], DRAFTED),
        "long": engine.add_request(prompts["long"], GREEDY),
    }
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids.values()}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert {name: tokens[request_id] for name, request_id in ids.items()} == {
        "repeating": alone["repeating"], "long": alone["long"],
    }  # fmt: skip
    assert engine.speculator.stats.drafts_accepted > 0


@pytest.mark.parametrize("settings", [{"long_prefill_token_threshold": 0}, {"max_long_partial_prefills": 0}])
def test_the_knobs_are_checked(model: LoadedModel, settings: dict) -> None:
    with pytest.raises(InvalidRequestError, match=next(iter(settings))):
        Engine(model, _config(**settings))
