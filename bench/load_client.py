"""Closed-loop streaming clients of an OpenAI-compatible server's `/v1/completions`, and what they record.

Each of C clients streams a completion, and sends its next request when the previous one ends. A request's
record: TTFT from sending to the first event that carries a choice, TPOT (last event - first event) /
(tokens - 1), so a server that sends several tokens per event is timed by when its tokens arrive; tokens
counted by the completion's usage (stream_options.include_usage). Errors: HTTP statuses other than 200,
and in-band SSE error events. The serving benches (serve_load.py, serve_structured.py, long_prompts.py,
replica_kill.py) share these clients, their prompts and their summaries.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

QWEN3_ORDINARY_TOKENS = 151643  # ids below are the Qwen3 tokenizer's ordinary (non-special) tokens


# --- prompts and results ------------------------------------------------------------------------


def prompt_vocab(model_vocab: int | None, vocab: str | None = None) -> tuple[int, int]:
    """The prompts' token ids, [low, high): `vocab` ("LOW:HIGH") when given, else the Qwen3 tokenizer's
    ordinary tokens within the model's vocabulary."""
    if vocab:
        low, high = (int(part) for part in vocab.split(":"))
        return low, high
    return 0, min(QWEN3_ORDINARY_TOKENS, model_vocab or QWEN3_ORDINARY_TOKENS)


def make_prompts(count: int, length: int, vocab: tuple[int, int], seed: int | str) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(*vocab) for _ in range(length)] for _ in range(count)]


def percentile(values: list[float], share: float) -> float | None:
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
        ("ttft_p50_ms", percentile(ttfts, 0.5)), ("ttft_p99_ms", percentile(ttfts, 0.99)),
        ("tpot_p50_ms", percentile(tpots, 0.5)), ("tpot_p99_ms", percentile(tpots, 0.99)),
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
    tok/s in run order: HTTP / engine-direct ratios vary by up to 20 % from run to run."""
    median = sorted(runs, key=lambda run: run["output_tok_s"])[(len(runs) - 1) // 2]
    return {**median, "runs": len(runs), "output_tok_s_runs": [run["output_tok_s"] for run in runs]}


def request_record(
    start: float, first: float | None, last: float | None, tokens: int, error: str | None
) -> dict[str, Any]:
    """One request's record from when it was sent, its first and last tokens came, and how many."""
    if error is None and (first is None or tokens == 0):
        error = "no tokens"
    tpot = (last - first) / (tokens - 1) if error is None and tokens > 1 else None
    return {"ttft_s": first - start if first is not None else None, "tpot_s": tpot, "tokens": tokens,
            "error": error}  # fmt: skip


# --- HTTP -----------------------------------------------------------------------------------------


def completion_body(
    model: str, prompt: list[int], output_tokens: int, ignore_eos: bool = True
) -> dict[str, Any]:
    """A streamed greedy completion of `output_tokens` tokens, its usage in the last event."""
    return {
        "model": model, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0,
        "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip


# A request's body from (model, prompt, output tokens, the client's id): http_records' body_for
BodyFor = Callable[[str, list[int], int, int], dict[str, Any]]


async def stream_one(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
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
    record = request_record(start, first, last, tokens, error)
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
    one clock for every process of the machine). body_for: each request's body (default completion_body's);
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
                body = completion_body(model, prompt, output_tokens)
            else:
                body = body_for(model, prompt, output_tokens, client_id)
            records.append({**await stream_one(client, url, body), "client": client_id})

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


# --- progress and figures -----------------------------------------------------------------------------


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def mark(marks: str | None, phase: str) -> None:
    """With a marks file: a line "<unix time> <phase>" where a phase begins (for lining a profiler up)."""
    if marks:
        with open(marks, "a") as file:
            file.write(f"{time.time():.3f} {phase}\n")


def brief(result: dict[str, Any]) -> str:
    """A summary's throughput, TPOT and errors in one line (and its TTFT inside the engine, when known)."""
    tpot = ms(result["tpot_p50_ms"])
    text = f"{result['output_tok_s']:.1f} tok/s, TPOT p50 {tpot}, errors {result['errors']}"
    if result.get("engine_ttft_mean_ms") is not None:  # the HTTP path's share of the TTFT
        text += f"; TTFT mean {ms(result['ttft_mean_ms'])}, in the engine {ms(result['engine_ttft_mean_ms'])}"
    return text


def ms(value: float | None) -> str:
    return f"{value:.2f} ms" if value is not None else "-"


def percent(share: float | None) -> str:
    return f"{100 * share:.1f} %" if share is not None else "-"
