"""Where an engine's start-up goes: loading, building (kernel compiles and CUDA-graph captures) and
warming up, as the engine deployment does them before it serves, in this process.

    python bench/startup.py --model qwen3-0.6b            # with Triton's cache as it is (warm or cold)
    python bench/startup.py --model qwen3-0.6b --cold     # with an empty Triton cache of its own

Prints one line per phase and the kernels Triton compiled (cache entries written) in each; --out writes
them as JSON. A restart of the app finds Triton's cache warm; a first start on a machine finds it cold.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cubins(cache: Path) -> int:
    return sum(1 for _ in cache.rglob("*.cubin")) if cache.is_dir() else 0


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen3-0.6b", help="a named shape or any model source")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the app's on a GPU (256)")
    parser.add_argument("--cold", action="store_true", help="an empty Triton cache of its own")
    parser.add_argument("--out", default=None, help="a folder for startup.json")
    args = parser.parse_args(argv)
    if args.cold:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    started = time.perf_counter()
    import torch
    from tileinfer.deployments.launch.app_args import parse_app_args
    from tileinfer.engine.engine import Engine
    from tileinfer.engine.models.loader import load_model
    from tileinfer.kernels.triton_common import cache_root

    from bench.serve_app import model_source

    device = "cuda" if torch.cuda.is_available() else "cpu"
    source = model_source(args.model, args.dtype)
    app_args = parse_app_args({"model": source, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs})
    config = app_args.for_device(device).engine_config(device, args.dtype)
    cache = Path(os.environ.get("TRITON_CACHE_DIR") or cache_root() / "triton")
    phases: dict[str, dict] = {}
    mark = [started, _cubins(cache)]

    def phase(name: str) -> None:
        now, kernels = time.perf_counter(), _cubins(cache)
        phases[name] = {"s": round(now - mark[0], 2), "kernels_compiled": kernels - mark[1]}
        print(f"{name:>9}: {now - mark[0]:7.2f} s, {kernels - mark[1]:4d} kernels compiled", flush=True)
        mark[:] = [now, kernels]

    phase("imports")
    model = load_model(source, config.torch_dtype(), config.torch_device(), config.quantization)
    phase("load")
    engine = Engine(model, config)
    phase("build")
    engine.warm_up()
    phase("warm-up")
    total = time.perf_counter() - started
    print(f"{'total':>9}: {total:7.2f} s (max_num_seqs {config.max_num_seqs}, device {device})")
    result = {"model": args.model, "cold": args.cold, "max_num_seqs": config.max_num_seqs, "phases": phases,
              "total_s": round(total, 2)}  # fmt: skip
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"startup{'-cold' if args.cold else ''}.json").write_text(
            json.dumps(result, indent=2)
        )
    return result


if __name__ == "__main__":
    main()
