"""BENCH.md's `serve` workload: time to first token (TTFT) and time per output token (TPOT) through
HTTP streaming (Ray Serve, the OpenAI API) against the engine called directly, in one run.

    python bench/bench_serve.py [--model smollm2-135m] [--requests 20] [--tokens 128] [--out DIR]

Batch 1: one request at a time. Ray starts on 127.0.0.1; the app runs from
tileinfer.deployments.app:build_app.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray takes 127.0.0.1 as the node IP

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _summary(ttfts: list[float], tpots: list[float]) -> dict[str, float]:
    return {"ttft_ms": statistics.median(ttfts) * 1e3, "tpot_ms": statistics.median(tpots) * 1e3}


def measure_direct(args: argparse.Namespace, device: str) -> dict[str, float]:
    from tileinfer.engine.config import EngineConfig
    from tileinfer.engine.engine import Engine
    from tileinfer.engine.sampling.params import SamplingParams

    dtype = "bfloat16" if device == "cuda" else "float32"
    engine = Engine.load(args.model, EngineConfig(device=device, dtype=dtype, max_model_len=2048,
                                                  kv_cache_tokens=16384, max_num_seqs=8))  # fmt: skip
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    ttfts, tpots = [], []
    for index in range(args.requests + 2):
        start = time.perf_counter()
        times = [time.perf_counter() for _ in engine.stream(prompt, params)]
        if index >= 2:  # the first two warm up
            ttfts.append(times[0] - start)
            tpots.append((times[-1] - times[0]) / (len(times) - 1))
    del engine
    return _summary(ttfts, tpots)


def measure_http(args: argparse.Namespace, device: str) -> dict[str, float]:
    import httpx
    import ray
    from ray import serve
    from tileinfer.deployments.app import build_app

    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    app_args = {"model": args.model, "device": device, "max_model_len": 2048, "kv_cache_tokens": 16384,
                "max_num_seqs": 8}  # fmt: skip
    serve.run(build_app(app_args), name="tileinfer", route_prefix="/")
    url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
    body = {"model": args.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    ttfts, tpots = [], []
    with httpx.Client(timeout=300) as client:
        for index in range(args.requests + 2):
            start = time.perf_counter()
            times = []
            with client.stream("POST", url, json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                        times.append(time.perf_counter())
            if index >= 2:
                ttfts.append(times[0] - start)
                tpots.append((times[-1] - times[0]) / (len(times) - 1))
    serve.shutdown()
    ray.shutdown()
    return _summary(ttfts, tpots)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    direct = measure_direct(args, device)
    http = measure_http(args, device)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "model": args.model,
              "requests": args.requests, "tokens": args.tokens, "direct": direct, "http": http}  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_serve.json").write_text(json.dumps(result, indent=2))
    print(f"\nserve workload, batch 1, {args.model}, {result['device']}, median of {args.requests} requests")
    print("| workload | model | TileInfer over HTTP | engine called directly | overhead |")
    print("| --- | --- | --- | --- | --- |")
    for key, name in (("ttft_ms", "time to first token (ms)"), ("tpot_ms", "time per output token (ms)")):
        overhead = http[key] - direct[key]
        print(f"| {name} | {args.model} | {http[key]:.2f} | {direct[key]:.2f} | {overhead:+.2f} ms |")


if __name__ == "__main__":
    main()
