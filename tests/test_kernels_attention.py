"""Paged decode attention: the split-KV Triton kernel against its torch reference.

On the CPU the kernels run in Triton's interpreter (see conftest.py), so the grids here are small.
Every case poisons what the kernel must not read (cache slots outside a sequence's visible keys,
blocks no sequence owns, block-table padding pointing at a NaN block) and the output (NaN), so an
unmasked load or a missed store shows up as a NaN.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_cases import paged_cache
from tileinfer.kernels.decode_attention import (
    DecodeTile,
    DecodeWorkspace,
    decode_min_keys_per_split,
    decode_num_splits,
    decode_splits_used,
    paged_decode_attention_reference,
    paged_decode_attention_triton,
)
from tileinfer.kernels.triton_common import num_sms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclasses.dataclass
class DecodeCase:
    query: torch.Tensor  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor  # clean: what the reference reads
    poisoned_cache: torch.Tensor  # NaN wherever the kernel must not look
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with the NaN trap block
    seq_lens: torch.Tensor  # [num_seqs] int32, on the device
    scale: float


def make_case(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    sliding_window: int | None = None,
    max_blocks: int | None = None,
    device: str = DEVICE,
) -> DecodeCase:
    """Random query and cache (tests/paged_cases.py); a sliding window hides each sequence's older keys."""
    generator = torch.Generator().manual_seed(seed)
    first_keys = [max(seq_len - sliding_window, 0) if sliding_window else 0 for seq_len in seq_lens]
    cache = paged_cache(
        seq_lens, first_keys, len(seq_lens), num_heads, num_kv_heads, head_dim, block_size, dtype, generator,
        max_blocks,
    )  # fmt: skip
    return DecodeCase(
        query=cache.query.to(device),
        kv_cache=cache.kv_cache.to(device),
        poisoned_cache=cache.poisoned_cache.to(device),
        block_tables=cache.block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )


def expected(case: DecodeCase, sliding_window: int | None) -> torch.Tensor:
    """The reference in fp32 on the clean cache."""
    return paged_decode_attention_reference(
        case.query.float(),
        case.kv_cache.float(),
        case.block_tables,
        case.seq_lens,
        case.scale,
        sliding_window,
    )


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    # on the GPU an fp32 tl.dot runs in TF32
    return {"atol": 5e-3, "rtol": 5e-3} if DEVICE == "cuda" else {"atol": 1e-5, "rtol": 1e-5}


BF16_UNIT = 2.0**-8  # bf16's unit roundoff (2^-9) with a factor 2 of margin


def assert_matches_reference(
    got: torch.Tensor, case: DecodeCase, sliding_window: int | None, dtype: torch.dtype
) -> None:
    """got equals the fp32 reference within the kernel's rounding. bf16: the kernel rounds the
    probabilities to bf16 for the P @ V product and its output to bf16, so each element may be off by
    up to u * sum_j p_j |v_j| + u * |out| (u = BF16_UNIT), a bound that scales with the values
    (outputs of long contexts are small, ~1/sqrt(keys), so a fixed atol would pass zeros)."""
    want = expected(case, sliding_window)
    if dtype != torch.bfloat16:
        torch.testing.assert_close(got.float(), want, **tolerance(dtype))
        return
    abs_values = case.kv_cache.clone()
    abs_values[1] = abs_values[1].abs()
    weighted_abs = expected(dataclasses.replace(case, kv_cache=abs_values), sliding_window)  # sum_j p_j |v_j|
    bound = BF16_UNIT * (weighted_abs + want.abs()) + 1e-6
    error = (got.float() - want).abs()
    worst = int((error - bound).argmax())
    assert (error <= bound).all(), (
        f"{int((error > bound).sum())} of {error.numel()} elements outside the bf16 rounding bound; worst "
        f"at flat index {worst}: error {error.flatten()[worst]:.3e}, bound {bound.flatten()[worst]:.3e}"
    )


def run_triton(
    case: DecodeCase, sliding_window: int | None, num_splits: int | None, **kwargs: object
) -> torch.Tensor:
    out = kwargs.pop("out", None)
    if out is None:
        out = torch.full_like(case.query, float("nan"))
    result = paged_decode_attention_triton(
        case.query,
        case.poisoned_cache,
        case.block_tables,
        case.seq_lens,
        case.scale,
        sliding_window,
        num_splits,
        out=out,
        **kwargs,
    )
    assert result is out
    return result


# (seq_lens, num_heads, num_kv_heads, head_dim, block_size, sliding_window, num_splits)
# Tiles are 128 keys at head_dim 64 and 64 at head_dim 128; a used split takes at least two tiles.
CASES = [
    ([300], 2, 2, 64, 16, None, 1),  # MHA, one split: three tiles, written directly
    ([1, 600, 16], 4, 2, 64, 16, None, 3),  # GQA 2, seq_len 1, a whole block, three splits merged
    ([45, 0, 700], 4, 1, 64, 32, None, 2),  # GQA 4, block size 32, a padded slot, uneven splits
    ([530], 8, 1, 64, 16, 300, 2),  # GQA 8 with a sliding window that starts mid-block and mid-tile
    ([29, 3, 700], 3, 1, 64, 16, 400, 4),  # GQA 3 (SmolLM2's group), window longer than seq 3
    ([300], 2, 1, 128, 16, None, 2),  # head dim 128, GQA 2
    ([129, 64, 200], 16, 2, 128, 16, None, 4),  # GQA 8 at head dim 128: tile and page boundaries
    ([257, 128], 2, 2, 128, 16, None, 4),  # MHA at head dim 128: 3 splits vs 1
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case_index", range(len(CASES)))
def test_decode_attention_matches_reference(case_index: int, dtype: torch.dtype) -> None:
    seq_lens, num_heads, num_kv_heads, head_dim, block_size, window, num_splits = CASES[case_index]
    case = make_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, case_index, window)
    got = run_triton(case, window, num_splits)
    assert got.dtype == dtype
    assert torch.isfinite(got).all()
    assert_matches_reference(got, case, window, dtype)
    assert (got[case.seq_lens == 0] == 0).all()


@pytest.mark.parametrize("window", [None, 200])
def test_split_counts_agree(window: int | None) -> None:
    """1, 2, 3 and 7 splits at most (more than the sequences can use) give the same answer."""
    case = make_case([1100, 90, 5, 0], 4, 2, 64, 16, torch.float32, 11, window)
    one_split = run_triton(case, window, 1)
    assert_matches_reference(one_split, case, window, torch.float32)
    for num_splits in (2, 3, 7):  # the same products, summed in another order
        torch.testing.assert_close(run_triton(case, window, num_splits), one_split, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("window", "tile"),
    [(None, None), (300, None), (None, DecodeTile(32, 1, 4, 2))],
    ids=["default", "window", "tile-32x1"],
)
def test_splits_follow_each_sequence_length(window: int | None, tile: DecodeTile | None) -> None:
    """In one batch under one grid, each sequence uses only the splits its own length needs: exactly
    those write partials (the rest of the NaN-poisoned workspace stays NaN, so the merge cannot have
    read it), a sequence that needs one split writes none, and the answer matches the reference; also
    with another launch shape (decode_splits_used mirrors it)."""
    # tiles of 64 keys, two per split at least: 0, 1, 2, 2, 2, 3, 4 (3 tiles each), 3 (9 tiles), 4
    seq_lens = [0, 1, 128, 129, 256, 257, 640, 576, 1000]
    num_heads, num_kv_heads, head_dim, num_splits = 4, 2, 128, 4
    case = make_case(seq_lens, num_heads, num_kv_heads, head_dim, 16, torch.float32, 14, window)
    workspace = DecodeWorkspace.allocate(len(seq_lens), num_heads, num_kv_heads, head_dim, 1, DEVICE, 4)
    workspace.partials.fill_(float("nan"))
    got = run_triton(case, window, num_splits, workspace=workspace, tile=tile)
    assert_matches_reference(got, case, window, torch.float32)
    assert (workspace.counters == 0).all()

    group = num_heads // num_kv_heads
    num_stats = len(seq_lens) * num_heads * num_splits
    partial_max = workspace.partials[num_stats * head_dim : num_stats * (head_dim + 1)]
    written = partial_max.view(len(seq_lens), num_kv_heads, num_splits, group).isfinite()
    used = [decode_splits_used(seq_len, num_splits, head_dim, window, tile) for seq_len in seq_lens]
    if window is None and tile is None:
        assert used == [0, 1, 1, 2, 2, 3, 4, 3, 4]
    if tile is not None:  # tiles of 32 keys, one a split at least, dealt evenly over at most 4 splits
        assert used == [0, 1, 4, 3, 4, 3, 4, 4, 4]
    for seq, used_here in enumerate(used):
        want = torch.arange(num_splits, device=DEVICE) < (used_here if used_here > 1 else 0)
        assert (written[seq] == want[None, :, None]).all(), (seq_lens[seq], used_here)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_sequence_among_short_ones(dtype: torch.dtype) -> None:
    """GQA 8 at head dim 128: a 2,200-key sequence spreads over 18 of 32 splits (the merge holds 16
    splits' partials at a time, so it takes two passes) while its short neighbours, in the same
    launch, use one or two."""
    case = make_case([2200, 3, 130, 0], 16, 2, 128, 16, dtype, 15)
    assert [decode_splits_used(seq_len, 32, 128) for seq_len in (2200, 3, 130, 0)] == [18, 1, 2, 0]
    got = run_triton(case, None, 32)
    assert torch.isfinite(got).all()
    assert_matches_reference(got, case, None, dtype)
    assert (got[3] == 0).all()


def test_default_splits_and_preallocated_workspace() -> None:
    """num_splits=None picks splits from shapes alone; a larger preallocated workspace (a CUDA graph's,
    sized for a bigger batch) and a strided query and out give the same answer as the reference."""
    case = make_case([19, 600], 4, 2, 64, 16, torch.float32, 12, max_blocks=64)
    num_splits = decode_num_splits(2, 2, case.block_tables.shape[1] * 16, 64)
    assert num_splits == decode_num_splits(2, 2, 1024, 64)  # never from seq_lens' values
    assert num_splits > 1
    workspace = DecodeWorkspace.allocate(4, 4, 2, 64, 1024, DEVICE)
    workspace.partials.fill_(float("nan"))
    qkv = torch.randn(2, 8, 64, device=DEVICE)  # the query as a slice of a fused projection
    qkv[:, :4] = case.query
    case.query = qkv[:, :4]
    out = torch.full((2, 4, 2, 64), float("nan"), device=DEVICE)[:, :, 0]  # strided out
    got = run_triton(case, None, None, out=out, workspace=workspace)
    assert_matches_reference(got, case, None, torch.float32)
    # the merge leaves the counters at zero: a second launch on the same workspace agrees
    assert (workspace.counters == 0).all()
    out.fill_(float("nan"))
    torch.testing.assert_close(run_triton(case, None, None, out=out, workspace=workspace), got)
    # the reference honours out= too
    ref_out = torch.full_like(case.query, float("nan"))
    paged_decode_attention_reference(
        case.query, case.kv_cache, case.block_tables, case.seq_lens, case.scale, out=ref_out
    )
    torch.testing.assert_close(ref_out, expected(case, None))


def test_all_slots_padded() -> None:
    """A batch of padded slots (seq_len 0 everywhere) writes zeros and reads no cache."""
    case = make_case([0, 0], 4, 2, 64, 16, torch.bfloat16, 13, max_blocks=2)
    for num_splits in (1, 2):
        assert (run_triton(case, None, num_splits) == 0).all()


def test_num_splits_heuristic() -> None:
    # one program per (seq, kv head) fills 2x the SMs already: no split
    assert decode_num_splits(4096, 8, 32768, 128) == 1
    # never more splits than the longest context can use (decode_min_keys_per_split keys each)
    assert decode_min_keys_per_split(128) == 128 and decode_min_keys_per_split(64) == 256
    assert decode_num_splits(1, 1, 16, 128) == 1
    assert decode_num_splits(1, 8, 256, 128) == 2
    assert decode_num_splits(1, 8, 32768, 128) >= 2
    # in a small batch the longest sequence alone still spreads over every SM (mixed lengths)...
    assert decode_num_splits(8, 8, 32768, 128) * 8 >= num_sms()
    # ...while a batch that fills the GPU by itself is not split
    assert decode_num_splits(256, 8, 32768, 128) == 1


# --- GPU: the real model shapes, compiled ---------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 16])
@pytest.mark.parametrize("num_heads", [32, 16], ids=["qwen3-4b", "qwen3-0.6b"])
def test_decode_attention_long_contexts_gpu(num_heads: int, num_splits: int | None) -> None:
    """Qwen3 heads (32 or 16 q / 8 kv of 128), bf16, contexts from 1 to 32k, vs the fp32 reference."""
    seq_lens = [1, 1023, 4096, 32768]
    case = make_case(seq_lens, num_heads, 8, 128, 16, torch.bfloat16, 21, device="cuda")
    got = run_triton(case, None, num_splits)
    assert_matches_reference(got, case, None, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "window"),
    [(16, 8, 128, 16, None), (9, 3, 64, 32, None), (16, 8, 128, 16, 1000)],
    ids=["qwen3-0.6b", "smollm2-135m-bs32", "qwen3-0.6b-window"],
)
def test_decode_attention_model_shapes_gpu(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, window: int | None
) -> None:
    seq_lens = [0, 1, 17, 1023, 2500, 4097]
    case = make_case(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, 22, window, device="cuda"
    )
    got = run_triton(case, window, None)
    assert_matches_reference(got, case, window, torch.bfloat16)
    assert (got[0] == 0).all()


@pytest.mark.gpu
def test_decode_attention_cuda_graph_replay() -> None:
    """Captured once for a 32k block table (num_splits fixed from it), replayed after the step's inputs
    change in place: other lengths (short, padded, 32k) and a new query. Each replay uses the splits the
    new lengths need, on the counters the last replay left, and matches the reference."""
    full_lens = [32768, 1, 4097, 300]
    case = make_case(full_lens, 32, 8, 128, 16, torch.bfloat16, 23, max_blocks=2056, device="cuda")
    num_splits = decode_num_splits(4, 8, 2056 * 16, 128)
    assert num_splits > 8
    workspace = DecodeWorkspace.allocate(4, 32, 8, 128, 2056 * 16, "cuda")
    query, seq_lens = case.query.clone(), case.seq_lens.clone()  # the graph's input buffers
    out = torch.empty_like(query)

    def step() -> None:
        paged_decode_attention_triton(
            query,
            case.poisoned_cache,
            case.block_tables,
            seq_lens,
            case.scale,
            num_splits=num_splits,
            out=out,
            workspace=workspace,
        )

    seq_lens.copy_(torch.tensor([5, 0, 1023, 300], dtype=torch.int32))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for lens in (full_lens, [20000, 0, 16, 129], full_lens):
        replay_case = dataclasses.replace(
            case, seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"), query=torch.randn_like(query)
        )
        seq_lens.copy_(replay_case.seq_lens)
        query.copy_(replay_case.query)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, replay_case, None, torch.bfloat16)
        assert (out[replay_case.seq_lens == 0] == 0).all()
        assert (workspace.counters == 0).all()


@pytest.mark.parametrize("window", [None, 100])
def test_reference_blocks_long_prompts_into_query_blocks_exactly(window: int | None) -> None:
    """The reference computes a long prompt REFERENCE_QUERY_BLOCK queries at a time; the result equals
    one dense masked softmax over contiguous keys (a 600-token chunk after 100 cached positions)."""
    from tileinfer.kernels.paged_attention import (
        REFERENCE_QUERY_BLOCK,
        AttentionMetadata,
        paged_attention_reference,
    )

    generator = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads, head_dim, block_size, cached, new = 4, 2, 16, 16, 100, 600
    assert new > 2 * REFERENCE_QUERY_BLOCK
    seq_len = cached + new
    num_blocks = -(-seq_len // block_size)
    keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
    values = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
    query = torch.randn(new, num_heads, head_dim, generator=generator, dtype=torch.float64)
    order = torch.randperm(num_blocks, generator=generator)  # blocks scattered over the cache
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float64)
    padded = num_blocks * block_size - seq_len
    for cache_part, part in ((kv_cache[0], keys), (kv_cache[1], values)):
        full = torch.cat([part, part.new_zeros(padded, num_kv_heads, head_dim)])
        cache_part[order] = full.view(num_blocks, block_size, num_kv_heads, head_dim)
    metadata = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        query_start_loc=torch.tensor([0, new], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=order[None].int(),
    )
    got = paged_attention_reference(query, kv_cache, metadata, head_dim**-0.5, window)

    query_positions = torch.arange(cached, seq_len)[:, None]
    key_positions = torch.arange(seq_len)[None, :]
    visible = key_positions <= query_positions
    if window is not None:
        visible &= key_positions > query_positions - window
    group = num_heads // num_kv_heads
    scores = torch.einsum("qhd,khd->hqk", query, keys.repeat_interleave(group, 1)) * head_dim**-0.5
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    expected = torch.einsum("hqk,khd->qhd", probs, values.repeat_interleave(group, 1))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)  # the reference works in float32
