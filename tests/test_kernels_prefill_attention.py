"""Paged prefill / verify attention: the Triton kernel against paged_attention_reference.

On the CPU the kernel runs in Triton's interpreter (see conftest.py), so the grids here are small.
Every case poisons what the kernel must not read (cache slots no query of a sequence sees, blocks no
sequence owns, block-table padding pointing at a NaN block) and the output (NaN), so an unmasked load
or a missed store shows up as a NaN.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_cases import paged_cache
from tileinfer.kernels.paged_attention import AttentionMetadata, paged_attention_reference
from tileinfer.kernels.prefill_attention import (
    allocate_prefill_workspace,
    paged_prefill_attention_triton,
    prefill_block_m,
    prefill_num_splits,
)
from tileinfer.kernels.triton_common import num_sms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclasses.dataclass
class PrefillCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # clean: what the reference reads
    poisoned_cache: torch.Tensor  # NaN wherever the kernel must not look
    metadata: AttentionMetadata
    scale: float


def make_case(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    sliding_window: int | None = None,
    device: str = DEVICE,
) -> PrefillCase:
    """Random queries and cache; each sequence's blocks scattered over the cache (shuffled ids); its
    new tokens are the last query_lens[i] of its seq_lens[i] positions."""
    generator = torch.Generator().manual_seed(seed)
    # what the first query sees: a sliding window hides the keys before its window
    first_keys = [
        max(seq_len - query_len - sliding_window + 1, 0) if sliding_window else 0
        for query_len, seq_len in zip(query_lens, seq_lens, strict=True)
    ]
    cache = paged_cache(
        seq_lens, first_keys, sum(query_lens), num_heads, num_kv_heads, head_dim, block_size, dtype,
        generator, padded=True,
    )  # fmt: skip
    query_start_loc = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=cache.block_tables.to(device),
    )
    return PrefillCase(
        cache.query.to(device), cache.kv_cache.to(device), cache.poisoned_cache.to(device), metadata,
        head_dim**-0.5,
    )  # fmt: skip


def expected(case: PrefillCase, sliding_window: int | None) -> torch.Tensor:
    """The reference in fp32 on the clean cache."""
    return paged_attention_reference(
        case.query.float(), case.kv_cache.float(), case.metadata, case.scale, sliding_window
    )


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.bfloat16:
        return {"atol": 2e-2, "rtol": 2e-2}
    # an fp32 cache uses exact fp32 dots ("ieee") on the GPU too; only the summation order differs
    return {"atol": 2e-5, "rtol": 2e-5} if DEVICE == "cpu" else {"atol": 1e-4, "rtol": 1e-4}


def run_triton(case: PrefillCase, sliding_window: int | None, **fields: object) -> torch.Tensor:
    """The kernel on the poisoned cache into a NaN-filled out; `fields` override metadata fields."""
    out = torch.full_like(case.query, float("nan"))
    metadata = dataclasses.replace(case.metadata, **fields)
    result = paged_prefill_attention_triton(
        case.query, case.poisoned_cache, metadata, case.scale, sliding_window, out=out
    )
    assert result is out
    assert torch.isfinite(out).all()  # every element written, nothing poisoned read
    return out


# (query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, window)
CASES = [
    ([150], [150], 2, 2, 64, 16, None),  # MHA: 128-row tiles, a partial first tile
    ([16, 33, 1], [48, 33, 100], 4, 2, 64, 16, None),  # GQA 2: cached prefixes on page edges, a decode row
    ([70], [203], 8, 2, 128, 16, None),  # GQA 4, head_dim 128, odd cached prefix
    ([40, 17], [40, 90], 8, 1, 64, 16, 24),  # GQA 8, sliding window shorter than the prompt
    ([29, 5], [61, 5], 3, 1, 64, 32, 40),  # GQA 3 (SmolLM2's group), block size 32, window
    ([4, 16, 2], [300, 517, 64], 4, 1, 64, 16, None),  # verify: few tokens after long contexts, splits
    ([21], [21], 2, 1, 256, 16, None),  # head_dim 256: 64-row tiles
    ([12], [44], 4, 2, 32, 8, 9),  # head_dim 32, block size 8, window within one page
    ([9, 3], [9, 20], 4, 2, 16, 16, None),  # head_dim 16 (the tiny model-family configs)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case_index", range(len(CASES)))
def test_prefill_attention_matches_reference(case_index: int, dtype: torch.dtype) -> None:
    query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, window = CASES[case_index]
    case = make_case(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, case_index, window
    )
    got = run_triton(case, window)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected(case, window), **tolerance(dtype))


@pytest.mark.parametrize("window", [None, 70])
def test_split_counts_agree(window: int | None) -> None:
    """Grids of 1, 2, 3 and 9 KV splits give the same answer (a query tile uses at most as many as its
    keys need: here 2 for the 260-key row), and the counters are left at zero for the next launch."""
    case = make_case([3, 8, 1], [260, 8, 77], 8, 2, 64, 16, torch.float32, 31, window)
    one_split = run_triton(case, window, prefill_num_splits=1)
    torch.testing.assert_close(one_split, expected(case, window), **tolerance(torch.float32))
    # max_query_len only picks the tile shape: an understated one still covers every token
    small_tiles = run_triton(case, window, prefill_num_splits=1, max_query_len=1)
    torch.testing.assert_close(small_tiles, one_split, atol=1e-5, rtol=1e-5)
    for num_splits in (2, 3, 9):
        workspace = allocate_prefill_workspace(12, 3, 8, 8, 2, 64, num_splits, DEVICE)
        workspace.partials.fill_(float("nan"))
        got = run_triton(case, window, prefill_num_splits=num_splits, prefill_workspace=workspace)
        torch.testing.assert_close(got, one_split, atol=1e-5, rtol=1e-5)
        assert (workspace.counters == 0).all()


def test_splits_follow_each_tile_s_key_range() -> None:
    """A grid of 16 splits over a 2,000-key verify row, a 40-key one and a 700-key one: each query tile
    uses only the splits its keys need (256 keys each at head_dim 64), the other programs write nothing,
    and the merge reads only the splits used."""
    query_lens, seq_lens = [4, 4, 1], [2000, 40, 700]
    case = make_case(query_lens, seq_lens, 4, 1, 64, 16, torch.float32, 33)
    one_split = run_triton(case, None, prefill_num_splits=1)
    torch.testing.assert_close(one_split, expected(case, None), **tolerance(torch.float32))
    workspace = allocate_prefill_workspace(9, 3, 4, 4, 1, 64, 16, DEVICE)
    workspace.partials.fill_(float("nan"))
    got = run_triton(case, None, prefill_num_splits=16, prefill_workspace=workspace)
    torch.testing.assert_close(got, one_split, atol=1e-5, rtol=1e-5)
    assert (workspace.counters == 0).all()
    _, running_max, _ = workspace.split_partials(9, 4, 64, 16, 1)
    written = ~running_max.view(9, 4, 16).isnan()  # [token, head, split]
    assert written[:4, :, :8].all() and not written[:4, :, 8:].any()  # 2,000 keys: 8 splits
    assert not written[4:8].any()  # 40 keys: one split, its output stored directly
    assert written[8, :, :3].all() and not written[8, :, 3:].any()  # 700 keys: 3 splits


def test_graph_style_call() -> None:
    """What a CUDA-graph verify step passes: max_query_len and num_splits as host ints, a preallocated
    workspace sized for a bigger batch, a query sliced from a fused projection and a strided out."""
    case = make_case([5, 5], [5, 133], 4, 2, 64, 16, torch.float32, 32)
    workspace = allocate_prefill_workspace(16, 4, 5, 4, 2, 64, 4, DEVICE)
    qkv = torch.randn(10, 8, 64, device=DEVICE)
    qkv[:, :4] = case.query
    case.query = qkv[:, :4]
    out = torch.full((10, 4, 2, 64), float("nan"), device=DEVICE)[:, :, 0]
    metadata = dataclasses.replace(
        case.metadata, max_query_len=5, prefill_num_splits=4, prefill_workspace=workspace
    )
    for _ in range(2):  # the second launch runs on the counters the first left
        out.fill_(float("nan"))
        got = paged_prefill_attention_triton(case.query, case.poisoned_cache, metadata, case.scale, out=out)
        assert got is out
        torch.testing.assert_close(got, expected(case, None), **tolerance(torch.float32))
    assert (workspace.counters == 0).all()


def test_tile_and_split_heuristics() -> None:
    # verify rows fill a 16..64-row tile; prefill uses 128 rows (64 at head_dim 256)
    assert prefill_block_m(4, 4, 128) == 16
    assert prefill_block_m(16, 4, 128) == 64
    assert prefill_block_m(4096, 4, 128) == 128
    assert prefill_block_m(4096, 1, 256) == 64
    assert prefill_block_m(1, 32, 128) == 32  # a group larger than 16 rows still fits one token
    # a 4k prefill of Qwen3-4B fills the GPU without splitting; a verify step over 4k keys splits
    # (about two programs per SM: 1 busy tile x 1 KV head here), never more splits than key tiles
    assert prefill_num_splits(4096, 1, 4096, 32, 8, 128, 4096) == 1
    assert prefill_num_splits(4, 1, 4, 8, 1, 128, 4096) == min(2 * num_sms(), 64)
    assert prefill_num_splits(4, 1, 4, 8, 1, 128, 64) == 1  # 64 keys: one tile


def test_bad_head_dim() -> None:
    case = make_case([3], [3], 2, 1, 64, 16, torch.float32, 33)
    query = torch.zeros(3, 2, 48, device=DEVICE)
    kv_cache = torch.zeros(2, 2, 16, 1, 48, device=DEVICE)
    with pytest.raises(AssertionError, match="head_dim 48"):
        paged_prefill_attention_triton(query, kv_cache, case.metadata, 1.0)


# --- GPU: the real model shapes, compiled ---------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "window"),
    [
        ([4096], [4096], None),  # a 4k prompt
        ([1000, 2048, 1, 17], [3000, 2048, 5000, 17], None),  # prefill chunks after cached prefixes, mixed
        ([4, 16, 2, 9], [4096, 4111, 30, 32768], None),  # verify after long contexts
        ([3000, 100], [5000, 100], 1024),  # sliding window
    ],
    ids=["prompt-4k", "chunks-mixed", "verify", "window"],
)
def test_prefill_attention_qwen3_4b_gpu(
    query_lens: list[int], seq_lens: list[int], window: int | None
) -> None:
    """Qwen3-4B heads (32 q / 8 kv of 128), bf16, vs the fp32 reference."""
    case = make_case(query_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16, 41, window, device="cuda")
    got = run_triton(case, window)
    torch.testing.assert_close(got.float(), expected(case, window), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(16, 8, 128, 16), (9, 3, 64, 32), (32, 4, 128, 16), (16, 16, 64, 16)],
    ids=["qwen3-0.6b", "smollm2-135m-bs32", "gqa8", "mha"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_prefill_attention_model_shapes_gpu(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    query_lens, seq_lens = [513, 1, 16, 7, 300], [513, 1025, 2000, 7, 333]
    case = make_case(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, 42, device="cuda"
    )
    got = run_triton(case, None)
    torch.testing.assert_close(got.float(), expected(case, None), **tolerance(dtype))


@pytest.mark.gpu
def test_verify_attention_cuda_graph_replay() -> None:
    """A verify step captured once (max_query_len, splits, workspace fixed), replayed after the
    sequences grew and the queries changed in place."""
    case = make_case([8, 8], [2000, 4104], 32, 8, 128, 16, torch.bfloat16, 43, device="cuda")
    final_seq_lens, final_query = case.metadata.seq_lens.clone(), case.query.clone()
    case.metadata.seq_lens.copy_(torch.tensor([900, 1024], dtype=torch.int32))
    case.query.normal_()
    num_splits = prefill_num_splits(16, 2, 8, 32, 8, 128, case.metadata.block_tables.shape[1] * 16)
    assert num_splits > 1
    workspace = allocate_prefill_workspace(16, 2, 8, 32, 8, 128, num_splits, "cuda")
    metadata = dataclasses.replace(
        case.metadata, max_query_len=8, prefill_num_splits=num_splits, prefill_workspace=workspace
    )
    out = torch.empty_like(case.query)

    def step() -> None:
        paged_prefill_attention_triton(case.query, case.kv_cache, metadata, case.scale, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    case.metadata.seq_lens.copy_(final_seq_lens)
    case.query.copy_(final_query)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), expected(case, None), atol=2e-2, rtol=2e-2)
    assert (workspace.counters == 0).all()
