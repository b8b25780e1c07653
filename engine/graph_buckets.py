"""The graph steps' buckets (engine/graphs.py captures one graph per bucket): their sizes, how a step is
padded to one, and the layout of a bucket's inputs in one static byte buffer.

Padding. A step bucket's shapes are fixed: T tokens, up to min(T, max_num_seqs) sequences and at most T
logit rows. Its padding tokens belong to extra sequences, each no longer than a context (its keys fill one
block-table row, its positions the RoPE table), whose block table rows point at block 0 and whose KV writes
are skipped (slot -1), so they read finite stale values and change nothing; so a step may hold more
tokens than max_model_len (many prompts at once). Sequence slots beyond those get no tokens and no keys. A
decode bucket's padding rows have length 0, which attention skips.

Inputs. Every input of a replay is a field of one static byte buffer (Bucket.fields: one more per-row input
is one more line there, and its write in GraphCache._stage). A bucket lays its fields out one after another,
the block tables first (so a row's table sits at the same place in every bucket), and a step's inputs reach
the device in one copy of the bucket's bytes from a pinned staging buffer.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy
import torch
from tileinfer.engine.step_inputs import SAMPLING_FLOAT_FIELDS
from tileinfer.kernels.paged_attention import AttentionMetadata
from tileinfer.kernels.sampling import SamplingTensors

DECODE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# No step bucket below 16: with buckets of 1-8 tokens (linear layers as GEMVs) an n-gram verify step on
# SmolLM2-135M took 2.82 ms on the H200, against 1.95 ms from the 16-token bucket (BENCHMARKS.md).
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def sizes_up_to(sizes: tuple[int, ...], most: int) -> tuple[int, ...]:
    """The bucket sizes below `most`, then `most` itself."""
    return tuple(sorted({size for size in sizes if size < most} | {most}))


def step_sizes(max_num_tokens: int) -> tuple[int, ...]:
    """The token counts of the step buckets, up to a step of max_num_tokens: the sizes a step runs at
    without padding (the scheduler ends a long prompt's cut chunks on them too)."""
    return sizes_up_to(TOKEN_BUCKETS, max_num_tokens)


# the float fields' values for a padding row: greedy, no filtering, no penalties
_NEUTRAL_FLOATS = numpy.array([0.0, 1.0, 0.0, 0.0, 0.0, 1.0], dtype=numpy.float32)
_ALIGN = 16  # bytes: every field starts at a multiple of it (so any dtype views it)


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


@dataclasses.dataclass
class Bucket:
    """One captured shape: its row counts, its fields' views of the static buffer (device) and of each
    staging buffer (host), and the bytes a step copies."""

    decode: bool
    num_tokens: int
    num_slots: int  # sequence slots (padding ones included)
    num_logit_rows: int  # 0 in a decode bucket, which computes every row's logits
    num_samples: int  # rows it can sample
    max_blocks_per_seq: int  # a block-table row's length
    masked: bool = False  # a masked-sampling bucket: num_samples constrained rows, nothing else
    offsets: dict[str, int] = dataclasses.field(default_factory=dict)  # each field's first byte
    nbytes: int = 0
    device: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    host: list[dict[str, numpy.ndarray]] = dataclasses.field(default_factory=list)  # per staging buffer
    replay: Callable[[], None] | None = None

    def fields(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """A bucket's input fields, in buffer order (the block tables first)."""
        tokens, slots, samples = self.num_tokens, self.num_slots, self.num_samples
        sampling = [
            ("seeds", torch.int64, (samples,)),
            ("draw_positions", torch.int64, (samples,)),
            ("top_k", torch.int32, (samples,)),
            ("sampling_floats", torch.float32, (len(SAMPLING_FLOAT_FIELDS), samples)),
        ]
        if self.masked:  # rows: each one's row of token_ids and of the step's logits (-1: padding)
            return [("rows", torch.int64, (samples,)), *sampling]
        return [
            ("block_tables", torch.int32, (slots, self.max_blocks_per_seq)),
            ("input_ids", torch.int64, (tokens,)),
            ("positions", torch.int64, (tokens,)),
            ("slot_mapping", torch.int64, (tokens,)),  # -1: no KV write
            ("source_rows", torch.int64, (tokens,)),  # >= 0: the id is that row of token_ids
            ("query_start_loc", torch.int32, (slots + 1,)),
            ("seq_lens", torch.int32, (slots,)),
            ("logit_rows", torch.int64, (self.num_logit_rows,)),
            *sampling,  # per sampled row
        ]

    def lay_out(self) -> None:
        """Each field's first byte, and the bytes a step copies."""
        offset = 0
        for name, dtype, shape in self.fields():
            self.offsets[name] = offset
            size = dtype.itemsize * int(numpy.prod(shape))
            offset += -(-size // _ALIGN) * _ALIGN
        self.nbytes = offset

    def views(self, buffer: torch.Tensor | numpy.ndarray) -> dict:
        """Its fields as views of `buffer` (a byte tensor, or a staging buffer's numpy array)."""
        views = {}
        for name, dtype, shape in self.fields():
            size = dtype.itemsize * int(numpy.prod(shape))
            part = buffer[self.offsets[name] : self.offsets[name] + size]
            if isinstance(part, numpy.ndarray):
                views[name] = part.view(torch.empty(0, dtype=dtype).numpy().dtype).reshape(shape)
            else:
                views[name] = part.view(dtype).view(shape)
        return views


def sampling_tensors(
    views: dict[str, torch.Tensor], num_rows: int, output_counts: torch.Tensor, prompt_mask: torch.Tensor
) -> SamplingTensors:
    """The sampler's tensors over a bucket's first num_rows sampling fields, with these token counts."""
    floats = views["sampling_floats"][:, :num_rows]
    return SamplingTensors(
        **dict(zip(SAMPLING_FLOAT_FIELDS, floats, strict=True)),
        top_k=views["top_k"][:num_rows],
        seeds=views["seeds"][:num_rows],
        positions=views["draw_positions"][:num_rows],
        output_counts=output_counts[:num_rows],
        prompt_mask=prompt_mask[:num_rows],
    )


def stage_sampling(
    host: dict[str, numpy.ndarray],
    seeds: list[int],
    draw_positions: list[int],
    top_k: list[int],
    sampling_floats: list[tuple[float, ...]],
) -> None:
    """A bucket's sampling fields: the given rows', then neutral padding rows (greedy, no filtering)."""
    num_samples = len(seeds)
    host["seeds"][:num_samples] = seeds
    host["draw_positions"][:num_samples] = draw_positions
    host["top_k"][:num_samples] = top_k
    if num_samples:
        host["sampling_floats"][:, :num_samples] = numpy.array(sampling_floats, dtype=numpy.float32).T
    host["seeds"][num_samples:] = 0
    host["draw_positions"][num_samples:] = 0
    host["top_k"][num_samples:] = 0
    host["sampling_floats"][:, num_samples:] = _NEUTRAL_FLOATS[:, None]


def attention_metadata(views: dict[str, torch.Tensor], **step_kind: object) -> AttentionMetadata:
    """A bucket's attention metadata over its device views; step_kind: the decode or prefill fields."""
    return AttentionMetadata(
        slot_mapping=views["slot_mapping"], query_start_loc=views["query_start_loc"],
        seq_lens=views["seq_lens"], block_tables=views["block_tables"], **step_kind,
    )  # fmt: skip
