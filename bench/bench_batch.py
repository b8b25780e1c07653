"""The `batch` workload (BENCH.md): many sequences at once through the engine's own API, against the
static-batch compiled peer and the memory roofline, in one run.

    python bench/bench_batch.py [--out DIR] [--models qwen3-0.6b,qwen3-4b] [--batches 1,2,4,...,256]
    python bench/bench_batch.py --device cpu --tiny --batches 1,4 --peer-batches 1,4 --peer-eager  # CPU smoke

For each model (random weights, bf16) ONE engine is built for the largest batch (its decode graphs have
buckets 1, 2, 4, ..., 256) and warmed up (Engine.warm_up); every batch size runs on it in turn:
  B requests of distinct random prompts (prompt-len tokens, so the prefix cache shares nothing), greedy,
  ignore_eos, output-len tokens each, no tokenizer.
  decode tok/s   B x decode steps / their time, over the steps in which all B sequences decode (every
                 prefill done, none finished); each Engine.step() timed on the host; the median too.
  e2e tok/s      all output tokens / wall time from adding the requests to the last one finished.
  roofline       B x bandwidth / (weights + B x KV bytes of one sequence at its mean cached length while
                 decoding, prompt-len + output-len / 2), the copy bandwidth measured at the start.
The peer (bench/peer.py, static KV cache for the batch, its greedy step under torch.compile
reduce-overhead fullgraph) prefills B prompts at once and times output-len decode steps after 3 warm-up
ones, at the same positions: peer tok/s = B / the median step time.
A failure in one part is printed and recorded and the run goes on. Raw numbers go to
DIR/bench_batch.json (DIR: --out, else $OUT, else ./bench_out), rewritten after each model; the table
is printed last, also when --budget-s runs out or SIGTERM arrives.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tileinfer.engine.config import EngineConfig, torch_dtype  # noqa: E402
from tileinfer.engine.engine import Engine  # noqa: E402
from tileinfer.engine.kv.budget import kv_bytes_per_token  # noqa: E402
from tileinfer.engine.models.loader import LoadedModel  # noqa: E402
from tileinfer.engine.models.random_model import SHAPES  # noqa: E402
from tileinfer.engine.models.shape import ModelSpec  # noqa: E402
from tileinfer.engine.sampling.params import SamplingParams  # noqa: E402

from bench import limits  # noqa: E402
from bench.bench_engine import (  # noqa: E402
    DISPLAY_NAMES,
    attempt,
    begin_model,
    chosen_models,
    free_memory,
    log,
    model_parser,
    random_prompt,
    run_models,
    step_summary,
    tileinfer_then_peer,
    timed_build,
)
from bench.peer import PeerModel, compile_greedy_step, greedy_step  # noqa: E402

PEER_WARMUP_STEPS = 3  # the compiled step compiles on the 1st call; CUDA graph trees record on the 2nd/3rd


@dataclasses.dataclass
class Settings:
    device: torch.device
    dtype: torch.dtype
    tiny: bool
    batches: list[int]
    peer_batches: list[int]
    prompt_len: int
    output_len: int
    max_num_batched_tokens: int
    peer_compiled: bool
    compile_backend: str
    budget_s: float  # past this (since start), remaining heavy parts are skipped (bench_engine.attempt)
    quantization: str | None = None  # EngineConfig.quantization; the peer keeps the dtype
    persistent_decode: bool = False  # EngineConfig.persistent_decode
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def over_budget(self) -> bool:
        return time.perf_counter() - self.started > self.budget_s


def batch_roofline(
    spec: ModelSpec,
    bandwidth: float,
    batch: int,
    cached: int,
    dtype: torch.dtype,
    quantization: str | None = None,
) -> float:
    """Tokens per second if a step of `batch` sequences took only the time to read every weight once and
    each sequence's KV cache of `cached` positions (BENCH.md; limits.decode_roofline at batch 1)."""
    weights = limits.weight_bytes(spec, dtype, quantization)
    return batch * bandwidth / (weights + batch * cached * kv_bytes_per_token(spec, dtype))


def each_batch(
    record: dict[str, Any],
    batches: list[int],
    settings: Settings,
    measure: Callable[[int], dict[str, Any]],
    line: Callable[[int, dict[str, Any]], str],
) -> None:
    """record["batches"][batch] = measure(batch) for each batch size, under attempt, and line(batch, result)
    logged for each that measured."""
    record["batches"] = {}
    for batch in batches:
        if result := attempt(record["batches"], str(batch), settings, functools.partial(measure, batch)):
            log(line(batch, result))


# --- TileInfer ----------------------------------------------------------------------------------


def build_engine(name: str, spec: ModelSpec, weights: dict[str, torch.Tensor], settings: Settings) -> Engine:
    """One engine for every batch size: room for the largest batch's sequences at full length."""
    max_batch = max(settings.batches)
    per_sequence = settings.prompt_len + settings.output_len + 16  # + a block of slack
    config = EngineConfig(
        device=str(settings.device),
        dtype=str(settings.dtype).removeprefix("torch."),
        max_model_len=min(max(1024, per_sequence), spec.max_position_embeddings),
        kv_cache_tokens=-(-max_batch * per_sequence // 1024) * 1024,
        max_num_seqs=max_batch,
        max_num_batched_tokens=settings.max_num_batched_tokens,  # several whole prompts per prefill step
        quantization=settings.quantization,
        persistent_decode=settings.persistent_decode,
    )
    # tokenizer=None: no detokenization in the timed steps
    model = LoadedModel(name=name, source=Path("random"), spec=spec, weights=weights, tokenizer=None)
    return Engine(model, config)


def engine_batch(engine: Engine, spec: ModelSpec, batch: int, settings: Settings) -> dict[str, Any]:
    """Run `batch` fresh requests to the end, timing every step; free everything after."""
    generator = torch.Generator().manual_seed(1000 + batch)
    prompts = [random_prompt(generator, spec.vocab_size, settings.prompt_len) for _ in range(batch)]
    params = SamplingParams(max_tokens=settings.output_len, temperature=0.0, ignore_eos=True)
    scheduler = engine.scheduler
    decode_times: list[float] = []
    other_times: list[float] = []  # steps with a prefill in them, or with fewer than all sequences
    num_output_tokens = 0
    request_ids: list[str] = []
    try:
        limits.synchronize(settings.device)
        started = time.perf_counter()
        request_ids = [engine.add_request(prompt, params) for prompt in prompts]
        all_decoding_at = None
        while engine.has_unfinished():
            # all sequences admitted and past their prompts: a pure decode step (with run-ahead a sequence's
            # newest token may still be in flight, not yet among its tokens)
            all_decoding = (
                not scheduler.waiting
                and len(scheduler.running) == batch
                and all(seq.num_computed_tokens >= seq.num_prompt_tokens for seq in scheduler.running)
            )
            if all_decoding and all_decoding_at is None:
                all_decoding_at = time.perf_counter() - started
            step_started = time.perf_counter()
            outputs = engine.step()
            (decode_times if all_decoding else other_times).append(time.perf_counter() - step_started)
            num_output_tokens += sum(len(output.new_token_ids) for output in outputs)
        limits.synchronize(settings.device)
        wall_s = time.perf_counter() - started
    finally:
        for request_id in request_ids:
            engine.abort(request_id)  # only after a failure: finished requests are gone already
        engine.block_manager.reset_prefix_cache()  # each batch size starts from an empty cache
    if not decode_times:
        raise RuntimeError(f"no step decoded all {batch} sequences (output-len too short?)")
    decode = step_summary(decode_times, tokens_per_step=batch)
    return {
        "decode_tok_s": decode["mean_tok_s"],  # B x decode steps / their time
        "median_decode_step_ms": 1e3 * decode["median_step_s"],
        "median_decode_tok_s": decode["tok_s"],  # B / the median step
        "num_decode_steps": len(decode_times),
        "e2e_tok_s": num_output_tokens / wall_s,
        "wall_s": wall_s,
        "num_output_tokens": num_output_tokens,
        "all_decoding_after_s": all_decoding_at,  # when the last prefill was done
        "num_other_steps": len(other_times),  # prefill or mixed steps, and the ragged end
        "median_other_step_ms": 1e3 * statistics.median(other_times) if other_times else None,
        "decode_step_times_s": decode_times,
    }


def bench_tileinfer(
    record: dict[str, Any], name: str, spec: ModelSpec, weights: dict[str, torch.Tensor], settings: Settings
) -> None:
    engine = timed_build(record, settings, lambda: build_engine(name, spec, weights, settings))
    if engine is None:
        return
    built_s = record["build"]["seconds"]
    warm_up_s = engine.warm_up()  # compiles the eager paths (prefill sampling) before anything is timed
    record["build"].update(warm_up_s=warm_up_s, config=dataclasses.asdict(engine.config))
    log(f"  TileInfer engine built in {built_s:.1f} s, warmed up in {warm_up_s:.1f} s")
    each_batch(
        record, settings.batches, settings, lambda batch: engine_batch(engine, spec, batch, settings),
        lambda batch, result: f"  TileInfer batch {batch:4d}  decode {result['decode_tok_s']:10,.0f} tok/s "
        f"(median step {result['median_decode_step_ms']:.2f} ms)  e2e {result['e2e_tok_s']:10,.0f} tok/s",
    )  # fmt: skip
    # the engine is freed when this returns (bench_model then empties the CUDA cache)


# --- the peer -----------------------------------------------------------------------------------


def peer_batch(peer: PeerModel, spec: ModelSpec, batch: int, settings: Settings) -> dict[str, Any]:
    """Prefill `batch` prompts at once, then time greedy steps (one position per sequence) over the
    positions the engine decodes at; the step compiled afresh for this batch's static cache."""
    device = settings.device
    torch._dynamo.reset()  # a new batch shape: a fresh static graph, not a dynamic-shape recompile
    step_fn = compile_greedy_step(settings.compile_backend) if settings.peer_compiled else greedy_step
    generator = torch.Generator().manual_seed(2000 + batch)
    prompts = [random_prompt(generator, spec.vocab_size, settings.prompt_len) for _ in range(batch)]
    # The cache holds the prompt and every step; the mask row covers all of it (as in gpt-fast).
    peer.setup_cache(batch=batch, max_len=-(-(settings.prompt_len + settings.output_len) // 64) * 64)
    with torch.no_grad():
        token = peer.prefill(torch.tensor(prompts, device=device)).argmax(dim=-1, keepdim=True)  # [B, 1]
        input_pos = torch.full((batch,), settings.prompt_len, device=device)  # each sequence's position

        def one_step() -> None:
            nonlocal token
            if settings.peer_compiled:
                torch.compiler.cudagraph_mark_step_begin()
            token = step_fn(peer, token, input_pos).clone()  # the graph's output buffer is reused
            input_pos.add_(1)

        limits.synchronize(device)
        started = time.perf_counter()
        one_step()  # compiles when compiled
        limits.synchronize(device)
        first_step_s = time.perf_counter() - started
        for _ in range(PEER_WARMUP_STEPS - 1):
            one_step()
        step_times = limits.time_each(one_step, settings.output_len - PEER_WARMUP_STEPS, device)
    summary = step_summary(step_times, tokens_per_step=batch)
    return {
        "tok_s": summary["tok_s"],  # B / the median step
        "median_step_ms": 1e3 * summary["median_step_s"],
        "mean_tok_s": summary["mean_tok_s"],
        "num_steps": len(step_times),
        "cache_len": peer.max_len,
        "first_step_s": first_step_s,  # includes torch.compile when compiled
        "compiled": settings.peer_compiled,
        "step_times_s": step_times,
    }


def bench_peer(
    record: dict[str, Any], spec: ModelSpec, weights: dict[str, torch.Tensor], settings: Settings
) -> None:
    peer = attempt(record, "build", settings, lambda: PeerModel(spec, weights))
    if peer is None:
        return
    record["build"] = {"compiled": settings.peer_compiled, "backend": settings.compile_backend}

    def measure(batch: int) -> dict[str, Any]:
        try:
            return peer_batch(peer, spec, batch, settings)
        finally:
            peer.setup_cache(batch=1, max_len=64)  # drop this batch's cache before the next one's
            torch._dynamo.reset()
            free_memory()

    each_batch(
        record, settings.peer_batches, settings, measure,
        lambda batch, result: f"  peer batch {batch:4d}  {result['tok_s']:10,.0f} tok/s (median step "
        f"{result['median_step_ms']:.2f} ms, first step {result['first_step_s']:.1f} s)",
    )  # fmt: skip


# --- the run ------------------------------------------------------------------------------------


def bench_model(record: dict[str, Any], name: str, settings: Settings, bandwidth: float) -> None:
    """Fill record (already in the results, so an interrupted run keeps what it measured)."""
    spec = SHAPES[name]
    cached = settings.prompt_len + settings.output_len // 2  # the mean cached length while decoding
    rooflines = {
        str(batch): batch_roofline(spec, bandwidth, batch, cached, settings.dtype, settings.quantization)
        for batch in sorted({*settings.batches, *settings.peer_batches})
    }
    model_limits = {"mean_cached_positions": cached, "roofline_tok_s": rooflines}
    weights = begin_model(record, name, spec, settings, model_limits)
    if weights is None:
        return
    tileinfer_then_peer(
        lambda: bench_tileinfer(record["tileinfer"], name, spec, weights, settings),
        lambda: bench_peer(record["peer"], spec, weights, settings),
    )


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model and batch size: TileInfer's decode and e2e tok/s, the peer's, the roofline."""

    def value(record: dict[str, Any], key: str) -> float | None:
        found = record.get(key) if isinstance(record, dict) else None
        return found if isinstance(found, int | float) else None

    rows = []
    for record in results["models"]:
        if "limits" not in record:
            continue  # failed before it measured anything
        ours = record["tileinfer"].get("batches", {})
        theirs = record["peer"].get("batches", {})
        for batch, roofline in record["limits"]["roofline_tok_s"].items():
            rows.append(
                {
                    "model": DISPLAY_NAMES.get(record["model"], record["model"]),
                    "batch": int(batch),
                    "decode": value(ours.get(batch, {}), "decode_tok_s"),
                    "e2e": value(ours.get(batch, {}), "e2e_tok_s"),
                    "peer": value(theirs.get(batch, {}), "tok_s"),
                    "roofline": roofline,
                }
            )
    return rows


def print_table(results: dict[str, Any]) -> None:
    def rate(value: float | None) -> str:
        return "—" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"

    bandwidth = results.get("limits", {}).get("copy_bandwidth_bytes_per_s")
    settings = results["settings"]
    backend = settings["compile_backend"]
    peer = (
        "EAGER"
        if not settings["peer_compiled"]
        else "compiled" + (" (reduce-overhead)" if backend == "inductor" else f" (backend {backend})")
    )
    log(
        f"\nbatch workload: {settings['prompt_len']}-token prompts, {settings['output_len']} output tokens, "
        f"greedy, {results['dtype']}{', INT8 weights' if settings.get('quantization') else ''}, "
        f"{results['gpu']}; torch {results['versions']['torch']}, "
        f"triton {results['versions']['triton']}; peer {peer}"
    )
    if bandwidth:
        log(
            f"copy bandwidth in this run {bandwidth / 1e12:.2f} TB/s; "
            "% of roofline: TileInfer decode / roofline"
        )
    log(
        "| workload | model | batch | TileInfer decode tok/s | e2e tok/s | peer tok/s | TileInfer/peer "
        "| roofline tok/s | % of roofline |"
    )
    log("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in table_rows(results):
        ours, theirs, roofline = row["decode"], row["peer"], row["roofline"]
        ratio = f"{ours / theirs:.2f}x" if ours and theirs else "—"
        percent = f"{100 * ours / roofline:.1f} %" if ours and roofline else "—"
        log(
            f"| batch | {row['model']} | {row['batch']} | {rate(ours)} | {rate(row['e2e'])} | {rate(theirs)} "
            f"| {ratio} | {rate(roofline)} | {percent} |"
        )


def parse_settings() -> tuple[Settings, list[str], Path]:
    parser = model_parser(__doc__)

    def sizes(text: str) -> list[int]:  # "" (or "none"): no sizes, e.g. no peer
        return [int(size) for size in text.split(",") if size and size != "none"]

    parser.add_argument("--batches", type=sizes, default=None, help="default 1,2,4,...,256 (tiny: 1,2,4)")
    parser.add_argument("--peer-batches", type=sizes, default=None, help="default 1,8,64,256 (tiny: 1,4)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 512 (tiny: 32)")
    parser.add_argument("--output-len", type=int, default=None, help="default 128 (tiny: 8)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the engine's step budget")
    parser.add_argument("--peer-eager", action="store_true", help="the peer uncompiled (the CPU smoke)")
    parser.add_argument("--compile-backend", default="inductor", help="inductor = reduce-overhead mode")
    parser.add_argument("--budget-s", type=float, default=540.0, help="skip parts that start after this")
    parser.add_argument(
        "--quantization",
        choices=["int8"],
        default=None,
        help="TileInfer's weights (the peer keeps the dtype)",
    )
    parser.add_argument(
        "--persistent-decode", action="store_true", help="one-sequence steps in the persistent kernel"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for the JSON")
    args = parser.parse_args()
    if args.tiny:
        models, batches, peer_batches, prompt_len, output_len = "tiny", [1, 2, 4], [1, 4], 32, 8
    else:
        models, batches, peer_batches = "qwen3-0.6b,qwen3-4b", [2**i for i in range(9)], [1, 8, 64, 256]
        prompt_len, output_len = 512, 128
    model_names = chosen_models(parser, args, models)
    settings = Settings(
        device=torch.device(args.device),
        dtype=torch_dtype(args.dtype),
        tiny=args.tiny,
        batches=args.batches or batches,
        peer_batches=args.peer_batches if args.peer_batches is not None else peer_batches,
        prompt_len=args.prompt_len or prompt_len,
        output_len=args.output_len or output_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        peer_compiled=not args.peer_eager,
        compile_backend=args.compile_backend,
        budget_s=args.budget_s,
        quantization=args.quantization,
        persistent_decode=args.persistent_decode,
    )
    if settings.output_len <= PEER_WARMUP_STEPS + 1:
        parser.error(f"--output-len must exceed {PEER_WARMUP_STEPS + 1} (the peer's warm-up steps)")
    return settings, model_names, Path(args.out)


def main() -> None:
    settings, model_names, out_dir = parse_settings()

    def bench(record: dict[str, Any], name: str, measured: dict[str, Any]) -> None:
        bench_model(record, name, settings, measured["copy_bandwidth_bytes_per_s"])

    run_models(settings, model_names, out_dir / "bench_batch.json", bench, print_table)


if __name__ == "__main__":
    main()
