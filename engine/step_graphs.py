"""CUDA graphs of a forward pass over a packed batch of new tokens (prefill chunks, mixed steps,
speculative verification), one graph per token-count bucket.

Launched eagerly, such a step costs the host ~10 Triton launches per layer from Python, far more than the
GPU's own time for a few hundred tokens. A graph replays them all at once. Its shapes are fixed at
capture: T tokens (the bucket), up to min(T, max_num_seqs) sequences, and at most T logit rows. A step
with fewer tokens is padded. The padding tokens belong to extra sequences, each no longer than a context
(its keys fill one block-table row, its positions the RoPE table), whose block table rows point at block
0 and whose KV writes are skipped (slot -1), so they read finite stale values and change nothing. So a
step may hold more tokens than max_model_len (many prompts at once). Sequence slots beyond those get no
tokens and no keys. The logits of the chosen rows land in a static buffer, valid until the next replay.

On by default on a GPU (EngineConfig.step_graphs); tests/test_graphs_cuda.py checks a replay against the
eager step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from engine.model import Decoder
from engine.step_inputs import StepInputs
from kernels.attention import AttentionMetadata
from kernels.prefill_attention import allocate_prefill_workspace, prefill_num_splits

# No bucket below 16: with buckets of 1-8 tokens (linear layers as GEMVs) an n-gram verify step on
# SmolLM2-135M took 2.82 ms on the H200, against 1.95 ms from the 16-token bucket (BENCHMARKS.md).
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


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


def padded_sequences(
    query_start_loc: list[int], seq_lens: list[int], size: int, pad_len: int, num_slots: int
) -> tuple[list[int], list[int]]:
    """Every one of num_slots sequence slots' query start (and the end: num_slots + 1 starts) and length:
    the real sequences given, then padding sequences of at most pad_len tokens that fill the step to
    `size` tokens, then empty slots."""
    padding = size - query_start_loc[-1]
    whole, rest = divmod(padding, pad_len)
    pad_lens = [pad_len] * whole + [rest] * (rest > 0)
    pad_ends = list(itertools.accumulate(pad_lens, initial=query_start_loc[-1]))[1:]
    empty = num_slots - len(seq_lens) - len(pad_lens)
    assert empty >= 0, "more sequences than the step's slots"
    return query_start_loc + pad_ends + [size] * empty, seq_lens + pad_lens + [0] * empty


class StepGraphs:
    def __init__(
        self,
        decoder: Decoder,
        kv_cache: torch.Tensor,
        max_num_seqs: int,
        max_num_tokens: int,
        max_logit_rows: int,
        max_blocks_per_seq: int,
        block_size: int,
        capture_layers: tuple[int, ...] = (),
        feedback: torch.Tensor | None = None,
    ) -> None:
        """capture_layers: decoder layers whose output stream each replay also writes to `captured`
        ([tokens, len(capture_layers) * hidden], the layers side by side; for DFlash). feedback: the
        buffer of the previous launch's sampled tokens (DecodeGraphs.token_ids), where a replay takes
        the input ids of its tokens with a source row (StepInputs.source_rows): a step launched before
        the host has read them."""
        spec = decoder.spec
        device = kv_cache.device
        self.decoder, self.kv_cache, self.block_size = decoder, kv_cache, block_size
        max_context = max_blocks_per_seq * block_size
        self.buckets = sorted({size for size in TOKEN_BUCKETS if size < max_num_tokens} | {max_num_tokens})
        self.max_tokens = self.buckets[-1]
        self.max_num_seqs = max_num_seqs
        # A padding sequence's keys fit one block-table row and its positions the RoPE table. A bucket of
        # T tokens holds at most min(T, max_num_seqs) sequences and the padding ones: its attention grid
        # covers that many sequence slots, not all of them (a verify step's 16-token bucket: 17, not 65).
        self.pad_len = min(max_context, decoder.max_positions)
        self.slots = {size: min(max_num_seqs, size) + -(-size // self.pad_len) for size in self.buckets}
        self.max_seqs = max(self.slots.values())
        self.max_logit_rows = max_logit_rows
        self.feedback = feedback
        # ids, positions, slots, source rows (-1: the id is the host's)
        self.ints = torch.zeros(4, self.max_tokens, dtype=torch.int64, device=device)
        self.int32s = torch.zeros(2 * self.max_seqs + 1, dtype=torch.int32, device=device)  # starts, lengths
        self.block_tables = torch.zeros(self.max_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.logit_rows = torch.zeros(max_logit_rows, dtype=torch.int64, device=device)
        self.logits = torch.zeros(
            max_logit_rows, decoder.logit_vocab_size, dtype=torch.float32, device=device
        )
        self.capture_layers = capture_layers
        self.captured = torch.zeros(
            self.max_tokens if capture_layers else 0, len(capture_layers) * spec.hidden_size,
            dtype=decoder.model.embed_tokens.weight.dtype, device=device,  # the residual stream's
        )  # fmt: skip
        # Two pinned sets, used by alternate replays: a step launched ahead (ModelRunner.launch) is
        # prepared while the previous one's copies may not have run yet.
        buffers = (self.ints, self.int32s, self.block_tables, self.logit_rows)
        self.staging = [
            [torch.empty_like(buffer, device="cpu").pin_memory() for buffer in buffers] for _ in range(2)
        ]
        self.parity = 0
        self.splits = {
            size: prefill_num_splits(
                size, self.slots[size], size, spec.num_heads, spec.num_kv_heads, spec.head_dim, max_context
            )  # fmt: skip
            for size in self.buckets
        }
        self.workspace = allocate_prefill_workspace(
            self.max_tokens, self.max_seqs, 1, spec.num_heads, spec.num_kv_heads, spec.head_dim,
            max(self.splits.values()), device,
        )  # fmt: skip
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        for size in reversed(self.buckets):  # largest first, so the smaller ones reuse its pool
            self._capture(size)

    def fits(self, inputs: StepInputs) -> bool:
        return (
            len(inputs.input_ids) <= self.max_tokens
            and len(inputs.seq_lens) <= self.max_num_seqs
            and 0 < len(inputs.logit_rows) <= self.max_logit_rows
            and max(len(row) for row in inputs.block_tables) <= self.block_tables.shape[1]
        )

    def _step(self, size: int) -> None:
        ids, positions, slots = self.ints[0, :size], self.ints[1], self.ints[2]
        if self.feedback is not None:
            sources = self.ints[3, :size]
            ids = torch.where(sources >= 0, self.feedback[sources.clamp(min=0)], ids)
        num_slots = self.slots[size]
        metadata = AttentionMetadata(
            slot_mapping=slots[:size],
            query_start_loc=self.int32s[: num_slots + 1],
            seq_lens=self.int32s[self.max_seqs + 1 : self.max_seqs + 1 + num_slots],
            block_tables=self.block_tables[:num_slots],
            max_query_len=size,
            prefill_num_splits=self.splits[size],
            prefill_workspace=self.workspace,
        )
        capture = dict.fromkeys(self.capture_layers) if self.capture_layers else None
        hidden, residual = self.decoder(ids, positions[:size], self.kv_cache, metadata, capture)
        if capture is not None:
            torch.cat([capture[index] for index in self.capture_layers], dim=-1, out=self.captured[:size])
        rows = self.logit_rows[: self._num_logit_rows(size)]
        self.decoder.compute_logits(hidden[rows], residual[rows], out=self.logits[: len(rows)])

    def _num_logit_rows(self, size: int) -> int:
        """A bucket of `size` tokens has at most that many logit rows: the LM head runs on no more."""
        return min(size, self.max_logit_rows)

    def _capture(self, size: int) -> None:
        # every token a padding one while capturing
        starts, lengths = padded_sequences([0], [], size, self.pad_len, self.max_seqs)
        self.int32s.copy_(torch.tensor(starts + lengths, dtype=torch.int32))
        self.ints[1, :size] = torch.tensor([position for n in lengths for position in range(n)])
        self.ints[2:].fill_(-1)  # capture writes no KV, and takes no ids from the feedback buffer
        graph = capture_graph(lambda: self._step(size), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[size] = graph

    def forward(
        self, inputs: StepInputs, before_replay: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """The float32 logits of inputs.logit_rows (a view of a static buffer, valid until the next
        replay; so are the captured layers' rows, in `captured`). before_replay(input_ids) may change
        the ids on the device once the inputs are there (the draft ring's drafts: proposers/draft_ring.py)."""
        num_tokens, num_seqs = len(inputs.input_ids), len(inputs.seq_lens)
        size = next(bucket for bucket in self.buckets if bucket >= num_tokens)
        padding = size - num_tokens
        ints_host, int32s_host, tables_host, rows_host = self.staging[self.parity]
        self.parity ^= 1
        sources = inputs.source_rows if inputs.source_rows is not None else [-1] * num_tokens
        assert self.feedback is not None or inputs.source_rows is None
        starts, lengths = padded_sequences(
            inputs.query_start_loc, inputs.seq_lens, size, self.pad_len, self.max_seqs
        )
        pad_positions = [position for n in lengths[num_seqs:] for position in range(n)]
        ints_host[:, :size] = torch.tensor(
            [inputs.input_ids + [0] * padding,
             inputs.positions + pad_positions,
             inputs.slot_mapping + [-1] * padding,
             sources + [-1] * padding]
        )  # fmt: skip
        int32s_host[:] = torch.tensor(starts + lengths, dtype=torch.int32)
        tables_host.zero_()
        tables = tables_host.numpy()  # a view: numpy takes a row's list far faster than torch.tensor
        for row, table in enumerate(inputs.block_tables):
            tables[row, : len(table)] = table
        num_rows = len(inputs.logit_rows)  # <= num_tokens <= size
        rows_host[:] = torch.tensor(inputs.logit_rows + [0] * (self.max_logit_rows - num_rows))
        self.ints[:, :size].copy_(ints_host[:, :size], non_blocking=True)
        self.int32s.copy_(int32s_host, non_blocking=True)
        self.block_tables.copy_(tables_host, non_blocking=True)
        self.logit_rows.copy_(rows_host, non_blocking=True)
        if before_replay is not None:
            before_replay(self.ints[0, :size])
        self.graphs[size].replay()
        return self.logits[:num_rows]
