"""Runs one step of the model and samples: owns the KV cache, builds the step's inputs, returns tokens.

On the CPU every step runs eagerly with the torch reference ops and sampler. On a GPU the decoder runs
Triton kernels and samples on the device (engine/sampler.py: the same tokens for the same logits); a step
that only decodes (one new token per sequence) replays a CUDA graph captured for its batch-size bucket,
whose inputs are written into static buffers, so the step costs the GPU's time and not the host's.

A step can also be launched ahead (launch): a decode step (a decode-graph replay) or a mixed one
(prompt chunks beside decoding sequences: a step-graph replay, then sampling on the device). Its input
tokens may be the device-side samples of the previous launch, which the host has not read yet (rows with
a fed_back_row, engine/step.py), so the host prepares step n+1 while the GPU still runs step n and reads
tokens back one step later.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.block_manager import BlockCopy
from engine.decode_graphs import DecodeGraphs
from engine.interfaces import DraftsRead, RingStep
from engine.kv_cache import allocate_kv_cache, copy_blocks
from engine.model import Decoder
from engine.sampler import Sampler
from engine.sampling import TokenLogprob
from engine.sequence import Sequence
from engine.speculative import verify_greedy
from engine.step import PendingStep, ScheduledRow, is_decode_step
from engine.step_graphs import StepGraphs, StepInputs
from kernels.attention import AttentionMetadata
from kernels.sampling import top_logprobs

# In Sequence.token_ids: a draft that the proposer writes into the draft ring, read by the verify step
# (engine/interfaces.py RingStep); the host learns it with the step's results.
PENDING_DRAFT = -2


@dataclasses.dataclass
class SampledToken:
    seq: Sequence
    token_id: int
    logprob: TokenLogprob | None


@dataclasses.dataclass
class Verification:
    """A sequence's drafts checked against the target: the tokens it emits this step."""

    seq: Sequence
    token_ids: list[int]  # the accepted drafts, then the target's own next token
    num_accepted: int


class ModelRunner:
    def __init__(
        self,
        decoder: Decoder,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        max_num_seqs: int,
        max_model_len: int,
        use_cuda_graphs: bool = True,
        step_graphs: bool = True,
        max_num_batched_tokens: int = 2048,
        max_logit_rows: int | None = None,
        capture_layers: tuple[int, ...] = (),
        kv_cache_dtype: str = "auto",
        calibration_tokens: list[int] | None = None,
    ) -> None:
        """step_graphs: also replay prefill, mixed and verify steps from CUDA graphs (StepGraphs) of up to
        max_num_batched_tokens tokens and max_logit_rows logit rows (default: one per sequence).
        capture_layers: decoder layers whose output stream every step keeps in captured_hidden (DFlash);
        their steps run from the step graphs (which capture them too) or eagerly, never from DecodeGraphs.
        kv_cache_dtype "int8": an INT8 cache, whose key smoothing comes from a forward pass over
        calibration_tokens before any graph is captured (engine/kv_cache.py)."""
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
        self.capture_layers = capture_layers
        self.captured_hidden: torch.Tensor | None = None  # [num_tokens, len(layers) * hidden], packed
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and use_cuda_graphs and not capture_layers:
            self.graphs = DecodeGraphs(self, max_num_seqs)
        self.step_graphs: StepGraphs | None = None
        if self.device.type == "cuda" and use_cuda_graphs and step_graphs:
            self.step_graphs = StepGraphs(
                decoder, self.kv_cache, max_num_seqs, max_num_batched_tokens,
                max_logit_rows or max_num_seqs, self.max_blocks_per_seq, block_size, capture_layers,
                feedback=self.graphs.token_ids if self.graphs is not None else None,
            )  # fmt: skip

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        copy_blocks(self.kv_cache, copies)

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)
        if self.graphs is not None:
            self.graphs.forget(request_id)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRow]) -> list[SampledToken]:
        """Compute the scheduled tokens and sample the next token of every sequence whose tokens are
        then all computed (in scheduled order)."""
        sampled = [item.seq for item in scheduled if item.samples]
        is_decode = is_decode_step(scheduled)
        if self.graphs is not None and is_decode and self.graphs.fits(len(scheduled)):
            launch = self.graphs.launch(scheduled)
            launch.read()
            token_ids, logits = launch.host_tokens, self.graphs.logits[: len(scheduled)]
        else:
            logits = self.forward_eager(scheduled, is_decode)
            if not sampled:
                return []
            token_ids = self._sample_eager(logits, sampled, [seq.num_tokens for seq in sampled])
        return self._results(sampled, token_ids, logits)

    @torch.inference_mode()
    def execute_speculative(
        self,
        scheduled: list[ScheduledRow],
        drafts: dict[Sequence, list[int]],
        ring: RingStep | None = None,
    ) -> tuple[list[SampledToken], list[Verification]]:
        """As execute, for a step in which some sequences end with drafts (already in their tokens):
        the target scores [last token, drafts] of those in the same forward pass, and their drafts are
        verified exactly (greedy: the target's argmax; sampled: rejection sampling). Eager, or a step
        graph. With a `ring`, its sequences' drafts are PENDING_DRAFT here: the step reads them from the
        draft ring, and they replace the placeholders (and their entries in `drafts`, as many as the
        proposer wrote) before verification."""
        num_logits = {seq: len(d) + 1 for seq, d in drafts.items()}
        # (before the ring's drafts replace the placeholders, which may shorten the sequences)
        completes = [
            item.seq.num_computed_tokens + item.num_new_tokens == item.seq.num_tokens for item in scheduled
        ]
        ring_read, covered = self._ring_read(scheduled, ring) if ring is not None else (None, [])
        logits = self.forward_eager(scheduled, num_logits=num_logits, ring_read=ring_read)
        if ring is not None:
            self._take_ring_drafts(ring, ring_read, covered, drafts)
        plain_seqs: list[Sequence] = []
        plain_rows: list[int] = []
        greedy: list[tuple[Sequence, int]] = []  # (sequence, its first logits row)
        verifications: list[Verification] = []
        row = 0
        for item, complete in zip(scheduled, completes, strict=True):
            seq = item.seq
            if not complete:
                continue  # a prompt chunk: no logits
            if seq not in drafts:
                plain_seqs.append(seq)
                plain_rows.append(row)
                row += 1
                continue
            count = num_logits[seq]
            if seq.params.is_greedy:
                greedy.append((seq, row))
            else:
                token_ids, num_accepted = self.sampler.verify(seq, logits[row : row + count], drafts[seq])
                verifications.append(Verification(seq, token_ids, num_accepted))
            row += count
        if greedy:
            verifications += self._verify_greedy(greedy, logits, drafts)
        results: list[SampledToken] = []
        if plain_seqs:
            plain_logits = logits[torch.tensor(plain_rows, dtype=torch.int64, device=logits.device)]
            token_ids = self._sample_eager(plain_logits, plain_seqs, [seq.num_tokens for seq in plain_seqs])
            results = self._results(plain_seqs, token_ids, plain_logits)
        return results, verifications

    def _ring_read(
        self, scheduled: list[ScheduledRow], ring: RingStep
    ) -> tuple[DraftsRead | None, list[Sequence]]:
        """Where the step's packed input ids take the ring's drafts (each ring sequence's last tokens),
        and the ring sequences the step runs, in that order."""
        token_rows: list[int] = []
        slots: list[tuple[int, int]] = []
        covered: list[Sequence] = []
        end = 0
        for item in scheduled:
            end += item.num_new_tokens
            row = ring.rows.get(item.seq)
            if row is not None:
                count = ring.num_drafts[item.seq]
                token_rows += range(end - count, end)
                slots += [(row, j) for j in range(count)]
                covered.append(item.seq)
        if not token_rows:
            return None, covered
        return ring.drafts.read(token_rows, slots, self.device), covered

    @staticmethod
    def _take_ring_drafts(
        ring: RingStep,
        ring_read: DraftsRead | None,
        covered: list[Sequence],
        drafts: dict[Sequence, list[int]],
    ) -> None:
        """Put the drafts the step read from the ring in place of each sequence's placeholders (only as
        many as the proposer wrote: the rest were padding; a sequence the step did not run gets none)."""
        used, lengths = ring_read.finish() if ring_read is not None else ([], {})
        read: dict[Sequence, list[int]] = {}
        offset = 0
        for seq in covered:
            count = ring.num_drafts[seq]
            read[seq] = used[offset : offset + count][: lengths[ring.rows[seq]]]
            offset += count
        for seq in ring.rows:
            count = ring.num_drafts[seq]
            del seq.token_ids[len(seq.token_ids) - count :]
            drafts[seq] = read.get(seq, [])
            seq.token_ids += drafts[seq]

    @staticmethod
    def _verify_greedy(
        greedy: list[tuple[Sequence, int]], logits: torch.Tensor, drafts: dict[Sequence, list[int]]
    ) -> list[Verification]:
        """All greedy sequences at once, drafts padded to the longest. One argmax on the device and one
        read back; the drafts are on the host, so the comparison runs there (a few ops on [rows] ints,
        where on a GPU it cost three copies up and a dozen tiny kernels)."""
        k_max = max(len(drafts[seq]) for seq, _ in greedy)
        rows = [[first + min(j, len(drafts[seq])) for j in range(k_max + 1)] for seq, first in greedy]
        targets = logits.argmax(dim=-1).cpu()[torch.tensor(rows, dtype=torch.int64)]
        padded = [drafts[seq] + [-1] * (k_max - len(drafts[seq])) for seq, _ in greedy]
        verified = verify_greedy(
            targets,
            torch.tensor(padded, dtype=torch.int64),
            torch.tensor([len(drafts[seq]) for seq, _ in greedy]),
        )
        emitted, accepted = verified.output_token_ids.tolist(), verified.num_accepted.tolist()
        return [
            Verification(seq, tokens[: count + 1], count)
            for (seq, _), tokens, count in zip(greedy, emitted, accepted, strict=True)
        ]

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
        if self.graphs is None:
            return False
        if is_decode_step(scheduled):
            return self.graphs.fits(len(scheduled))
        num_sampled = sum(item.samples for item in scheduled)
        step_graphs = self.step_graphs
        return (
            step_graphs is not None
            and 0 < num_sampled <= min(step_graphs.max_logit_rows, self.graphs.max_bs)
            and sum(item.num_new_tokens for item in scheduled) <= step_graphs.max_tokens
            and len(scheduled) <= step_graphs.max_num_seqs
        )

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledRow], previous: PendingStep | None) -> PendingStep:
        """Launch a step (can_launch_ahead) without waiting for it. A row with a fed_back_row takes its last
        input from `previous`, the launch that sampled it."""
        assert all(item.num_new_tokens == 1 for item in scheduled if item.fed_back_row is not None), (
            "a fed-back token is a decoding sequence's input"
        )
        is_decode = is_decode_step(scheduled)
        if self.graphs is not None and is_decode:
            return self.graphs.launch(scheduled)
        fed_back = None
        if any(item.fed_back_row is not None for item in scheduled):
            assert previous is not None
            fed_back = previous.device_tokens
        sampled = [item for item in scheduled if item.samples]
        seqs, draw_positions = [item.seq for item in sampled], [item.end for item in sampled]
        logits = self.forward_eager(scheduled, is_decode, fed_back=fed_back)
        if self.graphs is not None:
            return self.graphs.sample_rows(logits, seqs, draw_positions)
        token_ids = self._sample_eager(logits, seqs, draw_positions)
        return PendingStep(seqs, token_ids, token_ids, ready=None)  # CPU: filled already

    @torch.inference_mode()
    def forward_eager(
        self,
        scheduled: list[ScheduledRow],
        is_decode: bool = False,
        fed_back: torch.Tensor | None = None,
        num_logits: dict[Sequence, int] | None = None,
        ring_read: DraftsRead | None = None,
    ) -> torch.Tensor:
        """The float32 logits [num_rows, logit_vocab_size] of each sequence whose tokens are all computed
        after this step, without sampling: its last token's row, or its last num_logits[seq] rows.
        fed_back: the previous launch's samples (PendingStep.device_tokens), the last input of each row
        with a fed_back_row. ring_read: input ids that come from the draft ring (PENDING_DRAFT in the
        sequences' lists)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logit_rows: list[int] = []
        fed_back_rows: dict[int, int] = {}  # packed token row -> row of fed_back
        for item in scheduled:
            seq, start, end = item.seq, item.seq.num_computed_tokens, item.end
            input_ids += seq.token_ids[start:end]
            if item.fed_back_row is not None:
                fed_back_rows[len(input_ids)] = item.fed_back_row
                input_ids.append(0)  # the graph (or the eager step below) takes it from fed_back
            positions += range(start, end)
            table = seq.block_table
            slot_mapping += [
                table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)
            ]
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
            seq_lens.append(end)
            if item.samples:
                count = num_logits.get(seq, 1) if num_logits else 1
                logit_rows += range(query_start_loc[-1] - count, query_start_loc[-1])
        source_rows = None
        if fed_back_rows:
            source_rows = [-1] * len(input_ids)
            for row, source in fed_back_rows.items():
                source_rows[row] = source
        gather_drafts = None
        if ring_read is not None:
            for row in ring_read.token_rows:  # a valid id, should the proposer never answer
                input_ids[row] = 0
            gather_drafts = ring_read.gather_into
        if self.step_graphs is not None and logit_rows:
            inputs = StepInputs(
                input_ids, positions, slot_mapping, query_start_loc, seq_lens,
                [item.seq.block_table for item in scheduled], logit_rows, source_rows,
            )  # fmt: skip
            if self.step_graphs.fits(inputs) and (fed_back is None or fed_back is self.step_graphs.feedback):
                logits = self.step_graphs.forward(inputs, gather_drafts)
                if self.capture_layers:  # the graph's buffer is overwritten by its next replay
                    self.captured_hidden = self.step_graphs.captured[: len(input_ids)].clone()
                return logits
        max_blocks = max(len(item.seq.block_table) for item in scheduled)
        block_tables = torch.zeros(len(scheduled), max_blocks, dtype=torch.int32)
        for row, item in enumerate(scheduled):
            block_tables[row, : len(item.seq.block_table)] = torch.tensor(item.seq.block_table)
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=block_tables.to(device),
            is_decode=is_decode,
            max_query_len=max(item.num_new_tokens for item in scheduled),
        )
        capture: dict[int, torch.Tensor | None] | None = (
            dict.fromkeys(self.capture_layers) if self.capture_layers else None
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
        if fed_back_rows:
            token_rows = torch.tensor(list(fed_back_rows), dtype=torch.int64, device=device)
            sources = torch.tensor(list(fed_back_rows.values()), dtype=torch.int64, device=device)
            ids[token_rows] = fed_back.to(device)[sources]
        position_ids = torch.tensor(positions, dtype=torch.int64, device=device)
        if gather_drafts is not None:  # last: a copy queued behind the ring's wait would block the host
            gather_drafts(ids)
        hidden, residual = self.decoder(ids, position_ids, self.kv_cache, metadata, capture)
        if capture is not None:
            self.captured_hidden = torch.cat([capture[index] for index in self.capture_layers], dim=-1)
        if not logit_rows:  # a prompt chunk that completes no sequence
            return torch.empty(0, self.logit_vocab_size, dtype=torch.float32, device=device)
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=device)
        return self.decoder.compute_logits(hidden[rows], residual[rows])

    def _sample_eager(
        self, logits: torch.Tensor, seqs: list[Sequence], draw_positions: list[int]
    ) -> torch.Tensor:
        """The next token of each row, drawn at draw_positions (its index in the sequence), on the host
        (int64)."""
        if self.graphs is not None and len(seqs) <= self.graphs.max_bs:
            launch = self.graphs.sample_rows(logits, seqs, draw_positions)
            launch.read()
            return launch.host_tokens.clone()  # the pinned buffer is reused two launches later
        return self.sampler.sample(logits, seqs, draw_positions).cpu()

    def _results(
        self, seqs: list[Sequence], token_ids: torch.Tensor, logits: torch.Tensor
    ) -> list[SampledToken]:
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
        ids = token_ids.tolist()
        return [SampledToken(seq, ids[row], logprobs[row]) for row, seq in enumerate(seqs)]
