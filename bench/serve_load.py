"""serve-load: closed-loop streaming load on an OpenAI-compatible server, against the
same engine driven in process (engine-direct).

    python bench/serve_load.py --url http://127.0.0.1:8000 [--concurrency 1,8,64,256]
    python bench/serve_load.py --engine-direct --model qwen3-0.6b --dtype bfloat16
    python bench/serve_load.py --serve-config serve_config.yaml --model qwen3-0.6b [--out DIR]
    python bench/serve_load.py --serve-config serve_config.yaml --model qwen3-0.6b --engine-replicas 2 \
        --workload shared-prefix --compare-routers

Each of C clients streams `/v1/completions` with a prompt of token ids (--prompt-tokens random ids from
a seeded RNG in --vocab LOW:HIGH, default the Qwen3 tokenizer's ordinary tokens within the model's
vocabulary), --output-tokens tokens, ignore_eos, temperature 0, and sends its next request when the
previous one ends, until --requests (default max(R C, 32), R = --requests-per-client, 4: profilers
want longer levels than the 10 s that 256 clients take at R = 4) have run. Tokens are counted by the
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
again) and prints both, with HTTP/engine-direct ratios. The app starts as `make run` starts it
(tileinfer.deployments.launch.launcher: Ray Serve's HAProxy mode where ray[serve] brought HAProxy);
--serve-proxy measures Serve's Python proxy instead, --ray-defaults the app as a plain `serve run
serve_config.yaml` serves it (Serve's proxy in its default mode, its logs on stderr), and --ingress-replicas N
overrides num_ingress_replicas: auto.
--model: a named shape (tileinfer.engine.models.random_model.SHAPES) other than the default smollm2-135m
becomes a folder of random weights of that shape with the real Qwen3 tokenizer (tests/assets.py);
anything else is passed on as given.
--restart then starts the app once more (Triton's kernels cached by then) to time a restart; the first
start's and the restart's times to a healthy app are in the JSON (ready_s), as are the TTFTs of the
first 8 requests after ready and of the same 8 once warm (first_requests). --client-processes spreads a
level's clients over several processes. --runs K runs each level K times in the same app (each run its own
prompts): the tables take the run with the median output tok/s (for an even K the lower middle one) and
the ratio from it; every run's tok/s is in the JSON (BENCH.md asks for the median of three: --runs 3).
Results as JSON in --out (default $OUT, else bench_out); the last table printed is BENCH.md's (workload |
model | TileInfer | peer | ...).

Engine replicas (--serve-config): --engine-replicas N writes num_engine_replicas; on a GPU machine each
replica then takes engine_num_gpus 1/N of the one GPU (ceil(N / GPUs) replicas to a GPU on several), unless
--engine-num-gpus sets it. --engine-router prefix|power_of_two writes engine_router (else the app's
default). Engine-direct stays one engine on the whole GPU. The JSON (serve) and the tables name the engine
replicas, the ingress replicas and Serve's mode (throughput-optimized when serve run's environment has
RAY_SERVE_THROUGHPUT_OPTIMIZED=1, as `make run`'s; else default).

--workload shared-prefix: --conversations conversations of --turns turns. Each conversation has its own
--context-tokens context (seeded random ids), and each turn sends the conversation so far plus
--turn-tokens new random ids; the conversation so far holds the earlier turns' prompts and the ids the
server generated. The completions API returns text, so the turns ask for logprobs (0 alternatives) and
map each token's spelling back to its id with the model's tokenizer (which makes the engine step without
running ahead, for every router alike). --concurrency clients (one value, default all conversations)
each take a conversation and run its turns in order. Turn 1 of every conversation runs first, then turns
2 and on; /metrics is read before, between and after, so that the prefix-hit share of turns 2 and on
(tileinfer_prefix_cache_hit_tokens_total over tileinfer_prompt_tokens_total, in all and per `engine`
label) is theirs alone, beside the router's decisions (tileinfer_router_decisions_total). Reported: TTFT
p50/p99 per turn, and the hit shares. --compare-routers serves the app once per router, one after the
other, and sets the two side by side. No engine-direct run for this workload.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_direct import build_engine, engine_records  # noqa: E402
from bench.load_client import (  # noqa: E402
    brief,
    http_level_records,
    log,
    make_prompts,
    mark,
    median_run,
    ms,
    percent,
    prompt_vocab,
    summarize,
)
from bench.serve_app import (  # noqa: E402
    DEFAULT_RAY_PORT,
    app_config,
    describe_serve,
    exit_on_sigterm,
    make_run_env,
    model_source,
    model_spec,
    num_gpus,
    serve_and_load,
    serve_setup,
    served_model,
    with_app_args,
)
from bench.server_metrics import engine_ttft_totals, with_engine_ttft  # noqa: E402
from bench.shared_prefix import print_shared_prefix, shared_prefix_workload  # noqa: E402

ROUTERS = ("prefix", "power_of_two")  # the app's engine_router values; --compare-routers runs both
FIRST_REQUESTS = 8  # sent together right after the server is ready, and again once it is warm
T = TypeVar("T")


# --- the levels -----------------------------------------------------------------------------------


def _num_requests(args: argparse.Namespace, concurrency: int) -> int:
    return args.requests or max(args.requests_per_client * concurrency, 32)


def level_prompts(
    args: argparse.Namespace, concurrency: int, vocab: tuple[int, int], run: int = 0
) -> list[list[int]]:
    """A level's prompts, its own and each run's its own: with one seed for all, each level (or run) began
    with the earlier ones' prompts, whose KV the prefix cache still held. Engine-direct runs run 0's."""
    seed = f"{args.seed}:{concurrency}" + (f":{run}" if run else "")
    return make_prompts(_num_requests(args, concurrency), args.prompt_tokens, vocab, seed)


def http_level(
    base_url: str, model: str, prompts: list[list[int]], concurrency: int, output_tokens: int, processes: int
) -> dict[str, Any]:
    """One level's summary (load_client.http_level_records), with the engines' own TTFT over it."""
    before = engine_ttft_totals(base_url)
    records, wall_s = http_level_records(base_url, model, prompts, concurrency, output_tokens, processes)
    return with_engine_ttft(summarize(records, wall_s), before, engine_ttft_totals(base_url))


def run_http(
    base_url: str, args: argparse.Namespace, vocab: tuple[int, int], workload: Callable[..., T]
) -> tuple[T, dict[str, Any]]:
    """workload(base_url, model, args, vocab) (http_levels or run_shared_prefix); before it the first
    requests after ready, after it the same ones warm (their TTFT p50s: the second value)."""
    model = served_model(base_url)
    first = make_prompts(FIRST_REQUESTS, args.prompt_tokens, vocab, seed=args.seed + 1)
    cold = http_level(base_url, model, first, FIRST_REQUESTS, args.output_tokens, 1)
    results = workload(base_url, model, args, vocab)
    mark(args.marks, "http-warm-requests")
    warm = http_level(base_url, model, first, FIRST_REQUESTS, args.output_tokens, 1)
    first_requests = {
        "requests": FIRST_REQUESTS, "after_ready_ttft_p50_ms": cold["ttft_p50_ms"],
        "warm_ttft_p50_ms": warm["ttft_p50_ms"], "after_ready": cold, "warm": warm,
    }  # fmt: skip
    log(f"first {FIRST_REQUESTS} requests after ready: TTFT p50 {ms(cold['ttft_p50_ms'])}, "
        f"the same warm: {ms(warm['ttft_p50_ms'])}")  # fmt: skip
    return results, first_requests


def http_levels(
    base_url: str, model: str, args: argparse.Namespace, vocab: tuple[int, int]
) -> dict[int, dict[str, Any]]:
    """Each level --runs times, one run after another (each its own prompts); per level the median run."""
    results = {}
    for concurrency in args.concurrency:
        runs = []
        for run in range(args.runs):
            name = f"C={concurrency}" + (f" run {run + 1}/{args.runs}" if args.runs > 1 else "")
            mark(args.marks, "http-" + name.replace(" ", "-"))
            prompts = level_prompts(args, concurrency, vocab, run)
            runs.append(
                http_level(base_url, model, prompts, concurrency, args.output_tokens, args.client_processes)
            )
            log(f"http {name}: {brief(runs[-1])}")
        results[concurrency] = median_run(runs)
    return results


def engine_level(
    engine: Any,
    prompts: list[list[int]],
    concurrency: int,
    output_tokens: int,
) -> dict[str, Any]:
    from tileinfer.engine.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    return summarize(*engine_records(engine, prompts, concurrency, lambda client: params))


def run_engine_direct(app_args: Any, args: argparse.Namespace, vocab: tuple[int, int]) -> dict[int, dict]:
    engine = build_engine(app_args, args.device)
    engine_level(
        engine, make_prompts(2, args.prompt_tokens, vocab, seed=args.seed + 1), 1, args.output_tokens
    )
    results = {}
    for concurrency in args.concurrency:
        prompts = level_prompts(args, concurrency, vocab)
        results[concurrency] = engine_level(engine, prompts, concurrency, args.output_tokens)
        log(f"engine-direct C={concurrency}: {brief(results[concurrency])}")
    return results


# --- the served app ---------------------------------------------------------------------------------


def app_args_for(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """The serve config (parsed) and its first application's args, with --model and the sizes in."""
    raw: dict[str, Any] = {}
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
    return app_config(args.serve_config, raw)


def engine_replica_args(args: argparse.Namespace, gpus: int, router: str | None) -> dict[str, Any]:
    """The app args that place the engine: --engine-replicas replicas, on GPUs each one's share of a GPU
    (on one GPU 1/N each; ceil(N / GPUs) replicas to a GPU on several) unless --engine-num-gpus sets it,
    and the router when one is named (else the app's default)."""
    placed: dict[str, Any] = {"num_engine_replicas": args.engine_replicas}
    if args.engine_num_gpus is not None:
        placed["engine_num_gpus"] = args.engine_num_gpus
    elif args.engine_replicas > 1 and gpus > 0:
        placed["engine_num_gpus"] = 1 / math.ceil(args.engine_replicas / gpus)
    if router is not None:
        placed["engine_router"] = router
    return placed


def model_vocab(model: str) -> int | None:
    """The model's vocabulary size, without loading weights."""
    return model_spec(model).vocab_size


def vocab_for(args: argparse.Namespace, app_args: Any) -> tuple[int, int]:
    """The prompts' token ids: --vocab, else the served model's ordinary tokens."""
    return prompt_vocab(model_vocab(app_args.model), args.vocab)


# --- output -------------------------------------------------------------------------------------------


def print_table(results: dict[str, dict[int, dict[str, Any]]]) -> None:
    print("| clients | path | output tok/s | req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    levels = sorted({level for by_level in results.values() for level in by_level})
    for level in levels:
        for path, by_level in results.items():
            if level in by_level:
                row = by_level[level]
                label = f"{path} (median of {row['runs']})" if row.get("runs", 1) > 1 else path
                print(
                    f"| {level} | {label} | {row['output_tok_s']:.1f} | {row['req_s']:.2f} | "
                    f"{ms(row['ttft_p50_ms'])} | {ms(row['ttft_p99_ms'])} | {ms(row['tpot_p50_ms'])} | "
                    f"{ms(row['tpot_p99_ms'])} | {row['errors']} |"
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


def print_summary(results: dict[str, dict[Any, dict[str, Any]]], meta: dict[str, Any]) -> None:
    """BENCH.md's table, printed last: per level HTTP against engine-direct (one engine on the whole
    device); for the shared-prefix workload the later turns' prefix-hit share and TTFT p50, the prefix
    router against power of two when both ran."""
    model, setup = meta.get("model", "-"), describe_serve(meta.get("serve"))
    print("| workload | model | TileInfer | peer | TileInfer / peer | % of limit |")
    print("| --- | --- | --- | --- | --- | --- |")
    http, direct = results.get("http", {}), results.get("engine-direct", {})
    for level in sorted(http.keys() | direct.keys()):
        ours, peer = http.get(level), direct.get(level)
        ours_text = peer_text = ratio = "-"
        if ours is not None:
            runs = f" (median of {ours['runs']})" if ours.get("runs", 1) > 1 else ""
            ours_text = f"HTTP {ours['output_tok_s']:,.0f} tok/s{runs}"
        if peer is not None:
            peer_text = f"engine-direct {peer['output_tok_s']:,.0f} tok/s (one engine, whole device)"
        if ours is not None and peer is not None and peer["output_tok_s"]:
            ratio = f"{ours['output_tok_s'] / peer['output_tok_s']:.3f}"
        workload = f"serve-load, {level} client(s); {setup}"
        print(f"| {workload} | {model} | {ours_text} | {peer_text} | {ratio} | - |")
    by_router = results.get("shared-prefix", {})
    if not by_router:
        return
    ours_router, *peer_routers = by_router
    later = list(by_router[ours_router]["phases"])[-1]
    args = meta["args"]
    workload = f"shared-prefix, {args['conversations']} conversations x {args['turns']} turns"
    for measure, key, show in (("prefix-hit share", "hit_share", percent), ("TTFT p50", "ttft_p50_ms", ms)):
        ours = by_router[ours_router]["phases"][later][key]
        peer_text = ratio = "-"
        if peer_routers:
            peer = by_router[peer_routers[0]]["phases"][later][key]
            peer_text = f"{peer_routers[0]} {show(peer)}"
            ratio = f"{ours / peer:.3f}" if ours is not None and peer else "-"
        print(
            f"| {workload}: {measure} of {later}; {setup} | {model} | {ours_router} {show(ours)} | "
            f"{peer_text} | {ratio} | - |"
        )


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
    parser.add_argument("--workload", choices=("random", "shared-prefix"), default="random")
    parser.add_argument(
        "--concurrency", default=None, type=lambda text: [int(v) for v in text.split(",")],
        help="default 1,8,64,256; shared-prefix: one value, default --conversations",
    )  # fmt: skip
    parser.add_argument("--requests", type=int, default=None, help="per level; default max(R C, 32)")
    parser.add_argument("--requests-per-client", type=int, default=4, help="R: a level's length")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=None, help="default 128; shared-prefix 64")
    parser.add_argument("--runs", type=int, default=1, help="HTTP runs per level; the median one counts")
    parser.add_argument("--conversations", type=int, default=64, help="shared-prefix")
    parser.add_argument("--turns", type=int, default=4, help="shared-prefix: turns per conversation")
    parser.add_argument("--context-tokens", type=int, default=1000, help="shared-prefix: each one's own")
    parser.add_argument("--turn-tokens", type=int, default=50, help="shared-prefix: user tokens a turn")
    parser.add_argument("--vocab", default=None, help="LOW:HIGH prompt ids; default 0:min(151643, vocab)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the largest concurrency")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="default: the longest prompt plus its output"
    )
    parser.add_argument("--kv-cache-tokens", type=int, default=None, help="default: what the load needs")
    parser.add_argument("--health-timeout", type=float, default=900)
    parser.add_argument("--client-processes", type=int, default=1, help="client processes per level")
    parser.add_argument("--ingress-replicas", type=int, default=None, help="num_ingress_replicas")
    parser.add_argument("--serve-proxy", action="store_true", help="Serve's Python proxy, not HAProxy mode")
    parser.add_argument(
        "--ray-defaults", action="store_true", help="Ray Serve's own settings, as plain `serve run` has them"
    )
    parser.add_argument("--engine-replicas", type=int, default=1, help="num_engine_replicas")
    parser.add_argument("--engine-num-gpus", type=float, default=None, help="default: 1/N on one GPU")
    parser.add_argument("--engine-router", choices=ROUTERS, default=None, help="default: the app's")
    parser.add_argument("--compare-routers", action="store_true", help="shared-prefix once per router")
    parser.add_argument("--stream-events-per-s", type=float, default=None, help="max_stream_events_per_s")
    parser.add_argument("--restart", action="store_true", help="then serve run once more: restart time")
    parser.add_argument("--no-engine-direct", action="store_true", help="with --serve-config: HTTP only")
    parser.add_argument("--ray-port", type=int, default=DEFAULT_RAY_PORT)
    parser.add_argument("--marks", default=None, help="append where each phase begins (for a profiler)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args(argv)
    shared = args.workload == "shared-prefix"
    placing = args.engine_replicas != 1 or args.engine_num_gpus is not None or args.engine_router is not None
    if (placing or args.compare_routers) and not args.serve_config:
        parser.error("--engine-replicas, --engine-num-gpus, --engine-router and --compare-routers: only "
                     "with --serve-config")  # fmt: skip
    if args.compare_routers and (not shared or args.engine_router is not None):
        parser.error("--compare-routers runs --workload shared-prefix once per router (no --engine-router)")
    if args.runs < 1 or (shared and args.runs > 1):
        parser.error("--runs: 1 or more, for --workload random")
    if shared and (args.engine_direct or (args.url and args.model is None)):
        parser.error("--workload shared-prefix runs over HTTP; with --url, --model names the served model")
    if shared and (args.turns < 2 or (args.concurrency is not None and len(args.concurrency) > 1)):
        parser.error("--workload shared-prefix: --turns 2 or more, and one --concurrency")
    if args.concurrency is None:
        args.concurrency = [args.conversations] if shared else [1, 8, 64, 256]
    if args.output_tokens is None:
        args.output_tokens = 64 if shared else 128
    longest = args.prompt_tokens + args.output_tokens  # the first requests' too
    if shared:
        longest = max(longest, args.context_tokens + args.turns * (args.turn_tokens + args.output_tokens))
    if args.max_num_seqs is None and not args.url:
        args.max_num_seqs = max(args.concurrency)
    if args.max_model_len is None and not args.url:
        args.max_model_len = longest + 16
    if args.kv_cache_tokens is None and not args.url:
        # shared-prefix: every conversation's history stays cached between its turns
        sequences = max(args.max_num_seqs, args.conversations) if shared else args.max_num_seqs
        args.kv_cache_tokens = sequences * args.max_model_len
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[Any, dict[str, Any]]] = {}
    meta: dict[str, Any] = {"args": vars(args)}
    shared = args.workload == "shared-prefix"
    if args.url:
        served_name = served_model(args.url)
        vocab = prompt_vocab(None, args.vocab)
        workload = shared_prefix_workload(model_source(args.model, args.dtype)) if shared else http_levels
        loaded, meta["first_requests"] = run_http(args.url, args, vocab, workload)
        if shared:
            results["shared-prefix"] = {"as served": loaded}
        else:
            results["http"] = loaded
        meta["model"] = served_name
        meta["serve"] = None
    else:
        from tileinfer.deployments.launch.app_args import parse_app_args

        config, app_args = app_args_for(args)
        meta["app_args"] = app_args.model_dump()
        meta["model"] = app_args.model_name
        vocab = vocab_for(args, app_args)
        if args.serve_config:
            env = make_run_env(args.serve_proxy, args.ray_defaults)
            routers = ROUTERS if args.compare_routers else (args.engine_router,)
            gpus = num_gpus(app_args.device)
            apps = [with_app_args(config, engine_replica_args(args, gpus, router)) for router in routers]
            served = [parse_app_args(app["applications"][0]["args"]) for app in apps]  # before Ray starts
            # as build_app resolves it: the head offers this machine's CPUs
            device = "cuda" if gpus else "cpu"
            meta["serve"] = serve_setup(served[0].for_device(device, os.cpu_count() or 1), env)
            workload = shared_prefix_workload(app_args.model) if shared else http_levels
            meta["ready_s"] = {}
            by_router: dict[str, dict[str, Any]] = {}
            for index, (app, app_served) in enumerate(zip(apps, served, strict=True)):
                router = app_served.engine_router
                suffix = f"_{router}" if index else ""
                (loaded, first_requests), ready_s = serve_and_load(
                    app, out / f"serve_load_config{suffix}.yaml", out / f"serve_load_serve{suffix}.log", env,
                    lambda base_url: run_http(base_url, args, vocab, workload), args.ray_port,
                    args.health_timeout,
                )  # fmt: skip
                if index == 0:
                    meta["ready_s"]["first_start"], meta["first_requests"] = ready_s, first_requests
                if shared:
                    by_router[router] = {**loaded, "ready_s": ready_s, "first_requests": first_requests}
                else:
                    results["http"] = loaded
            if shared:
                results["shared-prefix"] = by_router
            if args.restart:  # the first app again: Triton's kernels come from its cache this time
                _, meta["ready_s"]["restart"] = serve_and_load(
                    apps[0], out / "serve_load_config.yaml", out / "serve_load_restart.log", env, None,
                    args.ray_port, args.health_timeout,
                )  # fmt: skip
        if not args.no_engine_direct and not shared:
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
              f"{FIRST_REQUESTS} requests TTFT p50 after ready {ms(first.get('after_ready_ttft_p50_ms'))}, "
              f"warm {ms(first.get('warm_ttft_p50_ms'))}")  # fmt: skip
    print(f"served: {describe_serve(meta.get('serve'))}" if "serve" in meta else "engine-direct only")
    if shared:
        print_shared_prefix(results["shared-prefix"])
    else:
        print_table(results)
    print()
    print_summary(results, meta)
    return payload


if __name__ == "__main__":
    exit_on_sigterm()
    main()
