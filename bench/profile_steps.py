"""Where a serving workload's steps go: serve_load's engine-direct closed loop (512-token prompts, 128
output tokens, C requests in flight), each Engine.step() timed and classed by what it ran, then the
kernels and host functions of a window of its steps (torch.profiler).

    python bench/profile_steps.py [OUT_DIR] [--model qwen3-0.6b] [--concurrency 64,256]

Step classes: `decode B` (B sequences, one token each) and `mixed B+P` (B decoding sequences and P
prompt tokens in one step). Per class: steps, median and total ms, and the share of the loop's time.
Writes OUT_DIR/profile_steps.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import serve_load  # noqa: E402
from bench.profile_decode import kernel_table, print_kernels  # noqa: E402


def step_class(scheduled: list) -> str:
    decoding = sum(1 for item in scheduled if item.seq.num_computed_tokens + 1 == item.seq.num_tokens)
    prompt = sum(item.num_new_tokens for item in scheduled) - decoding
    bucket = lambda n: 1 << max(0, (n - 1).bit_length())  # noqa: E731 - powers of two keep classes few
    return f"decode {bucket(decoding)}" if prompt == 0 else f"mixed {bucket(decoding)}+{bucket(prompt)}"


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def closed_loop(
    engine: Any, prompts: list[list[int]], concurrency: int, output_tokens: int, profile_steps: int = 0
) -> dict[str, Any]:
    """serve_load.engine_level's loop, with each step's class and wall time; with profile_steps, a
    torch.profiler window over that many steps from the middle of the run, and a cProfile one before it."""
    import cProfile
    import io
    import pstats

    classes: list[str] = []
    schedule = engine.scheduler.schedule

    def recording_schedule(
        *args: Any, **kwargs: Any
    ):  # the bench's own wrapper: the class of the step about to run
        batch = schedule(*args, **kwargs)
        classes.append(step_class(batch.scheduled) if batch else "empty")
        return batch

    times: list[float] = []
    window = (len(prompts) * output_tokens // concurrency // 2, profile_steps)
    host_window = (window[0] // 2, profile_steps)  # cProfile: where the host's Python time goes
    host_profile = cProfile.Profile()
    profiling: list[torch.profiler.profile] = []  # the torch.profiler window, once it has begun

    def timed_step() -> list:
        if profile_steps and len(times) == window[0]:
            _synchronize()
            profiling.append(
                torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                )
            )
            profiling[0].__enter__()
        profiling_host = profile_steps and host_window[0] <= len(times) < sum(host_window)
        before = time.perf_counter()
        if profiling_host:
            host_profile.enable()
        outputs = engine.step()
        if profiling_host:
            host_profile.disable()
        times.append(time.perf_counter() - before)
        if profiling and len(times) == sum(window):
            _synchronize()
            profiling[0].__exit__(None, None, None)
        return outputs

    engine.scheduler.schedule = recording_schedule
    try:
        wall = serve_load.engine_level(engine, prompts, concurrency, output_tokens, timed_step)["wall_s"]
    finally:
        engine.scheduler.schedule = schedule
    by_class: dict[str, list[float]] = collections.defaultdict(list)
    for name, seconds in zip(classes, times, strict=False):
        by_class[name].append(seconds)
    rows = sorted(
        (
            {
                "class": name,
                "steps": len(v),
                "median_ms": statistics.median(v) * 1e3,
                "total_ms": sum(v) * 1e3,
                "share": sum(v) / wall,
            }
            for name, v in by_class.items()
        ),
        key=lambda row: -row["total_ms"],
    )
    result: dict[str, Any] = {
        "concurrency": concurrency,
        "wall_s": wall,
        "steps": len(times),
        "classes": rows,
    }
    if profiling and len(times) >= sum(window):
        profiled = profiling[0]
        result["window_classes"] = collections.Counter(classes[window[0] : window[0] + window[1]])
        kernels = kernel_table(profiled, window[1])
        result["gpu_ms_per_step"] = sum(row["us_per_step"] for row in kernels) / 1e3
        result["window_ms_per_step"] = sum(times[window[0] : window[0] + window[1]]) / window[1] * 1e3
        result["kernels"] = kernels[:25]
        text = io.StringIO()
        pstats.Stats(host_profile, stream=text).sort_stats("tottime").print_stats(18)
        result["host_python"] = text.getvalue()
        cpu = profiled.key_averages()
        result["host"] = [
            {"name": e.key[:80], "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / window[1]}
            for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:20]
        ]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", nargs="?", default="bench_out")
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--profile-steps", type=int, default=30)
    parser.add_argument("--prompt-tokens", default="512")
    parser.add_argument("--output-tokens", default="128")
    args = parser.parse_args()
    concurrency = [int(value) for value in args.concurrency.split(",")]
    load_args = serve_load.parse_args(
        [
            "--engine-direct",
            "--model",
            args.model,
            "--dtype",
            "bfloat16",
            "--concurrency",
            args.concurrency,
            "--prompt-tokens",
            args.prompt_tokens,
            "--output-tokens",
            args.output_tokens,
        ]
    )
    _, app_args = serve_load.app_args_for(load_args)
    from engine.engine import Engine
    from engine.loader import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = app_args.engine_config(device, "bfloat16" if device == "cuda" else "float32")
    started = time.perf_counter()
    engine = Engine(
        load_model(app_args.model, dtype=config.torch_dtype(), device=config.torch_device()), config
    )
    built = time.perf_counter() - started
    warm_up_s = engine.warm_up()
    print(f"engine built in {built:.1f} s, warmed up in {warm_up_s:.1f} s", flush=True)
    vocab = serve_load._vocab(load_args, engine.logit_vocab_size)
    results = []
    for level in concurrency:
        prompts = serve_load.level_prompts(load_args, level, vocab)
        result = closed_loop(engine, prompts, level, load_args.output_tokens, args.profile_steps)
        tokens = len(prompts) * load_args.output_tokens
        print(
            f"\nC={level}: {result['steps']} steps in {result['wall_s']:.2f} s, "
            f"{tokens / result['wall_s']:.0f} output tok/s"
        )
        for row in result["classes"][:14]:
            print(
                f"  {row['class']:>16}: {row['steps']:5d} steps, median {row['median_ms']:7.2f} ms, "
                f"{row['share'] * 100:5.1f} % of the time"
            )
        if "kernels" in result:
            print(
                f"  profiled window: {dict(result['window_classes'])}: {result['window_ms_per_step']:.2f} ms "
                f"a step, GPU kernels {result['gpu_ms_per_step']:.2f} ms"
            )
            print_kernels(result["kernels"][:14], "    ")
            for row in result["host"][:12]:
                print(f"    host {row['self_cpu_ms_per_step']:7.3f} ms/step  {row['name']}")
            lines = result["host_python"].splitlines()
            start = next((i for i, line in enumerate(lines) if "tottime" in line), 0)
            print("\n".join("    " + line[:150] for line in lines[start - 2 : start + 19]))
        results.append(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_steps.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
