"""TileInfer against its gpt-fast-style peer and the machine's limits, in one run (BENCH.md).

    python bench/bench_engine.py [--out DIR] [--models qwen3-0.6b,qwen3-4b,smollm2-135m] [--long]
    python bench/bench_engine.py --device cpu --tiny --long --peer-compile-prefill   # CPU smoke run

For each model (random weights, bf16, batch 1):
  decode   tok/s after a 1,024-token prompt: 1 / the median of >= 200 step times after warm-up.
           TileInfer: one Engine.step() per token, greedy and sampled (temperature 0.8, top-p 0.95).
           Peer: its greedy step compiled (torch.compile reduce-overhead, fullgraph) and eager.
  prefill  tok/s of a 512-token prompt (4k and 16k with --long). TileInfer: the step that prefills a
           fresh prompt (new random tokens every time, so the prefix cache cannot hit). Peer: its
           eager forward (and compiled with --peer-compile-prefill).
  limits   copy bandwidth and bf16 matmul rate measured at the start of the run; "% of limit" is
           TileInfer over the decode roofline or the prefill FLOP limit (bench/limits.py).
A failure in one part (OOM, a compile error) is printed and recorded, and the run goes on. Raw
numbers go to DIR/bench_engine.json (DIR: --out, else $OUT, else ./bench_out), rewritten after each
model. The table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tileinfer.engine.config import DTYPES, EngineConfig, torch_dtype  # noqa: E402
from tileinfer.engine.engine import Engine  # noqa: E402
from tileinfer.engine.models.loader import LoadedModel  # noqa: E402
from tileinfer.engine.models.random_model import SHAPES, random_weights  # noqa: E402
from tileinfer.engine.models.shape import ModelSpec  # noqa: E402
from tileinfer.engine.sampling.params import SamplingParams  # noqa: E402

from bench import limits  # noqa: E402
from bench.peer import PeerModel, compile_greedy_step, greedy_step  # noqa: E402

GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
NUM_FIRST_TOKENS = 8  # greedy tokens kept from each side, to compare TileInfer with the peer
# Display names for the result tables.
DISPLAY_NAMES = {"qwen3-0.6b": "Qwen3-0.6B", "qwen3-4b": "Qwen3-4B", "smollm2-135m": "SmolLM2-135M"}


@dataclasses.dataclass
class Settings:
    device: torch.device
    dtype: torch.dtype
    tiny: bool
    prompt_len: int  # decode starts after this many cached positions
    steps: int  # timed decode steps
    warmup: int  # decode steps before timing
    prefill_lens: list[int]
    prefill_repeats: int
    peer_compile_prefill: bool
    compile_backend: str
    budget_s: float  # past this (since start), remaining heavy parts are skipped
    step_graphs: bool = True  # EngineConfig.step_graphs: prefill steps replayed from CUDA graphs
    quantization: str | None = None  # EngineConfig.quantization (bench/bench_int8.py)
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype (bench/bench_int8.py)
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def over_budget(self) -> bool:
        return time.perf_counter() - self.started > self.budget_s


class Interrupted(BaseException):
    """SIGTERM (a timeout): stop measuring, still write the JSON and print the table. A BaseException,
    like KeyboardInterrupt, so that the per-part `except Exception` does not swallow it."""


def log(message: str) -> None:
    print(message, flush=True)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def attempt(record: dict[str, Any], key: str, settings: Settings, measure: Callable[[], Any]) -> Any:
    """record[key] = measure(), or the error it raised (printed); None on error or when over budget."""
    if settings.over_budget():
        record[key] = {"skipped": f"time budget of {settings.budget_s:.0f} s spent"}
        log(f"  {key}: skipped (time budget)")
        return None
    try:
        record[key] = measure()
        return record[key]
    except Exception as error:  # one part failing must not cost the rest of the run
        traceback.print_exc()
        record[key] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        log(f"  {key}: FAILED ({type(error).__name__}: {str(error)[:300]})")
        free_memory()
        return None


def timed_build(record: dict[str, Any], settings: Any, build: Callable[[], Engine]) -> Engine | None:
    """The engine build() makes, under attempt: record["build"] holds the seconds it took; None when it
    failed or the time budget was spent."""
    started = time.perf_counter()
    engine = attempt(record, "build", settings, build)
    if engine is not None:
        record["build"] = {"seconds": time.perf_counter() - started}  # not the engine itself (JSON)
    return engine


def model_weights(record: dict[str, Any], spec: ModelSpec, settings: Any) -> dict[str, torch.Tensor] | None:
    """The model's random weights (seed 0) on the settings' device and dtype, under attempt; None when
    drawing them failed or the time budget was spent."""
    weights = attempt(
        record, "weights", settings, lambda: random_weights(spec, settings.dtype, settings.device)
    )
    if weights is not None:
        record["weights"] = {"seed": 0, "num_tensors": len(weights)}
    return weights


def begin_model(
    record: dict[str, Any],
    name: str,
    spec: ModelSpec,
    settings: Any,
    model_limits: dict[str, Any],
    note: str = "",
) -> dict[str, torch.Tensor] | None:
    """A model's record begun (its name, shape and limits, empty parts for TileInfer and the peer) and
    logged as "== name" + note; then its weights, as model_weights draws them."""
    record.update(model=name, spec=dataclasses.asdict(spec), limits=model_limits, tileinfer={}, peer={})
    log(f"\n== {name}{note}")
    return model_weights(record, spec, settings)


def tileinfer_then_peer(bench_tileinfer: Callable[[], None], bench_peer: Callable[[], None]) -> None:
    """TileInfer's part, then the peer's on the same weights: memory freed between them, and the peer's
    compiled graphs and memory after, also when a part raised."""
    try:
        bench_tileinfer()
        free_memory()
        bench_peer()
    finally:
        torch._dynamo.reset()
        free_memory()


def random_prompt(generator: torch.Generator, vocab_size: int, length: int) -> list[int]:
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def step_summary(step_times: list[float], tokens_per_step: int = 1) -> dict[str, Any]:
    median = statistics.median(step_times)
    return {
        "tok_s": tokens_per_step / median,
        "median_step_s": median,
        "mean_tok_s": tokens_per_step * len(step_times) / sum(step_times),
        "min_step_s": min(step_times),
        "max_step_s": max(step_times),
        "step_times_s": step_times,
    }


# --- TileInfer ----------------------------------------------------------------------------------


def build_engine(name: str, spec: ModelSpec, weights: dict[str, torch.Tensor], settings: Settings) -> Engine:
    longest = max([settings.prompt_len + settings.warmup + settings.steps + 2, *settings.prefill_lens]) + 2
    max_model_len = min(max(4096, longest), spec.max_position_embeddings)
    config = EngineConfig(
        device=str(settings.device),
        dtype=str(settings.dtype).removeprefix("torch."),
        max_model_len=max_model_len,
        kv_cache_tokens=max(8192, max_model_len),
        max_num_seqs=8,
        max_num_batched_tokens=max(2048, *settings.prefill_lens),  # a whole prompt in one step
        step_graphs=settings.step_graphs,
        quantization=settings.quantization,
        kv_cache_dtype=settings.kv_cache_dtype,
    )

    # tokenizer=None: no detokenization in the timed steps
    model = LoadedModel(name=name, source=Path("random"), spec=spec, weights=weights, tokenizer=None)
    return Engine(model, config)


def engine_decode(
    engine: Engine, prompt: list[int], settings: Settings, sampling: dict[str, float]
) -> dict[str, Any]:
    """Time each Engine.step() of one request after its prefill step and the warm-up steps."""
    total_steps = settings.warmup + settings.steps
    params = SamplingParams(max_tokens=total_steps + 2, ignore_eos=True, **sampling)
    request_id = engine.add_request(prompt, params)
    token_ids: list[int] = []

    def step() -> None:
        for output in engine.step():
            if output.request_id == request_id:
                token_ids.extend(output.new_token_ids)

    try:
        limits.synchronize(settings.device)
        started = time.perf_counter()
        step()  # the prefill
        limits.synchronize(settings.device)
        prefill_s = time.perf_counter() - started
        for _ in range(settings.warmup):
            step()
        limits.synchronize(settings.device)
        emitted_before = len(token_ids)
        step_times = []
        loop_started = time.perf_counter()
        for _ in range(settings.steps):
            started = time.perf_counter()
            step()  # returns host tokens, so it waits for its own GPU work (or runs one step ahead)
            step_times.append(time.perf_counter() - started)
        limits.synchronize(settings.device)
        loop_s = time.perf_counter() - loop_started
    finally:
        engine.abort(request_id)
    emitted = len(token_ids) - emitted_before
    if emitted < settings.steps - 1:  # one step of lag is allowed for an engine that runs ahead
        log(f"  warning: {emitted} tokens came back from {settings.steps} timed steps")
    return {
        **step_summary(step_times),
        "loop_tok_s": emitted / loop_s,  # tokens that came back / wall time of the timed loop
        "tokens_emitted": emitted,
        "prefill_step_s": prefill_s,
        "first_tokens": token_ids[:NUM_FIRST_TOKENS],
        "sampling": sampling,
    }


def engine_prefill(
    engine: Engine, spec: ModelSpec, length: int, settings: Settings, generator: torch.Generator
) -> dict[str, Any]:
    """Time the step that prefills a fresh `length`-token prompt; abort the request after it."""
    step_times = []
    emitted_first_token = []
    for repetition in range(1 + settings.prefill_repeats):  # the first one warms up
        prompt = random_prompt(generator, spec.vocab_size, length)
        request_id = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        try:
            limits.synchronize(settings.device)
            started = time.perf_counter()
            outputs = engine.step()
            limits.synchronize(settings.device)
            elapsed = time.perf_counter() - started
        finally:
            engine.abort(request_id)
        if repetition:
            step_times.append(elapsed)
            emitted_first_token.append(any(output.request_id == request_id for output in outputs))
    summary = step_summary(step_times, tokens_per_step=length)
    # False means the step did not finish the prompt (chunked) or the engine returns tokens a step late
    summary["first_step_emitted_token"] = all(emitted_first_token)
    return summary


def bench_tileinfer(
    record: dict[str, Any],
    name: str,
    spec: ModelSpec,
    weights: dict[str, torch.Tensor],
    prompt: list[int],
    settings: Settings,
) -> None:
    """Fill record with TileInfer's decode (greedy, sampled) and prefill figures, part by part."""
    engine = timed_build(record, settings, lambda: build_engine(name, spec, weights, settings))
    if engine is None:
        return
    record["build"]["cuda_graphs"] = engine.config.cuda_graphs
    log(f"  TileInfer engine built in {record['build']['seconds']:.1f} s")
    generator = torch.Generator().manual_seed(7)
    if attempt(record, "decode_greedy", settings, lambda: engine_decode(engine, prompt, settings, GREEDY)):
        log(f"  TileInfer decode greedy  {record['decode_greedy']['tok_s']:10,.1f} tok/s")
    measure = lambda: engine_decode(engine, prompt, settings, SAMPLED)
    if attempt(record, "decode_sampled", settings, measure):
        log(f"  TileInfer decode sampled {record['decode_sampled']['tok_s']:10,.1f} tok/s")
    record["prefill"] = {}
    for length in settings.prefill_lens:
        key = str(length)
        measure = lambda length=length: engine_prefill(engine, spec, length, settings, generator)
        if attempt(record["prefill"], key, settings, measure):
            log(f"  TileInfer prefill {length:6d}  {record['prefill'][key]['tok_s']:10,.0f} tok/s")
    # the engine is freed when this returns (bench_model then empties the CUDA cache)


# --- the peer -----------------------------------------------------------------------------------


def peer_decode(
    peer: PeerModel,
    step_fn: Callable[..., torch.Tensor],
    prompt: torch.Tensor,
    settings: Settings,
    compiled: bool,
) -> dict[str, Any]:
    """Prefill the prompt, then time each greedy step (CUDA events on a GPU) after the warm-up."""
    device = settings.device
    # The cache holds the prompt and every step; the mask row covers all of it (as in gpt-fast).
    peer.setup_cache(batch=1, max_len=-(-(prompt.shape[1] + settings.warmup + settings.steps + 4) // 64) * 64)
    with torch.no_grad():
        token = peer.prefill(prompt).argmax(dim=-1, keepdim=True)  # [1, 1]
        input_pos = torch.tensor([prompt.shape[1]], device=device)
        tokens = [token]

        def one_step() -> None:
            nonlocal token
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            token = step_fn(peer, token, input_pos).clone()  # the graph's output buffer is reused
            input_pos.add_(1)
            tokens.append(token)

        limits.synchronize(device)
        started = time.perf_counter()
        one_step()  # compiles when compiled
        limits.synchronize(device)
        first_step_s = time.perf_counter() - started
        for _ in range(max(settings.warmup - 1, 2)):  # CUDA graph trees record on the 2nd/3rd call
            one_step()
        step_times = limits.time_each(one_step, settings.steps, device)
    return {
        **step_summary(step_times),
        "cache_len": peer.max_len,
        "first_step_s": first_step_s,  # includes torch.compile when compiled
        "first_tokens": torch.cat(tokens[:NUM_FIRST_TOKENS]).flatten().tolist(),
    }


def peer_prefill(
    peer: PeerModel,
    prefill_fn: Callable[[torch.Tensor], torch.Tensor],
    prompt: torch.Tensor,
    settings: Settings,
) -> dict[str, Any]:
    """Time the peer's forward over a fresh prompt (positions 0..), its cache sized to the prompt."""
    peer.setup_cache(batch=1, max_len=prompt.shape[1])
    with torch.no_grad():
        limits.synchronize(settings.device)
        started = time.perf_counter()
        prefill_fn(prompt)  # warm-up (and compile)
        prefill_fn(prompt)
        limits.synchronize(settings.device)
        warmup_s = time.perf_counter() - started
        step_times = limits.time_each(lambda: prefill_fn(prompt), settings.prefill_repeats, settings.device)
    return {**step_summary(step_times, tokens_per_step=prompt.shape[1]), "warmup_s": warmup_s}


def bench_peer(
    record: dict[str, Any],
    spec: ModelSpec,
    weights: dict[str, torch.Tensor],
    prompt: list[int],
    settings: Settings,
) -> None:
    """Fill record with the peer's decode (compiled, eager) and prefill figures, part by part."""
    device = settings.device
    peer = attempt(record, "build", settings, lambda: PeerModel(spec, weights))
    if peer is None:
        return
    record["build"] = {"fused_qkv": True}
    prompt_tensor = torch.tensor([prompt], device=device)
    compiled_step = lambda: compile_greedy_step(settings.compile_backend)
    measure = lambda: peer_decode(peer, compiled_step(), prompt_tensor, settings, compiled=True)
    if result := attempt(record, "decode_compiled", settings, measure):
        first_s = result["first_step_s"]
        log(f"  peer decode compiled     {result['tok_s']:10,.1f} tok/s (first step {first_s:.1f} s)")
    torch._dynamo.reset()  # drop the compiled step and its CUDA graphs before the eager runs
    free_memory()
    measure = lambda: peer_decode(peer, greedy_step, prompt_tensor, settings, compiled=False)
    if result := attempt(record, "decode_eager", settings, measure):
        log(f"  peer decode eager        {result['tok_s']:10,.1f} tok/s")

    generator = torch.Generator().manual_seed(11)
    # each entry makes the prefill function (compiling inside the attempt, so a failure is recorded)
    prefill_fns: dict[str, Callable[[], Callable[[torch.Tensor], torch.Tensor]]] = {
        "prefill_eager": lambda: peer.prefill
    }
    if settings.peer_compile_prefill:
        # default mode (no CUDA graphs): a prefill is long enough to hide its launches
        prefill_fns["prefill_compiled"] = lambda: torch.compile(peer.prefill, fullgraph=True)
    for key, make_prefill_fn in prefill_fns.items():
        record[key] = {}
        for length in settings.prefill_lens:
            tokens = torch.tensor([random_prompt(generator, spec.vocab_size, length)], device=device)
            measure = lambda make=make_prefill_fn, tokens=tokens: peer_prefill(peer, make(), tokens, settings)
            if result := attempt(record[key], str(length), settings, measure):
                log(f"  peer {key:16s} {length:6d} {result['tok_s']:10,.0f} tok/s")
    # the peer is freed when this returns (bench_model then resets dynamo and empties the cache)


# --- the run ------------------------------------------------------------------------------------


def bench_model(
    record: dict[str, Any], name: str, settings: Settings, machine_limits: dict[str, float]
) -> None:
    """Fill record (already in the results, so an interrupted run keeps what it measured)."""
    spec = SHAPES[name]
    # prompts within the model's context only (SmolLM2-135M holds 8k positions, so no 16k prefill)
    settings = dataclasses.replace(
        settings, prefill_lens=[n for n in settings.prefill_lens if n < spec.max_position_embeddings]
    )
    bandwidth, flops = machine_limits["copy_bandwidth_bytes_per_s"], machine_limits["matmul_flops_per_s"]
    cached = settings.prompt_len - 1
    model_limits = {
        "decode_cached_positions": cached,
        "decode_bytes_per_token": limits.decode_bytes_per_token(spec, cached, settings.dtype),
        "decode_roofline_tok_s": limits.decode_roofline(spec, bandwidth, cached, settings.dtype),
        "prefill_flops": {str(n): limits.prefill_flops(spec, n) for n in settings.prefill_lens},
        "prefill_limit_tok_s": {str(n): limits.prefill_limit(spec, flops, n) for n in settings.prefill_lens},
    }
    roofline = f": decode roofline {model_limits['decode_roofline_tok_s']:,.0f} tok/s"
    weights = begin_model(record, name, spec, settings, model_limits, roofline)
    if weights is None:
        return
    prompt = random_prompt(torch.Generator().manual_seed(1234), spec.vocab_size, settings.prompt_len)
    tileinfer_then_peer(
        lambda: bench_tileinfer(record["tileinfer"], name, spec, weights, prompt, settings),
        lambda: bench_peer(record["peer"], spec, weights, prompt, settings),
    )
    ours = record["tileinfer"].get("decode_greedy", {}).get("first_tokens")
    theirs = record["peer"].get("decode_eager", {}).get("first_tokens")
    if ours and theirs:
        agreed = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), len(ours))
        record["greedy_tokens_agreeing"] = agreed  # random weights: bf16 near-ties may split them early
        log(f"  greedy tokens: TileInfer {ours} peer {theirs} (first {agreed} agree)")


def _value(record: dict[str, Any] | None, *keys: str) -> float | None:
    for key in keys:
        if not isinstance(record, dict):
            return None
        record = record.get(key)
    return record if isinstance(record, int | float) else None


def table_rows(results: dict[str, Any]) -> list[tuple[str, str, float | None, float | None, float | None]]:
    """(workload, model, TileInfer tok/s, peer tok/s, limit tok/s): decode against the compiled peer,
    prefill against the eager one (BENCH.md), with the other peer in its own row."""
    rows = []
    for record in results["models"]:
        if "limits" not in record:
            continue  # failed before it measured anything
        model = DISPLAY_NAMES.get(record["model"], record["model"])
        ours, peer, limit = record["tileinfer"], record["peer"], record["limits"]
        roofline = limit["decode_roofline_tok_s"]
        greedy = _value(ours, "decode_greedy", "tok_s")
        compiled = _value(peer, "decode_compiled", "tok_s")
        rows.append(("decode", model, greedy, compiled, roofline))
        rows.append(("decode, eager peer", model, greedy, _value(peer, "decode_eager", "tok_s"), roofline))
        rows.append(("decode sampled", model, _value(ours, "decode_sampled", "tok_s"), compiled, roofline))
        for length, prefill_limit in limit["prefill_limit_tok_s"].items():
            prefill = _value(ours, "prefill", length, "tok_s")
            rows.append(
                (
                    f"prefill {length}",
                    model,
                    prefill,
                    _value(peer, "prefill_eager", length, "tok_s"),
                    prefill_limit,
                )
            )
            if "prefill_compiled" in peer:
                theirs = _value(peer, "prefill_compiled", length, "tok_s")
                rows.append((f"prefill {length}, compiled peer", model, prefill, theirs, prefill_limit))
    return rows


def print_table(results: dict[str, Any]) -> None:
    def rate(value: float | None) -> str:
        return "—" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"

    machine = results.get("limits", {})
    bandwidth, flops = machine.get("copy_bandwidth_bytes_per_s"), machine.get("matmul_flops_per_s")
    log(
        f"\nTileInfer vs gpt-fast-style peer, batch 1, {results['dtype']}, {results['gpu']}; "
        f"torch {results['versions']['torch']}, triton {results['versions']['triton']}"
    )
    if bandwidth and flops:
        log(
            f"limits in this run: copy {bandwidth / 1e12:.2f} TB/s, matmul {flops / 1e12:.0f} TFLOP/s; "
            "% of limit = TileInfer / (decode roofline | prefill FLOP limit); tok/s throughout"
        )
    log("| workload | model | TileInfer | peer | TileInfer / peer | % of limit |")
    log("| --- | --- | ---: | ---: | ---: | ---: |")
    for workload, model, ours, theirs, limit in table_rows(results):
        ratio = f"{ours / theirs:.2f}x" if ours and theirs else "—"
        percent = f"{100 * ours / limit:.1f} %" if ours and limit else "—"
        log(f"| {workload} | {model} | {rate(ours)} | {rate(theirs)} | {ratio} | {percent} |")


def model_parser(description: str | None) -> argparse.ArgumentParser:
    """A parser with the flags the engine benchmarks share: --device, --dtype, --tiny and --models."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--tiny", action="store_true", help="the tiny model and short runs (CPU smoke)")
    parser.add_argument("--models", default=None, help="comma-separated subset of " + ",".join(SHAPES))
    return parser


def chosen_models(parser: argparse.ArgumentParser, args: argparse.Namespace, default: str) -> list[str]:
    """--models (else default, comma-separated) as a list; a name not in SHAPES is a usage error."""
    model_names = (args.models or default).split(",")
    unknown = [name for name in model_names if name not in SHAPES]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    return model_names


def parse_settings() -> tuple[Settings, list[str], Path]:
    parser = model_parser(__doc__)
    parser.add_argument("--long", action="store_true", help="also prefill 4k and 16k prompts")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (default 200)")
    parser.add_argument("--warmup", type=int, default=None, help="decode steps before timing (default 20)")
    parser.add_argument("--prefill-repeats", type=int, default=None, help="timed prefills per length")
    parser.add_argument(
        "--peer-compile-prefill", action="store_true", help="also time a compiled peer prefill"
    )
    parser.add_argument("--compile-backend", default="inductor", help="inductor = reduce-overhead mode")
    parser.add_argument("--budget-s", type=float, default=540.0, help="skip parts that start after this")
    parser.add_argument(
        "--no-step-graphs", action="store_true", help="run prefill steps eagerly, not from CUDA graphs"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for the JSON")
    args = parser.parse_args()
    if args.tiny:
        models, prompt_len, steps, warmup, lens, repeats = "tiny", 64, 8, 2, [32], 2
        long_lens = [128, 256]
    else:
        models, prompt_len, steps, warmup, lens, repeats = (
            "qwen3-0.6b,qwen3-4b,smollm2-135m",
            1024,
            200,
            20,
            [512],
            10,
        )
        long_lens = [4096, 16384]
    model_names = chosen_models(parser, args, models)
    settings = Settings(
        device=torch.device(args.device),
        dtype=torch_dtype(args.dtype),
        tiny=args.tiny,
        prompt_len=prompt_len,
        steps=args.steps or steps,
        warmup=args.warmup if args.warmup is not None else warmup,
        prefill_lens=lens + (long_lens if args.long else []),
        prefill_repeats=args.prefill_repeats or repeats,
        peer_compile_prefill=args.peer_compile_prefill,
        compile_backend=args.compile_backend,
        budget_s=args.budget_s,
        step_graphs=not args.no_step_graphs,
    )
    return settings, model_names, Path(args.out)


def versions() -> dict[str, str]:
    found = {}
    for package in ("torch", "triton", "transformers"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "absent"
    found["python"] = sys.version.split()[0]
    found["cuda"] = str(torch.version.cuda)
    return found


def run_models(
    settings: Any,
    model_names: list[str],
    out_path: Path,
    bench_model: Callable[[dict[str, Any], str, dict[str, Any]], None],
    print_table: Callable[[dict[str, Any]], None],
) -> None:
    """The run the engine benchmarks share: the limits, then bench_model(record, name, limits) for each
    model, the JSON rewritten after each, and the table printed last, also when SIGTERM (a timeout) or
    Ctrl-C stops it early. settings: a dataclass with device, dtype, tiny and started."""

    def on_sigterm(signum: int, frame: object) -> None:
        raise Interrupted("SIGTERM")

    signal.signal(signal.SIGTERM, on_sigterm)
    device = settings.device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "gpu": gpu,
        "versions": versions(),
        "dtype": str(settings.dtype).removeprefix("torch."),
        "settings": {
            key: value
            for key, value in dataclasses.asdict(settings).items()
            if key not in ("device", "dtype", "started")
        },
        "models": [],
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        results["limits"] = limits.measure(device, settings.tiny)
        log(
            f"limits: copy {results['limits']['copy_bandwidth_bytes_per_s'] / 1e12:.3f} TB/s, "
            f"matmul {results['limits']['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({gpu})"
        )
        for name in model_names:
            record: dict[str, Any] = {}
            results["models"].append(record)
            try:
                bench_model(record, name, results["limits"])
            except Exception as error:  # the parts catch their own; this is the last net for a model
                traceback.print_exc()
                record["error"] = f"{type(error).__name__}: {error}"[:2000]
                free_memory()
            out_path.write_text(json.dumps(results, indent=1, default=str))
    except (Interrupted, KeyboardInterrupt) as stop:
        log(f"\nstopped early ({type(stop).__name__}); the table holds what was measured")
        results["stopped_early"] = True
    finally:
        results["elapsed_s"] = time.perf_counter() - settings.started
        out_path.write_text(json.dumps(results, indent=1, default=str))
        log(f"\nraw results: {out_path} ({results['elapsed_s']:.0f} s in all)")
        if "limits" in results:
            print_table(results)


def main() -> None:
    settings, model_names, out_dir = parse_settings()
    run_models(
        settings, model_names, out_dir / "bench_engine.json",
        lambda record, name, measured: bench_model(record, name, settings, measured), print_table,
    )  # fmt: skip


if __name__ == "__main__":
    main()
