"""Long contexts on the Qwen3-4B shape: decode speed after 32k cached positions beside its
roofline, and the device memory a long prompt's prefill needs beyond the weights and the KV cache.

    python bench/bench_long_context.py [OUT_DIR] [--model qwen3-4b] [--context 32768]

Random weights, bf16, batch 1. Prompts are prefilled in chunks of max_num_batched_tokens (2,048), so the
activations are sized by the chunk: the peak memory above the engine's own (weights, KV cache, graph
pools) is reported for a 4k and a 16k prompt. Decode: the median step of 100 (Engine.step() wall time,
run-ahead on) after the whole context is cached. Writes OUT_DIR/bench_long_context.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tileinfer.engine.config import EngineConfig  # noqa: E402
from tileinfer.engine.engine import Engine  # noqa: E402
from tileinfer.engine.models.loader import LoadedModel  # noqa: E402
from tileinfer.engine.models.random_model import SHAPES, random_weights  # noqa: E402
from tileinfer.engine.sampling.params import SamplingParams  # noqa: E402

from bench import limits  # noqa: E402

CHUNK = 2048


def prefill_peak_bytes(engine: Engine, length: int, vocab_size: int) -> tuple[int, float]:
    """Peak allocated bytes above the engine's resting allocation while prefilling `length` tokens, and
    the prefill's wall time."""
    torch.cuda.synchronize()
    resting = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    prompt = torch.randint(0, vocab_size, (length,)).tolist()
    started = time.perf_counter()
    for _ in engine.stream(prompt, SamplingParams(max_tokens=1, temperature=0.0)):
        pass
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - resting, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--model", default="qwen3-4b")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    device = torch.device("cuda")
    spec = SHAPES[args.model]
    bandwidth = limits.copy_bandwidth(device)
    weights = random_weights(spec, torch.bfloat16, device)
    model = LoadedModel(name=args.model, source=Path("random"), spec=spec, weights=weights, tokenizer=None)
    total = args.context + args.steps + 64
    engine = Engine(model, EngineConfig(device="cuda", dtype="bfloat16", max_model_len=total,
                                        kv_cache_tokens=total, max_num_seqs=4,
                                        max_num_batched_tokens=CHUNK))  # fmt: skip
    result: dict = {"model": args.model, "copy_bandwidth": bandwidth, "chunk": CHUNK}
    prefill_peak_bytes(engine, 512, spec.vocab_size)  # warm-up: compiles the prefill kernels
    for length in (4096, 16384):
        peak, seconds = prefill_peak_bytes(engine, length, spec.vocab_size)
        result[f"prefill_{length}_peak_extra_mib"] = peak / 2**20
        result[f"prefill_{length}_tok_s"] = length / seconds
        print(
            f"prefill {length:6d}: peak above resting {peak / 2**20:8.1f} MiB, {length / seconds:9.0f} tok/s"
        )
    growth = result["prefill_16384_peak_extra_mib"] / result["prefill_4096_peak_extra_mib"] - 1
    result["peak_growth_4k_to_16k"] = growth
    print(f"peak growth 4k -> 16k: {100 * growth:.1f} %")

    prompt = torch.randint(0, spec.vocab_size, (args.context - 1,)).tolist()
    params = SamplingParams(max_tokens=args.steps + 30, temperature=0.0, ignore_eos=True)
    request_id = engine.add_request(prompt, params)
    started = time.perf_counter()
    while engine.requests[request_id].seq.num_output_tokens == 0:
        engine.step()
    prefill_s = time.perf_counter() - started
    for _ in range(10):
        engine.step()
    step_times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - started)
    engine.abort(request_id)
    tok_s = 1 / statistics.median(step_times)
    roofline = limits.decode_roofline(spec, bandwidth, cached_positions=args.context)
    result.update({
        "context": args.context,
        "prefill_context_s": prefill_s,
        "decode_tok_s": tok_s,
        "decode_roofline_tok_s": roofline,
        "decode_pct_of_roofline": 100 * tok_s / roofline,
    })  # fmt: skip
    rate = (args.context - 1) / prefill_s
    print(f"prefill of {args.context - 1} tokens in {prefill_s:.2f} s ({rate:.0f} tok/s)")
    print(f"decode after {args.context} positions: {tok_s:.1f} tok/s, roofline {roofline:.1f} "
          f"({100 * tok_s / roofline:.1f} %), copy bandwidth {bandwidth / 1e12:.2f} TB/s")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_long_context.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
