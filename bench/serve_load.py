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
import asyncio
import atexit
import dataclasses
import functools
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN3_ORDINARY_TOKENS = 151643  # ids below are the Qwen3 tokenizer's ordinary (non-special) tokens
ROUTERS = ("prefix", "power_of_two")  # the app's engine_router values; --compare-routers runs both
T = TypeVar("T")


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


def latencies(records: list[dict[str, Any]]) -> dict[str, Any]:
    """records: per request {ttft_s, tpot_s, tokens, error}."""
    good = [record for record in records if record["error"] is None]
    ttfts = [record["ttft_s"] for record in good]
    tpots = [record["tpot_s"] for record in good if record["tpot_s"] is not None]
    ms = {name: (value * 1e3 if value is not None else None) for name, value in (
        ("ttft_p50_ms", _percentile(ttfts, 0.5)), ("ttft_p99_ms", _percentile(ttfts, 0.99)),
        ("tpot_p50_ms", _percentile(tpots, 0.5)), ("tpot_p99_ms", _percentile(tpots, 0.99)),
    )}  # fmt: skip
    errors = [record["error"] for record in records if record["error"] is not None]
    return {
        "requests": len(records),
        **ms,
        "errors": len(errors),
        "first_errors": errors[:3],
        "ttft_mean_ms": 1e3 * sum(ttfts) / len(ttfts) if ttfts else None,
    }


def summarize(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """records: per request {ttft_s, tpot_s, tokens, error}; the latencies and the throughput."""
    summary = latencies(records)
    good = summary["requests"] - summary["errors"]
    tokens = sum(record["tokens"] for record in records if record["error"] is None)
    return {
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "req_s": good / wall_s if wall_s > 0 else 0.0,
        **summary,
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median output tok/s (for an even count the lower middle one), with every run's
    tok/s in run order: HTTP / engine-direct ratios vary by up to 20 % from run to run (BENCH.md)."""
    median = sorted(runs, key=lambda run: run["output_tok_s"])[(len(runs) - 1) // 2]
    return {**median, "runs": len(runs), "output_tok_s_runs": [run["output_tok_s"] for run in runs]}


# --- the server's /metrics ----------------------------------------------------------------------

ENGINE_TTFT = "tileinfer_time_to_first_token_seconds"
HIT_TOKENS = "tileinfer_prefix_cache_hit_tokens_total"
PROMPT_TOKENS = "tileinfer_prompt_tokens_total"
ROUTER_DECISIONS = "tileinfer_router_decisions_total"


def metrics_text(base_url: str) -> str:
    """The server's /metrics; empty from a server that has none."""
    import httpx

    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", timeout=30)
    except httpx.HTTPError:
        return ""
    return response.text if response.status_code == 200 else ""


def metric_sums(text: str, name: str, label: str | None = None) -> dict[str, float]:
    """The samples called `name` in a /metrics text, summed over their label sets per value of `label`
    (samples without that label under ""; all of them under "" when label is None)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                key = sample.labels.get(label, "") if label is not None else ""
                sums[key] = sums.get(key, 0.0) + sample.value
    return sums


def engine_ttft_totals(base_url: str) -> tuple[float, float] | None:
    """(sum, count) of the engines' own time-to-first-token histograms (from the request's arrival at an
    engine loop), from the server's /metrics; None from a server that has none."""
    text = metrics_text(base_url)
    total, count = (metric_sums(text, ENGINE_TTFT + suffix) for suffix in ("_sum", "_count"))
    if not total or not count:
        return None
    return total[""], count[""]


def with_engine_ttft(summary: dict[str, Any], before: tuple | None, after: tuple | None) -> dict[str, Any]:
    """The level's mean TTFT inside the engine (its /metrics, after less before) beside the clients':
    what the HTTP path adds is the difference."""
    if before is not None and after is not None and after[1] > before[1]:
        summary["engine_ttft_mean_ms"] = 1e3 * (after[0] - before[0]) / (after[1] - before[1])
    return summary


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _engine_order(label: str) -> tuple[int, str]:
    return len(label), label  # "2" before "10"


def prefix_hits(before: str, after: str) -> dict[str, Any]:
    """What the engines counted between two /metrics texts: prompt tokens and the prefix cache's hits
    among them, in all and per engine replica (label `engine`), and the router's decisions (label
    `decision`)."""

    def grown(name: str, label: str) -> dict[str, float]:
        old = metric_sums(before, name, label)
        return {key: value - old.get(key, 0.0) for key, value in metric_sums(after, name, label).items()}

    hits, prompts = grown(HIT_TOKENS, "engine"), grown(PROMPT_TOKENS, "engine")
    per_engine = {
        engine: {
            "prompt_tokens": prompts.get(engine, 0.0),
            "hit_tokens": hits.get(engine, 0.0),
            "hit_share": _share(hits.get(engine, 0.0), prompts.get(engine, 0.0)),
        }
        for engine in sorted(hits.keys() | prompts.keys(), key=_engine_order)
    }
    return {
        "prompt_tokens": sum(prompts.values()),
        "hit_tokens": sum(hits.values()),
        "hit_share": _share(sum(hits.values()), sum(prompts.values())),
        "per_engine": per_engine,
        "router_decisions": grown(ROUTER_DECISIONS, "decision"),
    }


def _record(start: float, first: float | None, last: float | None, tokens: int, error: str | None) -> dict:
    if error is None and (first is None or tokens == 0):
        error = "no tokens"
    tpot = (last - first) / (tokens - 1) if error is None and tokens > 1 else None
    return {"ttft_s": first - start if first is not None else None, "tpot_s": tpot, "tokens": tokens,
            "error": error}  # fmt: skip


# --- HTTP -----------------------------------------------------------------------------------------


def _completion_body(
    model: str, prompt: list[int], output_tokens: int, ignore_eos: bool = True
) -> dict[str, Any]:
    return {
        "model": model, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0,
        "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip


# A request's body from (model, prompt, output tokens, the client's id): http_records' body_for
BodyFor = Callable[[str, list[int], int, int], dict[str, Any]]


async def _stream_one(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion's record, with its text and finish_reason; with logprobs in the body also
    its tokens as the logprobs spell them (token_spellings)."""
    start = time.perf_counter()
    first = last = None
    tokens, error, finish_reason = 0, None, None
    spellings: list[str] = []
    pieces: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:  # the record has its error, no text and no finish_reason
                text = (await response.aread()).decode(errors="replace")
                error = f"HTTP {response.status_code}: {text[:200]}"
            else:
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
                        for choice in event["choices"]:
                            spellings += (choice.get("logprobs") or {}).get("tokens", [])
                            pieces.append(choice.get("text") or "")
                            finish_reason = choice.get("finish_reason") or finish_reason
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
    except Exception as failure:  # noqa: BLE001 - a broken connection counts as an error
        error = f"{type(failure).__name__}: {failure}"
    if error is None and tokens == 0:
        error = "no usage chunk"
    record = _record(start, first, last, tokens, error)
    return {**record, "token_spellings": spellings, "text": "".join(pieces), "finish_reason": finish_reason}


async def http_records(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    concurrency: int,
    output_tokens: int,
    body_for: BodyFor | None = None,
    client_ids: Sequence[int] | None = None,
) -> tuple[list[dict[str, Any]], float, float]:
    """Per-request records (each names its client), and when the level began and ended (time.monotonic:
    one clock for every process of the machine). body_for: each request's body (default _completion_body's);
    client_ids: the `concurrency` clients' ids that body_for gets (default 0 to concurrency - 1)."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    pending = iter(prompts)
    records: list[dict[str, Any]] = []
    client_ids = range(concurrency) if client_ids is None else client_ids

    async def client_loop(client: httpx.AsyncClient, client_id: int) -> None:
        for prompt in pending:  # a shared iterator: each client takes the next prompt when it is free
            if body_for is None:
                body = _completion_body(model, prompt, output_tokens)
            else:
                body = body_for(model, prompt, output_tokens, client_id)
            records.append({**await _stream_one(client, url, body), "client": client_id})

    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=60), limits=limits) as client:
        start = time.monotonic()
        await asyncio.gather(*(client_loop(client, client_id) for client_id in client_ids))
        end = time.monotonic()
    return records, start, end


def _client_process(
    job: tuple[str, str, list[list[int]], int, int, BodyFor | None, range],
) -> tuple[list[dict], float, float]:
    return asyncio.run(http_records(*job))


def http_level_records(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    concurrency: int,
    output_tokens: int,
    processes: int,
    body_for: BodyFor | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """The records of one level's clients (ids 0 to concurrency - 1, spread over `processes` client
    processes, each its own event loop, so that parsing every server-sent event does not bound what is
    measured), and the level's wall time."""
    processes = max(1, min(processes, concurrency))
    if processes == 1:
        records, start, end = asyncio.run(
            http_records(base_url, model, prompts, concurrency, output_tokens, body_for)
        )
        return records, end - start
    import concurrent.futures
    import multiprocessing

    jobs = []
    for index in range(processes):
        client_ids = range(index, concurrency, processes)
        jobs.append(
            (base_url, model, prompts[index::processes], len(client_ids), output_tokens, body_for, client_ids)
        )
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        parts = list(pool.map(_client_process, jobs))
    records = [record for part in parts for record in part[0]]
    return records, max(part[2] for part in parts) - min(part[1] for part in parts)


def http_level(
    base_url: str, model: str, prompts: list[list[int]], concurrency: int, output_tokens: int, processes: int
) -> dict[str, Any]:
    """One level's summary (http_level_records), with the engines' own TTFT over it."""
    before = engine_ttft_totals(base_url)
    records, wall_s = http_level_records(base_url, model, prompts, concurrency, output_tokens, processes)
    return with_engine_ttft(summarize(records, wall_s), before, engine_ttft_totals(base_url))


def served_model(base_url: str) -> str:
    import httpx

    return httpx.get(base_url.rstrip("/") + "/v1/models", timeout=60).json()["data"][0]["id"]


FIRST_REQUESTS = 8  # sent together right after the server is ready, and again once it is warm


def run_http(
    base_url: str, args: argparse.Namespace, vocab: tuple[int, int], workload: Callable[..., T]
) -> tuple[T, dict[str, Any]]:
    """workload(base_url, model, args, vocab) (http_levels or run_shared_prefix); before it the first
    requests after ready, after it the same ones warm (their TTFT p50s: the second value)."""
    model = served_model(base_url)
    first = make_prompts(FIRST_REQUESTS, args.prompt_tokens, vocab, seed=args.seed + 1)
    cold = http_level(base_url, model, first, FIRST_REQUESTS, args.output_tokens, 1)
    results = workload(base_url, model, args, vocab)
    _mark(args, "http-warm-requests")
    warm = http_level(base_url, model, first, FIRST_REQUESTS, args.output_tokens, 1)
    first_requests = {
        "requests": FIRST_REQUESTS, "after_ready_ttft_p50_ms": cold["ttft_p50_ms"],
        "warm_ttft_p50_ms": warm["ttft_p50_ms"], "after_ready": cold, "warm": warm,
    }  # fmt: skip
    _log(f"first {FIRST_REQUESTS} requests after ready: TTFT p50 {_ms(cold['ttft_p50_ms'])}, "
         f"the same warm: {_ms(warm['ttft_p50_ms'])}")  # fmt: skip
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
            _mark(args, "http-" + name.replace(" ", "-"))
            prompts = level_prompts(args, concurrency, vocab, run)
            runs.append(
                http_level(base_url, model, prompts, concurrency, args.output_tokens, args.client_processes)
            )
            _log(f"http {name}: {_brief(runs[-1])}")
        results[concurrency] = median_run(runs)
    return results


# --- the shared-prefix workload -------------------------------------------------------------------


@dataclasses.dataclass
class Conversation:
    """One conversation of the shared-prefix workload: what it holds so far (its context, then each
    answered turn's user tokens and the ids the server generated) and every turn's user tokens."""

    history: list[int]
    user_turns: list[list[int]]

    def prompt(self, turn: int) -> list[int]:
        return self.history + self.user_turns[turn]

    def answered(self, turn: int, output_token_ids: list[int]) -> None:
        self.history = self.prompt(turn) + output_token_ids


def make_conversations(args: argparse.Namespace, vocab: tuple[int, int]) -> list[Conversation]:
    """Each conversation its own context and its turns' user tokens: random ids from seeded RNGs, as
    make_prompts draws them."""
    contexts = make_prompts(args.conversations, args.context_tokens, vocab, seed=f"{args.seed}:contexts")
    user_tokens = make_prompts(args.conversations * args.turns, args.turn_tokens, vocab, f"{args.seed}:turns")
    return [
        Conversation(context, user_tokens[index * args.turns : (index + 1) * args.turns])
        for index, context in enumerate(contexts)
    ]


def token_id_table(tokenizer: Any) -> dict[str, int]:
    """Each token's spelling in the completions API's logprobs
    (tileinfer.deployments.openai_api.logprobs.token_text) -> its id. The API returns a completion as text,
    and a conversation's next turn must hold the very ids the server generated (the prefix cache matches ids),
    so the turns ask for logprobs and read the ids back. A spelling that several ids share is left out (the
    Qwen3 and SmolLM2 tokenizers have none)."""
    from tileinfer.deployments.openai_api.logprobs import token_text

    table: dict[str, int] = {}
    shared = set()
    for token_id in range(tokenizer.vocab_size):
        spelling = token_text(tokenizer.token_bytes(token_id))
        if spelling in table:
            shared.add(spelling)
        table[spelling] = token_id
    for spelling in shared:
        del table[spelling]
    return table


def output_token_ids(spellings: list[str], table: dict[str, int], num_tokens: int) -> list[int]:
    """A completion's token ids from their spellings in its logprobs; ValueError when a spelling is not
    one token's, or when their count is not the usage's."""
    if len(spellings) != num_tokens:
        raise ValueError(f"{len(spellings)} tokens in the logprobs, {num_tokens} in the usage")
    unknown = [spelling for spelling in spellings if spelling not in table]
    if unknown:
        raise ValueError(f"no one token is spelled {unknown[0]!r}")
    return [table[spelling] for spelling in spellings]


async def conversation_records(
    base_url: str,
    model: str,
    conversations: list[Conversation],
    turns: range,
    concurrency: int,
    output_tokens: int,
    token_ids: dict[str, int],
) -> tuple[dict[int, list[dict[str, Any]]], float]:
    """These turns (0-based) of every conversation, `concurrency` conversations at a time, each one's
    turns in order; per turn its records (with prompt_tokens), and the wall time. A turn that failed ends
    its conversation: its later turns count as errors."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    pending = iter(conversations)
    records: dict[int, list[dict[str, Any]]] = {turn: [] for turn in turns}

    async def client_loop(client: httpx.AsyncClient) -> None:
        for conversation in pending:  # a shared iterator: each client takes the next one when it is free
            failed: int | None = None
            for turn in turns:
                prompt = conversation.prompt(turn)
                if failed is not None:
                    record = _record(0.0, None, None, 0, f"turn {failed + 1} of its conversation failed")
                else:
                    body = {**_completion_body(model, prompt, output_tokens), "logprobs": 0}
                    record = await _stream_one(client, url, body)
                    if record["error"] is None:
                        try:
                            ids = output_token_ids(record["token_spellings"], token_ids, record["tokens"])
                            conversation.answered(turn, ids)
                        except ValueError as error:
                            record["error"] = str(error)
                    failed = turn if record["error"] is not None else None
                records[turn].append({**record, "prompt_tokens": len(prompt)})

    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=60), limits=limits) as client:
        start = time.monotonic()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall_s = time.monotonic() - start
    return records, wall_s


def run_shared_prefix(
    base_url: str, model: str, args: argparse.Namespace, vocab: tuple[int, int], token_ids: dict[str, int]
) -> dict[str, Any]:
    """Turn 1 of every conversation, then the later turns, with /metrics read before, between and after:
    turn 1's prompts are all new, so the prefix hits counted over the later turns are theirs alone. Per
    turn its latencies and prompt tokens; per phase its latencies, throughput and prefix hits."""
    from tileinfer.deployments.replicas.engine_replica import HEARTBEAT_S

    conversations = make_conversations(args, vocab)
    phases = {"turn 1": range(1), f"turns 2-{args.turns}": range(1, args.turns)}
    texts = [metrics_text(base_url)]
    result: dict[str, Any] = {"turns": {}, "phases": {}}
    for name, turns in phases.items():
        _mark(args, "shared-prefix-" + name.replace(" ", "-"))
        records, wall_s = asyncio.run(
            conversation_records(
                base_url, model, conversations, turns, args.concurrency[0], args.output_tokens, token_ids
            )
        )
        # the other ingress replicas' router decisions reach /metrics with their next heartbeat
        time.sleep(1.5 * HEARTBEAT_S)
        texts.append(metrics_text(base_url))
        for turn in turns:
            prompt_tokens = sum(record["prompt_tokens"] for record in records[turn])
            result["turns"][turn + 1] = {**latencies(records[turn]), "prompt_tokens": prompt_tokens}
        phase = summarize([record for turn in turns for record in records[turn]], wall_s)
        result["phases"][name] = {**phase, **prefix_hits(texts[-2], texts[-1])}
        _log(f"shared-prefix {name}: {_brief(phase)}; prefix-hit share "
             f"{_percent(result['phases'][name]['hit_share'])}")  # fmt: skip
    return result


# --- engine-direct --------------------------------------------------------------------------------


def engine_records(
    engine: Any, prompts: list[list[int]], concurrency: int, params_for: Callable[[int], Any]
) -> tuple[list[dict[str, Any]], float]:
    """The prompts through the engine by `concurrency` closed-loop clients (a client adds its next prompt
    when its request ends, with params_for(client)): each request's record (_record's, with its client,
    text and finish_reason) and the wall time."""
    pending = iter(prompts)
    state: dict[str, dict[str, Any]] = {}
    records: list[dict[str, Any]] = []

    def add_next(client: int) -> None:
        prompt = next(pending, None)
        if prompt is not None:
            state[engine.add_request(prompt, params_for(client))] = {
                "client": client, "start": time.perf_counter(), "first": None, "last": None, "tokens": 0,
                "text": [],
            }  # fmt: skip

    start = time.perf_counter()
    for client in range(concurrency):
        add_next(client)
    while state:
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            entry = state[output.request_id]
            entry["first"] = entry["first"] if entry["first"] is not None else now
            entry["last"] = now
            entry["tokens"] += len(output.new_token_ids)
            entry["text"].append(output.new_text)
            if output.finished:
                del state[output.request_id]
                record = _record(entry["start"], entry["first"], entry["last"], entry["tokens"], None)
                records.append({**record, "client": entry["client"], "text": "".join(entry["text"]),
                                "finish_reason": output.finish_reason})  # fmt: skip
                add_next(entry["client"])
    return records, time.perf_counter() - start


def engine_level(
    engine: Any,
    prompts: list[list[int]],
    concurrency: int,
    output_tokens: int,
) -> dict[str, Any]:
    from tileinfer.engine.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    return summarize(*engine_records(engine, prompts, concurrency, lambda client: params))


def build_engine(app_args: Any, device: str) -> Any:
    """An Engine in this process with the app's engine settings on `device` ("auto": a GPU where there is
    one), warmed up as the engine deployment does before it serves."""
    import torch
    from tileinfer.engine.engine import Engine
    from tileinfer.engine.models.loader import load_model

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = app_args.dtype if app_args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    config = app_args.engine_config(device, dtype)
    engine = Engine(
        load_model(app_args.model, dtype=config.torch_dtype(), device=config.torch_device()), config
    )
    engine.warm_up()
    return engine


def run_engine_direct(app_args: Any, args: argparse.Namespace, vocab: tuple[int, int]) -> dict[int, dict]:
    engine = build_engine(app_args, args.device)
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
    """A named shape (not the real default model) as a folder of random weights with the Qwen3 tokenizer,
    written once under the cache; anything else as given."""
    from tileinfer.engine.models.default_model import DEFAULT_MODEL_ALIAS, cache_dir
    from tileinfer.engine.models.random_model import SHAPES, random_weights

    if name == DEFAULT_MODEL_ALIAS or name not in SHAPES:
        return name
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "tests"))
    from assets import qwen3_tokenizer_dir

    spec = SHAPES[name]
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
    from tileinfer.deployments.launch.launcher import listening

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
    from tileinfer.deployments.launch.app_args import parse_app_args

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


def engine_replica_args(args: argparse.Namespace, num_gpus: int, router: str | None) -> dict[str, Any]:
    """The app args that place the engine: --engine-replicas replicas, on GPUs each one's share of a GPU
    (on one GPU 1/N each; ceil(N / GPUs) replicas to a GPU on several) unless --engine-num-gpus sets it,
    and the router when one is named (else the app's default)."""
    placed: dict[str, Any] = {"num_engine_replicas": args.engine_replicas}
    if args.engine_num_gpus is not None:
        placed["engine_num_gpus"] = args.engine_num_gpus
    elif args.engine_replicas > 1 and num_gpus > 0:
        placed["engine_num_gpus"] = 1 / math.ceil(args.engine_replicas / num_gpus)
    if router is not None:
        placed["engine_router"] = router
    return placed


def with_app_args(config: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The config with `extra` written into its first application's args."""
    app = config["applications"][0]
    return {**config, "applications": [{**app, "args": {**app["args"], **extra}}]}


def _num_gpus(device: str) -> int:
    """The GPUs the engine replicas share: this machine's, where serve run starts its Ray."""
    if device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count()


def serve_setup(app_args: Any, env: Mapping[str, str]) -> dict[str, Any]:
    """What the JSON and the tables say of the served app: its engine replicas (and the GPU share each
    was given; null: the app's default), ingress replicas and router, and Serve's mode, from the
    environment serve run starts with."""
    optimized = env.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1"  # Ray Serve reads "1" as on, else off
    haproxy = env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"
    return {
        "engine_replicas": app_args.num_engine_replicas,
        "engine_num_gpus": app_args.engine_num_gpus,
        "ingress_replicas": app_args.num_ingress_replicas,
        "engine_router": app_args.engine_router,
        "serve_mode": ("throughput-optimized" if optimized else "default") + (", HAProxy" if haproxy else ""),
    }


def make_run_env(serve_proxy: bool = False, ray_defaults: bool = False) -> dict[str, str]:
    """The environment `make run` starts Ray with (deployments/launch/launcher.py: HAProxy mode where HAProxy
    is here, unless serve_proxy), with the project first on the path and then the caller's (the GPU
    machine's wheels: Ray); HAProxy's script folder goes when this process exits. ray_defaults: Ray
    Serve's own settings instead, as a plain `serve run serve_config.yaml` gets them (Serve's proxy, its
    default mode, logs on stderr), on loopback and with make run's token mode."""
    from tileinfer.deployments.launch import cluster_security
    from tileinfer.deployments.launch.launcher import RAY_ENV, cluster_env

    if ray_defaults:
        env = {**os.environ, **RAY_ENV, **cluster_security.auth_env(os.environ)}
    else:
        env, haproxy_dir = cluster_env(serve_proxy)
        if haproxy_dir is not None:
            atexit.register(shutil.rmtree, haproxy_dir, True)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    return env


def serve_and_load(
    config: dict[str, Any],
    config_path: Path,
    log: Path,
    args: argparse.Namespace,
    env: dict[str, str],
    load: Callable[[str], T] | None,
) -> tuple[T | None, float]:
    """Write the config, serve run it, wait until it is healthy, run load(base_url) (None: only time the
    start), stop it; what load returned, and the seconds to a healthy app."""
    import yaml

    config_path.write_text(yaml.safe_dump(config))
    http = config.get("http_options") or {}
    http_port = int(http.get("port", 8000))
    base_url = f"http://{http.get('host', '127.0.0.1')}:{http_port}"
    base_url += (config["applications"][0].get("route_prefix") or "/").rstrip("/")
    started = time.monotonic()
    processes = start_serve(config_path, env, log, args.ray_port, http_port)
    try:
        wait_healthy(base_url, processes[1], log, args.health_timeout)
        ready_s = time.monotonic() - started
        _log(f"serve run ({config_path.name}) ready in {ready_s:.1f} s")
        return (load(base_url) if load is not None else None), ready_s
    finally:
        stop_serve(processes)


def shared_prefix_workload(model: str) -> Callable[..., dict[str, Any]]:
    """run_shared_prefix, reading the generated ids back with this model's tokenizer."""
    from tileinfer.engine.models.loader import load_tokenizer

    return functools.partial(run_shared_prefix, token_ids=token_id_table(load_tokenizer(model)))


# --- output -------------------------------------------------------------------------------------------


def _num_requests(args: argparse.Namespace, concurrency: int) -> int:
    return args.requests or max(args.requests_per_client * concurrency, 32)


def level_prompts(
    args: argparse.Namespace, concurrency: int, vocab: tuple[int, int], run: int = 0
) -> list[list[int]]:
    """A level's prompts, its own and each run's its own: with one seed for all, each level (or run) began
    with the earlier ones' prompts, whose KV the prefix cache still held. Engine-direct runs run 0's."""
    seed = f"{args.seed}:{concurrency}" + (f":{run}" if run else "")
    return make_prompts(_num_requests(args, concurrency), args.prompt_tokens, vocab, seed)


def _mark(args: argparse.Namespace, phase: str) -> None:
    """With --marks FILE: a line "<unix time> <phase>" where a phase begins (for lining a profiler up)."""
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


def _percent(share: float | None) -> str:
    return f"{100 * share:.1f} %" if share is not None else "-"


def describe_serve(serve: dict[str, Any] | None) -> str:
    """The served app's engine replicas, ingress replicas and Serve's mode, in words."""
    if serve is None:
        return "a running server (--url): replicas and Serve's mode its own"
    share = f" at {serve['engine_num_gpus']:.3g} GPU each" if serve["engine_num_gpus"] is not None else ""
    return (
        f"{serve['engine_replicas']} engine replica(s){share}, {serve['ingress_replicas']} ingress "
        f"replica(s), Serve {serve['serve_mode']}"
    )


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


def print_shared_prefix(by_router: dict[str, dict[str, Any]]) -> None:
    """Per turn its latencies, per phase (turn 1, the later turns) the prefix hits; a row per router."""
    print("| turn | router | requests | prompt tokens | TTFT p50 | TTFT p99 | TPOT p50 | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    turns = sorted({turn for result in by_router.values() for turn in result["turns"]})
    for turn in turns:
        for router, result in by_router.items():
            row = result["turns"][turn]
            print(
                f"| {turn} | {router} | {row['requests']} | {row['prompt_tokens']:,} | "
                f"{_ms(row['ttft_p50_ms'])} | {_ms(row['ttft_p99_ms'])} | {_ms(row['tpot_p50_ms'])} | "
                f"{row['errors']} |"
            )
    print("\n| phase | router | prompt tokens | prefix-hit tokens | hit share | per engine: hit share of "
          "its prompt tokens | router decisions |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for router, result in by_router.items():
        for phase, row in result["phases"].items():
            engines = ", ".join(
                f"{engine or '-'}: {_percent(counts['hit_share'])} of {counts['prompt_tokens']:,.0f}"
                for engine, counts in row["per_engine"].items()
            )
            decisions = ", ".join(f"{name} {count:,.0f}" for name, count in row["router_decisions"].items())
            print(
                f"| {phase} | {router} | {row['prompt_tokens']:,.0f} | {row['hit_tokens']:,.0f} | "
                f"{_percent(row['hit_share'])} | {engines or '-'} | {decisions or '-'} |"
            )


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
    for measure, key, show in (("prefix-hit share", "hit_share", _percent), ("TTFT p50", "ttft_p50_ms", _ms)):
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
    parser.add_argument("--ray-port", type=int, default=6390)
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
    results: dict[str, dict[Any, dict[str, Any]]] = {}
    meta: dict[str, Any] = {"args": vars(args)}
    shared = args.workload == "shared-prefix"
    if args.url:
        import httpx

        info = httpx.get(args.url.rstrip("/") + "/v1/models", timeout=60).json()["data"][0]
        vocab = _vocab(args, None)
        workload = shared_prefix_workload(model_source(args.model, args.dtype)) if shared else http_levels
        loaded, meta["first_requests"] = run_http(args.url, args, vocab, workload)
        if shared:
            results["shared-prefix"] = {"as served": loaded}
        else:
            results["http"] = loaded
        meta["model"] = info["id"]
        meta["serve"] = None
    else:
        from tileinfer.deployments.launch.app_args import parse_app_args

        config, app_args = app_args_for(args)
        meta["app_args"] = app_args.model_dump()
        meta["model"] = app_args.model_name
        vocab = _vocab(args, _model_vocab(app_args.model))
        if args.serve_config:
            env = make_run_env(args.serve_proxy, args.ray_defaults)
            routers = ROUTERS if args.compare_routers else (args.engine_router,)
            num_gpus = _num_gpus(app_args.device)
            apps = [with_app_args(config, engine_replica_args(args, num_gpus, router)) for router in routers]
            served = [parse_app_args(app["applications"][0]["args"]) for app in apps]  # before Ray starts
            # as build_app resolves it: the head offers this machine's CPUs
            device = "cuda" if num_gpus else "cpu"
            meta["serve"] = serve_setup(served[0].for_device(device, os.cpu_count() or 1), env)
            workload = shared_prefix_workload(app_args.model) if shared else http_levels
            meta["ready_s"] = {}
            by_router: dict[str, dict[str, Any]] = {}
            for index, (app, app_served) in enumerate(zip(apps, served, strict=True)):
                router = app_served.engine_router
                suffix = f"_{router}" if index else ""
                (loaded, first_requests), ready_s = serve_and_load(
                    app, out / f"serve_load_config{suffix}.yaml", out / f"serve_load_serve{suffix}.log", args,
                    env, lambda base_url: run_http(base_url, args, vocab, workload),
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
                    apps[0], out / "serve_load_config.yaml", out / "serve_load_restart.log", args, env, None
                )
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
              f"{FIRST_REQUESTS} requests TTFT p50 after ready {_ms(first.get('after_ready_ttft_p50_ms'))}, "
              f"warm {_ms(first.get('warm_ttft_p50_ms'))}")  # fmt: skip
    print(f"served: {describe_serve(meta.get('serve'))}" if "serve" in meta else "engine-direct only")
    if shared:
        print_shared_prefix(results["shared-prefix"])
    else:
        print_table(results)
    print()
    print_summary(results, meta)
    return payload


def model_spec(model: str) -> Any:
    """The model's ModelSpec, from its config.json or GGUF, without loading weights."""
    from tileinfer.engine.models.loader import resolve_model_source

    source = resolve_model_source(model)
    if source.is_dir():
        from tileinfer.engine.models.shape import ModelSpec

        return ModelSpec.from_config_file(source / "config.json")
    from tileinfer.engine.models.gguf_loader import read_gguf, spec_from_gguf

    return spec_from_gguf(read_gguf(source))


def _model_vocab(model: str) -> int | None:
    """The model's vocabulary size, without loading weights."""
    return model_spec(model).vocab_size


if __name__ == "__main__":
    _exit_on_sigterm()
    main()
