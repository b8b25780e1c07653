"""Where a decode step's time goes: host wall time of Engine.step() beside the GPU time of the CUDA graph
replay alone, and the per-kernel GPU time of one step (torch.profiler), for the bench model shapes; the
same for a 512-token prefill step and for a speculative verify step (the last token and 6 drafts).

    python bench/profile_decode.py [OUT_DIR] [--models qwen3-0.6b,qwen3-4b,smollm2-135m]
    python bench/profile_decode.py [OUT_DIR] --models qwen3-0.6b --batches 1,8,64,256

Random weights, bf16, batch 1, after a 1,024-token prompt. With --batches: the decode step of B
sequences after 512-token prompts instead (Engine.step wall time, and the per-kernel GPU time of one
replay of that batch's graph). Writes OUT_DIR/profile_decode.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.model_shapes import MODELS, random_weights  # noqa: E402
from engine.engine import Engine, EngineConfig  # noqa: E402
from engine.loader import LoadedModel  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.scheduler import ScheduledSequence  # noqa: E402

PROMPT_LEN = 1024
STEPS = 200


def profile(name: str, quantization: str | None = None) -> dict:
    spec = MODELS[name]
    device = torch.device("cuda")
    weights = random_weights(spec, torch.bfloat16, device)
    model = LoadedModel(name=name, source=Path("random"), spec=spec, weights=weights, tokenizer=None)
    engine = Engine(model, EngineConfig(device="cuda", dtype="bfloat16", max_model_len=4096,
                                        kv_cache_tokens=8192, max_num_seqs=8,
                                        quantization=quantization))  # fmt: skip
    prompt = torch.randint(0, spec.vocab_size, (PROMPT_LEN,)).tolist()
    request_id = engine.add_request(
        prompt, SamplingParams(max_tokens=2 * STEPS + 100, ignore_eos=True, temperature=0.0)
    )
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    wall = []
    for _ in range(STEPS):
        started = time.perf_counter()
        engine.step()
        wall.append(time.perf_counter() - started)
    graph = engine.runner.graphs.graphs[1]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay = []
    for _ in range(STEPS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        replay.append(start.elapsed_time(end) / 1e3)
    # back-to-back replays: the GPU time per step without any host gap
    torch.cuda.synchronize()
    start.record()
    for _ in range(STEPS):
        graph.replay()
    end.record()
    end.synchronize()
    back_to_back = start.elapsed_time(end) / 1e3 / STEPS
    table = replay_kernels(graph, 10)
    kernel_sum = sum(row["us_per_step"] for row in table)
    launches = sum(row["calls_per_step"] for row in table)
    result = {
        "model": name,
        "quantization": quantization,
        "engine_step_ms": statistics.median(wall) * 1e3,
        "graph_replay_ms": statistics.median(replay) * 1e3,
        "back_to_back_replay_ms": back_to_back * 1e3,
        "kernel_sum_ms": kernel_sum / 1e3,
        "launches_per_step": launches,
        "kernels": table,
    }
    print(
        f"\n{name}{' ' + quantization if quantization else ''}:"
        f" Engine.step {result['engine_step_ms']:.3f} ms,"
        f" graph replay {result['graph_replay_ms']:.3f} ms,"
        f" back-to-back {result['back_to_back_replay_ms']:.3f} ms,"
        f" kernel time sum {kernel_sum / 1e3:.3f} ms over {launches:.0f} launches"
    )
    print_kernels(table[:20], "  ")
    engine.abort(request_id)
    result["prefill"] = profile_prefill(engine, spec.vocab_size)
    result["verify"] = profile_verify(engine, spec.vocab_size)
    del engine, weights
    torch.cuda.empty_cache()
    return result


def profile_batches(name: str, batches: list[int], prompt_len: int = 512) -> dict:
    """Per batch size: the decode step of that many sequences once all of them decode."""
    spec = MODELS[name]
    weights = random_weights(spec, torch.bfloat16, torch.device("cuda"))
    model = LoadedModel(name=name, source=Path("random"), spec=spec, weights=weights, tokenizer=None)
    largest = max(batches)
    config = EngineConfig(
        device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=largest,
        kv_cache_tokens=largest * (prompt_len + 192), max_num_batched_tokens=8192,
    )  # fmt: skip
    engine = Engine(model, config)
    results = {"model": name, "batches": []}
    for batch in batches:
        params = SamplingParams(max_tokens=150, ignore_eos=True, temperature=0.0)
        ids = [engine.add_request(torch.randint(0, spec.vocab_size, (prompt_len,)).tolist(), params)
               for _ in range(batch)]  # fmt: skip
        while any(seq.num_output_tokens < 4 for seq in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
        wall = []
        for _ in range(40):
            started = time.perf_counter()
            engine.step()
            wall.append(time.perf_counter() - started)
        bucket = next(size for size in engine.runner.graphs.batch_sizes if size >= batch)
        graph = engine.runner.graphs.graphs[bucket]
        torch.cuda.synchronize()
        table = replay_kernels(graph, 5)
        row = {"batch": batch, "engine_step_ms": statistics.median(wall) * 1e3,
               "kernel_sum_ms": sum(r["us_per_step"] for r in table) / 1e3, "kernels": table}  # fmt: skip
        results["batches"].append(row)
        print(f"\n{name} batch {batch}: Engine.step {row['engine_step_ms']:.3f} ms, kernel time sum "
              f"{row['kernel_sum_ms']:.3f} ms ({batch / row['engine_step_ms'] * 1e3:.0f} tok/s)")  # fmt: skip
        print_kernels(table[:10], "  ")
        for request_id in ids:
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
    del engine, weights
    torch.cuda.empty_cache()
    return results


def profile_prefill(engine: Engine, vocab_size: int, length: int = 512) -> dict:
    """Wall time of the step that prefills a fresh prompt beside the GPU time of its kernels."""

    def prefill_step() -> None:
        prompt = torch.randint(0, vocab_size, (length,)).tolist()
        request_id = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        engine.step()
        engine.abort(request_id)

    for _ in range(3):
        prefill_step()
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        started = time.perf_counter()
        prefill_step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    kernels: dict[str, list[float]] = collections.defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name].append(event.device_time_total)
    table = sorted(
        ({"kernel": k[:80], "calls": len(v), "us": sum(v)} for k, v in kernels.items()),
        key=lambda row: -row["us"],
    )
    gpu_ms = sum(row["us"] for row in table) / 1e3
    print(f"  prefill {length}: wall {wall * 1e3:.2f} ms (profiled), kernel time sum {gpu_ms:.2f} ms")
    for row in table[:10]:
        print(f"    {row['us']:9.1f} us {row['calls']:4d} calls  {row['kernel']}")
    cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]
    for event in cpu:
        print(f"    host {event.self_cpu_time_total / 1e3:8.2f} ms {event.count:5d} x  {event.key[:70]}")
    return {"wall_ms": wall * 1e3, "kernel_sum_ms": gpu_ms, "kernels": table}


def replay_kernels(graph: torch.cuda.CUDAGraph, replays: int) -> list[dict]:
    """The per-kernel GPU time of one replay of the graph (kernel_table), over `replays` profiled ones."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return kernel_table(prof, replays)


def kernel_table(prof: torch.profiler.profile, steps: int) -> list[dict]:
    kernels: dict[str, list[float]] = collections.defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name].append(event.device_time_total)
    return sorted(
        ({"kernel": k[:80], "calls_per_step": len(v) / steps, "us_per_step": sum(v) / steps, "us_per_call":
          statistics.median(v)} for k, v in kernels.items()),
        key=lambda row: -row["us_per_step"],
    )  # fmt: skip


def print_kernels(rows: list[dict], indent: str) -> None:
    for row in rows:
        per_call = f"{row['calls_per_step']:6.1f} x {row['us_per_call']:6.2f} us"
        print(f"{indent}{row['us_per_step']:8.1f} us/step {per_call}  {row['kernel']}")


def profile_verify(engine: Engine, vocab_size: int, num_drafts: int = 6) -> dict:
    """A verify step of one sequence after 1,024 tokens: its last token and num_drafts drafts, scored
    from the step graph of their bucket and verified greedily. Wall time of the runner's call (host work,
    replay, verification, the read back) beside the replay's GPU time, and the replay's kernels."""
    runner = engine.runner
    assert runner.step_graphs is not None, "verify steps replay from step graphs"
    engine.run_ahead = False  # every token on the host, as when speculating
    prompt = torch.randint(0, vocab_size, (PROMPT_LEN,)).tolist()
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0))
    for _ in range(3):
        engine.step()
    (seq,) = engine.scheduler.running
    drafts = torch.randint(0, vocab_size, (num_drafts,)).tolist()
    seq.token_ids.extend(drafts)
    engine.block_manager.append_slots(seq, 0)
    scheduled = [ScheduledSequence(seq, num_drafts + 1)]
    for _ in range(3):
        runner.execute_speculative(scheduled, {seq: drafts})
    torch.cuda.synchronize()
    wall = []
    for _ in range(STEPS):
        started = time.perf_counter()
        runner.execute_speculative(scheduled, {seq: drafts})  # ends with the verified tokens on the host
        wall.append(time.perf_counter() - started)
    bucket = next(size for size in runner.step_graphs.buckets if size >= num_drafts + 1)
    graph = runner.step_graphs.graphs[bucket]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(STEPS):
        graph.replay()
    end.record()
    end.synchronize()
    replay_ms = start.elapsed_time(end) / STEPS
    table = replay_kernels(graph, 10)
    del seq.token_ids[-num_drafts:]
    engine.abort(request_id)
    result = {
        "num_drafts": num_drafts,
        "bucket": bucket,
        "execute_speculative_ms": statistics.median(wall) * 1e3,
        "back_to_back_replay_ms": replay_ms,
        "kernel_sum_ms": sum(row["us_per_step"] for row in table) / 1e3,
        "launches_per_step": sum(row["calls_per_step"] for row in table),
        "kernels": table,
    }
    print(
        f"  verify ({num_drafts} drafts, bucket {bucket}): execute_speculative "
        f"{result['execute_speculative_ms']:.3f} ms, back-to-back replay {replay_ms:.3f} ms, kernel time "
        f"sum {result['kernel_sum_ms']:.3f} ms over {result['launches_per_step']:.0f} launches"
    )
    print_kernels(table[:12], "    ")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-4b,smollm2-135m")
    parser.add_argument("--batches", help="comma-separated batch sizes: profile batched decode instead")
    parser.add_argument("--quantization", choices=["int8"], help="INT8 weights (batch 1 only)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
        results = [profile_batches(name, batches) for name in args.models.split(",")]
    else:
        results = [profile(name, args.quantization) for name in args.models.split(",")]
    (out / "profile_decode.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
