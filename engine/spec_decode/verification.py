"""Exact verification of draft tokens (greedy and rejection sampling) and the adaptive number of drafts.

The engine scores [last token, draft 1..k] in one forward pass, which gives the target's choice for k + 1
positions: position i is conditioned on drafts 1..i, so it is what plain decoding would see there if
those drafts are accepted. Verification keeps the longest accepted prefix of drafts and adds one token of
the target's own, so every step emits between 1 and k + 1 tokens and the output is what plain decoding
gives: token for token under greedy, in distribution under sampling.

Batches hold one row per sequence, padded to the longest draft (k_max); `num_drafts` [num_seqs] says how
many drafts of a row are real. Everything is batched torch with no host synchronization, on any device.
"""

from __future__ import annotations

import dataclasses

import torch
from tileinfer.kernels.sampling import race_scores_reference

PAD_TOKEN_ID = -1  # in output_token_ids, past a row's emitted tokens


@dataclasses.dataclass
class Verified:
    output_token_ids: torch.Tensor  # [num_seqs, k_max + 1] int64: emitted tokens, then PAD_TOKEN_ID
    num_accepted: torch.Tensor  # [num_seqs] int64: drafts accepted; the row emits num_accepted + 1 tokens


def verify_greedy(
    target_token_ids: torch.Tensor, draft_token_ids: torch.Tensor, num_drafts: torch.Tensor
) -> Verified:
    """Accept the drafts that equal the target's argmax, up to the first that does not.

    target_token_ids [num_seqs, k_max + 1]: the target's argmax at each scored position.
    draft_token_ids [num_seqs, k_max]: the drafts (padding past num_drafts is ignored).
    The emitted tokens are the target's own: accepted drafts equal them, and the one after is the target's
    correction at the first mismatch, or its bonus token when every draft was accepted.
    """
    num_accepted = _accepted_prefix(draft_token_ids == target_token_ids[:, :-1], num_drafts)
    return Verified(_mask_after(target_token_ids, num_accepted), num_accepted)


def verify_sampled(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    accept_uniforms: torch.Tensor,
    final_uniforms: torch.Tensor,
) -> Verified:
    """Rejection sampling (Leviathan et al. 2023, Chen et al. 2023): the emitted tokens follow target_probs.

    target_probs [num_seqs, k_max + 1, vocab]: the distribution plain decoding would sample from at each
        position (after temperature, top-k, top-p, min-p).
    draft_probs [num_seqs, k_max, vocab]: the distribution each draft was sampled from, or None for
        deterministic drafts (n-gram, a greedy draft model): q is then one-hot on the draft token.
    draft_token_ids [num_seqs, k_max]; num_drafts [num_seqs].

    Draft i (0-based) is accepted with probability min(1, p_i(x_i) / q_i(x_i)). At the first rejection
    the row's last token is drawn from normalize(max(p_i - q_i, 0)); when all of its drafts are accepted
    it is a bonus token drawn from p at position num_drafts.

    Random numbers, both U[0, 1) and supplied by the caller (so that the engine can key them by seed and
    position, as its sampler does):
    - accept_uniforms [num_seqs, k_max]: draft i is accepted iff accept_uniforms[:, i] * q_i(x_i) <
      p_i(x_i). Only columns up to the first rejection matter; the rest are ignored.
    - final_uniforms [num_seqs, k_max + 1, vocab]: each position's; the one last token of a row, at its
      position num_accepted, is argmax(r / -log(u)) over the vocabulary with that position's u, r being the
      residual or bonus distribution (the sampler's exponential race, kernels/sampling.py, which needs no
      normalization).
    """
    num_seqs, max_drafts = draft_token_ids.shape
    rows = torch.arange(num_seqs, device=target_probs.device)

    # [num_seqs, k_max]: p and q of each draft token at its own position
    draft_index = draft_token_ids.clamp_min(0).unsqueeze(-1)  # padding may hold any id
    target_at_draft = target_probs[:, :max_drafts].gather(2, draft_index).squeeze(-1)
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs.gather(2, draft_index).squeeze(-1)
    # u < p / q without dividing by a q of zero (then any p > 0 accepts)
    num_accepted = _accepted_prefix(accept_uniforms * draft_at_draft < target_at_draft, num_drafts)

    # The last token: at row r's position num_accepted[r], from p minus q where a draft was rejected there.
    final_probs = _row_at(target_probs, num_accepted)  # [num_seqs, vocab]
    rejected = (num_accepted < num_drafts).unsqueeze(-1)  # [num_seqs, 1]
    if max_drafts > 0:
        rejected_position = num_accepted.clamp_max(max_drafts - 1)
        if draft_probs is None:
            # q one-hot on x: max(p - q, 0) is p with x removed
            rejected_token = draft_token_ids[rows, rejected_position].clamp_min(0).unsqueeze(-1)
            residual = final_probs.scatter(1, rejected_token, 0.0)
        else:
            residual = (final_probs - _row_at(draft_probs, rejected_position)).clamp_min(0.0)
        # Rounding can leave no mass where p and q (nearly) agree; p itself is then the right fallback.
        has_mass = residual.sum(dim=-1, keepdim=True) > 0
        final_probs = torch.where(rejected & has_mass, residual, final_probs)
    # log r - log(-log u): a u of 0 makes its token lose, and r = 0 gives -inf
    scores = race_scores_reference(final_probs.log(), _row_at(final_uniforms, num_accepted))
    final_token_ids = scores.argmax(dim=-1)

    output_token_ids = torch.cat([draft_token_ids, draft_token_ids.new_zeros(num_seqs, 1)], dim=1)
    output_token_ids = _mask_after(output_token_ids, num_accepted)
    output_token_ids[rows, num_accepted] = final_token_ids.to(output_token_ids.dtype)
    return Verified(output_token_ids, num_accepted)


def _accepted_prefix(accepted: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """[num_seqs] length of each row's leading run of accepted real drafts; accepted is [num_seqs, k_max]."""
    positions = torch.arange(accepted.shape[1], device=accepted.device)
    accepted = accepted & (positions < num_drafts.unsqueeze(-1))
    return accepted.long().cumprod(dim=1).sum(dim=1)


def _row_at(probs: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """probs[row, position[row]] for each row: [num_seqs, vocab] from [num_seqs, positions, vocab]."""
    # gather, not advanced indexing: about 1.6x faster on an H200 for a [64, 9, 152k] batch
    index = position.view(-1, 1, 1).expand(-1, 1, probs.shape[2])
    return probs.gather(1, index).squeeze(1)


def _mask_after(token_ids: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """token_ids [num_seqs, k_max + 1] with PAD_TOKEN_ID past each row's num_accepted + 1 tokens."""
    positions = torch.arange(token_ids.shape[1], device=token_ids.device)
    emitted = positions <= num_accepted.unsqueeze(-1)
    return torch.where(emitted, token_ids, torch.full_like(token_ids, PAD_TOKEN_ID))


PROBE_ACCEPTANCE = 0.9  # a probe asks for the k that this acceptance would pay best for


class DraftLengthController:
    """Picks the number of drafts k for a sequence's next step from the acceptance measured so far.

    Rule: model each draft as accepted with the same probability a, independently. a is estimated as
    EMA(accepted) / EMA(examined) over the steps that had drafts, where a step examined its accepted
    drafts plus the one rejected draft, if any (drafts after a rejection tell nothing). A step with k
    drafts then emits E(k) = 1 + a + ... + a^k tokens at a cost of 1 + draft_cost * k plain decode steps,
    and the controller picks the k in [0, max_drafts] with the most tokens per cost (Leviathan et al.,
    eq. for the walltime improvement), the smallest k on ties; k = 0 means plain decoding pays better.
    A step with drafts costs at least the measured step_cost (Speculator.step_cost: a verify step's
    time over a plain step's, which on a GPU includes the overhead that drafts add whatever their number).
    So that a sequence at k = 0 can recover, it probes: its first step at k = 0 and then every
    probe_interval-th one ask for the k that an acceptance of PROBE_ACCEPTANCE would pay best for. A
    probe with one draft taught little (an accepted draft moved the estimate from 0.5 to 0.6), so on the
    H200's code edit 61 of 78 steps went without drafts while the estimate climbed; a probe of 15 n-gram
    drafts costs about what one does, since the verify step's fixed cost dominates. Probes stay rare:
    with run-ahead, asking the proposer at all means reading the launched step's tokens first. A probe
    the proposer had no drafts for (n-gram: no match yet) is repeated sooner, after 1, 2, 4, ... steps up
    to probe_interval: a prompt lookup often matches a few tokens into a copied passage, and waiting the
    whole interval cost the code edit its first 16 steps.
    Acceptance differs between requests (code edits vs open chat), so the engine keeps one per sequence.
    """

    def __init__(
        self,
        max_drafts: int,
        draft_cost: float = 0.1,
        smoothing: float = 0.2,
        initial_acceptance: float = 0.5,
        probe_interval: int = 16,
    ) -> None:
        self.max_drafts = max_drafts
        self.draft_cost = draft_cost  # one more draft (proposing + verifying it) / one plain decode step
        self.smoothing = smoothing  # weight of the newest step in the moving averages
        self.probe_interval = probe_interval
        self._accepted_average = initial_acceptance
        self._examined_average = 1.0
        self._steps_without_drafts = probe_interval - 1  # a first step at k = 0 probes at once
        self._probe_gap = probe_interval  # steps at k = 0 before the next probe
        self._gap_after_no_proposal = 1  # the next gap if this probe gets no drafts (doubles each time)
        self._probing = False  # whether the last step's k came from a probe

    @property
    def acceptance(self) -> float:
        """The estimated probability that one draft is accepted."""
        return self._accepted_average / self._examined_average

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """Report a verified step: how many drafts it had and how many were accepted."""
        if num_proposed == 0:
            return
        self._probe_gap, self._gap_after_no_proposal = self.probe_interval, 1
        num_examined = num_accepted + (1 if num_accepted < num_proposed else 0)
        keep = 1.0 - self.smoothing
        self._accepted_average = keep * self._accepted_average + self.smoothing * num_accepted
        self._examined_average = keep * self._examined_average + self.smoothing * num_examined

    def next_num_drafts(self, step_cost: float = 1.0) -> int:
        """k for the next step (call once per step). step_cost: what a step with drafts costs at least,
        in plain decode steps, as measured (a verify step's fixed overhead); each draft adds draft_cost."""
        best_drafts = self._best_num_drafts(self.acceptance, step_cost)
        self._probing = False
        if best_drafts > 0:
            self._steps_without_drafts = 0
            return best_drafts
        self._steps_without_drafts += 1
        if self.max_drafts > 0 and self._steps_without_drafts >= self._probe_gap:
            self._steps_without_drafts = 0
            self._probing = True
            return max(1, self._best_num_drafts(PROBE_ACCEPTANCE, step_cost))
        return 0

    def record_no_proposal(self) -> None:
        """The proposer had no drafts for the step that asked. After a probe, the next comes sooner."""
        if self._probing:
            self._probe_gap = self._gap_after_no_proposal
            self._gap_after_no_proposal = min(2 * self._gap_after_no_proposal, self.probe_interval)

    def _best_num_drafts(self, acceptance: float, step_cost: float) -> int:
        """The k in [0, max_drafts] with the most expected tokens per cost at this acceptance."""
        best_drafts, best_rate, expected_tokens = 0, 1.0, 1.0
        for num_drafts in range(1, self.max_drafts + 1):
            expected_tokens += acceptance**num_drafts
            rate = expected_tokens / max(step_cost, 1.0 + self.draft_cost * num_drafts)
            if rate > best_rate:
                best_drafts, best_rate = num_drafts, rate
        return best_drafts
