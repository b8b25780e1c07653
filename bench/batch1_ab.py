"""Batch-1 decode of two checkouts of TileInfer in one run: does the newer regress the older?

    python bench/batch1_ab.py OLD_ROOT NEW_ROOT [--models qwen3-0.6b,qwen3-4b] [--rounds 2] [--out DIR]

Each measurement is a fresh process that imports the engine and bench/bench_engine.py of one root
(so each side runs its own code): random weights of the model's shape (bf16), one request decoding
greedy after 1,023 cached positions, the median of 200 Engine.step() times after 20 warm-up steps
(bench_engine.engine_decode; --prompt-len, --steps, --warmup). Prefill steps run eagerly on both
sides (fewer graphs to capture); the decode step replays its CUDA graph as the engine does. The
sides alternate, old first in odd rounds and new first in even ones, so that neither always runs on
a warmer GPU. The table comes last: each model's best median step per side and new / old tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

MEASURE = """
import json, sys, time, torch
from bench import bench_engine as b
from bench.model_shapes import MODELS, random_weights
name, device, prompt_len, steps, warmup = json.loads(sys.argv[1])
spec = MODELS[name]
dtype = torch.bfloat16 if device == "cuda" else torch.float32
settings = b.Settings(
    device=torch.device(device), dtype=dtype, tiny=False, prompt_len=prompt_len, steps=steps, warmup=warmup,
    prefill_lens=[prompt_len], prefill_repeats=1, peer_compile_prefill=False, compile_backend="inductor",
    budget_s=1e9, step_graphs=False,
)
weights = random_weights(spec, dtype, device)
started = time.perf_counter()
engine = b.build_engine(name, spec, weights, settings)
built_s = time.perf_counter() - started
prompt = b.random_prompt(torch.Generator().manual_seed(7), spec.vocab_size, settings.prompt_len)
result = b.engine_decode(engine, prompt, settings, b.GREEDY)
print("RESULT " + json.dumps({"median_step_s": result["median_step_s"], "tok_s": result["tok_s"],
                              "build_s": built_s}))
"""


def measure(root: Path, model: str, args: argparse.Namespace) -> dict:
    part = json.dumps([model, args.device, args.prompt_len, args.steps, args.warmup])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, part],
        cwd=root, env=env, capture_output=True, text=True, timeout=args.timeout_s,
    )  # fmt: skip
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
    return {"error": " | ".join(tail)[:1000]}


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("old_root", type=Path)
    parser.add_argument("new_root", type=Path)
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-4b")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cuda", help="cuda (bf16) or cpu (float32, a smoke run)")
    parser.add_argument("--prompt-len", type=int, default=1023, help="cached positions before decoding")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=240.0, help="per measurement")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args()
    sides = {"old": args.old_root.resolve(), "new": args.new_root.resolve()}
    results: dict[str, dict[str, list[dict]]] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("SIGTERM: the table of what was measured follows"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        for round_index in range(args.rounds):
            for model in args.models.split(","):
                order = ["old", "new"] if round_index % 2 == 0 else ["new", "old"]
                for side in order:
                    try:
                        result = measure(sides[side], model, args)
                    except subprocess.TimeoutExpired:
                        result = {"error": f"over {args.timeout_s:.0f} s"}
                    results.setdefault(model, {}).setdefault(side, []).append(result)
                    print(f"round {round_index + 1} {model} {side}: {result}", flush=True)
                    record = {"roots": {side: str(root) for side, root in sides.items()}, "results": results}
                    (out / "batch1_ab.json").write_text(json.dumps(record, indent=1))
    finally:
        print("\n| model | old tok/s | new tok/s | new / old |")
        print("| --- | ---: | ---: | ---: |")
        for model, by_side in results.items():
            best = {
                side: min((r["median_step_s"] for r in runs if "median_step_s" in r), default=None)
                for side, runs in by_side.items()
            }
            old, new = best.get("old"), best.get("new")
            ratio = f"{old / new:.3f}" if old and new else "—"
            rates = [f"{1 / step:,.1f}" if step else "—" for step in (old, new)]
            print(f"| {model} | {rates[0]} | {rates[1]} | {ratio} |")


if __name__ == "__main__":
    main()
