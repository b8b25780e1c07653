"""Constrained rows sampled again from their masked logits: the graph cache's masked-sampling replays.

A constrained row's mask follows its previous token, which the host may not have read when a step launches
(run-ahead), so a graph step samples every row unmasked, and once the masks are written the constrained
rows are sampled again here: a bucket of C rows gathers their rows of the step's logits, applies their
bitmasks (kernels/token_mask.py) and samples into their rows of the step's samples (token_ids), before
the next launch reads them. The host writes the masks straight into a pinned staging buffer (bitmasks),
one row per constrained row; each replay's other inputs (rows, sampling fields) have a staging buffer of
their own, so none is overwritten before its copy has run. A step without constrained rows never
touches this.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tileinfer.engine.graph_buckets import (
    DECODE_BATCH_SIZES,
    Bucket,
    sampling_tensors,
    sizes_up_to,
    stage_sampling,
)
from tileinfer.engine.sampling.sampler import Sampler
from tileinfer.engine.step_inputs import StepInputs
from tileinfer.kernels.sampling import SamplingWorkspace
from tileinfer.kernels.token_mask import apply_token_mask

# The most constrained rows one masked-sampling replay takes (more take several): its gathered logits are
# [rows, vocab] float32 scratch, 39 MB at 64 rows of a 152k vocabulary.
MAX_MASKED_ROWS = 64


class MaskedSampling:
    def __init__(
        self,
        logits: torch.Tensor,
        token_ids: torch.Tensor,
        sampler: Sampler,
        workspace: SamplingWorkspace,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        vocab_words: int,
        host: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Buckets up to MAX_MASKED_ROWS rows, sampling from the graph cache's logits [rows, vocab] into its
        token_ids (whose last row takes padding rows' samples). host: a host buffer the device copies from
        without waiting (pinned on a GPU)."""
        self.logits, self.token_ids, self.sampler, self.workspace = logits, token_ids, sampler, workspace
        device, vocab = logits.device, logits.shape[1]
        max_masked = min(MAX_MASKED_ROWS, max_num_seqs)
        self.buckets = {
            size: Bucket(False, 0, 0, 0, size, max_blocks_per_seq, masked=True)
            for size in sizes_up_to(DECODE_BATCH_SIZES, max_masked)
        }
        for bucket in self.buckets.values():
            bucket.lay_out()
        # one static buffer; a staging buffer for each replay of one step; the bitmasks: a row per row
        nbytes = max(bucket.nbytes for bucket in self.buckets.values())
        self.inputs = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.staging = [
            host(torch.zeros(nbytes, dtype=torch.uint8)) for _ in range(-(-max_num_seqs // max_masked))
        ]
        for bucket in self.buckets.values():
            bucket.host = [bucket.views(staging.numpy()) for staging in self.staging]
            bucket.device = bucket.views(self.inputs)
        self.bitmask = torch.full((max_masked, vocab_words), -1, dtype=torch.int32, device=device)
        # two halves: a step's masks fill one while a late step's (ModelRunner.defer_masks) may hold the other
        self.bitmask_staging = host(torch.full((2, max_num_seqs, vocab_words), -1, dtype=torch.int32))
        self.masked_logits = torch.zeros(max_masked, vocab, dtype=torch.float32, device=device)
        self.masked_token_ids = torch.zeros(max_masked, dtype=torch.int64, device=device)
        # constrained rows never use penalties here (the runner samples those eagerly): no counts, stride 0
        self.no_counts = torch.zeros(1, vocab, dtype=torch.int32, device=device).expand(max_masked, vocab)
        self.no_prompt_mask = torch.zeros(1, vocab, dtype=torch.bool, device=device).expand(max_masked, vocab)

    def capture(self, capture: Callable[[Callable[[], None]], Callable[[], None]]) -> None:
        """Each bucket's replay: capture(step) (the graph cache's, on its memory pool), largest first."""
        empty = StepInputs.empty()
        for bucket in sorted(self.buckets.values(), key=lambda bucket: -bucket.num_samples):
            self._stage(bucket, 0, [], self.bitmask_staging[0, :0], empty)
            bucket.replay = capture(lambda bucket=bucket: self._step(bucket))

    def bitmasks(self, num_rows: int, half: int = 0) -> torch.Tensor:
        """Where the masks of num_rows rows are written on the host (int32 [num_rows, vocab words], pinned;
        in one half of the staging), before sample is called: free once that step has been read. A
        step's masks that sit out a launch (ModelRunner.defer_masks) hold their half until sampled."""
        return self.bitmask_staging[half, :num_rows]

    def sample(
        self, logits: torch.Tensor, inputs: StepInputs, rows: list[int], bitmask: torch.Tensor
    ) -> None:
        """Sample again the rows of a step (its inputs and logits, one row each) from their logits masked
        with their masks (bitmask, from bitmasks: row i for rows[i]), into their rows of token_ids."""
        if logits.data_ptr() != self.logits.data_ptr():  # an eager step's logits
            self.logits[: logits.shape[0]].copy_(logits)
        largest = max(self.buckets)
        for replay, start in enumerate(range(0, len(rows), largest)):
            chunk = rows[start : start + largest]
            bucket = next(b for size, b in self.buckets.items() if size >= len(chunk))
            self._stage(bucket, replay, chunk, bitmask[start : start + len(chunk)], inputs)
            bucket.replay()

    def _step(self, bucket: Bucket) -> None:
        """Sample the bucket's rows of the last step's logits, masked, into their rows of token_ids."""
        views, size = bucket.device, bucket.num_samples
        rows = views["rows"]
        logits = self.masked_logits[:size]
        torch.index_select(self.logits, 0, rows.clamp(min=0), out=logits)
        apply_token_mask(logits, self.bitmask[:size])
        tensors = sampling_tensors(views, size, self.no_counts, self.no_prompt_mask)
        self.sampler.sample_into(logits, tensors, self.masked_token_ids[:size], self.workspace)
        padding = len(self.token_ids) - 1
        self.token_ids.index_copy_(0, torch.where(rows >= 0, rows, padding), self.masked_token_ids[:size])

    def _stage(
        self, bucket: Bucket, replay: int, rows: list[int], masks: torch.Tensor, inputs: StepInputs
    ) -> None:
        """Copy a replay's inputs to the device: the constrained rows (of the step whose inputs these are),
        through the step's replay-th staging buffer, and their masks (pinned host rows). Padding rows keep
        an earlier replay's masks (their samples go to the padding row of token_ids)."""
        host = bucket.host[replay]
        num_rows = len(rows)
        host["rows"][:num_rows] = rows
        host["rows"][num_rows:] = -1
        stage_sampling(
            host, [inputs.seeds[row] for row in rows], [inputs.draw_positions[row] for row in rows],
            [inputs.top_k[row] for row in rows], [inputs.sampling_floats[row] for row in rows],
        )  # fmt: skip
        self.inputs[: bucket.nbytes].copy_(self.staging[replay][: bucket.nbytes], non_blocking=True)
        self.bitmask[:num_rows].copy_(masks, non_blocking=True)
