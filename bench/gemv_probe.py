"""The decode GEMV at given tiles, timed as bench_linear times it, or launched once each for a profiler.

    python bench/gemv_probe.py --model qwen3-4b --layers qkv,gate_up [--int8] --configs "8,512,8,1;..."
        [--write-tuned kernels/tuned/NVIDIA_H200.json]
    ncu --clock-control none ... python bench/gemv_probe.py ... --launch-only

A config is block_n,block_k,num_warps[,num_stages] (linear.GemvConfig); "tuned" is what the
engine picks for the shape; a range "4-32,512-2048,4-8,1-4" takes every power of two in it.
--write-tuned merges the fastest config of each layer into that table (bench_linear's format).
--launch-only runs each config twice outside graphs (the first compiles): a profiler sees two launches
per config, in the order given, the second warm.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_linear import (  # noqa: E402
    MODELS,
    Case,
    copy_bandwidth,
    gemv_elements_per_thread,
    merge_tuned,
    time_in_graph,
    tuned_rows,
)
from kernels import linear  # noqa: E402


def _values(field: str) -> list[int]:
    """ "8" -> [8]; "4-32" -> [4, 8, 16, 32]; "0-1" -> [0, 1]."""
    low, _, high = field.partition("-")
    values, value = [], int(low)
    while value <= int(high or low):
        values.append(value)
        value = value * 2 if value else 1
    return values


def parse_configs(text: str) -> list[linear.GemvConfig | None]:
    configs: list[linear.GemvConfig | None] = []
    for item in text.split(";"):
        item = item.strip()
        if item == "tuned":
            configs.append(None)
        elif item:
            grids = [_values(field) for field in item.split(",")]
            combos: list[list[int]] = [[]]
            for grid in grids:
                combos = [combo + [value] for combo in combos for value in grid]
            for fields in combos:
                configs.append(linear.GemvConfig(*fields))
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen3-4b", choices=sorted(MODELS))
    parser.add_argument("--layers", default="qkv,o,gate_up,down")
    parser.add_argument("--int8", action="store_true", help="INT8 weights, a scale per row")
    parser.add_argument("--configs", default="tuned")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--launch-only", action="store_true")
    parser.add_argument(
        "--max-per-thread", type=int, default=128, help="skip tiles with more elements a thread"
    )
    parser.add_argument("--write-tuned", type=Path, help="merge each layer's fastest config into this table")
    args = parser.parse_args()
    configs = parse_configs(args.configs)
    bandwidth = None if args.launch_only else copy_bandwidth()
    sweeps = []
    for layer in args.layers.split(","):
        n_rows, k = MODELS[args.model][layer]
        case = Case(args.model, layer, n_rows, k, 1, args.int8)
        timings = []
        for config in configs:
            shown = config or case.heuristic()
            per_thread = gemv_elements_per_thread(shown, case.gate_up)
            if config and not (16 <= per_thread <= args.max_per_thread and shown.block_k <= max(128, 2 * k)):
                continue
            call = case.triton_call(config)
            try:
                if args.launch_only:
                    call(0)
                    torch.cuda.synchronize()
                    call(1)
                    torch.cuda.synchronize()
                    print(f"{layer} {shown}: launched", flush=True)
                    continue
                seconds = time_in_graph(call, case.copies, args.replays)
            except Exception as exc:  # noqa: BLE001 - report, go on
                print(f"{layer} {shown}: failed ({type(exc).__name__}: {exc})"[:300], flush=True)
                continue
            share = 100 * case.bytes / seconds / bandwidth
            print(f"{layer:8s} {seconds * 1e6:8.2f} us {share:5.1f} % of copy bw  {shown}", flush=True)
            timings.append({"config": shown._asdict(), "us": seconds * 1e6})
        timings.sort(key=lambda timing: timing["us"])
        if timings:
            print(f"{layer:8s} fastest {timings[0]['us']:.2f} us {timings[0]['config']}", flush=True)
        sweeps.append({"kind": "gemv", "M": 1, "n": case.n_out, "k": k, "gate_up": case.gate_up,
                       "timings": timings})  # fmt: skip
        del case
        torch.cuda.empty_cache()
    if args.write_tuned:
        merged = merge_tuned(args.write_tuned, tuned_rows(sweeps, args.int8))
        args.write_tuned.write_text(json.dumps(merged, indent=1) + "\n")
        print(f"fastest configs merged into {args.write_tuned}")


if __name__ == "__main__":
    main()
