"""One decode step, kernel by kernel: where a small batch's step goes (the decode graph's replay under
torch.profiler), beside the bytes each kernel moves and the copy bandwidth.

    python bench/profile_step.py --models qwen3-0.6b,qwen3-4b --batches 1,8 --out DIR
    python bench/profile_step.py --device cpu --tiny --batches 1 --steps 2   # CPU smoke: no GPU kernels

For each model (random weights, bf16) one engine, built as served (CUDA graphs, run-ahead), decodes
`batch` random prompts of --context tokens (greedy, ignore_eos). Then:
  bytes    one step run eagerly (the graph cache set aside for it) with every Triton launch recorded: the
           bytes of each launch's tensor arguments, in launch order, where the KV cache counts as what the
           step reads of it (attention: every cached position of the batch, in every layer for the
           persistent kernel) or writes (the new tokens), the embedding as the rows it reads, and the
           linears' split-K scratch not at all (a launch touches a little of it);
  profile  --steps decode steps replayed from the graph under torch.profiler, cut into steps at the step's
           first Triton kernel: per position in the step, the kernel's time and the idle time since the
           kernel before it (the median over the steps).
A profiled kernel takes the bytes of the next recorded launch of its name (Triton kernels keep their
function's name; the graph's other kernels, copies and torch ops, get none). Share: bytes / time / the
copy bandwidth measured at the start (read + written bytes per second of a device-to-device copy).
Writes DIR/profile_step.json and prints a table per model and batch: launches per step, the kernels'
time, the idle time and the step's period on the GPU (first kernel to first kernel), then each kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tileinfer.engine.config import DTYPES, torch_dtype  # noqa: E402
from tileinfer.engine.engine import Engine  # noqa: E402
from tileinfer.engine.models.random_model import SHAPES, random_weights  # noqa: E402
from tileinfer.engine.models.shape import ModelSpec  # noqa: E402
from tileinfer.engine.sampling.params import SamplingParams  # noqa: E402

from bench import bench_batch, limits  # noqa: E402
from bench.bench_engine import free_memory, random_prompt, versions  # noqa: E402

ATTENTION_KERNELS = ("_paged_decode_kernel", "_paged_prefill_kernel")  # read the cached positions
PERSISTENT_KERNEL = "_persistent_decode_kernel"  # every layer's cached positions
EMBEDDING_KERNEL = "_embedding_kernel"  # reads one row of its table a token


def build_engine(
    name: str, spec: ModelSpec, weights: dict[str, torch.Tensor], args: argparse.Namespace
) -> Engine:
    """bench_batch's engine (its settings, so that the profile explains its figures): built as served, with
    room for the largest batch at the context and the steps."""
    settings = bench_batch.Settings(
        device=torch.device(args.device), dtype=torch_dtype(args.dtype), tiny=args.tiny, batches=args.batches,
        peer_batches=[], prompt_len=args.context, output_len=args.steps + 64, max_num_batched_tokens=8192,
        peer_compiled=False, compile_backend="", budget_s=float("inf"),
        persistent_decode=args.persistent_decode,
    )  # fmt: skip
    return bench_batch.build_engine(name, spec, weights, settings)


def start_decoding(engine: Engine, spec: ModelSpec, batch: int, args: argparse.Namespace) -> list[str]:
    """`batch` requests, stepped until every one is past its prompt, and a few decode steps more."""
    generator = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=args.steps + 64, temperature=0.0, ignore_eos=True)
    request_ids = [
        engine.add_request(random_prompt(generator, spec.vocab_size, args.context), params)
        for _ in range(batch)
    ]
    scheduler = engine.scheduler
    while scheduler.waiting or any(
        seq.num_computed_tokens < seq.num_prompt_tokens for seq in scheduler.running
    ):
        engine.step()
    for _ in range(4):
        engine.step()
    return request_ids


@contextmanager
def recorded_launches() -> Iterator[list[tuple[str, list[Any]]]]:
    """Every Triton launch meanwhile, as (kernel name, its arguments), the launches themselves unchanged."""
    from triton.runtime.jit import JITFunction

    launches: list[tuple[str, list[Any]]] = []
    original = JITFunction.run

    def run(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("warmup"):  # a compile alone (the persistent kernel's grid check) moves nothing
            launches.append((self.fn.__name__, [*args, *kwargs.values()]))
        return original(self, *args, **kwargs)

    JITFunction.run = run
    try:
        yield launches
    finally:
        JITFunction.run = original


def cache_storages(engine: Engine) -> set[int]:
    """The data pointers of the KV cache's storages (its values, and an INT8 cache's scales)."""
    cache = engine.runner.kv_cache
    parts = [cache] if isinstance(cache, torch.Tensor) else [cache.values, cache.scales]
    return {part.untyped_storage().data_ptr() for part in parts}


def launch_bytes(engine: Engine, spec: ModelSpec, batch: int, context: int) -> list[tuple[str, int]]:
    """(kernel, bytes) of each Triton launch of one eagerly run decode step (see the module docstring)."""
    itemsize = torch.empty(0, dtype=engine.config.torch_dtype()).element_size()
    kv_token_bytes = 2 * spec.kv_size * itemsize  # a token's keys and values in one layer
    cache = cache_storages(engine)
    workspace = engine.runner.decoder.linear_workspace
    scratch = set()
    if workspace is not None:
        scratch = {
            part.untyped_storage().data_ptr()
            for part in (workspace.split_k.partials, workspace.split_k.counters)
        }
    embedding = engine.runner.decoder.model.embed_tokens.weight
    graphs, engine.runner.graphs = engine.runner.graphs, None
    try:
        with recorded_launches() as launches:
            engine.step()
            limits.synchronize(engine.device)
    finally:
        engine.runner.graphs = graphs
    recorded = []
    for name, arguments in launches:
        tensors = [argument for argument in arguments if isinstance(argument, torch.Tensor)]
        moved = 0
        for tensor in tensors:
            storage = tensor.untyped_storage().data_ptr()
            if storage in cache or storage in scratch:
                continue
            if name == EMBEDDING_KERNEL and storage == embedding.untyped_storage().data_ptr():
                moved += batch * embedding.shape[1] * embedding.element_size()
            else:
                moved += tensor.numel() * tensor.element_size()
        if any(tensor.untyped_storage().data_ptr() in cache for tensor in tensors):
            positions = {PERSISTENT_KERNEL: context * spec.num_layers}.get(
                name, context if name in ATTENTION_KERNELS else 1
            )
            moved += batch * kv_token_bytes * positions
        recorded.append((name, moved))
    return recorded


def profiled_steps(engine: Engine, steps: int) -> list[Any]:
    """The GPU's kernels and copies over `steps` decode steps, in the order they ran."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        for _ in range(steps):
            engine.step()
        limits.synchronize(engine.device)
    events = [event for event in profiler.events() if event.device_type == DeviceType.CUDA]
    return sorted(events, key=lambda event: event.time_range.start)


def step_rows(events: list[Any], first_kernel: str) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Per position in a step: its kernel, median µs and median idle µs before it (over the whole steps
    between occurrences of first_kernel that launch the most common sequence of kernels); and the step's
    totals."""
    starts = [index for index, event in enumerate(events) if event.name == first_kernel]
    segments = [events[begin:end] for begin, end in zip(starts, starts[1:], strict=False)]
    if not segments:
        return [], {}
    names = [tuple(event.name for event in segment) for segment in segments]
    common = max(set(names), key=names.count)
    chosen = [index for index in range(len(segments)) if names[index] == common]
    whole = [(events[starts[index] - 1] if starts[index] else None, segments[index]) for index in chosen]
    rows = []
    for position, name in enumerate(common):
        durations, gaps = [], []
        for before, segment in whole:
            event = segment[position]
            previous = segment[position - 1] if position else before
            durations.append(event.time_range.end - event.time_range.start)
            if previous is not None:
                gaps.append(max(0.0, event.time_range.start - previous.time_range.end))
        rows.append({
            "kernel": name, "us": statistics.median(durations),
            "gap_us": statistics.median(gaps) if gaps else None,
        })  # fmt: skip
    # a step's period on the GPU: from its first kernel's start to the next step's
    spans = [
        events[starts[index + 1]].time_range.start - events[starts[index]].time_range.start
        for index in chosen
    ]
    totals = {
        "launches": len(common),
        "steps_profiled": len(whole),
        "kernel_us": sum(row["us"] for row in rows),
        "idle_us": sum(row["gap_us"] or 0.0 for row in rows),
        "step_us": statistics.median(spans),
    }
    return rows, totals


def with_bytes(rows: list[dict[str, Any]], recorded: list[tuple[str, int]], bandwidth: float) -> None:
    """Give each row the bytes of the next recorded launch of its kernel, and its share of the copy
    bandwidth."""
    cursor = 0
    for row in rows:
        row["bytes"] = row["share"] = None
        for index in range(cursor, len(recorded)):
            if recorded[index][0] == row["kernel"]:
                row["bytes"], cursor = recorded[index][1], index + 1
                if row["us"] > 0:
                    row["share"] = row["bytes"] / (row["us"] * 1e-6) / bandwidth
                break


def profile_model(name: str, args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    spec = SHAPES[name]
    weights = random_weights(spec, torch_dtype(args.dtype), torch.device(args.device))
    engine = build_engine(name, spec, weights, args)
    engine.warm_up()
    results: dict[str, Any] = {}
    for batch in args.batches:
        request_ids = start_decoding(engine, spec, batch, args)
        try:
            recorded = launch_bytes(engine, spec, batch, args.context)
            events = profiled_steps(engine, args.steps)
        finally:
            for request_id in request_ids:
                engine.abort(request_id)
            while engine.has_unfinished():  # a step launched ahead
                engine.step()
        rows, totals = step_rows(events, recorded[0][0]) if recorded else ([], {})
        with_bytes(rows, recorded, bandwidth)
        totals["bytes"] = sum(row["bytes"] or 0 for row in rows)
        results[str(batch)] = {"totals": totals, "kernels": rows, "launches_recorded": len(recorded)}
        print_table(name, batch, totals, rows)
    del engine, weights
    free_memory()
    return results


def print_table(name: str, batch: int, totals: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    if not rows:
        print(f"\n== {name}, {batch} sequences: no GPU kernels profiled", flush=True)
        return
    print(
        f"\n== {name}, {batch} sequences: {totals['launches']} launches a step, kernels "
        f"{totals['kernel_us']:.1f} us, idle {totals['idle_us']:.1f} us, step {totals['step_us']:.1f} us, "
        f"{totals['bytes'] / 1e6:.1f} MB ({totals['steps_profiled']} steps)"
    )
    print(f"{'#':>4} {'kernel':<40} {'us':>8} {'gap us':>8} {'MB':>9} {'share':>6}")
    for position, row in enumerate(rows):
        gap = "" if row["gap_us"] is None else f"{row['gap_us']:.1f}"
        size = "" if row["bytes"] is None else f"{row['bytes'] / 1e6:.2f}"
        share = "" if row["share"] is None else f"{row['share']:.0%}"
        print(f"{position:>4} {row['kernel'][:40]:<40} {row['us']:>8.1f} {gap:>8} {size:>9} {share:>6}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default=None, help="comma-separated subset of " + ",".join(SHAPES))
    parser.add_argument("--batches", default="1,8", help="sequences decoded together, comma-separated")
    parser.add_argument("--context", type=int, default=576, help="cached positions of each sequence")
    parser.add_argument("--steps", type=int, default=20, help="decode steps profiled")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--tiny", action="store_true", help="the tiny model and a short context (CPU smoke)")
    parser.add_argument(
        "--persistent-decode", action="store_true", help="one-sequence steps in the persistent kernel"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for the JSON")
    args = parser.parse_args()
    args.batches = [int(size) for size in args.batches.split(",")]
    if args.tiny:
        args.context = min(args.context, 32)
    models = (args.models or ("tiny" if args.tiny else "qwen3-0.6b,qwen3-4b")).split(",")
    unknown = [name for name in models if name not in SHAPES]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    device = torch.device(args.device)
    bandwidth = limits.copy_bandwidth(device, 2 * limits.GIB if device.type == "cuda" else 1 << 26)
    record: dict[str, Any] = {
        "args": dict(vars(args)),
        "versions": versions(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "models": {},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in models:
        record["models"][name] = profile_model(name, args, bandwidth)
        (out / "profile_step.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
