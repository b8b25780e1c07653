"""Verification of drafts: greedy cases, rejection sampling against the target distribution (chi-square,
with controls that a wrong rule fails), padding, and the draft-length controller."""

from __future__ import annotations

import pytest
import torch
from tileinfer.deployments.replicas.proposer_build import draft_cost
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.spec_decode.verification import (
    PAD_TOKEN_ID,
    DraftLengthController,
    Verified,
    verify_greedy,
    verify_sampled,
)
from tileinfer.kernels.sampling import SamplingTensors, race_scores_reference, sample_reference

# --- greedy --------------------------------------------------------------------------------------------


def test_greedy_none_some_all_accepted() -> None:
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    drafts = torch.tensor([[9, 6, 7], [5, 6, 9], [5, 6, 7], [5, 6, 7]])
    num_drafts = torch.tensor([3, 3, 3, 2])
    verified = verify_greedy(target, drafts, num_drafts)
    assert verified.num_accepted.tolist() == [0, 2, 3, 2]
    assert verified.output_token_ids.tolist() == [
        [5, -1, -1, -1],  # the first draft is wrong: the target's correction only
        [5, 6, 7, -1],  # two accepted, then the correction 7 instead of 9
        [5, 6, 7, 8],  # all accepted, plus the bonus token 8
        [5, 6, 7, -1],  # only two real drafts (the third is padding): both accepted, bonus 7
    ]


def test_greedy_ignores_padding_and_handles_no_drafts() -> None:
    target = torch.tensor([[3, 4, 1], [2, 0, 0]])
    drafts = torch.tensor([[3, 4], [2, 0]])  # row 1 has no real drafts, though its padding would match
    verified = verify_greedy(target, drafts, torch.tensor([2, 0]))
    assert verified.num_accepted.tolist() == [2, 0]
    assert verified.output_token_ids.tolist() == [[3, 4, 1], [2, PAD_TOKEN_ID, PAD_TOKEN_ID]]

    plain = verify_greedy(torch.tensor([[7]]), torch.empty(1, 0, dtype=torch.long), torch.tensor([0]))
    assert plain.output_token_ids.tolist() == [[7]] and plain.num_accepted.tolist() == [0]


def test_sampled_with_one_hot_targets_is_greedy() -> None:
    # temperature -> 0 makes p one-hot on the argmax: rejection sampling must then agree with greedy
    generator = torch.Generator().manual_seed(1)
    num_seqs, max_drafts, vocab_size = 64, 4, 10
    target = torch.randint(vocab_size, (num_seqs, max_drafts + 1), generator=generator)
    # drafts that agree with the target for a random number of positions
    drafts = torch.where(
        torch.rand(num_seqs, max_drafts, generator=generator) < 0.7,
        target[:, :-1],
        torch.randint(vocab_size, (num_seqs, max_drafts), generator=generator),
    )
    num_drafts = torch.randint(max_drafts + 1, (num_seqs,), generator=generator)
    target_probs = torch.nn.functional.one_hot(target, vocab_size).float()
    draft_probs = torch.rand(num_seqs, max_drafts, vocab_size, generator=generator).softmax(dim=-1)
    expected = verify_greedy(target, drafts, num_drafts)
    for probs in (draft_probs, None):
        verified = verify_sampled(
            target_probs,
            probs,
            drafts,
            num_drafts,
            torch.rand(num_seqs, max_drafts, generator=generator),
            torch.rand(num_seqs, max_drafts + 1, vocab_size, generator=generator),
        )
        assert torch.equal(verified.output_token_ids, expected.output_token_ids)
        assert torch.equal(verified.num_accepted, expected.num_accepted)


# --- sampled: the distribution of the emitted tokens ----------------------------------------------------

VOCAB_SIZE = 6
MAX_DRAFTS = 3
NUM_TRIALS = 200_000  # rows of one batch, one independent trial each
SIGNIFICANCE = 1e-6  # seeded, so deterministic; strict so that a change of seed does not flake either


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    assert expected.min() >= 5, "too few samples for the chi-square approximation"
    return float(((counts - expected) ** 2 / expected).sum())


def chi_square_critical(degrees_of_freedom: int, significance: float) -> float:
    """The statistic whose upper tail has probability `significance` (bisection on the survival function)."""
    half_dof = torch.tensor(degrees_of_freedom / 2, dtype=torch.float64)
    low, high = 0.0, 1000.0
    for _ in range(100):
        middle = (low + high) / 2
        tail = torch.special.gammaincc(half_dof, torch.tensor(middle / 2, dtype=torch.float64))
        low, high = (middle, high) if tail > significance else (low, middle)
    return high


CRITICAL = chi_square_critical(VOCAB_SIZE - 1, SIGNIFICANCE)


class Trials:
    """A fixed target p [k+1, V] and draft q [k, V], and NUM_TRIALS seeded speculative steps of them."""

    def __init__(self, seed: int, deterministic_drafts: bool) -> None:
        generator = torch.Generator().manual_seed(seed)
        # distinct, well-spread distributions, so that p - q has mass on several tokens
        self.target = torch.randn(MAX_DRAFTS + 1, VOCAB_SIZE, generator=generator).softmax(dim=-1)
        self.draft = torch.randn(MAX_DRAFTS, VOCAB_SIZE, generator=generator).softmax(dim=-1)
        if deterministic_drafts:  # like an n-gram proposer: the same guess every time, q one-hot on it
            self.draft_probs = None
            self.drafts = self.target[:MAX_DRAFTS].argmax(dim=-1).expand(NUM_TRIALS, MAX_DRAFTS)
        else:
            self.draft_probs = self.draft.expand(NUM_TRIALS, MAX_DRAFTS, VOCAB_SIZE)
            self.drafts = torch.multinomial(self.draft, NUM_TRIALS, replacement=True, generator=generator).T
        # rows with fewer real drafts cover padding and a bonus token at every position
        self.num_drafts = torch.randint(MAX_DRAFTS + 1, (NUM_TRIALS,), generator=generator)
        self.accept_uniforms = torch.rand(NUM_TRIALS, MAX_DRAFTS, generator=generator)
        # each position's: the last token uses those of its own position, as plain decoding would there
        self.final_uniforms = torch.rand(NUM_TRIALS, MAX_DRAFTS + 1, VOCAB_SIZE, generator=generator)
        # what plain decoding draws at position 1 when a step ends after one token
        self.next_step_tokens = torch.multinomial(
            self.target[1], NUM_TRIALS, replacement=True, generator=generator
        )

    def verify(self, accept_uniforms: torch.Tensor | None = None) -> Verified:
        return verify_sampled(
            self.target.expand(NUM_TRIALS, MAX_DRAFTS + 1, VOCAB_SIZE),
            self.draft_probs,
            self.drafts,
            self.num_drafts,
            self.accept_uniforms if accept_uniforms is None else accept_uniforms,
            self.final_uniforms,
        )

    def statistic_at(self, verified: Verified, position: int) -> float:
        """Chi-square of the tokens emitted at `position` (by the rows that got that far) against p there."""
        reached = verified.num_accepted >= position
        tokens = verified.output_token_ids[reached, position]
        return chi_square(
            torch.bincount(tokens, minlength=VOCAB_SIZE).double(), self.target[position].double()
        )


@pytest.fixture(scope="module", params=[False, True], ids=["sampled_drafts", "deterministic_drafts"])
def trials(request: pytest.FixtureRequest) -> Trials:
    return Trials(seed=1234, deterministic_drafts=request.param)


@pytest.mark.parametrize("position", range(MAX_DRAFTS + 1))
def test_each_emitted_token_follows_the_target(trials: Trials, position: int) -> None:
    # position 0 is the first emitted token; position i > 0 is emitted only after i accepted drafts, and
    # must then follow p_i whatever happened before (joint with acceptance, not just on average)
    verified = trials.verify()
    assert (verified.num_accepted <= trials.num_drafts).all()
    assert trials.statistic_at(verified, position) < CRITICAL


def test_two_token_stream_follows_the_target(trials: Trials) -> None:
    # the first two tokens of the output, the second from the next (plain) step when only one was emitted
    verified = trials.verify()
    second = torch.where(verified.num_accepted >= 1, verified.output_token_ids[:, 1], trials.next_step_tokens)
    pairs = verified.output_token_ids[:, 0] * VOCAB_SIZE + second
    joint = (trials.target[0].unsqueeze(1) * trials.target[1].unsqueeze(0)).flatten().double()
    statistic = chi_square(torch.bincount(pairs, minlength=VOCAB_SIZE**2).double(), joint)
    assert statistic < chi_square_critical(VOCAB_SIZE**2 - 1, SIGNIFICANCE)


def test_the_drafts_are_really_used(trials: Trials) -> None:
    # a speculative step that never accepted anything would pass the tests above trivially
    verified = trials.verify()
    mean_accepted = verified.num_accepted.double().mean().item()
    assert mean_accepted > 0.3


def test_control_accepting_every_draft_fails(trials: Trials) -> None:
    verified = trials.verify(accept_uniforms=torch.zeros(NUM_TRIALS, MAX_DRAFTS))
    assert trials.statistic_at(verified, 0) > 10 * CRITICAL


def test_control_resampling_from_the_target_instead_of_the_residual_fails(trials: Trials) -> None:
    verified = trials.verify()
    # the same acceptances, but the last token drawn from p at that position instead of max(p - q, 0)
    rows = torch.arange(NUM_TRIALS)
    final_probs = trials.target[verified.num_accepted]
    uniforms = trials.final_uniforms[rows, verified.num_accepted]
    wrong_final = race_scores_reference(final_probs.log(), uniforms).argmax(dim=-1)
    verified.output_token_ids[rows, verified.num_accepted] = wrong_final
    assert trials.statistic_at(verified, 0) > 10 * CRITICAL


def test_a_row_is_verified_as_if_alone() -> None:
    # padding to a longer k_max, and the other rows of the batch, change nothing about a row
    trials = Trials(seed=7, deterministic_drafts=False)
    batched = trials.verify()
    for row in range(20):
        num_drafts = int(trials.num_drafts[row])
        alone = verify_sampled(
            trials.target[: num_drafts + 1].unsqueeze(0),
            trials.draft[:num_drafts].unsqueeze(0),
            trials.drafts[row, :num_drafts].unsqueeze(0),
            torch.tensor([num_drafts]),
            trials.accept_uniforms[row, :num_drafts].unsqueeze(0),
            trials.final_uniforms[row, : num_drafts + 1].unsqueeze(0),
        )
        assert alone.num_accepted.item() == batched.num_accepted[row].item()
        assert alone.output_token_ids[0].tolist() == batched.output_token_ids[row, : num_drafts + 1].tolist()
        assert (batched.output_token_ids[row, num_drafts + 1 :] == PAD_TOKEN_ID).all()


def test_no_drafts_is_plain_sampling_with_the_same_noise() -> None:
    # so that a step without speculation draws what the plain sampler draws from the same uniforms
    trials = Trials(seed=5, deterministic_drafts=False)
    verified = verify_sampled(
        trials.target[:1].expand(NUM_TRIALS, 1, VOCAB_SIZE),
        None,
        torch.empty(NUM_TRIALS, 0, dtype=torch.long),
        torch.zeros(NUM_TRIALS, dtype=torch.long),
        torch.empty(NUM_TRIALS, 0),
        trials.final_uniforms[:, :1],
    )
    # the sampler at temperature 1 over logits log p
    tensors = SamplingTensors.from_params(
        [SamplingParams()] * NUM_TRIALS, [[]] * NUM_TRIALS, [[]] * NUM_TRIALS, [0] * NUM_TRIALS,
        [0] * NUM_TRIALS, VOCAB_SIZE,
    )  # fmt: skip
    logits = trials.target[0].log().expand(NUM_TRIALS, VOCAB_SIZE)
    plain = sample_reference(logits, tensors, trials.final_uniforms[:, 0])
    assert torch.equal(verified.output_token_ids[:, 0], plain)
    assert (verified.num_accepted == 0).all()


def test_drafts_from_the_target_itself_are_all_accepted() -> None:
    trials = Trials(seed=3, deterministic_drafts=False)
    target = trials.target.expand(NUM_TRIALS, MAX_DRAFTS + 1, VOCAB_SIZE)
    verified = verify_sampled(
        target,
        target[:, :MAX_DRAFTS],
        trials.drafts,
        trials.num_drafts,
        trials.accept_uniforms,
        trials.final_uniforms,
    )
    assert torch.equal(verified.num_accepted, trials.num_drafts)


# --- the draft-length controller ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("acceptance", "expected_drafts"),
    # tokens per cost E(k) / (1 + 0.1 k): a = 0.5 peaks at k = 2 (1.458 vs 1.364 and 1.442); a = 0.2 at
    # k = 1 (1.091); a = 0.05 never beats plain decoding (1.05 / 1.1 < 1); a = 0.95 wants every draft
    [(0.95, 8), (0.5, 2), (0.2, 1), (0.05, 0)],
)
def test_controller_picks_the_k_with_most_tokens_per_cost(acceptance: float, expected_drafts: int) -> None:
    controller = DraftLengthController(max_drafts=8, draft_cost=0.1, initial_acceptance=acceptance)
    first = controller.next_num_drafts()  # a first step that would not draft probes instead
    assert first == (expected_drafts or 8)
    assert controller.next_num_drafts() == expected_drafts


def test_draft_costs_follow_the_proposer() -> None:
    """n-gram (and DFlash) drafts cost only their share of a verify step, so at the code edit's 92 %
    acceptance every allowed draft pays; a self-draft pays for its layers, and wants fewer."""
    assert draft_cost(EngineConfig(proposer="ngram"), 30) == pytest.approx(0.02)
    assert draft_cost(EngineConfig(proposer="dflash", draft_model="x"), 30) == pytest.approx(0.02)
    assert draft_cost(EngineConfig(proposer="draft", draft_layers=15), 30) == pytest.approx(0.52)
    assert draft_cost(EngineConfig(proposer="draft"), 32) == pytest.approx(8 / 32 + 0.02)  # the default
    assert draft_cost(EngineConfig(proposer="draft", draft_model="small"), 30) == pytest.approx(0.1)
    cheap = DraftLengthController(max_drafts=15, draft_cost=0.02, initial_acceptance=0.92)
    layers = DraftLengthController(max_drafts=15, draft_cost=0.52, initial_acceptance=0.92)
    assert cheap.next_num_drafts() == 15 and 0 < layers.next_num_drafts() < 15


def test_controller_estimates_the_acceptance_from_truncated_steps() -> None:
    # drafts accepted independently with probability 0.7; each step stops at the first rejection
    generator = torch.Generator().manual_seed(5)
    controller = DraftLengthController(max_drafts=4, smoothing=0.01, initial_acceptance=0.1)
    for _ in range(3000):
        accepted = torch.rand(4, generator=generator) < 0.7
        controller.record(num_proposed=4, num_accepted=int(accepted.long().cumprod(0).sum()))
    # accepted / proposed would say about 0.48 here; the estimate must not be fooled by the truncation
    assert controller.acceptance == pytest.approx(0.7, abs=0.05)
    assert controller.next_num_drafts() == 4


def test_controller_backs_off_and_probes_again() -> None:
    controller = DraftLengthController(max_drafts=4, smoothing=0.5, probe_interval=5)
    assert controller.next_num_drafts() > 0
    for _ in range(10):
        controller.record(num_proposed=4, num_accepted=0)
    controller.record(num_proposed=0, num_accepted=0)  # a step with no drafts tells nothing
    assert controller.acceptance < 0.01
    chosen = [controller.next_num_drafts() for _ in range(10)]
    # a probe asks for what an acceptance of 0.9 pays best for: all 4 (4.10 tokens for a cost of 1.4)
    assert chosen == [0, 0, 0, 0, 4, 0, 0, 0, 0, 4]
    for _ in range(10):
        controller.record(num_proposed=1, num_accepted=1)
    assert controller.next_num_drafts() == 4


def test_controller_probes_on_its_first_step_with_the_k_a_success_would_want() -> None:
    """A request whose prior acceptance does not pay for drafting (the verify step costs 3 plain steps)
    probes on its first step, with the k that a high acceptance would pay for: all 15 cheap n-gram
    drafts, fewer 0.5-step self-draft layers; then it waits probe_interval steps before the next."""
    cheap = DraftLengthController(max_drafts=15, draft_cost=0.02, probe_interval=4)
    assert [cheap.next_num_drafts(step_cost=3.0) for _ in range(5)] == [15, 0, 0, 0, 15]
    costly = DraftLengthController(max_drafts=15, draft_cost=0.5)
    assert 1 < costly.next_num_drafts(step_cost=3.0) < 15
    # a fully accepted probe of 15 drafts is evidence enough to draft at the next step
    cheap.record(num_proposed=15, num_accepted=15)
    assert cheap.next_num_drafts(step_cost=3.0) == 15


def test_controller_probes_sooner_after_a_probe_without_drafts() -> None:
    """A probe the proposer had no drafts for (no n-gram match yet) is repeated after 1, 2, 4, ... steps,
    up to probe_interval; a probe that got drafts restores the full interval."""

    def probe_steps(controller: DraftLengthController, num_steps: int, has_drafts: bool) -> list[int]:
        steps = []
        for step in range(num_steps):
            if controller.next_num_drafts(step_cost=3.0) > 0:
                steps.append(step)
                if has_drafts:
                    controller.record(num_proposed=15, num_accepted=0)
                else:
                    controller.record_no_proposal()
        return steps

    controller = DraftLengthController(max_drafts=15, draft_cost=0.02, probe_interval=8)
    assert probe_steps(controller, 40, has_drafts=False) == [0, 1, 3, 7, 15, 23, 31, 39]
    # drafts again (all rejected): the full interval, and the backoff starts over after it
    assert probe_steps(controller, 10, has_drafts=True) == [7]
    assert probe_steps(controller, 8, has_drafts=False) == [5, 6]
    # no drafts for a step that was not a probe: the interval stays
    controller = DraftLengthController(max_drafts=15, draft_cost=0.02, probe_interval=8)
    assert probe_steps(controller, 1, has_drafts=True) == [0]
    assert controller.next_num_drafts(step_cost=3.0) == 0
    controller.record_no_proposal()
    assert probe_steps(controller, 8, has_drafts=False) == [6, 7]  # the full interval, then backoff


# --- on the GPU, the same answers as on the CPU -------------------------------------------------------


@pytest.mark.gpu
def test_cuda_matches_cpu() -> None:
    trials = Trials(seed=11, deterministic_drafts=False)
    on_cpu = trials.verify()
    cuda = torch.device("cuda")
    on_gpu = verify_sampled(
        trials.target.expand(NUM_TRIALS, MAX_DRAFTS + 1, VOCAB_SIZE).to(cuda),
        trials.draft_probs.to(cuda),
        trials.drafts.to(cuda),
        trials.num_drafts.to(cuda),
        trials.accept_uniforms.to(cuda),
        trials.final_uniforms.to(cuda),
    )
    assert torch.equal(on_gpu.num_accepted.cpu(), on_cpu.num_accepted)
    assert torch.equal(on_gpu.output_token_ids.cpu(), on_cpu.output_token_ids)
    greedy_target = trials.target.argmax(dim=-1).expand(NUM_TRIALS, MAX_DRAFTS + 1)
    greedy = verify_greedy(greedy_target.to(cuda), trials.drafts.to(cuda), trials.num_drafts.to(cuda))
    expected = verify_greedy(greedy_target, trials.drafts, trials.num_drafts)
    assert torch.equal(greedy.output_token_ids.cpu(), expected.output_token_ids)
