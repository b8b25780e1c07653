"""Speculative decoding in the engine, on the real SmolLM2-135M-Instruct: with each proposer the output
is plain decoding's, token for token under greedy; drafts really are accepted; a failing proposer only
costs speed."""

from __future__ import annotations

from pathlib import Path

import pytest
from tileinfer.deployments.replicas.proposer_build import build_engine
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.spec_decode import speculator as speculator_module
from tileinfer.engine.spec_decode.proposer_interface import DraftRequest, Proposer
from tileinfer.engine.spec_decode.speculator import Speculator
from tileinfer.proposers.ngram import NgramProposer

CODE_EDIT = (
    "Rename the variable `total` to `running_sum` in this function and return the whole function.\n\n"
    "def add_all(values):\n    total = 0\n    for value in values:\n        total = total + value\n"
    "    return total\n"
)
GREEDY = SamplingParams(max_tokens=28, temperature=0.0)


@pytest.fixture(scope="module")
def model(smollm2_model: LoadedModel) -> LoadedModel:
    return smollm2_model  # loaded once for the session (tests/conftest.py)


@pytest.fixture(scope="module")
def prompts(model: LoadedModel) -> list[list[int]]:
    tokenizer = model.tokenizer
    return [
        tokenizer.encode_chat([{"role": "user", "content": CODE_EDIT}]),
        tokenizer.encode_chat([{"role": "user", "content": "Name three rivers in Europe."}]),
    ]


@pytest.fixture(scope="module")
def plain(model: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(model, EngineConfig())
    return [engine.generate(prompt, GREEDY)[0] for prompt in prompts]


def run_batch(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [tokens[request_id] for request_id in ids]


@pytest.mark.parametrize(
    "settings",
    [{"proposer": "ngram"}, {"proposer": "draft", "draft_layers": 24}],
    ids=["ngram", "self-draft"],
)
def test_greedy_speculation_equals_plain_decoding(
    model: LoadedModel, prompts: list[list[int]], plain: list[list[int]], settings: dict
) -> None:
    # every step drafts (a 24-layer self-draft costs 0.82 of a decode step a draft, and at its
    # acceptance the adaptive count would rightly draft only now and then)
    engine = build_engine(model, EngineConfig(num_draft=4, **settings))
    assert engine.speculator is not None and not engine.run_ahead
    engine.speculator.adaptive = False
    if settings["proposer"] == "ngram":  # one at a time too (the self-draft's costs the suite 10 s)
        assert [engine.generate(prompt, GREEDY)[0] for prompt in prompts] == plain
    assert run_batch(engine, prompts, GREEDY) == plain  # all in one batch
    stats = engine.speculator.stats
    assert stats.drafts_accepted > 0 and stats.drafts_proposed >= stats.drafts_accepted
    assert stats.proposer_failures == 0


def test_a_separate_draft_model_and_a_one_hot_sampled_distribution(
    model: LoadedModel, smollm2_gguf: Path, prompts: list[list[int]], plain: list[list[int]]
) -> None:
    """The target itself as the draft model: every greedy draft is accepted. top_k=1 makes sampling
    one-hot, so rejection sampling must give the greedy tokens exactly."""
    engine = build_engine(model, EngineConfig(proposer="draft", draft_model=str(smollm2_gguf), num_draft=3))
    assert engine.generate(prompts[1], GREEDY)[0] == plain[1]
    stats = engine.speculator.stats
    assert stats.drafts_accepted == stats.drafts_proposed > 0
    one_hot = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.7, top_k=1, seed=3)
    assert engine.generate(prompts[0], one_hot)[0] == plain[0]


def test_ngram_accepts_several_tokens_a_step_when_the_answer_copies_the_prompt(model: LoadedModel) -> None:
    engine = build_engine(model, EngineConfig(proposer="ngram", num_draft=6))
    request = "Repeat this sentence three times: The quick brown fox jumps over the lazy dog."
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": request}])
    outputs = list(engine.stream(prompt, SamplingParams(max_tokens=60, temperature=0.0)))
    tokens = sum(len(output.new_token_ids) for output in outputs)
    assert "quick brown fox jumps over" in "".join(output.new_text for output in outputs)
    assert tokens / len(outputs) > 1.5  # steps emit more than one token on average


class _BrokenProposer(Proposer):
    def __init__(self) -> None:
        self.calls = 0

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        self.calls += 1
        raise ConnectionError("the proposer actor died")

    def forget(self, request_id: str) -> None:
        raise ConnectionError("the proposer actor died")


def test_a_failing_proposer_only_costs_speed(
    model: LoadedModel, prompts: list[list[int]], plain: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the pause outlasts the answer however slow the machine (at 5 s, a loaded one retried within it)
    monkeypatch.setattr(speculator_module, "RETRY_AFTER_S", 3600.0)
    proposer = _BrokenProposer()
    engine = Engine(model, EngineConfig(), proposer=proposer)
    assert engine.generate(prompts[0], GREEDY)[0] == plain[0]
    assert proposer.calls == 1 and engine.speculator.stats.proposer_failures == 1  # then paused


def _batch_counting_launches(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """_batch, also counting the steps that left a decode step launched and unread (run-ahead)."""
    ids = [engine.add_request(prompt, GREEDY) for prompt in prompts]
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    launched = 0
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
        launched += engine.in_flight is not None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [tokens[request_id] for request_id in ids], launched


@pytest.mark.parametrize("verify_cost", [None, 3.0], ids=["measured", "verify-costs-3-steps"])
def test_speculation_with_run_ahead_equals_plain_decoding(
    model: LoadedModel, prompts: list[list[int]], plain: list[list[int]], verify_cost: float | None
) -> None:
    """With run-ahead on (the GPU's default), a step that drafts first reads the launched step's tokens,
    and a step without drafts launches ahead; the output stays plain decoding's. When a verify step costs
    3 plain steps (held there), drafting pays only now and then, and most steps run ahead."""
    engine = build_engine(model, EngineConfig(proposer="ngram", num_draft=4, run_ahead=True))
    speculator = engine.speculator
    assert speculator is not None and engine.run_ahead
    speculator.fixed_step_cost = verify_cost
    tokens, launched = _batch_counting_launches(engine, prompts)
    assert tokens == plain
    if verify_cost is None:
        assert speculator.stats.drafts_accepted > 0 and launched > 0
    else:
        assert speculator.step_cost == verify_cost  # held, though both kinds of step ran
        assert launched > 0.5 * sum(len(t) for t in plain) / len(plain)


def test_a_fixed_draft_count_drafts_every_step(
    model: LoadedModel, prompts: list[list[int]], plain: list[list[int]]
) -> None:
    """A self-draft of all 30 layers is the target itself: its drafts are all accepted, but each costs a
    whole decode step, so the adaptive count drafts only on its probes; adaptive False asks for
    num_draft drafts at every step anyway (the placement benchmark's setting)."""
    settings = {"proposer": "draft", "draft_layers": model.spec.num_layers, "num_draft": 4}
    adaptive = build_engine(model, EngineConfig(**settings))
    assert run_batch(adaptive, prompts[1:], GREEDY) == plain[1:]
    fixed = build_engine(model, EngineConfig(**settings))
    fixed.speculator.adaptive = False
    assert run_batch(fixed, prompts[1:], GREEDY) == plain[1:]
    adaptive_stats, fixed_stats = adaptive.speculator.stats, fixed.speculator.stats
    assert adaptive_stats.drafts_proposed <= 4
    # 40 tokens: every step but the last few (cut by max_tokens) carries 4 drafts, and all are accepted
    assert fixed_stats.drafts_proposed >= 4 * (fixed_stats.steps - 2)
    assert fixed_stats.steps <= 10
    assert fixed_stats.drafts_accepted == fixed_stats.drafts_proposed


def test_one_slow_step_does_not_set_the_step_cost() -> None:
    """A first verify step that compiled kernels (or waited out a stalled proposer) takes 100x a normal
    one; once a few normal steps follow, the cost is theirs again."""
    speculator = Speculator(NgramProposer(), max_drafts=4)
    assert speculator.step_cost == 1.0  # nothing measured yet
    speculator.record_step(2.0, verified_drafts=True)  # compiled
    for _ in range(3):
        speculator.record_step(0.010, verified_drafts=False)
    assert speculator.step_cost == 200.0
    for _ in range(2):
        speculator.record_step(0.025, verified_drafts=True)
    assert speculator.step_cost == pytest.approx(2.5)
