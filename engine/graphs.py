"""One cache of the model's graph steps (GraphCache), each captured once per bucket and replayed with its
inputs written into static buffers, so a step costs the GPU's time and not the host's.

Buckets. A decode bucket holds B sequences of one new token each: forward (the split-KV decode kernel),
LM head and sampling, all in the graph. A step bucket holds T packed tokens (prefill chunks, mixed steps,
speculative verification): forward and the LM head of the chosen logit rows; a step that samples then
samples those rows from the same buffers (sample). Launched eagerly, a step of a few hundred tokens costs
the host ~10 Triton launches per layer from Python, far more than the GPU's own time.

Padding and inputs: engine/graph_buckets.py (a bucket's shapes, and its inputs' layout in one static
byte buffer, copied from a pinned staging buffer in one copy). Two staging buffers serve alternate steps: a
launch's inputs must stay intact until its copy has run, which may be after the host has prepared the next
launch (run-ahead). A row whose source row is >= 0 takes that row of the previous launch's samples
(token_ids, still on the device) as its input id.

Structured output (engine/sampling/grammar.py). A step samples every row unmasked, and its constrained rows
are then sampled again from their masked logits by the replays of engine/sampling/masked_sampling.py
(sample_masked), on this cache's logits and samples, before the next launch reads them. A step without
constrained rows is unchanged, and unconstrained rows keep running ahead.

On the CPU the same cache runs for tests: capture records the step and replay calls it, on the same
buffers, with the torch reference ops and sampler. The GPU-only lines are capture_graph, the pinned
staging and the read-back events.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy
import torch
from tileinfer.engine.graph_buckets import (
    DECODE_BATCH_SIZES,
    Bucket,
    attention_metadata,
    padded_sequences,
    sampling_tensors,
    sizes_up_to,
    stage_sampling,
    step_sizes,
)
from tileinfer.engine.models.decoder import Decoder
from tileinfer.engine.sampling.masked_sampling import MaskedSampling
from tileinfer.engine.sampling.sampler import Sampler
from tileinfer.engine.sequence import Sequence
from tileinfer.engine.step import GrammarMasks, PendingStep
from tileinfer.engine.step_inputs import StepInputs
from tileinfer.kernels.decode_attention import DecodeWorkspace, decode_num_splits
from tileinfer.kernels.prefill_attention import allocate_prefill_workspace, prefill_num_splits
from tileinfer.kernels.sampling import SamplingWorkspace
from tileinfer.kernels.token_mask import bitmask_words


def capture_graph(step: Callable[[], None], pool: tuple | None) -> torch.cuda.CUDAGraph:
    """Run `step` once on a side stream (compiles its kernels, warms the allocator), then capture it into
    a graph drawing on `pool` (None: a new one; pass graph.pool() on so that later graphs share it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph


class GraphCache:
    def __init__(
        self,
        decoder: Decoder,
        kv_cache: torch.Tensor,
        sampler: Sampler,
        max_num_seqs: int,
        max_num_tokens: int | None,
        max_logit_rows: int,
        max_blocks_per_seq: int,
        block_size: int,
        capture_layers: tuple[int, ...] = (),
        decode: bool = True,
    ) -> None:
        """Decode buckets up to max_num_seqs sequences (decode: with capture_layers there are none, as
        their steps return no hidden rows), and step buckets up to max_num_tokens tokens (None: none)
        with at most max_logit_rows logit rows. capture_layers: decoder layers whose output stream each
        step replay also writes to `captured` ([tokens, len(capture_layers) * hidden]; for DFlash)."""
        spec = decoder.spec
        device = kv_cache.device
        self.decoder, self.kv_cache, self.sampler = decoder, kv_cache, sampler
        self.on_gpu = device.type == "cuda"
        self.max_blocks_per_seq = max_blocks_per_seq
        max_context = max_blocks_per_seq * block_size
        self.max_num_seqs = max_num_seqs
        self.max_logit_rows = max_logit_rows
        self.capture_layers = capture_layers
        # A padding sequence's keys fit one block-table row and its positions the RoPE table. A step bucket
        # of T tokens holds at most min(T, max_num_seqs) sequences and the padding ones: its attention grid
        # covers that many sequence slots, not all of them (a verify step's 16-token bucket: 17, not 65).
        self.pad_len = min(max_context, decoder.max_positions)
        self.decode_buckets: dict[int, Bucket] = {}
        if decode:
            sizes = sizes_up_to(DECODE_BATCH_SIZES, max_num_seqs)
            self.decode_buckets = {
                size: Bucket(True, size, size, 0, size, max_blocks_per_seq) for size in sizes
            }
        self.step_buckets: dict[int, Bucket] = {}
        if max_num_tokens is not None:
            for size in step_sizes(max_num_tokens):
                num_logit_rows = min(size, max_logit_rows)
                num_slots = min(max_num_seqs, size) + -(-size // self.pad_len)
                self.step_buckets[size] = Bucket(
                    False, size, num_slots, num_logit_rows, min(num_logit_rows, max_num_seqs),
                    max_blocks_per_seq,
                )  # fmt: skip
        self.max_decode_seqs = max(self.decode_buckets, default=0)
        self.max_step_tokens = max(self.step_buckets, default=0)
        # sampling rows only (an eagerly computed step's logits): no tokens, no sequences
        self.sample_bucket = Bucket(False, 0, 0, 0, max_num_seqs, max_blocks_per_seq)
        buckets = [*self.decode_buckets.values(), *self.step_buckets.values(), self.sample_bucket]
        for bucket in buckets:
            bucket.lay_out()
        nbytes = max(bucket.nbytes for bucket in buckets)
        self.inputs = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.staging = [self._host(torch.zeros(nbytes, dtype=torch.uint8)) for _ in range(2)]
        for bucket in buckets:
            bucket.host = [bucket.views(staging.numpy()) for staging in self.staging]
            bucket.device = bucket.views(self.inputs)
        # per staging buffer and block-table row: the table list last written there, and how many blocks
        self.written_tables: list[list[tuple[list[int] | None, int]]] = [
            [(None, 0)] * max(bucket.num_slots for bucket in buckets) for _ in range(2)
        ]
        self._arange = numpy.arange(max(bucket.num_slots for bucket in buckets) + 1, dtype=numpy.int32)
        self.parity = 0  # the staging buffer (and read-back buffer) of the next step
        self._staged: tuple[StepInputs, Bucket] | None = None  # the inputs on the device, and their bucket

        # outputs and scratch
        vocab = decoder.logit_vocab_size
        num_logit_rows = max(max_logit_rows, self.max_decode_seqs)
        self.logits = torch.zeros(num_logit_rows, vocab, dtype=torch.float32, device=device)
        # the samples; the row past them takes a masked-sampling bucket's padding rows
        self.token_ids = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=device)
        self.host_token_ids = [self._host(torch.zeros(max_num_seqs, dtype=torch.int64)) for _ in range(2)]
        self.ready = [torch.cuda.Event() for _ in range(2)] if self.on_gpu else None
        self.output_counts = torch.zeros(max_num_seqs, vocab, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(max_num_seqs, vocab, dtype=torch.bool, device=device)
        self._penalized_rows: set[int] = set()
        self.sampling_workspace = SamplingWorkspace.allocate(max_num_seqs, vocab, device)
        self.masked = MaskedSampling(
            self.logits, self.token_ids, sampler, self.sampling_workspace, max_num_seqs, max_blocks_per_seq,
            bitmask_words(vocab), self._host,
        )  # fmt: skip
        self.captured = torch.zeros(
            self.max_step_tokens if capture_layers else 0, len(capture_layers) * spec.hidden_size,
            dtype=decoder.model.embed_tokens.weight.dtype, device=device,  # the residual stream's
        )  # fmt: skip
        self.decode_splits = {
            size: decode_num_splits(size, spec.num_kv_heads, max_context, spec.head_dim)
            for size in self.decode_buckets
        }
        self.decode_workspace = None
        if self.decode_buckets:
            self.decode_workspace = DecodeWorkspace.allocate(
                self.max_decode_seqs, spec.num_heads, spec.num_kv_heads, spec.head_dim, max_context, device
            )
        self.step_splits = {
            size: prefill_num_splits(
                size, bucket.num_slots, size, spec.num_heads, spec.num_kv_heads, spec.head_dim, max_context
            )  # fmt: skip
            for size, bucket in self.step_buckets.items()
        }
        self.step_workspace = None
        if self.step_buckets:
            self.step_workspace = allocate_prefill_workspace(
                self.max_step_tokens, max(bucket.num_slots for bucket in self.step_buckets.values()), 1,
                spec.num_heads, spec.num_kv_heads, spec.head_dim, max(self.step_splits.values()), device,
            )  # fmt: skip

        self.pool = None
        empty = StepInputs.empty()
        # largest first, so that the smaller ones reuse its memory pool
        for bucket in sorted(buckets[:-1], key=lambda bucket: (bucket.decode, -bucket.num_tokens)):
            self._transfer(bucket, empty)  # every row a padding one while capturing
            step = self._decode_step if bucket.decode else self._step
            bucket.replay = self._capture(lambda step=step, bucket=bucket: step(bucket))
        self.masked.capture(self._capture)
        self._staged = None

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host buffer the device copies from or to without waiting: pinned on a GPU."""
        return tensor.pin_memory() if self.on_gpu else tensor

    def _capture(self, step: Callable[[], None]) -> Callable[[], None]:
        """The replay of `step`: a CUDA graph's (all drawing on one memory pool), or on the CPU the step."""
        if not self.on_gpu:
            return step
        graph = capture_graph(step, self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay

    # --- the steps (captured) -------------------------------------------------------------------------

    def _input_ids(self, views: dict[str, torch.Tensor]) -> torch.Tensor:
        """The input ids, a fed-back row's taken from the previous launch's samples."""
        sources = views["source_rows"]
        return torch.where(sources >= 0, self.token_ids[sources.clamp(min=0)], views["input_ids"])

    def _decode_step(self, bucket: Bucket) -> None:
        views, size = bucket.device, bucket.num_tokens
        metadata = attention_metadata(
            views, is_decode=True, decode_num_splits=self.decode_splits[size],
            decode_workspace=self.decode_workspace,
        )  # fmt: skip
        hidden, residual = self.decoder(self._input_ids(views), views["positions"], self.kv_cache, metadata)
        self.decoder.compute_logits(hidden, residual, out=self.logits[:size])
        self._sample_step(bucket, self.logits[:size], size)

    def _step(self, bucket: Bucket) -> None:
        views, size = bucket.device, bucket.num_tokens
        metadata = attention_metadata(
            views, max_query_len=size, prefill_num_splits=self.step_splits[size],
            prefill_workspace=self.step_workspace,
        )  # fmt: skip
        capture = dict.fromkeys(self.capture_layers) if self.capture_layers else None
        ids = self._input_ids(views)
        hidden, residual = self.decoder(ids, views["positions"], self.kv_cache, metadata, capture)
        if capture is not None:
            torch.cat([capture[index] for index in self.capture_layers], dim=-1, out=self.captured[:size])
        rows = views["logit_rows"]
        self.decoder.compute_logits(hidden[rows], residual[rows], out=self.logits[: len(rows)])

    def _sample_step(self, bucket: Bucket, logits: torch.Tensor, num_rows: int) -> None:
        """Sample the bucket's first num_rows rows into token_ids."""
        tensors = sampling_tensors(bucket.device, num_rows, self.output_counts, self.prompt_mask)
        self.sampler.sample_into(logits, tensors, self.token_ids[:num_rows], self.sampling_workspace)

    # --- a step's inputs -----------------------------------------------------------------------------

    def fits_decode(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_decode_seqs

    def fits_step(self, num_tokens: int, num_seqs: int, num_logit_rows: int, max_blocks: int = 0) -> bool:
        return (
            num_tokens <= self.max_step_tokens
            and num_seqs <= self.max_num_seqs
            and 0 < num_logit_rows <= self.max_logit_rows
            and max_blocks <= self.max_blocks_per_seq
        )

    def fits(self, inputs: StepInputs) -> bool:
        """Whether a step bucket runs these inputs."""
        return self.fits_step(
            inputs.num_tokens, inputs.num_seqs, len(inputs.logit_rows),
            max(len(table) for table in inputs.block_tables),
        )  # fmt: skip

    def _transfer(self, bucket: Bucket, inputs: StepInputs) -> None:
        """Write the inputs into this step's staging buffer (bucket's layout) and copy them to the device."""
        self._stage(bucket, inputs)
        staging = self.staging[self.parity]
        self.inputs[: bucket.nbytes].copy_(staging[: bucket.nbytes], non_blocking=True)
        self._staged = (inputs, bucket)
        self._step_parity = self.parity
        self.parity ^= 1

    def _stage(self, bucket: Bucket, inputs: StepInputs) -> None:
        host = bucket.host[self.parity]
        num_tokens, num_seqs = inputs.num_tokens, inputs.num_seqs
        if bucket.num_tokens:
            host["input_ids"][:num_tokens] = inputs.input_ids
            host["input_ids"][num_tokens:] = 0
            host["slot_mapping"][:num_tokens] = inputs.slot_mapping
            host["slot_mapping"][num_tokens:] = -1  # padding writes nothing
            sources = host["source_rows"]
            sources[:num_tokens] = inputs.source_rows if inputs.source_rows is not None else -1
            sources[num_tokens:] = -1
            host["positions"][:num_tokens] = inputs.positions
            host["seq_lens"][:num_seqs] = inputs.seq_lens
            if bucket.decode:  # padding rows: one token each, of length 0 (attention skips them)
                host["positions"][num_tokens:] = 0
                host["seq_lens"][num_seqs:] = 0
                host["query_start_loc"][:] = self._arange[: bucket.num_slots + 1]
            else:
                starts, lengths = padded_sequences(
                    inputs.query_start_loc, inputs.seq_lens, bucket.num_tokens, self.pad_len, bucket.num_slots
                )
                host["positions"][num_tokens:] = [
                    position for n in lengths[num_seqs:] for position in range(n)
                ]
                host["query_start_loc"][:] = starts
                host["seq_lens"][num_seqs:] = lengths[num_seqs:]
                num_logit_rows = len(inputs.logit_rows)  # a decode bucket computes every row's logits
                host["logit_rows"][:num_logit_rows] = inputs.logit_rows
                host["logit_rows"][num_logit_rows:] = 0
        # (a bucket without sequence slots, the sampling one, writes none, and clobbers every row)
        self._write_block_tables(
            host["block_tables"], inputs.block_tables if bucket.num_slots else [], bucket.num_slots
        )
        if bucket.num_samples and len(inputs.sample_seqs) <= bucket.num_samples:
            stage_sampling(
                host, inputs.seeds, inputs.draw_positions, inputs.top_k, inputs.sampling_floats
            )  # fmt: skip

    def _write_block_tables(
        self, tables: numpy.ndarray, block_tables: list[list[int]], num_slots: int
    ) -> None:
        """Bring this staging buffer's block table rows up to date: a row that held the same sequence's
        table (the same list: a block table only grows, and is replaced when the sequence is preempted)
        takes only the blocks appended since; any other row is written whole. Columns past a row's table
        keep stale block ids, which attention never reads (it stops at the row's length). The bucket's
        other rows point at block 0; the rows past them hold the bucket's other fields."""
        written = self.written_tables[self.parity]
        for row, table in enumerate(block_tables):
            held, count = written[row]
            if held is not table:
                count = 0
            if count < len(table):
                tables[row, count : len(table)] = table[count:]
                written[row] = (table, len(table))
        num_seqs = len(block_tables)
        if num_seqs < num_slots:
            tables[num_seqs:num_slots] = 0
        written[num_seqs:] = [(None, 0)] * (len(written) - num_seqs)

    # --- replays ---------------------------------------------------------------------------------------

    def launch(self, inputs: StepInputs) -> PendingStep:
        """Replay a decode step (forward, LM head, sampling) without waiting: its logits stay in
        self.logits and its samples in token_ids until the next replay."""
        bucket = next(b for size, b in self.decode_buckets.items() if size >= inputs.num_seqs)
        self._transfer(bucket, inputs)
        self._write_penalty_counts(inputs.sample_seqs)
        bucket.replay()
        return self._read_back(inputs.sample_seqs)

    def forward(
        self, inputs: StepInputs, before_replay: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """Replay a step bucket (fits): the float32 logits of inputs.logit_rows (a view of a static buffer,
        valid until the next replay; so are the captured layers' rows, in `captured`). before_replay(ids)
        may change the input ids on the device once the inputs are there (the draft ring's drafts:
        proposers/draft_ring.py)."""
        bucket = next(b for size, b in self.step_buckets.items() if size >= inputs.num_tokens)
        self._transfer(bucket, inputs)
        if before_replay is not None:
            before_replay(bucket.device["input_ids"])
        bucket.replay()
        return self.logits[: len(inputs.logit_rows)]

    def sample(self, logits: torch.Tensor, inputs: StepInputs) -> PendingStep:
        """Sample the step's sampled rows (one logits row each, at its draw position) into token_ids as a
        decode replay would, without waiting: the next launch can take them as inputs on the device. A
        step replayed by forward has their parameters on the device already; else they go there now."""
        num_rows = len(inputs.sample_seqs)
        assert logits.shape[0] == num_rows <= self.max_num_seqs
        staged = self._staged
        if staged is not None and staged[0] is inputs and num_rows <= staged[1].num_samples:
            bucket = staged[1]
        else:
            bucket = self.sample_bucket
            self._transfer(bucket, inputs)
        self._write_penalty_counts(inputs.sample_seqs)
        self._sample_step(bucket, logits, num_rows)
        return self._read_back(inputs.sample_seqs)

    def sample_masked(self, launched: PendingStep, masks: GrammarMasks) -> None:
        """Sample again the constrained rows of the launch just made (launched, whose logits are
        launched.logits, one row each) from their masked logits (masks' bitmask, from masked.bitmasks), into
        their rows of token_ids, and queue its read-back anew, into its own host buffer and event."""
        self.masked.sample(launched.logits, launched.inputs, masks.rows, masks.bitmask)
        self._copy_tokens(launched.host_tokens, launched.ready)

    def _read_back(self, seqs: list[Sequence]) -> PendingStep:
        """Queue the copy of the sampled tokens to the host and return the step that waits for it."""
        parity = self._step_parity
        host_token_ids = self.host_token_ids[parity][: len(seqs)]
        ready = self.ready[parity] if self.ready is not None else None
        self._copy_tokens(host_token_ids, ready)
        return PendingStep(seqs, self.token_ids, host_token_ids, ready)

    def _copy_tokens(self, host_tokens: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        """Queue the copy of the first len(host_tokens) sampled tokens into host_tokens, then ready."""
        host_tokens.copy_(self.token_ids[: len(host_tokens)], non_blocking=True)
        if ready is not None:
            ready.record()

    def _write_penalty_counts(self, seqs: list[Sequence]) -> None:
        """Token counts for the rows that use penalties (and zeros where a row used them last step);
        a step without penalties touches nothing here."""
        device = self.token_ids.device
        penalized = {row for row, seq in enumerate(seqs) if seq.params.has_penalties}
        for row in penalized | self._penalized_rows:
            self.output_counts[row].zero_()
            self.prompt_mask[row].zero_()
            if row in penalized:
                seq = seqs[row]
                output = torch.tensor(seq.output_token_ids, dtype=torch.int64, device=device)
                self.output_counts[row].index_add_(0, output, torch.ones_like(output, dtype=torch.int32))
                self.prompt_mask[row, output] = True
                self.prompt_mask[row, torch.tensor(seq.prompt_token_ids, device=device)] = True
        self._penalized_rows = penalized
