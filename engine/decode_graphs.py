"""CUDA graphs of a decode step (forward, LM head, sampling), one per batch-size bucket, and the pinned
staging that feeds them (engine/runner.py uses them for decode steps and launches ahead).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy
import torch

from engine.sequence import Sequence
from engine.step import PendingStep
from engine.step_graphs import capture_graph
from engine.step_inputs import SAMPLING_FLOAT_FIELDS, StepInputs
from kernels.attention import AttentionMetadata, DecodeWorkspace, decode_num_splits
from kernels.sampling import SamplingTensors, SamplingWorkspace, sample_triton

if TYPE_CHECKING:
    from engine.runner import ModelRunner

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    """CUDA graphs of a decode step (forward, LM head, sampling), one per batch-size bucket."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int) -> None:
        self.runner = runner
        spec, device = runner.spec, runner.device
        self.batch_sizes = [size for size in GRAPH_BATCH_SIZES if size < max_num_seqs] + [max_num_seqs]
        self.batch_sizes = sorted(set(self.batch_sizes))
        max_bs = self.batch_sizes[-1]
        self.max_bs = max_bs
        max_context = runner.max_blocks_per_seq * runner.block_size
        # Every per-step input lives in one of three packed buffers (and the block tables), each filled
        # from a pinned host copy of the same shape with one transfer per step.
        self.ints = torch.zeros(
            6, max_bs, dtype=torch.int64, device=device
        )  # ids, positions, slots, seeds, draw positions, source rows
        self.int32s = torch.zeros(2, max_bs, dtype=torch.int32, device=device)  # seq lens, top-k
        self.floats = torch.tensor(_NEUTRAL_FLOATS, device=device)[:, None].repeat(1, max_bs)
        self.block_tables = torch.zeros(max_bs, runner.max_blocks_per_seq, dtype=torch.int32, device=device)
        # Two sets of pinned host buffers, used by alternate launches: a launch's inputs must stay intact
        # until its copies have run, which may be after the host has prepared the next launch.
        self.staging = [
            [torch.empty_like(buffer, device="cpu").pin_memory()
             for buffer in (self.ints, self.int32s, self.floats, self.block_tables)]
            for _ in range(2)
        ]  # fmt: skip
        self.staging_arrays = [[buffer.numpy() for buffer in staging] for staging in self.staging]
        # per staging set and row: the block table list last written there, and how many of its blocks
        self.written_tables: list[list[tuple[list[int] | None, int]]] = [
            [(None, 0)] * max_bs for _ in range(2)
        ]
        self.host_token_ids = [torch.empty(max_bs, dtype=torch.int64).pin_memory() for _ in range(2)]
        self.ready = [torch.cuda.Event() for _ in range(2)]
        self.parity = 0
        self.input_ids, self.positions, self.slot_mapping = self.ints[0], self.ints[1], self.ints[2]
        self.source_rows = self.ints[5]  # >= 0: the input is that row of the previous replay's samples
        self.seq_lens = self.int32s[0]
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.token_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        vocab = runner.logit_vocab_size
        self.logits = torch.zeros(max_bs, vocab, dtype=torch.float32, device=device)
        self.sampling = SamplingTensors(
            **dict(zip(SAMPLING_FLOAT_FIELDS, self.floats, strict=True)),
            top_k=self.int32s[1],
            seeds=self.ints[3],
            positions=self.ints[4],
            output_counts=torch.zeros(max_bs, vocab, dtype=torch.int32, device=device),
            prompt_mask=torch.zeros(max_bs, vocab, dtype=torch.bool, device=device),
        )
        self.sampling_workspace = SamplingWorkspace.allocate(max_bs, vocab, device)
        self.attention_workspace = DecodeWorkspace.allocate(
            max_bs, spec.num_heads, spec.num_kv_heads, spec.head_dim, max_context, device
        )
        self.max_context = max_context
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self._penalized_rows: set[int] = set()
        for batch_size in reversed(self.batch_sizes):  # largest first, so the smaller ones reuse its pool
            self._capture(batch_size)

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_bs

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        spec = self.runner.spec
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            is_decode=True,
            decode_num_splits=decode_num_splits(
                batch_size, spec.num_kv_heads, self.max_context, spec.head_dim
            ),
            decode_workspace=self.attention_workspace,
        )

    def _sampling_rows(self, batch_size: int) -> SamplingTensors:
        fields = {
            f.name: getattr(self.sampling, f.name)[:batch_size] for f in dataclasses.fields(self.sampling)
        }
        return SamplingTensors(**fields)

    def _step(self, batch_size: int) -> None:
        decoder = self.runner.decoder
        # Run-ahead: a row whose source row is >= 0 takes the previous replay's sample as its input
        # (self.token_ids still holds it: this replay's sampling overwrites it last).
        rows = self.source_rows[:batch_size]
        fed_back = self.token_ids[rows.clamp(min=0)]
        self.input_ids[:batch_size].copy_(torch.where(rows >= 0, fed_back, self.input_ids[:batch_size]))
        hidden, residual = decoder(
            self.input_ids[:batch_size],
            self.positions[:batch_size],
            self.runner.kv_cache,
            self._metadata(batch_size),
        )
        decoder.compute_logits(hidden, residual, out=self.logits[:batch_size])
        sample_triton(
            self.logits[:batch_size], self._sampling_rows(batch_size),
            out=self.token_ids[:batch_size], workspace=self.sampling_workspace,
        )  # fmt: skip

    def _capture(self, batch_size: int) -> None:
        graph = capture_graph(lambda: self._step(batch_size), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[batch_size] = graph

    def launch(self, inputs: StepInputs) -> PendingStep:
        """Write a decode step's inputs into the static buffers and replay, without waiting. A row with a
        source row takes that row of the previous replay's samples as its input. The logits stay in
        self.logits until the next replay.

        The host side writes the inputs' lists into numpy views of the pinned staging buffers: at 256
        sequences a tensor per block table row, and per-row parameter lookups, had cost the host more
        than the GPU's step."""
        num_seqs = inputs.num_seqs
        batch_size = next(size for size in self.batch_sizes if size >= num_seqs)
        self._stage_sampling(inputs)
        ints, int32s, floats, tables = self.staging_arrays[self.parity]
        ints[0, :num_seqs] = inputs.input_ids
        ints[1, :num_seqs] = inputs.positions
        ints[2, :num_seqs] = inputs.slot_mapping
        ints[5, :num_seqs] = inputs.source_rows if inputs.source_rows is not None else -1
        ints[:, num_seqs:batch_size] = _PADDING_INTS[:, None]  # slot -1: padding writes nothing
        int32s[0, :num_seqs] = inputs.seq_lens  # a length of 0 makes attention skip the row
        int32s[:, num_seqs:batch_size] = 0
        floats[:, num_seqs:batch_size] = _PADDING_FLOATS[:, None]
        self._write_block_tables(tables, inputs.block_tables)
        ints_host, int32s_host, floats_host, tables_host = self.staging[self.parity]
        self.ints[:, :batch_size].copy_(ints_host[:, :batch_size], non_blocking=True)
        self.int32s[:, :batch_size].copy_(int32s_host[:, :batch_size], non_blocking=True)
        self.floats[:, :batch_size].copy_(floats_host[:, :batch_size], non_blocking=True)
        self.block_tables[:batch_size].copy_(tables_host[:batch_size], non_blocking=True)
        self._write_penalty_counts(inputs.sample_seqs)
        self.graphs[batch_size].replay()
        return self._read_back(inputs.sample_seqs)

    def sample_rows(self, logits: torch.Tensor, inputs: StepInputs) -> PendingStep:
        """Sample the step's sampled rows of eagerly computed (or step-graph) logits, one logits row each,
        each drawing the token at its draw position, into token_ids as a replay would, without waiting:
        the next launch can take them as inputs on the device."""
        num_seqs = len(inputs.sample_seqs)
        assert logits.shape[0] == num_seqs <= self.max_bs
        self._stage_sampling(inputs)
        ints_host, int32s_host, floats_host, _ = self.staging[self.parity]
        self.ints[3:5, :num_seqs].copy_(ints_host[3:5, :num_seqs], non_blocking=True)
        self.int32s[1, :num_seqs].copy_(int32s_host[1, :num_seqs], non_blocking=True)
        self.floats[:, :num_seqs].copy_(floats_host[:, :num_seqs], non_blocking=True)
        self._write_penalty_counts(inputs.sample_seqs)
        sample_triton(
            logits, self._sampling_rows(num_seqs), out=self.token_ids[:num_seqs],
            workspace=self.sampling_workspace,
        )  # fmt: skip
        return self._read_back(inputs.sample_seqs)

    def _stage_sampling(self, inputs: StepInputs) -> None:
        """Write the sampled rows' parameters (seeds, draw positions: the drawn token's index in the
        sequence, top-k, the float fields) into this launch's pinned staging buffers: graph inputs,
        refreshed every step."""
        ints, int32s, floats, _ = self.staging_arrays[self.parity]
        num_seqs = len(inputs.sample_seqs)
        ints[3, :num_seqs] = inputs.seeds
        ints[4, :num_seqs] = inputs.draw_positions
        int32s[1, :num_seqs] = inputs.top_k
        floats[:, :num_seqs] = numpy.array(inputs.sampling_floats, dtype=numpy.float32).T

    def _read_back(self, seqs: list[Sequence]) -> PendingStep:
        """Queue the copy of the sampled tokens to the host and return the step that waits for it."""
        host_token_ids = self.host_token_ids[self.parity][: len(seqs)]
        host_token_ids.copy_(self.token_ids[: len(seqs)], non_blocking=True)
        ready = self.ready[self.parity]
        ready.record()
        self.parity ^= 1
        return PendingStep(seqs, self.token_ids, host_token_ids, ready)

    def _write_block_tables(self, tables: numpy.ndarray, block_tables: list[list[int]]) -> None:
        """Bring this staging buffer's block table rows up to date: a row that held the same sequence's
        table (the same list: a block table only grows, and is replaced when the sequence is preempted)
        takes only the blocks appended since; any other row is written whole. Columns past a row's table
        keep stale block ids, which attention never reads (it stops at the row's length)."""
        written = self.written_tables[self.parity]
        for row, table in enumerate(block_tables):
            held, count = written[row]
            if held is not table:
                count = 0
            if count < len(table):
                tables[row, count : len(table)] = table[count:]
                written[row] = (table, len(table))

    def _write_penalty_counts(self, seqs: list[Sequence]) -> None:
        """Token counts for the rows that use penalties (and zeros where a row used them last step);
        a step without penalties touches nothing here."""
        target = self.sampling
        device = target.positions.device
        penalized = {row for row, seq in enumerate(seqs) if seq.params.has_penalties}
        for row in penalized | self._penalized_rows:
            target.output_counts[row].zero_()
            target.prompt_mask[row].zero_()
            if row in penalized:
                seq = seqs[row]
                output = torch.tensor(seq.output_token_ids, dtype=torch.int64, device=device)
                target.output_counts[row].index_add_(0, output, torch.ones_like(output, dtype=torch.int32))
                target.prompt_mask[row, output] = True
                target.prompt_mask[row, torch.tensor(seq.prompt_token_ids, device=device)] = True
        self._penalized_rows = penalized


# the float fields' values (SAMPLINGSAMPLING_FLOAT_FIELDS) for a padding row
_NEUTRAL_FLOATS = [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]  # greedy, no filtering, no penalties
_PADDING_FLOATS = numpy.array(_NEUTRAL_FLOATS, dtype=numpy.float32)
# a padding row's ids, positions, slots (-1: no KV write), seeds, draw positions and source rows (-1: none)
_PADDING_INTS = numpy.array([0, 0, -1, 0, 0, -1], dtype=numpy.int64)
