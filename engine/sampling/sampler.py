"""The one sampler: the next token of each sequence from its logits, and sampled verification of drafts.

One algorithm (kernels/sampling.py): penalties -> greedy argmax at temperature 0 -> temperature -> top-k
-> top-p -> min-p -> the exponential race, whose noise is Philox keyed by the request's seed (a random one
if unseeded) with counter (vocab index, position, stream), position being the drawn token's index in the
sequence. The CPU runs the torch reference and a GPU the Triton kernels; both compute the same bits, so
the same logits, seed and position give the same token on either. Sampled verification draws each
draft's acceptance uniform from ACCEPT_STREAM and its last token from TOKEN_STREAM, at the positions plain
decoding would draw them: a verify step uses plain decoding's counters.
"""

from __future__ import annotations

import torch
from tileinfer.engine.sequence import Sequence
from tileinfer.engine.spec_decode.verification import verify_sampled
from tileinfer.kernels.sampling import (
    ACCEPT_STREAM,
    TOKEN_STREAM,
    SamplingTensors,
    SamplingWorkspace,
    filtered_probs_reference,
    philox_uniform_reference,
    philox_uniform_triton,
    sample_reference,
    sample_triton,
    seed_to_int64,
)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size  # the width of every logits row
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.keys: dict[str, int] = {}  # request id -> the Philox key of its noise

    def key_of(self, seq: Sequence) -> int:
        """The request's Philox key (int64): its seed, or a random one drawn (from torch's generator) on
        first use; 0 for greedy requests, which draw no noise."""
        if seq.params.is_greedy:
            return 0
        key = self.keys.get(seq.request_id)
        if key is None:
            seed = seq.params.seed
            key = seed_to_int64(seed) if seed is not None else int(torch.randint(0, 2**63 - 1, ()))
            self.keys[seq.request_id] = key
        return key

    def forget(self, request_id: str) -> None:
        self.keys.pop(request_id, None)

    def tensors(self, seqs: list[Sequence], draw_positions: list[int] | None = None) -> SamplingTensors:
        """Per-row parameters on the device, each row drawing its sequence's token at draw_positions[row]
        (its index in the sequence; by default the next one, num_tokens); the token counts only for rows
        that use penalties."""
        histories = [seq.params.has_penalties for seq in seqs]
        return SamplingTensors.from_params(
            [seq.params for seq in seqs],
            [seq.prompt_token_ids if used else [] for seq, used in zip(seqs, histories, strict=True)],
            [seq.output_token_ids if used else [] for seq, used in zip(seqs, histories, strict=True)],
            [self.key_of(seq) for seq in seqs],
            draw_positions if draw_positions is not None else [seq.num_tokens for seq in seqs],
            self.vocab_size,
            self.device,
        )

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], draw_positions: list[int] | None = None
    ) -> torch.Tensor:
        """Each sequence's token at draw_positions[row] (by default its next one), one logits row each:
        [num_seqs] int64 on the logits' device."""
        tensors = self.tensors(seqs, draw_positions)
        return sample_triton(logits, tensors) if self.on_gpu else sample_reference(logits, tensors)

    def sample_into(
        self, logits: torch.Tensor, tensors: SamplingTensors, out: torch.Tensor, workspace: SamplingWorkspace
    ) -> None:
        """Each row's token into `out`, drawing on `workspace` on a GPU: a graph's static buffers."""
        if self.on_gpu:
            sample_triton(logits, tensors, out=out, workspace=workspace)
        else:
            out.copy_(sample_reference(logits, tensors))

    def verify(self, seq: Sequence, logits: torch.Tensor, drafts: list[int]) -> tuple[list[int], int]:
        """Rejection sampling of a sequence's drafts (the tokens after its committed ones); logits [k + 1, V]
        score its last committed token and each draft. Returns (accepted drafts + the target's own next
        token, number of drafts accepted)."""
        device = logits.device
        num_rows = len(drafts) + 1
        first = seq.num_tokens  # the position of the first draft
        tensors = SamplingTensors.from_params(
            [seq.params] * num_rows, [[]] * num_rows, [[]] * num_rows, [self.key_of(seq)] * num_rows,
            range(first, first + num_rows), self.vocab_size, device,
        )  # fmt: skip
        uniform = philox_uniform_triton if self.on_gpu else philox_uniform_reference
        final_uniforms = uniform(tensors.seeds, tensors.positions, logits.shape[1], TOKEN_STREAM)
        accept_uniforms = uniform(tensors.seeds[:-1], tensors.positions[:-1], 1, ACCEPT_STREAM)
        verified = verify_sampled(
            filtered_probs_reference(logits, tensors)[None],
            None,  # deterministic drafts: q is one-hot on each
            torch.tensor([drafts], dtype=torch.int64, device=device),
            torch.tensor([len(drafts)], device=device),
            accept_uniforms.T,
            final_uniforms[None],
        )
        num_accepted = int(verified.num_accepted[0])
        return verified.output_token_ids[0, : num_accepted + 1].tolist(), num_accepted
