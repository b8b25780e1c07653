"""serve-load (issue #15 item 6): closed-loop streaming load on an OpenAI-compatible server, against the
same engine driven in process (engine-direct).

    python bench/serve_load.py --url http://127.0.0.1:8000 [--concurrency 1,8,64,256]
    python bench/serve_load.py --engine-direct --model qwen3-0.6b --dtype bfloat16
    python bench/serve_load.py --serve-config serve_config.yaml --model qwen3-0.6b [--out DIR]

Each of C clients streams `/v1/completions` with a prompt of token ids (--prompt-tokens random ids from
a seeded RNG in --vocab LOW:HIGH, default the Qwen3 tokenizer's ordinary tokens within the model's
vocabulary), --output-tokens tokens, ignore_eos, temperature 0, and sends its next request when the
previous one ends, until --requests (default max(4 C, 32)) have run. Tokens are counted by the
completion's usage (stream_options.include_usage); TTFT is from sending to the first event that
carries a choice, TPOT per request (last event - first event) / (tokens - 1), so a server that sends
several tokens per event is timed by when its tokens arrive. Errors: HTTP statuses other than 200, and
in-band SSE error events.

engine-direct: an Engine built in this process (tokenizer attached, detokenizing, the serve config's
engine settings) runs the same prompts in the same closed loop, C requests in flight, through
Engine.add_request / Engine.step; its TTFT is from add_request to the step that returned the first token.

--serve-config starts Ray on 127.0.0.1 and `serve run` (the `serve` script, else `python -m
ray.serve.scripts run`) on a copy of the config (its first application's args, with --model and the
sizes below written in), waits for /health, runs the load, stops that Ray cluster (only that one: its
head runs with --block), then runs engine-direct with the same args in this process (the GPU is free
again) and prints both, with HTTP/engine-direct ratios.
--model: a model_shapes name other than the default smollm2-135m becomes a folder of random weights of
that shape with the real Qwen3 tokenizer (tests/assets.py); anything else is passed on as given.
--restart then starts the app once more (Triton's kernels cached by then) to time a restart; the first
start's and the restart's times to a healthy app are in the JSON (ready_s), as are the TTFTs of the
first 8 requests after ready and of the same 8 once warm (first_requests). --client-processes spreads a
level's clients over several processes. Results as JSON in --out (default $OUT, else bench_out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN3_ORDINARY_TOKENS = 151643  # ids below are the Qwen3 tokenizer's ordinary (non-special) tokens


# --- prompts and results ------------------------------------------------------------------------


def make_prompts(count: int, length: int, vocab: tuple[int, int], seed: int | str) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(*vocab) for _ in range(length)] for _ in range(count)]


def _percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def summarize(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """records: per request {ttft_s, tpot_s, tokens, error}."""
    good = [record for record in records if record["error"] is None]
    ttfts = [record["ttft_s"] for record in good]
    tpots = [record["tpot_s"] for record in good if record["tpot_s"] is not None]
    tokens = sum(record["tokens"] for record in good)
    ms = {name: (value * 1e3 if value is not None else None) for name, value in (
        ("ttft_p50_ms", _percentile(ttfts, 0.5)), ("ttft_p99_ms", _percentile(ttfts, 0.99)),
        ("tpot_p50_ms", _percentile(tpots, 0.5)), ("tpot_p99_ms", _percentile(tpots, 0.99)),
    )}  # fmt: skip
    errors = [record["error"] for record in records if record["error"] is not None]
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "req_s": len(good) / wall_s if wall_s > 0 else 0.0,
        **ms,
        "errors": len(errors),
        "first_errors": errors[:3],
        "ttft_mean_ms": 1e3 * sum(ttfts) / len(ttfts) if ttfts else None,
    }


ENGINE_TTFT = "tileinfer_time_to_first_token_seconds"


def engine_ttft_totals(base_url: str) -> tuple[float, float] | None:
    """(sum, count) of the engine's own time-to-first-token histogram (from the request's arrival at
    the engine loop), from the server's /metrics; None from a server that has none."""
    import httpx

    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    totals = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        name = name.split("{", 1)[0]
        if name in (ENGINE_TTFT + "_sum", ENGINE_TTFT + "_count"):
            totals[name] = totals.get(name, 0.0) + float(value)
    if len(totals) < 2:
        return None
    return totals[ENGINE_TTFT + "_sum"], totals[ENGINE_TTFT + "_count"]


def with_engine_ttft(summary: dict[str, Any], before: tuple | None, after: tuple | None) -> dict[str, Any]:
    """The level's mean TTFT inside the engine (its /metrics, after less before) beside the clients':
    what the HTTP path adds is the difference."""
    if before is not None and after is not None and after[1] > before[1]:
        summary["engine_ttft_mean_ms"] = 1e3 * (after[0] - before[0]) / (after[1] - before[1])
    return summary


def _record(start: float, first: float | None, last: float | None, tokens: int, error: str | None) -> dict:
    if error is None and (first is None or tokens == 0):
        error = "no tokens"
    tpot = (last - first) / (tokens - 1) if error is None and tokens > 1 else None
    return {"ttft_s": first - start if first is not None else None, "tpot_s": tpot, "tokens": tokens,
            "error": error}  # fmt: skip


# --- HTTP -----------------------------------------------------------------------------------------


async def _stream_one(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    first = last = None
    tokens, error = 0, None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return _record(start, None, None, 0, f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    error = f"in-band: {event['error'].get('message')}"
                    continue
                if event.get("choices"):
                    last = time.perf_counter()
                    first = first if first is not None else last
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except Exception as failure:  # noqa: BLE001 - a broken connection counts as an error
        error = f"{type(failure).__name__}: {failure}"
    if error is None and tokens == 0:
        error = "no usage chunk"
    return _record(start, first, last, tokens, error)


async def http_records(
    base_url: str, model: str, prompts: list[list[int]], concurrency: int, output_tokens: int
) -> tuple[list[dict[str, Any]], float, float]:
    """Per-request records, and when the level began and ended (time.monotonic: one clock for every
    process of the machine)."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    pending = iter(prompts)
    records: list[dict[str, Any]] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        for prompt in pending:  # a shared iterator: each client takes the next prompt when it is free
            body = {
                "model": model, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            }  # fmt: skip
            records.append(await _stream_one(client, url, body))

    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=60), limits=limits) as client:
        start = time.monotonic()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        end = time.monotonic()
    return records, start, end


def _client_process(job: tuple[str, str, list[list[int]], int, int]) -> tuple[list[dict], float, float]:
    return asyncio.run(http_records(*job))


def http_level(
    base_url: str, model: str, prompts: list[list[int]], concurrency: int, output_tokens: int, processes: int
) -> dict[str, Any]:
    """The clients of one level, spread over `processes` client processes (each its own event loop), so
    that parsing every server-sent event does not bound what is measured."""
    processes = max(1, min(processes, concurrency))
    before = engine_ttft_totals(base_url)
    if processes == 1:
        records, start, end = asyncio.run(http_records(base_url, model, prompts, concurrency, output_tokens))
        return with_engine_ttft(summarize(records, end - start), before, engine_ttft_totals(base_url))
    import concurrent.futures
    import multiprocessing

    jobs = [
        (base_url, model, prompts[index::processes], len(range(index, concurrency, processes)), output_tokens)
        for index in range(processes)
    ]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        parts = list(pool.map(_client_process, jobs))
    records = [record for part in parts for record in part[0]]
    summary = summarize(records, max(part[2] for part in parts) - min(part[1] for part in parts))
    return with_engine_ttft(summary, before, engine_ttft_totals(base_url))


def served_model(base_url: str) -> str:
    import httpx

    return httpx.get(base_url.rstrip("/") + "/v1/models", timeout=60).json()["data"][0]["id"]


FIRST_REQUESTS = 8  # sent together right after the server is ready, and again once it is warm


def run_http(
    base_url: str, args: argparse.Namespace, vocab: tuple[int, int], meta: dict[str, Any]
) -> dict[int, dict[str, Any]]:
    """The levels; before them the first requests after ready, and after them the same ones warm (their
    TTFT p50 in meta["first_requests"])."""
    model = served_model(base_url)
    first = make_prompts(FIRST_REQUESTS, args.prompt_tokens, vocab, seed=args.seed + 1)
    cold = http_level(base_url, model, first, FIRST_REQUESTS, args.output_tokens, 1)
    results = {}
    for concurrency in args.concurrency:
        prompts = level_prompts(args, concurrency, vocab)
        _mark(args, f"http-C={concurrency}")
        results[concurrency] = http_level(
            base_url, model, prompts, concurrency, args.output_tokens, args.client_processes
        )
        _log(f"http C={concurrency}: {_brief(results[concurrency])}")
    _mark(args, "http-warm-requests")
    warm = http_level(base_url, model, first, FIRST_REQUESTS, args.output_tokens, 1)
    meta["first_requests"] = {
        "requests": FIRST_REQUESTS, "after_ready_ttft_p50_ms": cold["ttft_p50_ms"],
        "warm_ttft_p50_ms": warm["ttft_p50_ms"], "after_ready": cold, "warm": warm,
    }  # fmt: skip
    _log(f"first {FIRST_REQUESTS} requests after ready: TTFT p50 {_ms(cold['ttft_p50_ms'])}, "
         f"the same warm: {_ms(warm['ttft_p50_ms'])}")  # fmt: skip
    return results


# --- engine-direct --------------------------------------------------------------------------------


def engine_level(
    engine: Any,
    prompts: list[list[int]],
    concurrency: int,
    output_tokens: int,
    step: Callable[[], list] | None = None,
) -> dict[str, Any]:
    """step: what runs one engine step (default engine.step; bench/profile_steps.py times it)."""
    from engine.sampling import SamplingParams

    step = step or engine.step
    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    pending = iter(prompts)
    state: dict[str, list] = {}  # request_id -> [start, first, last, tokens]
    records: list[dict[str, Any]] = []

    def add_next() -> None:
        prompt = next(pending, None)
        if prompt is not None:
            state[engine.add_request(prompt, params)] = [time.perf_counter(), None, None, 0]

    start = time.perf_counter()
    for _ in range(concurrency):
        add_next()
    while state:
        outputs = step()
        now = time.perf_counter()
        for output in outputs:
            entry = state[output.request_id]
            entry[1] = entry[1] if entry[1] is not None else now
            entry[2] = now
            entry[3] += len(output.new_token_ids)
            if output.finished:
                del state[output.request_id]
                records.append(_record(entry[0], entry[1], entry[2], entry[3], None))
                add_next()
    return summarize(records, time.perf_counter() - start)


def run_engine_direct(app_args: Any, args: argparse.Namespace, vocab: tuple[int, int]) -> dict[int, dict]:
    import torch

    from engine.engine import Engine
    from engine.loader import load_model

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = app_args.dtype if app_args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    config = app_args.engine_config(device, dtype)
    engine = Engine(
        load_model(app_args.model, dtype=config.torch_dtype(), device=config.torch_device()), config
    )
    warm_up = getattr(engine, "warm_up", None)
    if warm_up is not None:  # as the engine deployment does before it serves
        warm_up()
    engine_level(
        engine, make_prompts(2, args.prompt_tokens, vocab, seed=args.seed + 1), 1, args.output_tokens
    )
    results = {}
    for concurrency in args.concurrency:
        prompts = level_prompts(args, concurrency, vocab)
        results[concurrency] = engine_level(engine, prompts, concurrency, args.output_tokens)
        _log(f"engine-direct C={concurrency}: {_brief(results[concurrency])}")
    return results


# --- models and serve run ---------------------------------------------------------------------------


def model_source(name: str, dtype: str) -> str:
    """A model_shapes shape (not the real default model) as a folder of random weights with the Qwen3
    tokenizer, written once under the cache; anything else as given."""
    from bench.model_shapes import MODELS, random_weights
    from engine.default_model import DEFAULT_MODEL_ALIAS, cache_dir

    if name == DEFAULT_MODEL_ALIAS or name not in MODELS:
        return name
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "tests"))
    from assets import qwen3_tokenizer_dir

    spec = MODELS[name]
    storage = "bfloat16" if dtype in ("auto", "bfloat16") else dtype
    folder = cache_dir() / "bench-models" / f"{name}-random-{storage}"
    if (folder / "model.safetensors").is_file():
        return str(folder)
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    config = {
        "architectures": ["Qwen3ForCausalLM" if spec.family == "qwen3" else "LlamaForCausalLM"],
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings, "bos_token_id": spec.bos_token_id,
        "eos_token_id": list(spec.eos_token_ids),
    }  # fmt: skip
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    weights = random_weights(spec, getattr(torch, storage), "cpu")
    save_file({key: value.contiguous() for key, value in weights.items()}, str(staging / "model.safetensors"))
    for path in qwen3_tokenizer_dir().iterdir():
        shutil.copy(path, staging / path.name)
    staging.rename(folder)
    return str(folder)


def _ray_cli(name: str) -> list[str]:
    """`ray` / `serve`, or their modules where the console scripts are missing (the GPU machine)."""
    script = Path(sys.executable).parent / name
    module = {"ray": "ray.scripts.scripts", "serve": "ray.serve.scripts"}[name]
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def start_serve(
    config_path: Path, env: dict[str, str], log: Path, ray_port: int, http_port: int
) -> list[subprocess.Popen]:
    """Ray's head on 127.0.0.1 (--block: stopping that process stops this cluster only, where `ray stop`
    would stop every cluster on a shared machine), then `serve run`; both processes, head first. Refuses
    when something listens on either port already: a run cut short can leave its app serving there, and
    the load would then measure that one."""
    from deployments.launch import listening

    for port in (ray_port, http_port):
        if listening(port):
            raise RuntimeError(f"port {port} on 127.0.0.1 is in use already (an earlier run's app?)")
    with log.open("w") as log_file:
        head = subprocess.Popen(
            [*_ray_cli("ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
             f"--port={ray_port}", "--disable-usage-stats", "--include-dashboard=false"],
            env=env, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", ray_port), timeout=1).close()
            break
        except OSError:
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start failed:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.5)
    with log.open("a") as log_file:
        serve = subprocess.Popen(
            [*_ray_cli("serve"), "run", "--address", f"127.0.0.1:{ray_port}", str(config_path)],
            env=env, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return [head, serve]


def stop_serve(processes: list[subprocess.Popen]) -> None:
    for process in reversed(processes):  # serve run, then the head (it stops its cluster's processes)
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def wait_healthy(base_url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"serve run exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(
        f"the application did not become healthy in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}"
    )


def app_args_for(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """The serve config (parsed) and its first application's args, with --model and the sizes in."""
    import yaml

    from deployments.config import parse_app_args

    config = yaml.safe_load(Path(args.serve_config or ROOT / "serve_config.yaml").read_text())
    raw = dict(config["applications"][0].get("args") or {})
    if args.model is not None:
        raw["model"] = model_source(args.model, args.dtype)
        raw["served_model_name"] = args.model
    if args.dtype != "auto":
        raw["dtype"] = args.dtype
    if args.device != "auto":
        raw["device"] = args.device
    for key in ("max_num_seqs", "max_model_len", "kv_cache_tokens"):
        if getattr(args, key) is not None:
            raw[key] = getattr(args, key)
    if args.ingress_replicas is not None:
        raw["num_ingress_replicas"] = args.ingress_replicas
    if args.stream_events_per_s is not None:
        raw["max_stream_events_per_s"] = args.stream_events_per_s
    config["applications"] = [{**config["applications"][0], "args": raw}]
    return config, parse_app_args(raw)


# --- output -------------------------------------------------------------------------------------------


def _num_requests(args: argparse.Namespace, concurrency: int) -> int:
    return args.requests or max(4 * concurrency, 32)


def level_prompts(args: argparse.Namespace, concurrency: int, vocab: tuple[int, int]) -> list[list[int]]:
    """A level's prompts, its own: with one seed for all, each level began with the earlier levels'
    prompts, whose KV the prefix cache still held."""
    seed = f"{args.seed}:{concurrency}"
    return make_prompts(_num_requests(args, concurrency), args.prompt_tokens, vocab, seed)


def _mark(args: argparse.Namespace, phase: str) -> None:
    """With --marks FILE: a line "<unix time> <phase>" where a phase begins (bench/cpu_sampler.py)."""
    if args.marks:
        with open(args.marks, "a") as file:
            file.write(f"{time.time():.3f} {phase}\n")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _brief(result: dict[str, Any]) -> str:
    tpot = _ms(result["tpot_p50_ms"])
    brief = f"{result['output_tok_s']:.1f} tok/s, TPOT p50 {tpot}, errors {result['errors']}"
    if result.get("engine_ttft_mean_ms") is not None:  # the HTTP path's share of the TTFT
        brief += (
            f"; TTFT mean {_ms(result['ttft_mean_ms'])}, in the engine {_ms(result['engine_ttft_mean_ms'])}"
        )
    return brief


def _ms(value: float | None) -> str:
    return f"{value:.2f} ms" if value is not None else "-"


def print_table(results: dict[str, dict[int, dict[str, Any]]]) -> None:
    print("| clients | path | output tok/s | req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    levels = sorted({level for by_level in results.values() for level in by_level})
    for level in levels:
        for path, by_level in results.items():
            if level in by_level:
                row = by_level[level]
                print(
                    f"| {level} | {path} | {row['output_tok_s']:.1f} | {row['req_s']:.2f} | "
                    f"{_ms(row['ttft_p50_ms'])} | {_ms(row['ttft_p99_ms'])} | {_ms(row['tpot_p50_ms'])} | "
                    f"{_ms(row['tpot_p99_ms'])} | {row['errors']} |"
                )
    if "http" in results and "engine-direct" in results:
        print("\n| clients | HTTP / engine-direct tok/s | TPOT p50 ratio | TTFT p50 difference |")
        print("| --- | --- | --- | --- |")
        for level in levels:
            http, direct = results["http"].get(level), results["engine-direct"].get(level)
            if http is None or direct is None:
                continue
            tok = http["output_tok_s"] / direct["output_tok_s"] if direct["output_tok_s"] else float("nan")
            tpot = (http["tpot_p50_ms"] or float("nan")) / (direct["tpot_p50_ms"] or float("nan"))
            ttft = (http["ttft_p50_ms"] or float("nan")) - (direct["ttft_p50_ms"] or float("nan"))
            print(f"| {level} | {tok:.3f} | {tpot:.3f} | {ttft:+.2f} ms |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--url", help="load this running server")
    mode.add_argument("--engine-direct", action="store_true", help="the in-process reference only")
    mode.add_argument("--serve-config", help="serve run this config, load it, then engine-direct")
    parser.add_argument("--model", default=None, help="default: the serve config's (smollm2-135m)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--concurrency", default="1,8,64,256", type=lambda text: [int(v) for v in text.split(",")]
    )
    parser.add_argument("--requests", type=int, default=None, help="per level; default max(4 C, 32)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--vocab", default=None, help="LOW:HIGH prompt ids; default 0:min(151643, vocab)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the largest concurrency")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: prompt + output tokens")
    parser.add_argument("--kv-cache-tokens", type=int, default=None, help="default: what max_num_seqs need")
    parser.add_argument("--health-timeout", type=float, default=900)
    parser.add_argument("--client-processes", type=int, default=1, help="client processes per level")
    parser.add_argument("--ingress-replicas", type=int, default=None, help="num_ingress_replicas")
    parser.add_argument("--stream-events-per-s", type=float, default=None, help="max_stream_events_per_s")
    parser.add_argument("--restart", action="store_true", help="then serve run once more: restart time")
    parser.add_argument("--no-engine-direct", action="store_true", help="with --serve-config: HTTP only")
    parser.add_argument("--ray-port", type=int, default=6390)
    parser.add_argument("--marks", default=None, help="append where each phase begins (bench/cpu_sampler.py)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args(argv)
    if args.max_num_seqs is None and not args.url:
        args.max_num_seqs = max(args.concurrency)
    if args.max_model_len is None and not args.url:
        args.max_model_len = args.prompt_tokens + args.output_tokens + 16
    if args.kv_cache_tokens is None and not args.url:
        args.kv_cache_tokens = args.max_num_seqs * args.max_model_len
    return args


def _vocab(args: argparse.Namespace, model_vocab: int | None) -> tuple[int, int]:
    if args.vocab:
        low, high = (int(part) for part in args.vocab.split(":"))
        return low, high
    return 0, min(QWEN3_ORDINARY_TOKENS, model_vocab or QWEN3_ORDINARY_TOKENS)


def _exit_on_sigterm() -> None:
    """`timeout` stops a run with SIGTERM: exit through the finally blocks, which stop the app."""
    import signal

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[int, dict[str, Any]]] = {}
    meta: dict[str, Any] = {"args": vars(args)}
    if args.url:
        import httpx

        info = httpx.get(args.url.rstrip("/") + "/v1/models", timeout=60).json()["data"][0]
        vocab = _vocab(args, None)
        results["http"] = run_http(args.url, args, vocab, meta)
        meta["model"] = info["id"]
    else:
        import yaml

        config, app_args = app_args_for(args)
        meta["app_args"] = app_args.model_dump()
        vocab = _vocab(args, _model_vocab(app_args.model))
        if args.serve_config:
            config_path = out / "serve_load_config.yaml"
            config_path.write_text(yaml.safe_dump(config))
            http = config.get("http_options") or {}
            http_port = int(http.get("port", 8000))
            base_url = f"http://{http.get('host', '127.0.0.1')}:{http_port}"
            base_url += (config["applications"][0].get("route_prefix") or "/").rstrip("/")
            # the project first, then whatever the caller's path holds (the GPU machine's wheels: Ray)
            python_path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
            from deployments.launch import RAY_ENV, SERVE_ENV

            env = {**SERVE_ENV, **os.environ, **RAY_ENV, "PYTHONPATH": python_path}  # as `make run`'s
            log = out / "serve_load_serve.log"
            started = time.monotonic()
            processes = start_serve(config_path, env, log, args.ray_port, http_port)
            try:
                wait_healthy(base_url, processes[1], log, args.health_timeout)
                meta["ready_s"] = {"first_start": time.monotonic() - started}
                _log(f"serve run ready in {meta['ready_s']['first_start']:.1f} s")
                results["http"] = run_http(base_url, args, vocab, meta)
            finally:
                stop_serve(processes)
            if args.restart:  # the same app again: Triton's kernels come from its cache this time
                started = time.monotonic()
                processes = start_serve(
                    config_path, env, out / "serve_load_restart.log", args.ray_port, http_port
                )
                try:
                    wait_healthy(base_url, processes[1], out / "serve_load_restart.log", args.health_timeout)
                    meta["ready_s"]["restart"] = time.monotonic() - started
                    _log(f"serve run ready again in {meta['ready_s']['restart']:.1f} s")
                finally:
                    stop_serve(processes)
        if not args.no_engine_direct:
            results["engine-direct"] = run_engine_direct(app_args, args, vocab)
    meta["vocab"] = vocab
    payload = {
        **meta,
        "results": {path: {str(k): v for k, v in rows.items()} for path, rows in results.items()},
    }
    (out / "serve_load.json").write_text(json.dumps(payload, indent=2, default=str))
    if "ready_s" in meta or "first_requests" in meta:
        first = meta.get("first_requests", {})
        print(f"ready: {json.dumps({k: round(v, 1) for k, v in meta.get('ready_s', {}).items()})}; first "
              f"{FIRST_REQUESTS} requests TTFT p50 after ready {_ms(first.get('after_ready_ttft_p50_ms'))}, "
              f"warm {_ms(first.get('warm_ttft_p50_ms'))}")  # fmt: skip
    print_table(results)
    return payload


def _model_vocab(model: str) -> int | None:
    """The model's vocabulary size, from its config.json or GGUF, without loading weights."""
    from engine.loader import resolve_model_source

    source = resolve_model_source(model)
    if source.is_dir():
        from engine.spec import ModelSpec

        return ModelSpec.from_config_file(source / "config.json").vocab_size
    from engine.gguf_loader import read_gguf, spec_from_gguf

    return spec_from_gguf(read_gguf(source)).vocab_size


if __name__ == "__main__":
    _exit_on_sigterm()
    main()
