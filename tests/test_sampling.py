"""The sampler (engine/sampling/sampler.py; on the CPU the torch reference of kernels/sampling.py): parameter
validation, penalties, the filtered distributions, seeds and positions, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.sampling.sampler import Sampler
from tileinfer.engine.sequence import Sequence
from tileinfer.kernels.sampling import (
    SamplingTensors,
    apply_penalties_reference,
    filtered_probs_reference,
    sample_reference,
    top_logprobs,
)

CPU = torch.device("cpu")
# A small vocabulary with distinct, well-spread logits, so every filter has something to cut.
SMALL_LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]
NUM_DRAWS = 20_000


def tensors_for(
    params: list[SamplingParams],
    vocab_size: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    seeds: list[int] | None = None,
    positions: list[int] | None = None,
) -> SamplingTensors:
    rows = len(params)
    return SamplingTensors.from_params(
        params, prompts or [[]] * rows, outputs or [[]] * rows, seeds or [0] * rows, positions or [0] * rows,
        vocab_size,
    )  # fmt: skip


def sequence(request_id: str, params: SamplingParams, prompt: list[int], output: list[int] = ()) -> Sequence:
    return Sequence(request_id, prompt, params, token_ids=prompt + list(output))


# --- validate() ---------------------------------------------------------------------------------------

BAD_VALUES = [
    ("max_tokens", 0),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("temperature", -0.1),
    ("temperature", 2.5),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2.0),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("presence_penalty", -2.5),
    ("presence_penalty", 2.01),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -math.inf),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan),
    ("seed", 1.5),
    ("seed", 2**64),
    ("logprobs", -1),
    ("logprobs", 21),
    ("stop", ("",)),
    ("stop", ("ok", 3)),
    ("stop", "a string, not a list"),
    ("stop_token_ids", (-1,)),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_validate_rejects_bad_value_naming_the_field(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(InvalidRequestError, match=field):
        params.validate()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(max_tokens=1, temperature=0.0, top_p=1e-3, top_k=-1, min_p=1.0),
        SamplingParams(temperature=2.0, top_k=100_000, presence_penalty=-2.0, frequency_penalty=2.0),
        SamplingParams(repetition_penalty=0.5, seed=0, logprobs=0, stop=("\n", "User:"), stop_token_ids=(2,)),
        SamplingParams(logprobs=20, seed=2**63, top_p=1, temperature=1),
    ],
)
def test_validate_accepts_good_values(params: SamplingParams) -> None:
    params.validate()


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


# --- greedy and penalties -------------------------------------------------------------------------------


def test_greedy_is_argmax_and_draws_no_noise() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0, top_k=5)] * 6
    sampler = Sampler(300, CPU)
    seqs = [sequence(f"r{row}", params[row], [1, 2]) for row in range(6)]
    state = torch.random.get_rng_state()
    assert sampler.sample(logits, seqs).tolist() == logits.argmax(dim=-1).tolist()
    # Greedy rows take no key: torch's generator is left where it was.
    assert torch.equal(torch.random.get_rng_state(), state) and not sampler.keys


def test_penalties_by_hand() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)]
    # Seen: 0, 1 (prompt) and 1, 3, 3 (output). Repetition: positive divided, negative multiplied.
    # Then frequency (0.5 per occurrence) and presence (0.25 once) for generated tokens only.
    penalized = apply_penalties_reference(logits, tensors_for(params, 5, [[0, 1]], [[1, 3, 3]]))
    expected = [
        2.0 / 2,  # prompt only: repetition, no frequency/presence
        -1.0 * 2 - 0.5 * 1 - 0.25,
        0.5,  # never seen
        3.0 / 2 - 0.5 * 2 - 0.25,
        -2.0,
    ]
    assert penalized[0].tolist() == pytest.approx(expected)
    # The raw argmax (token 3) loses to token 0 once penalized; the sampler reads the sequence's history.
    greedy = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    assert Sampler(5, CPU).sample(logits, [sequence("r", greedy, [0, 1], [1, 3, 3])]).tolist() == [0]


def test_presence_counts_once_frequency_counts_every_occurrence() -> None:
    logits = torch.zeros(2, 4)
    params = [SamplingParams(presence_penalty=1.5), SamplingParams(frequency_penalty=1.5)]
    outputs = [[2, 2, 2, 1], [2, 2, 2, 1]]
    penalized = apply_penalties_reference(logits, tensors_for(params, 4, [[0], [0]], outputs))
    assert penalized[0].tolist() == pytest.approx([0.0, -1.5, -1.5, 0.0])
    assert penalized[1].tolist() == pytest.approx([0.0, -1.5, -4.5, 0.0])


def test_repetition_penalty_below_one_favours_seen_tokens_and_other_rows_are_untouched() -> None:
    logits = torch.tensor([[1.0, -1.0, 1.0], [1.0, -1.0, 1.0]])
    params = [SamplingParams(repetition_penalty=0.5), SamplingParams()]
    penalized = apply_penalties_reference(logits, tensors_for(params, 3, [[0, 1], [0, 1]], [[], []]))
    assert penalized[0].tolist() == pytest.approx([2.0, -0.5, 1.0])
    assert penalized[1].tolist() == pytest.approx([1.0, -1.0, 1.0])


# --- distributions --------------------------------------------------------------------------------------


def expected_distribution(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float):
    """The intended distribution, written out plainly as HF's warpers describe it."""
    scaled = [logit / temperature for logit in logits]
    order = sorted(range(len(scaled)), key=lambda index: -scaled[index])
    kept = order[:top_k] if top_k > 0 else order

    def normalized(indices: list[int]) -> dict[int, float]:
        weights = {index: math.exp(scaled[index]) for index in indices}
        total = sum(weights.values())
        return {index: weight / total for index, weight in weights.items()}

    probs = normalized(kept)
    mass, nucleus = 0.0, []
    for index in kept:  # best first; stop once the mass before a token reaches top_p
        if mass >= top_p:
            break
        nucleus.append(index)
        mass += probs[index]
    probs = normalized(nucleus)
    best = max(probs.values())
    return normalized([index for index in nucleus if probs[index] >= min_p * best])


def chi_square_critical(degrees_of_freedom: int, z_score: float = 3.72) -> float:
    """Upper chi-square quantile (z = 3.72: p of about 1e-4) by the Wilson-Hilferty approximation."""
    k = degrees_of_freedom
    return k * (1 - 2 / (9 * k) + z_score * math.sqrt(2 / (9 * k))) ** 3


DISTRIBUTION_CASES = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=1.7, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=3, top_p=1.0, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0),
    dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.2),
    dict(temperature=1.3, top_k=6, top_p=0.9, min_p=0.1),
]


def seeded_draws(
    params: SamplingParams, seed: int, count: int, logits: list[float] = SMALL_LOGITS
) -> list[int]:
    """One seeded request's draws at positions 0 .. count - 1 (one row each) from the same logits."""
    batch = torch.tensor(logits).expand(count, -1)
    tensors = tensors_for([params] * count, len(logits), seeds=[seed] * count, positions=list(range(count)))
    return sample_reference(batch, tensors).tolist()


@pytest.mark.parametrize(
    "case", DISTRIBUTION_CASES, ids=lambda case: "-".join(f"{k}={v}" for k, v in case.items())
)
def test_sampled_frequencies_match_the_filtered_distribution(case: dict) -> None:
    expected = expected_distribution(SMALL_LOGITS, **case)
    # The successive draws of one seeded request.
    token_ids = seeded_draws(SamplingParams(**case), seed=1234, count=NUM_DRAWS)
    counts = torch.bincount(torch.tensor(token_ids), minlength=len(SMALL_LOGITS)).tolist()

    filtered_out = [index for index in range(len(SMALL_LOGITS)) if index not in expected]
    assert [counts[index] for index in filtered_out] == [0] * len(filtered_out)
    chi_square = sum((counts[index] - NUM_DRAWS * p) ** 2 / (NUM_DRAWS * p) for index, p in expected.items())
    assert chi_square < chi_square_critical(len(expected) - 1), (counts, expected)


def test_filtered_probs_equal_the_intended_distribution() -> None:
    logits = torch.tensor([SMALL_LOGITS] * len(DISTRIBUTION_CASES))
    params = [SamplingParams(**case) for case in DISTRIBUTION_CASES]
    probs = filtered_probs_reference(logits, tensors_for(params, len(SMALL_LOGITS)))
    for row, case in enumerate(DISTRIBUTION_CASES):
        expected = expected_distribution(SMALL_LOGITS, **case)
        dense = [expected.get(index, 0.0) for index in range(len(SMALL_LOGITS))]
        assert probs[row].tolist() == pytest.approx(dense, abs=1e-6)


def test_unseeded_requests_sample_the_same_distribution() -> None:
    """Unseeded requests get random keys (from torch's generator): one draw each."""
    case = DISTRIBUTION_CASES[3]
    expected = expected_distribution(SMALL_LOGITS, **case)
    sampler = Sampler(len(SMALL_LOGITS), CPU)
    seqs = [sequence(f"r{n}", SamplingParams(**case), [0]) for n in range(NUM_DRAWS)]
    with torch.random.fork_rng():
        torch.manual_seed(99)
        token_ids = sampler.sample(torch.tensor(SMALL_LOGITS).expand(NUM_DRAWS, -1), seqs).tolist()
    assert len(set(sampler.keys.values())) == NUM_DRAWS
    counts = torch.bincount(torch.tensor(token_ids), minlength=len(SMALL_LOGITS)).tolist()
    assert sum(counts[index] for index in expected) == NUM_DRAWS
    chi_square = sum((counts[index] - NUM_DRAWS * p) ** 2 / (NUM_DRAWS * p) for index, p in expected.items())
    assert chi_square < chi_square_critical(len(expected) - 1), (counts, expected)


def test_top_k_keeps_ties_and_a_top_k_beyond_the_vocab_keeps_everything() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [1.0, 3.0, 3.0, 3.0, 0.0]])
    params = [SamplingParams(top_k=2), SamplingParams(top_k=1000)]
    probs = filtered_probs_reference(logits, tensors_for(params, 5))
    assert probs[0].tolist() == pytest.approx([0, 1 / 3, 1 / 3, 1 / 3, 0])
    assert probs[1].tolist() == pytest.approx(torch.softmax(logits[1], dim=-1).tolist())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1),
        SamplingParams(top_p=0.01),
        SamplingParams(min_p=1.0),
        SamplingParams(temperature=2.0, top_k=3, top_p=0.5),
    ],
)
def test_a_single_surviving_token_is_always_drawn(params: SamplingParams) -> None:
    assert seeded_draws(params, seed=7, count=500, logits=[0.0, 0.0, 9.0, -20.0, 0.0]) == [2] * 500


# --- seeds and positions -----------------------------------------------------------------------------


def seeded_sequence(seed: int, steps: int, companions: int = 0) -> list[int]:
    """Draw `steps` tokens for one seeded request, maybe batched with unseeded, seeded and greedy ones."""
    logits_stream = torch.Generator().manual_seed(5)
    sampler = Sampler(64, CPU)
    seq = sequence("seeded", SamplingParams(temperature=1.0, top_p=0.95, seed=seed), [1, 2, 3])
    batch = [seq]
    for companion in range(companions):
        batch += [
            sequence(f"unseeded-{companion}", SamplingParams(temperature=0.8), [4]),
            sequence(f"seeded-{companion}", SamplingParams(seed=100 + companion), [5, 6]),
            sequence(f"greedy-{companion}", SamplingParams(temperature=0), [7]),
        ]
    for _ in range(steps):
        step_logits = torch.randn(1, 64, generator=logits_stream)
        batch_logits = torch.cat([step_logits, torch.randn(len(batch) - 1, 64)])
        for other, token in zip(batch, sampler.sample(batch_logits, batch).tolist(), strict=True):
            other.token_ids.append(token)
    return seq.output_token_ids


def test_same_seed_same_tokens_different_seeds_differ() -> None:
    first = seeded_sequence(seed=42, steps=30)
    assert seeded_sequence(seed=42, steps=30) == first
    assert seeded_sequence(seed=43, steps=30) != first


def test_seeded_row_is_independent_of_its_batch() -> None:
    assert seeded_sequence(seed=42, steps=30, companions=2) == seeded_sequence(seed=42, steps=30)


def test_the_noise_is_keyed_by_position_not_by_draw_count() -> None:
    """A draw depends on the seed and the drawn token's index in the sequence: the same logits at the same
    position give the same token, whatever the prompt's length or how many tokens were drawn before."""
    params = SamplingParams(temperature=1.0, seed=9)
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(4))
    sampler = Sampler(500, CPU)
    short_prompt = sequence("a", params, [1, 2, 3], [4, 5])  # draws position 5, its third output
    long_prompt = sequence("b", params, [1, 2, 3, 4, 5])  # draws position 5, its first output
    assert sampler.sample(logits, [short_prompt]).tolist() == sampler.sample(logits, [long_prompt]).tolist()
    later = [sampler.sample(logits, [sequence(f"c{n}", params, [1] * n)]).item() for n in range(6, 26)]
    assert len(set(later)) > 1  # other positions, other noise


def test_a_request_keeps_its_random_key_until_forgotten() -> None:
    sampler = Sampler(8, CPU)
    seq = sequence("r", SamplingParams(temperature=1.0), [1])
    key = sampler.key_of(seq)
    assert sampler.key_of(seq) == key
    sampler.forget("r")
    assert "r" not in sampler.keys and sampler.key_of(seq) != key
    # A seed is the key: its low 64 bits as int64.
    assert sampler.key_of(sequence("s", SamplingParams(seed=2**64 - 1), [1])) == -1


# --- logprobs -------------------------------------------------------------------------------------------


def test_logprobs_are_the_raw_model_distribution() -> None:
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(3)) * 4
    params = [
        SamplingParams(temperature=0.6, repetition_penalty=1.8, top_k=10, seed=0),
        SamplingParams(temperature=0.0, repetition_penalty=1.8),
        SamplingParams(),
    ]
    seqs = [sequence(f"r{row}", params[row], [1, 2, 3], [4, 4]) for row in range(3)]
    token_ids = Sampler(200, CPU).sample(logits, seqs)
    chosen, top_ids, top_values = top_logprobs(logits, token_ids, 5)
    reference = torch.log_softmax(logits.double(), dim=-1)

    assert chosen.tolist() == pytest.approx(reference[torch.arange(3), token_ids].tolist(), abs=1e-5)
    assert top_ids[:, 0].tolist() == logits.argmax(dim=-1).tolist()
    expected_values, expected_ids = reference.topk(5, dim=-1)
    assert torch.equal(top_ids, expected_ids)
    assert torch.allclose(top_values.double(), expected_values, atol=1e-5)
