"""Runs one step of the model and samples: owns the KV cache, builds the step's inputs, returns tokens.

On the CPU every step runs eagerly with the torch reference ops and sampler. On a GPU the decoder runs
Triton kernels and samples on the device (engine/sampling/sampler.py: the same tokens for the same logits),
and a step replays a CUDA graph of the graph cache (engine/graphs.py) where one fits: a decode step (one new
token per sequence) a decode bucket's, which samples too; a prefill, mixed or verify step a step bucket's.
Each step's inputs are built once (engine/step_inputs.py), and the graphs and the eager step fill from them.

A step can also be launched ahead (launch): a decode step (a decode-bucket replay) or a mixed one
(prompt chunks beside decoding sequences: a step-bucket replay, then sampling on the device). Its input
tokens may be the device-side samples of the previous launch, which the host has not read yet (rows with
a fed_back_row, engine/step.py), so the host prepares step n+1 while the GPU still runs step n and reads
tokens back one step later.

Structured output: a row whose sequence has a grammar samples from logits masked with its allowed tokens
(engine/sampling/grammar.py fills the masks on the host; kernels/token_mask.py applies them); logprobs are
those of the unmasked logits. Its mask follows its previous token, which a step launched ahead takes on the
device before the host has read it; so a decode or launched step samples every row as usual, and once the host
knows the constrained rows' grammar state (after reading the previous step), start_masks has their masks
filled on a worker thread while the host goes on, and the samples are replaced from the masked logits
(GraphCache.sample_masked, a replay) before anything reads them: the next launch, or reading this one
(finish_masks). Constrained rows thus decode every step beside the others, in the same graphs, and the
mask fill overlaps the host's other work. A step the host does not launch ahead (execute: eager, verify)
has its masks filled while its forward runs, at every draft position (the drafts are on the host), and
samples or verifies from masked logits; a constrained row with penalties samples eagerly from them. Either
way a step's masks are one GrammarMasks (engine/step.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection

import torch
from tileinfer.engine.graphs import GraphCache
from tileinfer.engine.kv.block_manager import BlockCopy
from tileinfer.engine.kv.cache import allocate_kv_cache, copy_blocks
from tileinfer.engine.models.decoder import Decoder
from tileinfer.engine.sampling.grammar import MaskFiller
from tileinfer.engine.sampling.params import TokenLogprob
from tileinfer.engine.sampling.sampler import Sampler
from tileinfer.engine.sequence import Sequence
from tileinfer.engine.spec_decode.proposer_interface import DeviceDrafts, DraftsRead
from tileinfer.engine.spec_decode.verify_step import read_ring, ring_drafts_read, verify_rows
from tileinfer.engine.step import (
    GrammarMasks,
    LateSamples,
    PendingStep,
    RowOutput,
    ScheduledRow,
    is_decode_step,
)
from tileinfer.engine.step_inputs import StepInputs, StepInputsBuilder
from tileinfer.kernels.paged_attention import AttentionMetadata
from tileinfer.kernels.sampling import top_logprobs
from tileinfer.kernels.token_mask import apply_token_mask, bitmask_words

# The most constrained rows of one step that sit out a launch while their masks are filled (defer_masks):
# their kept logits are float32 [rows, vocab], 39 MB at 64 rows of a 152k vocabulary.
MAX_LATE_ROWS = 64


class ModelRunner:
    def __init__(
        self,
        decoder: Decoder,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        max_num_seqs: int,
        max_model_len: int,
        graphs: bool | None = None,
        step_graphs: bool = True,
        max_num_batched_tokens: int = 2048,
        max_logit_rows: int | None = None,
        capture_layers: tuple[int, ...] = (),
        kv_cache_dtype: str = "auto",
        calibration_tokens: list[int] | None = None,
    ) -> None:
        """graphs: replay steps from a GraphCache (None: on a GPU only; True on the CPU too, where capture
        records each step and replay calls it: tests); decode steps from its decode buckets, and with
        step_graphs prefill, mixed and verify steps of up to max_num_batched_tokens tokens and
        max_logit_rows logit rows (default: one per sequence) from its step buckets.
        capture_layers: decoder layers whose output stream every step returns (RowOutput.hidden; DFlash);
        their steps run from step buckets (which capture them too) or eagerly, never from decode buckets.
        kv_cache_dtype "int8": an INT8 cache, whose key smoothing comes from a forward pass over
        calibration_tokens before any graph is captured (engine/kv/cache.py)."""
        spec = decoder.spec
        self.decoder = decoder
        self.spec = spec
        self.logit_vocab_size = decoder.logit_vocab_size  # the width of every logits tensor
        self.block_size = block_size
        self.device = decoder.model.embed_tokens.weight.device
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # [num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = allocate_kv_cache(
            decoder, num_blocks, block_size, dtype, self.max_blocks_per_seq * block_size, kv_cache_dtype,
            calibration_tokens,
        )  # fmt: skip
        self.sampler = Sampler(self.logit_vocab_size, self.device)
        self.inputs = StepInputsBuilder(block_size, self.sampler)
        self.capture_layers = capture_layers
        self.graphs: GraphCache | None = None
        # the half of the masked sampling's bitmask staging that the last masks began took, and the one a
        # late step's masks hold (defer_masks; None: none)
        self._masks_half, self._late_half = 0, None
        if graphs is None:
            graphs = self.device.type == "cuda"
        if graphs and (step_graphs or not capture_layers):
            self.graphs = GraphCache(
                decoder, self.kv_cache, self.sampler, max_num_seqs,
                max_num_batched_tokens if step_graphs else None, max_logit_rows or max_num_seqs,
                self.max_blocks_per_seq, block_size, capture_layers, decode=not capture_layers,
            )  # fmt: skip

    @functools.cached_property
    def masks(self) -> MaskFiller:
        """The constrained rows' mask filler (its threads made when a grammar first needs them)."""
        return MaskFiller()

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        copy_blocks(self.kv_cache, copies)

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)
        self.inputs.forget(request_id)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRow], ring: DeviceDrafts | None = None) -> list[RowOutput]:
        """Compute the scheduled tokens (and drafts) and return each row's output: a row whose tokens are
        then all computed samples its next token, or has its drafts verified exactly against the target's
        [last token, drafts] logits (greedy: the target's argmax; sampled: rejection sampling). Drafts with
        a ring_row come from `ring`, read on the device. Eager, a step bucket, or a decode bucket."""
        outputs = [RowOutput([]) for _ in scheduled]
        inputs = self.inputs.build(scheduled)
        if (
            self.graphs is not None
            and inputs.is_decode
            and self.graphs.fits_decode(len(scheduled))
            and not _penalized_and_constrained(scheduled)
        ):
            launch = self._launched(self.graphs.launch(inputs), inputs)
            self.start_masks(launch)
            self.read(launch)
            logits = self.graphs.logits[: len(scheduled)]
            self._sample_into(outputs, list(range(len(scheduled))), scheduled, logits, launch.host_tokens)
            return outputs
        ring_read = read_ring(scheduled, ring, self.device) if ring is not None else None
        masks = self._step_masks(scheduled)  # filled while the forward runs
        logits, hidden = self._forward(inputs, ring_read=ring_read)
        raw_logits, logits = logits, masked_logits(logits, masks)
        ring_drafts = iter(ring_drafts_read(scheduled, ring_read)) if ring is not None else iter(())
        plain: list[int] = []  # rows that sample
        verifying: list[tuple[ScheduledRow, int, list[int]]] = []  # (row, its first logits row, drafts)
        verifying_rows: list[int] = []
        first = 0
        start = 0
        for index, item in enumerate(scheduled):
            if hidden is not None:
                outputs[index].hidden = hidden[start : start + item.num_tokens]
            start += item.num_tokens
            if not item.samples:
                continue  # a prompt chunk: no logits
            if item.num_drafts == 0:
                plain.append(index)
            else:
                drafts = item.draft_ids if item.ring_row is None else next(ring_drafts)
                outputs[index].draft_ids = drafts
                verifying.append((item, first, drafts))
                verifying_rows.append(index)
            first += 1 + item.num_drafts
        for index, (token_ids, num_accepted) in zip(
            verifying_rows, verify_rows(self.sampler, logits, verifying), strict=True
        ):
            output = outputs[index]
            output.token_ids, output.num_accepted = token_ids, num_accepted
            if output.hidden is not None:  # the rows of the tokens it keeps: the last one, accepted drafts
                output.hidden = output.hidden[: num_accepted + 1]
        if plain:
            if verifying:
                rows = torch.tensor(inputs.sample_rows, dtype=torch.int64, device=logits.device)
                logits, raw_logits = logits[rows], raw_logits[rows]
            token_ids = self._sample_eager(logits, inputs)
            self._sample_into(outputs, plain, scheduled, raw_logits, token_ids)
        return outputs

    def can_launch_ahead(self, scheduled: list[ScheduledRow]) -> bool:
        """Whether this step can run before the host has read the previous launch's tokens: a decode-graph
        or step-graph replay on a GPU (the eager CPU path also can, to test the bookkeeping); penalties
        and logprobs need the tokens on the host, so they run step by step."""
        if self.capture_layers or any(
            item.seq.params.has_penalties or item.seq.params.logprobs is not None for item in scheduled
        ):
            return False
        if self.device.type != "cuda":
            return True
        graphs = self.graphs
        if graphs is None or not graphs.decode_buckets:
            return False
        if is_decode_step(scheduled):
            return graphs.fits_decode(len(scheduled))
        num_sampled = sum(item.samples for item in scheduled)
        return (
            graphs.fits_step(sum(item.num_new_tokens for item in scheduled), len(scheduled), num_sampled)
            and num_sampled <= graphs.max_num_seqs
        )

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledRow], previous: PendingStep | None) -> PendingStep:
        """Launch a step (can_launch_ahead) without waiting for it. A row with a fed_back_row takes its last
        input from `previous`, the launch that sampled it."""
        assert all(item.num_new_tokens == 1 for item in scheduled if item.fed_back_row is not None), (
            "a fed-back token is a decoding sequence's input"
        )
        inputs = self.inputs.build(scheduled)
        if previous is not None:
            self.finish_masks(previous)  # its rows' masked samples before this launch reads or replaces them
        if self.graphs is not None and inputs.is_decode and self.graphs.fits_decode(inputs.num_seqs):
            return self._launched(self.graphs.launch(inputs), inputs)
        fed_back = None
        if inputs.source_rows is not None:
            assert previous is not None
            fed_back = previous.device_tokens
        logits = self._forward(inputs, fed_back)[0]
        if self.graphs is not None:
            return self._launched(self.graphs.sample(logits, inputs), inputs, logits)
        token_ids = self._sample_eager(logits, inputs)
        # CPU: filled already
        return PendingStep(inputs.sample_seqs, token_ids, token_ids, ready=None, inputs=inputs, logits=logits)

    @torch.inference_mode()
    def start_masks(self, launched: PendingStep, ending: Collection[Sequence] = ()) -> None:
        """Begin sampling the launched step's constrained rows again from their masked logits: their
        grammars, which must have taken every token before these (the host has read the previous step),
        fill the masks on a worker thread, and finish_masks samples once they are written (until then the
        rows hold unmasked samples). Rows of sequences that finished meanwhile, or are `ending` (their
        grammar ended on the token just read), keep theirs: they are dropped."""
        rows = [
            row
            for row, seq in enumerate(launched.seqs)
            if seq.grammar is not None and not seq.is_finished and seq not in ending
        ]
        if not rows:
            return
        if self.graphs is not None:  # not the half a late fill may still be writing (defer_masks)
            self._masks_half = 1 if self._late_half == 0 else 0
            bitmask = self.graphs.masked.bitmasks(len(rows), self._masks_half)
        else:
            bitmask = torch.empty(len(rows), bitmask_words(self.logit_vocab_size), dtype=torch.int32)
        entries = [(launched.seqs[row].grammar, index, []) for index, row in enumerate(rows)]
        launched.masks = GrammarMasks(rows, bitmask, self.masks.start(entries, bitmask))

    @torch.inference_mode()
    def finish_masks(self, launched: PendingStep) -> None:
        """Replace the launched step's constrained rows' samples (start_masks) by ones from their masked
        logits, once their masks are written: before anything reads the samples. Once only."""
        masks, launched.masks = launched.masks, None
        if masks is None:
            return
        masks.fill.result()
        if self.graphs is not None:
            self.graphs.sample_masked(launched, masks)
            return
        seqs = [launched.seqs[row] for row in masks.rows]
        positions = [launched.inputs.draw_positions[row] for row in masks.rows]
        token_ids = self._sample_masked_rows(launched.logits[masks.rows], masks.bitmask, seqs, positions)
        launched.host_tokens[masks.rows] = token_ids.to(launched.host_tokens.device)

    def defer_masks(self, launched: PendingStep) -> LateSamples | None:
        """Take the launched step's constrained rows out of it while their masks are still being filled,
        so that the next launch need not wait for them: their logits are kept (the next replay overwrites
        the graph's), and sample_late samples them once the fill is done; until then their samples in
        `launched` are not theirs to read. None (nothing taken) when the fill is done, or when there are
        more rows than MAX_LATE_ROWS (the kept logits' bound: about 600 KB a row at Qwen3's vocabulary)."""
        masks = launched.masks
        if masks is None or masks.fill.done() or len(masks.rows) > MAX_LATE_ROWS:
            return None
        launched.masks = None
        rows = masks.rows
        kept = launched.logits[rows]  # a copy, queued before the next launch
        self._late_half = self._masks_half  # a launched step's masks are the last ones begun
        late_masks = GrammarMasks(list(range(len(rows))), masks.bitmask, masks.fill)
        positions = [launched.inputs.draw_positions[row] for row in rows]
        return LateSamples([launched.seqs[row] for row in rows], kept, positions, late_masks)

    @torch.inference_mode()
    def sample_late(self, late: LateSamples) -> list[tuple[Sequence, int]]:
        """The late rows' tokens (defer_masks), from their kept logits masked once the fill is done (it
        waits for it), at their draw positions: the tokens they would have had without sitting out. Rows
        of sequences that finished meanwhile (aborted) draw nothing."""
        late.masks.fill.result()
        live = [row for row, seq in enumerate(late.seqs) if not seq.is_finished]
        self._late_half = None  # read below, before the next masks begin
        if not live:
            return []
        seqs = [late.seqs[row] for row in live]
        positions = [late.draw_positions[row] for row in live]
        tokens = self._sample_masked_rows(late.logits[live], late.masks.bitmask[live], seqs, positions)
        return list(zip(seqs, tokens.tolist(), strict=True))

    def _sample_masked_rows(
        self, logits: torch.Tensor, bitmask: torch.Tensor, seqs: list[Sequence], positions: list[int]
    ) -> torch.Tensor:
        """Each row's token from its logits (a copy, masked in place by its row of the host bitmask), at
        its draw position."""
        apply_token_mask(logits, bitmask.to(logits.device))
        return self.sampler.sample(logits, seqs, positions)

    def read(self, launched: PendingStep) -> list[int]:
        """The launched step's sampled tokens, its constrained rows' masked (finish_masks)."""
        self.finish_masks(launched)
        return launched.read()

    def _launched(
        self, launched: PendingStep, inputs: StepInputs, logits: torch.Tensor | None = None
    ) -> PendingStep:
        """The launch, with what start_masks needs: its inputs and logits (a decode replay's: the graph
        cache's)."""
        launched.inputs = inputs
        launched.logits = logits if logits is not None else self.graphs.logits[: inputs.num_seqs]
        return launched

    @torch.inference_mode()
    def forward_eager(
        self, scheduled: list[ScheduledRow], num_logits: dict[Sequence, int] | None = None
    ) -> torch.Tensor:
        """The float32 logits [num_rows, logit_vocab_size] of each sequence whose tokens are all computed
        after this step, computed eagerly (no graph), without sampling: its last token's row and one per
        draft, or its last num_logits[seq] rows."""
        return self._eager(self.inputs.build(scheduled, num_logits))[0]

    def _forward(
        self, inputs: StepInputs, fed_back: torch.Tensor | None = None, ring_read: DraftsRead | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's logits (inputs.logit_rows), from a step bucket where one fits, else eagerly; and the
        captured hidden rows of every packed token (capture_layers; else None). fed_back: the previous
        launch's samples (PendingStep.device_tokens), which rows with a source row take as input.
        ring_read: input ids (draft rows with a ring_row) that come from the draft ring."""
        gather_drafts = ring_read.gather_into if ring_read is not None else None
        graphs = self.graphs
        if (
            graphs is not None
            and inputs.logit_rows
            and graphs.fits(inputs)
            and (fed_back is None or fed_back is graphs.token_ids)
        ):
            logits = graphs.forward(inputs, gather_drafts)
            hidden = None
            if self.capture_layers:  # the graph's buffer is overwritten by its next replay
                hidden = graphs.captured[: inputs.num_tokens].clone()
            return logits, hidden
        return self._eager(inputs, fed_back, gather_drafts)

    def _eager(
        self,
        inputs: StepInputs,
        fed_back: torch.Tensor | None = None,
        gather_drafts: Callable[[torch.Tensor], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """_forward's logits and hidden rows, computed eagerly."""
        max_blocks = max(len(table) for table in inputs.block_tables)
        block_tables = torch.zeros(inputs.num_seqs, max_blocks, dtype=torch.int32)
        for row, table in enumerate(inputs.block_tables):
            block_tables[row, : len(table)] = torch.tensor(table)
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(inputs.slot_mapping, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(inputs.query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(inputs.seq_lens, dtype=torch.int32, device=device),
            block_tables=block_tables.to(device),
            is_decode=inputs.is_decode,
            max_query_len=inputs.max_query_len,
        )
        capture: dict[int, torch.Tensor | None] | None = (
            dict.fromkeys(self.capture_layers) if self.capture_layers else None
        )
        ids = torch.tensor(inputs.input_ids, dtype=torch.int64, device=device)
        if inputs.source_rows is not None:  # a fed-back token's id is that row of the previous samples
            sources = torch.tensor(inputs.source_rows, dtype=torch.int64, device=device)
            ids = torch.where(sources >= 0, fed_back.to(device)[sources.clamp(min=0)], ids)
        position_ids = torch.tensor(inputs.positions, dtype=torch.int64, device=device)
        rows = torch.tensor(inputs.logit_rows, dtype=torch.int64, device=device)
        if gather_drafts is not None:  # last: a copy queued behind the ring's wait would block the host
            gather_drafts(ids)
        hidden, residual = self.decoder(ids, position_ids, self.kv_cache, metadata, capture)
        captured = None
        if capture is not None:
            captured = torch.cat([capture[index] for index in self.capture_layers], dim=-1)
        if not inputs.logit_rows:  # a prompt chunk that completes no sequence
            return torch.empty(0, self.logit_vocab_size, dtype=torch.float32, device=device), captured
        return self.decoder.compute_logits(hidden[rows], residual[rows]), captured

    def _step_masks(self, scheduled: list[ScheduledRow]) -> GrammarMasks | None:
        """Begin filling the masks of an executed step's constrained logits rows (each sampling row's
        1 + num_drafts rows, in order): a sequence's next token, and one after each draft its grammar
        allows (the rows after one it does not stay unmasked: verification stops there). None: no row is
        constrained."""
        entries, rows = [], []
        first = 0
        for item in scheduled:
            if not item.samples:
                continue
            if item.seq.grammar is not None:  # host drafts only: the speculator gives it no ring drafts
                drafts = item.draft_ids or []
                entries.append((item.seq.grammar, len(rows), drafts))
                rows += range(first, first + 1 + len(drafts))
            first += 1 + item.num_drafts
        if not rows:
            return None
        bitmask = torch.full((len(rows), bitmask_words(self.logit_vocab_size)), -1, dtype=torch.int32)
        return GrammarMasks(rows, bitmask, self.masks.start(entries, bitmask))

    def _sample_eager(self, logits: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """The next token of each sampled row (one logits row each), drawn at its draw position, on the
        host (int64)."""
        if self.graphs is not None and len(inputs.sample_seqs) <= self.graphs.max_num_seqs:
            launch = self.graphs.sample(logits, inputs)
            launch.read()
            return launch.host_tokens.clone()  # the pinned buffer is reused two launches later
        return self.sampler.sample(logits, inputs.sample_seqs, inputs.draw_positions).cpu()

    def _sample_into(
        self,
        outputs: list[RowOutput],
        indices: list[int],
        scheduled: list[ScheduledRow],
        logits: torch.Tensor,
        token_ids: torch.Tensor,
    ) -> None:
        """Fill the outputs of the rows at `indices` (which sampled token_ids[i] from logits[i]): the
        token, and its logprobs where the request asks for them."""
        seqs = [scheduled[index].seq for index in indices]
        wanted = [seq.params.logprobs for seq in seqs]
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if any(count is not None for count in wanted):
            top = max(count or 0 for count in wanted)
            chosen, top_ids, top_values = top_logprobs(logits, token_ids.to(logits.device), max(top, 1))
            chosen, top_ids, top_values = chosen.tolist(), top_ids.tolist(), top_values.tolist()
            for row, count in enumerate(wanted):
                if count is not None:
                    pairs = list(zip(top_ids[row][:count], top_values[row][:count], strict=True))
                    logprobs[row] = TokenLogprob(int(token_ids[row]), chosen[row], pairs)
        for row, (index, token_id) in enumerate(zip(indices, token_ids.tolist(), strict=True)):
            outputs[index].token_ids = [token_id]
            outputs[index].logprob = logprobs[row]


def _penalized_and_constrained(scheduled: list[ScheduledRow]) -> bool:
    """Whether a row's sequence has a grammar and penalties (its masked logits are sampled eagerly: the
    graph cache's masked sampling reads no token counts)."""
    return any(item.seq.grammar is not None and item.seq.params.has_penalties for item in scheduled)


def masked_logits(logits: torch.Tensor, masks: GrammarMasks | None) -> torch.Tensor:
    """The logits with the masks' rows' disallowed tokens at -inf (once the fill is done): a copy; the
    logits themselves without masks."""
    if masks is None:
        return logits
    masks.fill.result()
    rows = torch.tensor(masks.rows, dtype=torch.int64, device=logits.device)
    bitmask = masks.bitmask
    if logits.is_cuda:
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    constrained = logits[rows]
    apply_token_mask(constrained, bitmask)
    return logits.index_copy(0, rows, constrained)
