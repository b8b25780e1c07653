"""Engine.warm_up on the real SmolLM2-135M (forced on the CPU): it runs every kind of step, including
verify steps of n-gram drafts, and leaves the engine as built, so a request afterwards gives what a
fresh engine gives and reuses nothing the warm-up computed."""

from __future__ import annotations

from tileinfer.deployments.replicas.proposer_build import build_engine
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.spec_decode.speculator import SpeculationStats

# a small budget and batch, so that the forced warm-up stays cheap and still has a prompt to chunk
CONFIG = EngineConfig(
    block_size=16, kv_cache_tokens=1024, max_num_seqs=4, max_num_batched_tokens=32, proposer="ngram"
)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def test_warm_up_leaves_the_engine_clean(smollm2_model: LoadedModel) -> None:
    fresh = build_engine(smollm2_model, CONFIG)
    prompt = fresh.tokenizer.encode_chat([{"role": "user", "content": "Name three colours."}])
    expected = fresh.generate(prompt, GREEDY)

    engine = build_engine(smollm2_model, CONFIG)
    assert engine.warm_up() == 0.0  # skipped on the CPU unless forced
    prompts: list[list[int]] = []
    stats_before_reset: list[SpeculationStats] = []
    add_request, reset = engine.add_request, engine.speculator.reset_measurements
    engine.add_request = lambda tokens, *args, **kwargs: (
        prompts.append(tokens) or add_request(tokens, *args, **kwargs)
    )

    def reset_measurements() -> None:
        stats_before_reset.append(engine.speculator.stats)
        reset()

    engine.speculator.reset_measurements = reset_measurements
    assert engine.warm_up(force=True) > 0
    del engine.add_request, engine.speculator.reset_measurements

    assert len(prompts) > 8 and max(map(len, prompts)) > CONFIG.max_num_batched_tokens  # a chunked prompt
    assert stats_before_reset[0].steps > 0  # drafts were verified
    assert not engine.requests and not engine.has_unfinished()
    manager = engine.block_manager
    assert len(manager.free_block_ids) == manager.num_blocks and not manager.evictable
    assert not manager.hash_to_block and not manager.children
    assert engine.scheduler.num_preemptions == 0
    speculator = engine.speculator
    assert speculator.stats == SpeculationStats() and not speculator.controllers
    assert speculator.median_step_seconds(True) is None and speculator.median_step_seconds(False) is None

    # no prefix-cache hit for a prompt that starts with the longest warm-up prompt
    longest = max(prompts, key=len)
    outputs = list(engine.stream(longest + prompt, SamplingParams(max_tokens=1, temperature=0.0)))
    assert outputs[0].num_cached_tokens == 0
    assert engine.generate(prompt, GREEDY) == expected
