"""Which Qwen3 models serve N sequences of a given context on one GPU, in each weight and KV mode: the
engine's own sizing (engine/kv/budget.py) applied to each shape, without loading anything.

    python bench/capacity.py [--free-gib 139.0] [--sequences 64] [--context 4096] [--out DIR]

For every Qwen3 dense size and mode (bench_int8.py's: base = bf16; INT8 weights; INT8 KV; both) it
takes the weights' bytes (bench/limits.weight_bytes: INT8 layer linears with their scales, the
embedding and any untied LM head in bf16), the free memory left after them, and the KV tokens the engine
would allot there (kv_cache_tokens_from_memory with the default gpu_memory_utilization 0.9, the step
reserve of max_num_batched_tokens 8192 and one logit row a sequence). A model "serves" the load when those
tokens hold every sequence's whole context. --free-gib is the device memory free before loading (an
H200 shows about 139 GiB). This is arithmetic on the shapes: the weights' peak while loading and the
CUDA context are not in it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tileinfer.engine.errors import InvalidRequestError  # noqa: E402
from tileinfer.engine.kv.budget import kv_bytes_per_token, kv_cache_tokens_from_memory, step_reserve_bytes  # noqa: E402
from tileinfer.engine.models.random_model import QWEN3_SIZES  # noqa: E402

from bench.bench_int8 import MODES  # noqa: E402
from bench.limits import weight_bytes  # noqa: E402

GIB = 1 << 30
BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 8192
GPU_MEMORY_UTILIZATION = 0.9


def capacity(spec: object, mode: str, free_bytes: int, sequences: int, context: int) -> dict:
    """The KV tokens the engine would allot for this shape and mode, and whether they hold the load."""
    quantization, kv_cache_dtype = MODES[mode]
    weights = weight_bytes(spec, torch.bfloat16, quantization)
    per_token = kv_bytes_per_token(spec, torch.bfloat16, kv_cache_dtype)
    reserve = step_reserve_bytes(spec, MAX_NUM_BATCHED_TOKENS, sequences, spec.vocab_size)
    try:
        tokens = kv_cache_tokens_from_memory(
            free_bytes - weights, GPU_MEMORY_UTILIZATION, per_token, reserve, BLOCK_SIZE, max_tokens=1 << 40
        )
    except InvalidRequestError:
        tokens = 0
    return {
        "weights_gib": weights / GIB,
        "kv_bytes_per_token": per_token,
        "kv_tokens": tokens,
        "sequences_of_context": tokens // context,
        "serves": tokens >= sequences * context,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--free-gib", type=float, default=139.0, help="device memory free before loading")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096, help="tokens a sequence: prompt and output")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args()
    free_bytes = int(args.free_gib * GIB)
    results = {
        name: {mode: capacity(spec, mode, free_bytes, args.sequences, args.context) for mode in MODES}
        for name, spec in QWEN3_SIZES.items()
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "free_gib": args.free_gib,
        "sequences": args.sequences,
        "context": args.context,
        "models": results,
    }
    (out / "capacity.json").write_text(json.dumps(record, indent=1) + "\n")
    largest = {mode: [name for name in results if results[name][mode]["serves"]][-1:] for mode in MODES}
    print(f"{args.sequences} sequences of {args.context} tokens, {args.free_gib:g} GiB free before loading")
    print(
        "| model | mode | weights GiB | KV bytes a token | KV tokens | sequences of that context | serves |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for name, modes in results.items():
        for mode, row in modes.items():
            print(
                f"| {name} | {mode} | {row['weights_gib']:.1f} | {row['kv_bytes_per_token']:,} | "
                f"{row['kv_tokens']:,} | {row['sequences_of_context']:,} | "
                f"{'yes' if row['serves'] else 'no'} |"
            )
    print(
        "largest that serves: "
        + ", ".join(f"{mode} {names[0] if names else 'none'}" for mode, names in largest.items())
    )


if __name__ == "__main__":
    main()
