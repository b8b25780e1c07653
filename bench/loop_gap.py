"""Heavy request bodies beside a stream: the stream's longest gap while each is handled.

An ingress replica parses, validates, renders and tokenizes every request it takes on the event loop that
also sends its streams, unless the work runs off it (deployments/openai_api/ingress.py, OFF_LOOP_BYTES). This
serves serve_config.yaml as `make run` does (one ingress replica below 8 CPUs), or loads --url, keeps one
streamed completion going, and sends each heavy request in turn, --repeats times:

- tools: a chat with four tools, each with a 30,000-string enum (2 MB);
- prompt-3mb, prompt-1mb: completions with a 3 MB and a 1 MB prompt;
- prompt-500kb: a 500 KB prompt, which (unlike the two above) is short enough to be tokenized before it is
  refused.

Each is answered 400 (too long for the context). The table gives the stream's median and longest gap alone,
and its longest gap while each request was handled: the least over the repeats, since a blocked loop blocks
every time and a busy machine's scheduling does not.

    python bench/loop_gap.py --out /tmp/gap                    # the CPU, SmolLM2-135M, as `make run`
    python bench/loop_gap.py --url http://127.0.0.1:8000       # a running server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import serve_app, serve_load  # noqa: E402

STORY = "Tell me a story about a dragon. "  # 32 characters


def heavy_requests(model: str) -> dict[str, tuple[str, bytes]]:
    """Each heavy request: its path and its JSON body."""

    def tool(index: int) -> dict[str, Any]:
        choices = {"type": "string", "enum": [f"value-{index}-{n:05d}" for n in range(30000)]}
        parameters = {"type": "object", "properties": {"value": choices}}
        return {"type": "function", "function": {"name": f"pick_{index}", "parameters": parameters}}

    tools = [tool(index) for index in range(4)]
    chat = {"model": model, "messages": [{"role": "user", "content": "Pick one."}], "tools": tools}

    def completion(num_bytes: int) -> dict[str, Any]:
        return {"model": model, "prompt": STORY * (num_bytes // len(STORY)), "max_tokens": 16}

    bodies = {
        "tools": ("/v1/chat/completions", chat),
        "prompt-3mb": ("/v1/completions", completion(3 << 20)),
        "prompt-1mb": ("/v1/completions", completion(1 << 20)),
        "prompt-500kb": ("/v1/completions", completion(500 << 10)),
    }
    return {name: (path, json.dumps(body).encode()) for name, (path, body) in bodies.items()}


def gaps(events: list[float], start: float, end: float) -> list[float]:
    """The gaps between a stream's events (their arrival times) that overlap [start, end], in seconds."""
    pairs = zip(events, events[1:], strict=False)
    return [later - earlier for earlier, later in pairs if later >= start and earlier <= end]


async def _stream(client: Any, base_url: str, model: str, events: list[float]) -> None:
    """Streamed completions one after another, the arrival time of each event into `events`."""
    body = {"model": model, "prompt": "Once upon", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    while True:
        async with client.stream("POST", base_url + "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(time.monotonic())


def _post(url: str, body: bytes) -> int:
    import httpx

    return httpx.post(
        url, content=body, headers={"Content-Type": "application/json"}, timeout=600
    ).status_code


async def measure(base_url: str, model: str, repeats: int, alone_s: float) -> dict[str, Any]:
    import httpx

    events: list[float] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=60)) as client:
        streaming = asyncio.create_task(_stream(client, base_url, model, events))
        try:
            while len(events) < 5:
                await asyncio.sleep(0.05)
            start = time.monotonic()
            await asyncio.sleep(alone_s)
            alone = gaps(events, start, time.monotonic())
            result: dict[str, Any] = {
                "alone": {"median_gap_ms": statistics.median(alone) * 1e3, "longest_gap_ms": max(alone) * 1e3}
            }
            for name, (path, body) in heavy_requests(model).items():
                statuses, longest = [], []
                for _ in range(repeats):
                    await asyncio.sleep(0.5)
                    sent = time.monotonic()
                    # from a thread: sending 3 MB must not hold up this loop, which times the stream
                    statuses.append(await asyncio.to_thread(_post, base_url + path, body))
                    done = time.monotonic()
                    await asyncio.sleep(1.0)  # the gap that spans the end closes
                    longest.append(max(gaps(events, sent, done)) * 1e3)
                result[name] = {"bytes": len(body), "statuses": statuses, "longest_gap_ms": min(longest),
                                "longest_gap_each_ms": longest}  # fmt: skip
        finally:
            streaming.cancel()
    return result


def table(result: dict[str, Any]) -> str:
    alone = result["alone"]
    lines = [
        f"stream alone: median gap {alone['median_gap_ms']:.0f} ms, longest {alone['longest_gap_ms']:.0f} ms",
        f"{'request':<14} {'MB':>5} {'status':>6} {'longest gap ms':>15}",
    ]
    for name, row in result.items():
        if name != "alone":
            status = "/".join(sorted({str(code) for code in row["statuses"]}))
            lines.append(f"{name:<14} {row['bytes'] / 1e6:5.2f} {status:>6} {row['longest_gap_ms']:15.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default=None, help="load this running server (default: serve one)")
    parser.add_argument("--model", default=None, help="default: the serve config's (smollm2-135m)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--alone-s", type=float, default=5.0, help="the stream timed alone first")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def load(base_url: str) -> dict[str, Any]:
        return asyncio.run(measure(base_url, serve_app.served_model(base_url), args.repeats, args.alone_s))

    if args.url:
        result, setup = load(args.url.rstrip("/")), {"url": args.url}
    else:
        model = ["--model", args.model] if args.model else []
        load_args = serve_load.parse_args(["--serve-config", str(ROOT / "serve_config.yaml"), *model])
        config, app_args = serve_load.app_args_for(load_args)
        env = serve_app.make_run_env()
        result, _ = serve_app.serve_and_load(
            config, out / "loop_gap_config.yaml", out / "loop_gap_serve.log", env, load
        )
        setup = serve_app.serve_setup(app_args, env)
    payload = {"args": vars(args), "setup": setup, "result": result}
    (out / "loop_gap.json").write_text(json.dumps(payload, indent=2))
    print(table(result))
    return payload


if __name__ == "__main__":
    main()
