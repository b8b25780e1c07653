"""Short requests beside long prompts: their time to first token, with and without the long ones, and what
the long prompts pay for it.

Serves serve_config.yaml as `make run` does (one engine replica), then runs three phases:
- alone: --short-clients streaming clients in a closed loop (--short-tokens prompts, --short-output-tokens
  output tokens each), --requests-per-client requests each;
- beside: the same, beside --long-clients clients that each send --long-tokens prompts (16 output tokens)
  one after another, sent a second before the short ones start;
- long alone: the long clients alone, --long-alone-requests prompts each: the long prompts' TTFT without
  short requests, what the time budget costs them.

The engine cuts a long prompt's chunks so that a step holding one takes about long_prefill_step_ms
(engine/scheduler.py), so the short requests' TTFT beside the long ones should stay within about twice
what it is alone (the target: p99 beside <= 2x p99 alone). --long-prefill-step-ms sets that budget (0: off,
steps by tokens only, for the comparison). Prints the short requests' TTFT p50 and p99 in both phases and
the long ones' TTFT beside them and alone, as JSON, then a table; writes long_prompts.json to --out.

    python bench/long_prompts.py --model qwen3-0.6b --dtype bfloat16 --out /tmp/long
    python bench/long_prompts.py --model smollm2-135m --long-tokens 1024 --short-tokens 16 \
        --short-output-tokens 4 --short-clients 2 --long-clients 1 --requests-per-client 3 \
        --long-alone-requests 1 --http-port 8610 --out /tmp/long   # a few minutes on a CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import load_client, serve_app, serve_load  # noqa: E402
from bench.replica_kill import stream_request  # noqa: E402

LONG_OUTPUT_TOKENS = 16


def _ttfts_ms(records: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [(record["first"] - record["sent"]) * 1e3 for record in records if record["first"] is not None]
    return {
        "requests": len(records),
        "errors": sum(record["error"] is not None for record in records),
        "ttft_p50_ms": load_client.percentile(ttfts, 0.5),
        "ttft_p99_ms": load_client.percentile(ttfts, 0.99),
    }


async def phase(
    base_url: str, model: str, args: argparse.Namespace, vocab: tuple[int, int], name: str,
    shorts: bool = True, longs: bool = False,
) -> dict:  # fmt: skip
    """The short clients' requests, prompts seeded by `name`; with `longs`, the long clients' beside them
    (until the short ones end, or, alone, --long-alone-requests each)."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    num_shorts = args.short_clients * args.requests_per_client if shorts else 0
    short_prompts = iter(load_client.make_prompts(num_shorts, args.short_tokens, vocab, name))
    records: dict[str, list[dict[str, Any]]] = {"short": [], "long": []}
    done = asyncio.Event()
    events: list[float] = []

    async def short_loop(client: httpx.AsyncClient) -> None:
        for prompt in short_prompts:
            body = load_client.completion_body(model, prompt, args.short_output_tokens)
            records["short"].append(await stream_request(client, url, body, events))

    async def long_loop(client: httpx.AsyncClient, index: int) -> None:
        count = 0
        while not done.is_set() if shorts else count < args.long_alone_requests:
            prompt = load_client.make_prompts(1, args.long_tokens, vocab, f"{name}:long:{index}:{count}")[0]
            body = load_client.completion_body(model, prompt, LONG_OUTPUT_TOKENS)
            records["long"].append(await stream_request(client, url, body, events))
            count += 1

    clients = args.short_clients + args.long_clients
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=60), limits=limits) as client:
        num_longs = args.long_clients if longs else 0
        long_tasks = [asyncio.create_task(long_loop(client, index)) for index in range(num_longs)]
        if longs and shorts:
            await asyncio.sleep(1.0)  # the long prompts first in the queue
        started = time.monotonic()
        await asyncio.gather(*(short_loop(client) for _ in range(args.short_clients if shorts else 0)))
        wall_s = time.monotonic() - started
        done.set()
        await asyncio.gather(*long_tasks)
    result: dict[str, Any] = {}
    if shorts:
        result.update(short=_ttfts_ms(records["short"]), short_wall_s=wall_s)
    if longs:
        result["long"] = _ttfts_ms(records["long"])
    return result


def table(result: dict[str, Any]) -> str:
    alone, beside = result["alone"]["short"], result["beside_long_prompts"]["short"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.1f} ms"

    rows = [
        "| requests | TTFT p50 | TTFT p99 | n | errors |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(
            f"| {label} | {ms(figures['ttft_p50_ms'])} | {ms(figures['ttft_p99_ms'])} | "
            f"{figures['requests']} | {figures['errors']} |"
            for label, figures in (
                ("short, alone", alone),
                ("short, beside the long prompts", beside),
                ("long, beside the short requests", result["beside_long_prompts"]["long"]),
                ("long, alone", result["long_alone"]["long"]),
            )
        ),
    ]
    if alone["ttft_p99_ms"] and beside["ttft_p99_ms"] is not None:
        ratio = beside["ttft_p99_ms"] / alone["ttft_p99_ms"]
        rows.append(f"\nshort requests' TTFT p99, beside / alone: {ratio:.2f} (the target: 2 at most)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--short-clients", type=int, default=8)
    parser.add_argument("--short-tokens", type=int, default=512)
    parser.add_argument("--short-output-tokens", type=int, default=128)
    parser.add_argument("--long-clients", type=int, default=2)
    parser.add_argument("--long-tokens", type=int, default=16384)
    parser.add_argument("--requests-per-client", type=int, default=8, help="short requests per client")
    parser.add_argument("--long-alone-requests", type=int, default=4, help="per long client, alone")
    parser.add_argument(
        "--long-prefill-step-ms", type=float, default=None, help="the app arg; default: the device's; 0: off"
    )
    parser.add_argument("--http-port", type=int, default=None, help="default: the serve config's (8000)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clients = args.short_clients + args.long_clients
    load_args = serve_load.parse_args([
        "--serve-config", str(ROOT / "serve_config.yaml"), "--model", args.model, "--dtype", args.dtype,
        "--concurrency", str(clients), "--prompt-tokens", str(args.long_tokens),
        "--output-tokens", str(args.short_output_tokens),
    ])  # fmt: skip
    config, app_args = serve_load.app_args_for(load_args)
    if args.long_prefill_step_ms is not None:
        config = serve_app.with_app_args(config, {"long_prefill_step_ms": args.long_prefill_step_ms})
    if args.http_port is not None:
        config = {**config, "http_options": {**(config.get("http_options") or {}), "port": args.http_port}}
    vocab = serve_load.vocab_for(load_args, app_args)

    def load(base_url: str) -> dict[str, Any]:
        model = serve_app.served_model(base_url)
        results = {}
        for key, name, shorts, longs in (
            ("warm_up", "warm-up", True, False), ("alone", "alone", True, False),
            ("beside_long_prompts", "beside", True, True), ("long_alone", "long-alone", False, True),
        ):  # fmt: skip
            started = time.monotonic()
            results[key] = asyncio.run(phase(base_url, model, args, vocab, name, shorts, longs))
            took = time.monotonic() - started
            print(f"long_prompts: {name} done in {took:.1f} s", file=sys.stderr, flush=True)
        del results["warm_up"]
        return results

    payload = serve_app.serve_and_record("long_prompts", args, config, out, load)
    print(json.dumps(payload["result"], indent=2))
    print(table(payload["result"]))
    return payload


if __name__ == "__main__":
    main()
