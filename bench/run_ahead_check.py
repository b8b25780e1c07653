"""Run-ahead against step-by-step decoding on the GPU, for random weights of a bench shape in float32:
requests arrive every few steps while others decode, so prompt chunks are launched ahead beside decoding
rows whose inputs are fed back on the device (engine/runner.py launch). Greedy. Prints how many requests
came out token for token the same, and how many launches were mixed.

    python bench/run_ahead_check.py [--model qwen3-0.6b] [--requests 64]

A token can differ where the two runs batch the same sequence otherwise (a sequence that ends by length
sits a run-ahead step out) and two logits nearly tie: the first difference of each differing request is
printed.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_load import model_source  # noqa: E402
from engine.engine import Engine, EngineConfig  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402


def run(
    engine: Engine, arrivals: dict[int, list[tuple[str, list[int]]]], max_tokens: int
) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for request_id, prompt in arrivals.get(step, []):
            engine.add_request(prompt, params, request_id)
            tokens[request_id] = []
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
        step += 1
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    model = load_model(model_source(args.model, "float32"), dtype=torch.float32, device=args.device)
    rng = random.Random(0)
    vocab = min(model.spec.vocab_size, 151643)
    arrivals: dict[int, list[tuple[str, list[int]]]] = {}
    for index in range(args.requests):  # two every three steps, prompts of 20 to 300 tokens
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(20, 300))]
        arrivals.setdefault(index * 3 // 2, []).append((f"r{index}", prompt))

    def engine(run_ahead: bool) -> Engine:
        config = EngineConfig(
            device=args.device, dtype="float32", run_ahead=run_ahead, max_num_seqs=32,
            max_num_batched_tokens=256, max_model_len=512, kv_cache_tokens=32 * 512,
        )  # fmt: skip
        return Engine(model, config)

    ahead = engine(run_ahead=True)
    launches = {"decode": 0, "mixed": 0}
    launch = ahead.runner.launch

    def counting_launch(scheduled, previous):  # noqa: ANN001, ANN202 - the runner's own signature
        launches["mixed" if any(item.num_new_tokens > 1 for item in scheduled) else "decode"] += 1
        return launch(scheduled, previous)

    ahead.runner.launch = counting_launch
    expected = run(engine(run_ahead=False), arrivals, args.max_tokens)
    got = run(ahead, arrivals, args.max_tokens)
    same = [request_id for request_id in expected if got[request_id] == expected[request_id]]
    for request_id in expected:
        if got[request_id] != expected[request_id]:
            pairs = zip(got[request_id], expected[request_id], strict=False)
            first = next((i for i, (a, b) in enumerate(pairs) if a != b), len(got[request_id]))
            print(f"{request_id}: differs from token {first} of {len(expected[request_id])}")
    print(f"launches: {launches}")
    print(f"run-ahead equal to step-by-step: {len(same)} of {len(expected)} requests")


if __name__ == "__main__":
    main()
