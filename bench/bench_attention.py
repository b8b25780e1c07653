"""Paged attention kernels on Qwen3 heads (4B: 32 query / 8 KV heads of 128; 0.6B: 16 / 8), bf16, pages of
16 tokens.

    python3 bench/bench_attention.py [OUT_DIR] [--sweep-decode [--contexts 1024,4096] [--shapes short]]

prefill: paged_prefill_attention_triton on a causal prompt of 4k and 16k tokens read through a
         shuffled block table, against torch SDPA's flash backend (is_causal) on contiguous K/V; the
         median of CUDA-event timings; TFLOP/s counts the causal half: 2 * 2 * heads * head_dim * n^2 / 2.
decode:  paged_decode_attention_triton at batch 1 after 1k, 4k and 32k cached positions, on Qwen3-4B
         and Qwen3-0.6B heads, replayed in a CUDA graph that calls it once per layer copy of the cache
         (the copies together exceed the 50 MB L2); the graph is captured as the engine captures it,
         for a block table of MAX_MODEL_LEN positions (num_splits from that), so the splits each
         context actually uses are the kernel's run-time choice; % of the copy bandwidth on the K/V
         bytes read.
verify:  paged_prefill_attention_triton with 4 and 16 query tokens after 4k cached positions (4B heads),
         timed like decode.
--sweep-decode: instead, the decode kernel on Qwen3-4B heads at 1k, 4k and 32k positions for every
         launch shape (keys per tile, fewest tiles a split, warps, stages) and most splits tried, the
         fastest first (to tune kernels/decode_attention.py's decode_tile and decode_num_splits).
Copy bandwidth (a 2 GiB device-to-device copy, bytes read + written) is measured in the same run.
The last thing printed is the table; the full results go to OUT_DIR/bench_attention.json (OUT_DIR:
the argument, else $OUT, else ./bench_out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tileinfer.kernels.decode_attention import (  # noqa: E402
    MAX_DECODE_SPLITS,
    DecodeTile,
    DecodeWorkspace,
    decode_num_splits,
    decode_splits_used,
    paged_decode_attention_triton,
)
from tileinfer.kernels.paged_attention import AttentionMetadata  # noqa: E402
from tileinfer.kernels.prefill_attention import (  # noqa: E402
    allocate_prefill_workspace,
    paged_prefill_attention_triton,
    prefill_num_splits,
)

from bench.bench_linear import time_in_graph  # noqa: E402
from bench.limits import copy_bandwidth, time_each  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5
L2_BYTES = 256 * 2**20  # enough cache copies per graph that none is served from L2
MAX_MODEL_LEN = 40960  # Qwen3's: the block table width a decode graph is captured for
DECODE_HEADS = {"Qwen3-4B": 32, "Qwen3-0.6B": 16}  # query heads; both have 8 KV heads of 128
DEVICE = torch.device("cuda")


def paged_cache(num_tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random cache of exactly num_tokens positions, its pages in a shuffled order, and the block
    table [1, num_blocks] that reads them back in order."""
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kv_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE, generator=generator)
    block_table = torch.randperm(num_blocks, device=DEVICE, generator=generator).int()[None]
    return kv_cache, block_table


def contiguous_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[2, 1, num_kv_heads, num_tokens, head_dim]: what SDPA reads."""
    pages = kv_cache[:, block_table[0].long()].flatten(1, 2)[:, :num_tokens]  # [2, tokens, kv heads, dim]
    return pages.transpose(1, 2).contiguous()[:, None]


def metadata_for(
    query_len: int, seq_len: int, block_table: torch.Tensor, **fields: object
) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor([0, query_len], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
        block_tables=block_table,
        max_query_len=query_len,
        **fields,
    )


def median_seconds(call: object, repeats: int) -> float:
    for _ in range(3):
        call()
    return statistics.median(time_each(call, repeats, DEVICE))


def bench_prefill(num_tokens: int, generator: torch.Generator) -> dict:
    kv_cache, block_table = paged_cache(num_tokens, generator)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=generator)
    metadata = metadata_for(num_tokens, num_tokens, block_table)
    out = torch.empty_like(query)
    ours = median_seconds(
        lambda: paged_prefill_attention_triton(query, kv_cache, metadata, SCALE, out=out), 10
    )

    keys, values = contiguous_kv(kv_cache, block_table, num_tokens)  # [1, kv heads, tokens, dim]
    sdpa_query = query.transpose(0, 1)[None].contiguous()  # [1, heads, tokens, dim]
    group = NUM_HEADS // NUM_KV_HEADS
    try:  # the flash backend reads K/V once per group where this torch supports GQA in it
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(sdpa_query, keys, values, is_causal=True, enable_gqa=True)
        gqa_keys, gqa_values, gqa = keys, values, True
    except RuntimeError:
        gqa_keys = keys.repeat_interleave(group, dim=1)
        gqa_values = values.repeat_interleave(group, dim=1)
        gqa = False

    def sdpa() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(
                sdpa_query, gqa_keys, gqa_values, is_causal=True, enable_gqa=gqa
            )

    peer = median_seconds(sdpa, 10)
    error = (out.float() - sdpa()[0].transpose(0, 1).float()).abs().max().item()
    flops = 2 * 2 * NUM_HEADS * HEAD_DIM * num_tokens * num_tokens / 2
    return {
        "workload": f"prefill {num_tokens // 1024}k",
        "ours_us": ours * 1e6,
        "peer_us": peer * 1e6,
        "ours_tflops": flops / ours / 1e12,
        "peer_tflops": flops / peer / 1e12,
        "peer_gqa": gqa,
        "max_abs_diff_vs_sdpa": error,
    }


def cache_copies(seq_len: int, generator: torch.Generator) -> tuple[list, int]:
    """Enough copies of a seq_len-position cache to miss L2 across one graph replay, and their K/V bytes."""
    kv_bytes = 2 * seq_len * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    copies = max(2, -(-L2_BYTES // kv_bytes))
    return [paged_cache(seq_len, generator) for _ in range(copies)], kv_bytes


def bench_decode(
    model: str,
    context: int,
    bandwidth: float,
    generator: torch.Generator,
    tile: DecodeTile | None = None,
    num_splits: int | None = None,
    caches: tuple[list, int] | None = None,
) -> dict:
    """One query token after `context` cached positions, batch 1. tile and num_splits: the kernel's
    defaults unless given; caches: cache_copies(context + 1) made already."""
    num_heads = DECODE_HEADS[model]
    seq_len = context + 1
    caches, kv_bytes = caches or cache_copies(seq_len, generator)
    max_blocks = -(-MAX_MODEL_LEN // BLOCK_SIZE)
    tables = []
    for _, block_table in caches:  # padded with block 0 to the captured width; never read past seq_len
        padded = torch.zeros(1, max_blocks, dtype=torch.int32, device=DEVICE)
        padded[:, : block_table.shape[1]] = block_table
        tables.append(padded)
    query = torch.randn(1, num_heads, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=generator)
    out = torch.empty_like(query)
    max_context = max_blocks * BLOCK_SIZE
    num_splits = num_splits or decode_num_splits(1, NUM_KV_HEADS, max_context, HEAD_DIM)
    workspace = DecodeWorkspace(
        partials=torch.empty(
            DecodeWorkspace.partials_numel(1, num_heads, HEAD_DIM, MAX_DECODE_SPLITS), device=DEVICE
        ),
        counters=torch.zeros(NUM_KV_HEADS, dtype=torch.int32, device=DEVICE),
    )
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)

    def call(i: int) -> None:
        paged_decode_attention_triton(
            query,
            caches[i][0],
            tables[i],
            seq_lens,
            SCALE,
            num_splits=num_splits,
            out=out,
            workspace=workspace,
            tile=tile,
        )

    seconds = time_in_graph(call, len(caches), replays=20)
    return {
        "workload": f"decode {context // 1024}k, {model} heads",
        "tile": tile._asdict() if tile else None,
        "ours_us": seconds * 1e6,
        "num_splits": f"{decode_splits_used(seq_len, num_splits, HEAD_DIM, tile=tile)} of {num_splits}",
        "kv_bytes": kv_bytes,
        "pct_copy_bw": 100 * kv_bytes / seconds / bandwidth,
    }


def bench_verify(query_len: int, context: int, bandwidth: float, generator: torch.Generator) -> dict:
    """query_len new tokens after `context` cached positions, batch 1, 4B heads."""
    seq_len = context + query_len
    caches, kv_bytes = cache_copies(seq_len, generator)
    query = torch.randn(query_len, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=generator)
    out = torch.empty_like(query)
    max_context = caches[0][1].shape[1] * BLOCK_SIZE
    num_splits = prefill_num_splits(query_len, 1, query_len, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, max_context)
    workspace = allocate_prefill_workspace(
        query_len, 1, query_len, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, num_splits, DEVICE
    )
    metadatas = [
        metadata_for(query_len, seq_len, table, prefill_num_splits=num_splits, prefill_workspace=workspace)
        for _, table in caches
    ]

    def call(i: int) -> None:
        paged_prefill_attention_triton(query, caches[i][0], metadatas[i], SCALE, out=out)

    seconds = time_in_graph(call, len(caches), replays=20)
    return {
        "workload": f"verify q{query_len} @ {context // 1024}k",
        "ours_us": seconds * 1e6,
        "num_splits": num_splits,
        "kv_bytes": kv_bytes,
        "pct_copy_bw": 100 * kv_bytes / seconds / bandwidth,
    }


def sweep_decode(
    bandwidth: float, generator: torch.Generator, out_dir: Path, contexts: list[int], shapes: str
) -> None:
    """Every decode launch shape and split count at the given contexts (Qwen3-4B heads), fastest first
    per context. shapes: "all", or "short" (the shapes a short context may want: min tiles 1 and 2)."""
    if shapes == "short":  # block_n, min tiles, warps, stages
        grid = itertools.product((32, 64, 128), (1, 2), (4, 8), (2, 3))
    else:
        grid = itertools.product((32, 64, 128), (1, 2), (4, 8), (2, 3, 4))
    tiles = [DecodeTile(*shape) for shape in grid]
    results = {}
    for context in contexts:
        caches = cache_copies(context + 1, generator)
        rows = []
        for tile, num_splits in itertools.product(tiles, (None, 64, MAX_DECODE_SPLITS)):
            try:
                row = bench_decode("Qwen3-4B", context, bandwidth, generator, tile, num_splits, caches)
            except Exception as error:  # noqa: BLE001 - a shape that does not compile (shared memory)
                print(f"  {tile} x {num_splits}: {type(error).__name__}")
                continue
            row["max_splits"] = num_splits or "default"
            rows.append(row)
        rows.sort(key=lambda row: row["ours_us"])
        results[context] = rows
        del caches
        torch.cuda.empty_cache()
        print(f"\ndecode {context} positions, Qwen3-4B heads: fastest of {len(rows)} launch shapes")
        print("| block_n | min tiles | warps | stages | most splits | splits used | us | % of copy bw |")
        print("| ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |")
        for row in rows[:8]:
            tile = row["tile"]
            print(
                f"| {tile['block_n']} | {tile['min_tiles']} | {tile['num_warps']} | {tile['num_stages']} | "
                f"{row['max_splits']} | {row['num_splits']} | {row['ours_us']:.1f} | "
                f"{row['pct_copy_bw']:.0f} % |"
            )
    (out_dir / "bench_attention_sweep.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--sweep-decode", action="store_true", help="sweep the decode kernel's launch shape")
    parser.add_argument("--contexts", default="1024,4096,32768", help="with --sweep-decode: cached positions")
    parser.add_argument("--shapes", choices=["all", "short"], default="all", help="with --sweep-decode")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    bandwidth = copy_bandwidth(DEVICE)
    if args.sweep_decode:
        sweep_decode(bandwidth, generator, out_dir, [int(c) for c in args.contexts.split(",")], args.shapes)
        return
    rows = [bench_prefill(4096, generator), bench_prefill(16384, generator)]
    for model in DECODE_HEADS:
        for context in (1024, 4096, 32768):
            rows.append(bench_decode(model, context, bandwidth, generator))
            torch.cuda.empty_cache()  # the 1k case's many cache copies
    for query_len in (4, 16):
        rows.append(bench_verify(query_len, 4096, bandwidth, generator))
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "copy_bandwidth_tb_s": bandwidth / 1e12,
        "heads": [NUM_HEADS, NUM_KV_HEADS, HEAD_DIM],
        "rows": rows,
    }
    (out_dir / "bench_attention.json").write_text(json.dumps(result, indent=2))

    print(
        f"\n{result['gpu']}, torch {result['torch']}, triton {result['triton']}, "
        f"copy bw {bandwidth / 1e12:.2f} TB/s"
    )
    print("| workload | TileInfer | peer (SDPA flash) | TileInfer / peer | % of limit |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        if "peer_us" in row:
            print(
                f"| {row['workload']} | {row['ours_us']:.0f} us ({row['ours_tflops']:.0f} TFLOP/s) "
                f"| {row['peer_us']:.0f} us ({row['peer_tflops']:.0f} TFLOP/s) "
                f"| {row['peer_us'] / row['ours_us']:.2f}x | |"
            )
        else:
            print(
                f"| {row['workload']} ({row['num_splits']} splits) | {row['ours_us']:.1f} us | | "
                f"| {row['pct_copy_bw']:.0f} % of copy bw |"
            )


if __name__ == "__main__":
    main()
