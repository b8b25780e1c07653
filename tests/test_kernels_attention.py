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

from kernels.attention import (
    DecodeWorkspace,
    decode_num_splits,
    paged_decode_attention_reference,
    paged_decode_attention_triton,
)
from kernels.triton_common import num_sms

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
    """Random query and cache; each sequence's blocks scattered over the cache (shuffled ids)."""
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-seq_len // block_size) for seq_len in seq_lens]
    max_blocks = max_blocks or max(max(blocks_needed), 1)
    num_blocks = sum(blocks_needed) + 3  # two unused blocks and the trap block
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=generator).to(dtype)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator).to(dtype)

    trap = num_blocks - 1
    order = torch.randperm(num_blocks - 1, generator=generator).tolist()
    block_tables = torch.full((len(seq_lens), max_blocks), trap, dtype=torch.int32)
    poisoned = torch.full_like(kv_cache, float("nan"))
    clean_slots = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_blocks * block_size, ...]
    poisoned_slots = poisoned.view(2, -1, num_kv_heads, head_dim)
    for seq, (seq_len, needed) in enumerate(zip(seq_lens, blocks_needed, strict=True)):
        blocks, order = torch.tensor(order[:needed], dtype=torch.int64), order[needed:]
        block_tables[seq, :needed] = blocks.int()
        first_key = max(seq_len - sliding_window, 0) if sliding_window else 0
        keys = torch.arange(first_key, seq_len)
        slots = blocks[keys // block_size] * block_size + keys % block_size
        poisoned_slots[:, slots] = clean_slots[:, slots]
    return DecodeCase(
        query=query.to(device),
        kv_cache=kv_cache.to(device),
        poisoned_cache=poisoned.to(device),
        block_tables=block_tables.to(device),
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
    if dtype == torch.bfloat16:
        return {"atol": 2e-2, "rtol": 2e-2}
    # on the GPU an fp32 tl.dot runs in TF32
    return {"atol": 5e-3, "rtol": 5e-3} if DEVICE == "cuda" else {"atol": 1e-5, "rtol": 1e-5}


def run_triton(
    case: DecodeCase, sliding_window: int | None, num_splits: int | None, **kwargs: torch.Tensor
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
CASES = [  # tiles are 128 keys at head_dim 64, 64 at head_dim 128
    ([300], 2, 2, 64, 16, None, 1),  # MHA, one split: three tiles, written directly
    ([1, 300, 16], 4, 2, 64, 16, None, 3),  # GQA 2, seq_len 1, a whole block, three splits merged
    ([45, 0, 333], 4, 1, 64, 32, None, 2),  # GQA 4, block size 32, a padded slot, uneven splits
    ([270], 8, 1, 64, 16, 150, 2),  # GQA 8 with a sliding window that starts mid-block
    ([29, 3, 400], 3, 1, 64, 16, 200, 4),  # GQA 3 (SmolLM2's group), window longer than seq 3
    ([150], 2, 1, 128, 16, None, 2),  # head dim 128
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case_index", range(len(CASES)))
def test_decode_attention_matches_reference(case_index: int, dtype: torch.dtype) -> None:
    seq_lens, num_heads, num_kv_heads, head_dim, block_size, window, num_splits = CASES[case_index]
    case = make_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, case_index, window)
    got = run_triton(case, window, num_splits)
    assert got.dtype == dtype
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected(case, window), **tolerance(dtype))
    assert (got[case.seq_lens == 0] == 0).all()


@pytest.mark.parametrize("window", [None, 200])
def test_split_counts_agree(window: int | None) -> None:
    """1, 2, 3 and 7 splits (more than the sequences have tiles) give the same answer."""
    case = make_case([600, 90, 5, 0], 4, 2, 64, 16, torch.float32, 11, window)
    one_split = run_triton(case, window, 1)
    torch.testing.assert_close(one_split, expected(case, window), **tolerance(torch.float32))
    for num_splits in (2, 3, 7):  # the same products, summed in another order
        torch.testing.assert_close(run_triton(case, window, num_splits), one_split, atol=1e-4, rtol=1e-4)


def test_default_splits_and_preallocated_workspace() -> None:
    """num_splits=None picks splits from shapes alone; a larger preallocated workspace (a CUDA graph's,
    sized for a bigger batch) and a strided query and out give the same answer as the reference."""
    case = make_case([19, 200], 4, 2, 64, 16, torch.float32, 12, max_blocks=16)
    num_splits = decode_num_splits(2, 2, case.block_tables.shape[1] * 16, 64)
    assert num_splits == decode_num_splits(2, 2, 256, 64)  # never from seq_lens' values
    assert num_splits > 1
    workspace = DecodeWorkspace.allocate(4, 4, 2, 64, 256, DEVICE)
    workspace.partials.fill_(float("nan"))
    qkv = torch.randn(2, 8, 64, device=DEVICE)  # the query as a slice of a fused projection
    qkv[:, :4] = case.query
    case.query = qkv[:, :4]
    out = torch.full((2, 4, 2, 64), float("nan"), device=DEVICE)[:, :, 0]  # strided out
    got = run_triton(case, None, None, out=out, workspace=workspace)
    torch.testing.assert_close(got, expected(case, None), **tolerance(torch.float32))
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
    # never more splits than tiles of keys in the longest context
    assert decode_num_splits(1, 1, 16, 128) == 1
    assert decode_num_splits(1, 8, 32768, 128) >= 2
    # in a small batch the longest sequence alone still spreads over every SM (mixed lengths)...
    assert decode_num_splits(8, 8, 32768, 128) * 8 >= num_sms()
    # ...while a batch that fills the GPU by itself is not split
    assert decode_num_splits(256, 8, 32768, 128) == 1


# --- GPU: the real model shapes, compiled ---------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 16])
def test_decode_attention_qwen3_4b_gpu(num_splits: int | None) -> None:
    """Qwen3-4B heads (32 q / 8 kv of 128), bf16, contexts from 1 to 32k, vs the fp32 reference."""
    seq_lens = [1, 1023, 4096, 32768]
    case = make_case(seq_lens, 32, 8, 128, 16, torch.bfloat16, 21, device="cuda")
    got = run_triton(case, None, num_splits)
    torch.testing.assert_close(got.float(), expected(case, None), atol=2e-2, rtol=2e-2)


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
    torch.testing.assert_close(got.float(), expected(case, window), atol=2e-2, rtol=2e-2)
    assert (got[0] == 0).all()


@pytest.mark.gpu
def test_decode_attention_cuda_graph_replay() -> None:
    """Captured once on fixed buffers, replayed after the step's inputs change in place (longer and
    padded sequences, a new query): the grid fixed at capture still gives the right answer."""
    case = make_case([6, 0, 2047], 32, 8, 128, 16, torch.bfloat16, 23, max_blocks=160, device="cuda")
    final_seq_lens, final_query = case.seq_lens.clone(), case.query.clone()
    case.seq_lens.copy_(torch.tensor([5, 300, 1023], dtype=torch.int32))
    case.query.normal_()
    workspace = DecodeWorkspace.allocate(3, 32, 8, 128, 160 * 16, "cuda")
    out = torch.empty_like(case.query)

    def step() -> None:
        paged_decode_attention_triton(
            case.query,
            case.kv_cache,
            case.block_tables,
            case.seq_lens,
            case.scale,
            out=out,
            workspace=workspace,
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    case.seq_lens.copy_(final_seq_lens)
    case.query.copy_(final_query)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), expected(case, None), atol=2e-2, rtol=2e-2)
    assert (out[1] == 0).all()
    assert (workspace.counters == 0).all()
    graph.replay()  # again, on the counters the last replay left
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), expected(case, None), atol=2e-2, rtol=2e-2)
