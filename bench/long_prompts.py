"""Short requests beside long prompts: their time to first token, with and without the long ones.

Serves serve_config.yaml as `make run` does (one engine replica), then runs --short-clients streaming
clients in a closed loop (512-token prompts, 128 output tokens), first alone and then beside
--long-clients clients that each send --long-tokens-token prompts (16 output tokens) one after another.
A long prompt takes at most long_prefill_token_threshold tokens of a step while shorter ones wait
(engine/scheduler.py), so the short requests' TTFT should stay near what it is alone. Reports the short
requests' TTFT p50 and p99 in both phases and the long ones' TTFT.

    python bench/long_prompts.py --model qwen3-0.6b --dtype bfloat16 --out /tmp/long
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

from bench import serve_load  # noqa: E402
from bench.replica_kill import stream_request  # noqa: E402


def _ttfts_ms(records: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [(record["first"] - record["sent"]) * 1e3 for record in records if record["first"] is not None]
    return {
        "requests": len(records),
        "errors": sum(record["error"] is not None for record in records),
        "ttft_p50_ms": serve_load._percentile(ttfts, 0.5),
        "ttft_p99_ms": serve_load._percentile(ttfts, 0.99),
    }


async def phase(
    base_url: str, model: str, args: argparse.Namespace, vocab: tuple[int, int], name: str, long: bool
) -> dict:
    """The short clients' requests, prompts seeded by `name` (with `long`, the long clients' beside them
    until the short ones end)."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    shorts = iter(serve_load.make_prompts(args.short_clients * args.requests_per_client, 512, vocab, name))
    records: dict[str, list[dict[str, Any]]] = {"short": [], "long": []}
    done = asyncio.Event()
    events: list[float] = []

    async def short_loop(client: httpx.AsyncClient) -> None:
        for prompt in shorts:
            body = serve_load._completion_body(model, prompt, 128)
            records["short"].append(await stream_request(client, url, body, events))

    async def long_loop(client: httpx.AsyncClient, index: int) -> None:
        count = 0
        while not done.is_set():
            prompt = serve_load.make_prompts(1, args.long_tokens, vocab, f"{name}:long:{index}:{count}")[0]
            body = serve_load._completion_body(model, prompt, 16)
            records["long"].append(await stream_request(client, url, body, events))
            count += 1

    clients = args.short_clients + args.long_clients
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=60), limits=limits) as client:
        longs = [
            asyncio.create_task(long_loop(client, index)) for index in range(args.long_clients if long else 0)
        ]
        await asyncio.sleep(1.0 if long else 0.0)  # the long prompts first in the queue
        started = time.monotonic()
        await asyncio.gather(*(short_loop(client) for _ in range(args.short_clients)))
        wall_s = time.monotonic() - started
        done.set()
        await asyncio.gather(*longs)
    return {"short": _ttfts_ms(records["short"]), "long": _ttfts_ms(records["long"]), "short_wall_s": wall_s}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--short-clients", type=int, default=8)
    parser.add_argument("--long-clients", type=int, default=2)
    parser.add_argument("--long-tokens", type=int, default=16384)
    parser.add_argument("--requests-per-client", type=int, default=8)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clients = args.short_clients + args.long_clients
    load_args = serve_load.parse_args([
        "--serve-config", str(ROOT / "serve_config.yaml"), "--model", args.model, "--dtype", args.dtype,
        "--concurrency", str(clients), "--prompt-tokens", str(args.long_tokens), "--output-tokens", "128",
    ])  # fmt: skip
    config, app_args = serve_load.app_args_for(load_args)
    vocab = serve_load._vocab(load_args, serve_load._model_vocab(app_args.model))

    env = serve_load.make_run_env()

    def load(base_url: str) -> dict[str, Any]:
        model = serve_load.served_model(base_url)
        asyncio.run(phase(base_url, model, args, vocab, "warm-up", long=False))
        alone = asyncio.run(phase(base_url, model, args, vocab, "alone", long=False))
        beside = asyncio.run(phase(base_url, model, args, vocab, "beside", long=True))
        return {"alone": alone, "beside_long_prompts": beside}

    result, ready_s = serve_load.serve_and_load(
        config, out / "long_prompts_config.yaml", out / "long_prompts_serve.log", load_args, env, load
    )
    payload = {"args": vars(args), "ready_s": ready_s, "result": result}
    (out / "long_prompts.json").write_text(json.dumps(payload, indent=2))
    print(json.dumps(result, indent=2))
    return payload


if __name__ == "__main__":
    main()
