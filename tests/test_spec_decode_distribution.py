"""Sampled speculative decoding leaves the output distribution unchanged, end to end through the engine.

A tiny random Qwen3 with a 6-token vocabulary; thousands of seeded requests sample 3 tokens at
temperature 1 with the n-gram proposer, whose drafts are verified by rejection sampling in the second
step. The joint distribution of the 2nd and 3rd tokens (the ones a verify step emits) is compared by a
chi-square test with the exact one, computed by transformers. A control with a deliberately wrong
acceptance rule (accept every draft) must fail the same test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tileinfer.deployments.replicas.proposer_build import build_engine
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.models.shape import ModelSpec
from tileinfer.engine.sampling import sampler
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.spec_decode.verification import verify_sampled

VOCAB = 6
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats, so the n-gram proposer drafts
NUM_REQUESTS = 6000
CRITICAL = 64.0  # chi-square, about 30 degrees of freedom, significance ~1e-4


@pytest.fixture(scope="module")
def tiny() -> tuple[LoadedModel, transformers.Qwen3ForCausalLM]:
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.5)  # spread-out next-token distributions
    spec = ModelSpec.from_hf_config(config.to_dict())
    weights = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    return LoadedModel(name="tiny", source=Path("random"), spec=spec, weights=weights, tokenizer=None), model


def exact_joint(model: transformers.Qwen3ForCausalLM) -> torch.Tensor:
    """P(2nd token, 3rd token | PROMPT) [VOCAB, VOCAB], summed over the 1st token, in float64."""
    with torch.no_grad():
        tokens = torch.tensor(PROMPT)
        first = model(tokens[None]).logits[0, -1].double().softmax(-1)  # [V]
        prefixes = torch.cat([tokens.repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], dim=1)
        second = model(prefixes).logits[:, -1].double().softmax(-1)  # [V (1st), V (2nd)]
        grid = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # (1st, 2nd) pairs
        third_input = torch.cat([tokens.repeat(len(grid), 1), grid], dim=1)
        third = model(third_input).logits[:, -1].double().softmax(-1).view(VOCAB, VOCAB, VOCAB)
    joint = first[:, None, None] * second[:, :, None] * third  # [1st, 2nd, 3rd]
    return joint.sum(dim=0)


def sampled_counts(model: LoadedModel) -> tuple[torch.Tensor, int]:
    """Counts of (2nd, 3rd) token over NUM_REQUESTS seeded requests, and how many drafts were accepted."""
    engine = build_engine(model, EngineConfig(proposer="ngram", num_draft=1, max_num_seqs=512,
                                        max_num_batched_tokens=8192, kv_cache_tokens=16384))  # fmt: skip
    ids = [
        engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True))
        for seed in range(NUM_REQUESTS)
    ]
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for generated in tokens.values():
        assert len(generated) == 3
        counts[generated[1], generated[2]] += 1
    return counts, engine.speculator.stats.drafts_accepted


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic, cells with an expected count under 5 pooled into one."""
    expected = probs.flatten() * counts.sum()
    observed = counts.flatten()
    small = expected < 5
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    observed = torch.cat([observed[~small], observed[small].sum()[None]])
    return float(((observed - expected) ** 2 / expected.clamp(min=1e-12)).sum())


def test_sampled_speculation_keeps_the_distribution(tiny) -> None:  # noqa: ANN001
    model, reference = tiny
    counts, accepted = sampled_counts(model)
    statistic = chi_square(counts, exact_joint(reference))
    print(f"accepted drafts {accepted}, chi-square {statistic:.1f}")
    assert accepted > NUM_REQUESTS // 10  # verification really decided many of these tokens
    assert statistic < CRITICAL


def test_a_wrong_acceptance_rule_fails_the_same_test(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    def accept_every_draft(probs, draft_probs, drafts, num_drafts, accept_uniforms, final_uniforms):  # noqa: ANN001, ANN202
        return verify_sampled(probs, draft_probs, drafts, num_drafts, accept_uniforms * 0, final_uniforms)

    monkeypatch.setattr(sampler, "verify_sampled", accept_every_draft)
    model, reference = tiny
    counts, _ = sampled_counts(model)
    statistic = chi_square(counts, exact_joint(reference))
    print(f"wrong rule: chi-square {statistic:.1f}")
    assert statistic > 5 * CRITICAL
