"""An engine replica killed under load: what the clients see.

Serves serve_config.yaml as `make run` does, with --engine-replicas replicas (2 by default; on one GPU at
1/N of it each), runs C streaming clients in a closed loop (load_client.py's prompts and requests), and
SIGKILLs one engine replica's process --kill-after seconds into the load. Then it reports:

- lost: requests that ended with an error and no token (a request with no token yet must move to
  another replica unseen);
- in-band: requests that had streamed tokens and ended with OpenAI's error event (as they should);
- hung: requests cut by the client's timeout;
- resume: from the kill to the first token of the first request sent after it; and the longest
  pause in the whole load's token stream after the kill.

    python bench/replica_kill.py --model qwen3-0.6b --dtype bfloat16 --clients 64 --out /tmp/kill
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import load_client, serve_app, serve_load  # noqa: E402

REQUEST_TIMEOUT_S = 120.0  # a request still open after this long counts as hung


def engine_pids(app: str) -> list[int]:
    """The processes of the app's engine replicas (Ray names them ServeReplica:<app>:EngineDeployment)."""
    found = subprocess.run(["pgrep", "-f", f"ServeReplica:{app}:Engine"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


async def stream_request(client: Any, url: str, body: dict[str, Any], events: list[float]) -> dict[str, Any]:
    """One streamed completion: when it was sent, got its first and last token, its tokens and error;
    the time of every chunk with text goes into `events`."""
    import httpx

    sent, first, tokens, error = time.monotonic(), None, 0, None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return {
                    "sent": sent,
                    "first": None,
                    "tokens": 0,
                    "error": f"HTTP {response.status_code}: {text}",
                }
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    error = "in-band: " + str(event["error"].get("message"))
                elif event.get("choices"):
                    now = time.monotonic()
                    first = first if first is not None else now
                    events.append(now)
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except httpx.TimeoutException:
        error = "hung"
    except Exception as failure:  # noqa: BLE001 - a broken connection counts as an error
        error = f"{type(failure).__name__}: {failure}"
    return {"sent": sent, "first": first, "tokens": tokens, "error": error}


async def load_and_kill(
    base_url: str, model: str, prompts: list[list[int]], args: argparse.Namespace
) -> dict:
    import httpx

    pids = engine_pids(args.app)
    if len(pids) < 2:
        raise RuntimeError(f"{len(pids)} engine replica processes found: the kill needs 2 or more")
    url = base_url.rstrip("/") + "/v1/completions"
    pending = iter(prompts)
    records: list[dict[str, Any]] = []
    events: list[float] = []
    killed: dict[str, float] = {}

    async def client_loop(client: httpx.AsyncClient) -> None:
        for prompt in pending:
            body = load_client.completion_body(model, prompt, args.output_tokens)
            records.append(await stream_request(client, url, body, events))

    async def kill() -> None:
        await asyncio.sleep(args.kill_after)
        killed["at"] = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        load_client.log(f"killed engine replica process {pids[0]} ({len(events)} chunks so far)")

    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=60)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        killer = asyncio.create_task(kill())
        await asyncio.gather(*(client_loop(client) for _ in range(args.clients)))
        await killer
    return summarize(records, sorted(events), killed["at"])


def summarize(records: list[dict[str, Any]], events: list[float], killed_at: float) -> dict[str, Any]:
    """What the clients saw, around the kill at `killed_at` (time.monotonic)."""
    after = [record for record in records if record["sent"] >= killed_at]
    firsts_after = [record["first"] for record in after if record["first"] is not None]
    later = [event for event in events if event >= killed_at]
    pauses = [b - a for a, b in zip([killed_at, *later], later, strict=False)]
    no_token_at_kill = [
        record for record in records
        if record["sent"] < killed_at and (record["first"] is None or record["first"] > killed_at)
    ]  # fmt: skip
    return {
        "requests": len(records),
        "completed": sum(record["error"] is None for record in records),
        "lost": sum(record["error"] is not None and record["first"] is None for record in records),
        "in_band": sum(bool(record["error"] and record["error"].startswith("in-band")) for record in records),
        "hung": sum(record["error"] == "hung" for record in records),
        "errors": sorted({record["error"][:120] for record in records if record["error"]}),
        "waiting_at_kill": len(no_token_at_kill),
        "waiting_at_kill_completed": sum(record["error"] is None for record in no_token_at_kill),
        "resume_s": min(firsts_after) - killed_at if firsts_after else None,
        "longest_pause_after_kill_s": max(pauses) if pauses else None,
        "ttft_p50_after_kill_ms": load_client.percentile(
            [(record["first"] - record["sent"]) * 1e3 for record in after if record["first"] is not None], 0.5
        ),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--kill-after", type=float, default=5.0, help="seconds into the load")
    parser.add_argument("--engine-replicas", type=int, default=2)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--app", default="tileinfer", help="the application's name in serve_config.yaml")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_args = serve_load.parse_args([
        "--serve-config", str(ROOT / "serve_config.yaml"), "--model", args.model, "--dtype", args.dtype,
        "--engine-replicas", str(args.engine_replicas), "--concurrency", str(args.clients),
        "--prompt-tokens", str(args.prompt_tokens), "--output-tokens", str(args.output_tokens),
    ])  # fmt: skip
    config, app_args = serve_load.app_args_for(load_args)
    num_gpus = serve_app.num_gpus(app_args.device)
    config = serve_app.with_app_args(config, serve_load.engine_replica_args(load_args, num_gpus, None))
    vocab = serve_load.vocab_for(load_args, app_args)
    prompts = load_client.make_prompts(
        args.clients * args.requests_per_client, args.prompt_tokens, vocab, "kill"
    )

    def load(base_url: str) -> dict[str, Any]:
        model = serve_app.served_model(base_url)
        return asyncio.run(load_and_kill(base_url, model, prompts, args))

    payload = serve_app.serve_and_record("replica_kill", args, config, out, load)
    print(json.dumps(payload["result"], indent=2))
    return payload


if __name__ == "__main__":
    main()
