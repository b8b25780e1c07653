"""How tokens stream through the served app (deployments/replicas/engine_replica.py's outputs stream, the
ingress's TextStream): stop strings cut at the ingress, usage counting only the tokens up to the stop, and the
serve-load generator's HTTP mode."""

from __future__ import annotations

import json

import httpx
import pytest
from serving import Served

from bench import serve_load

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me a short story about a fox and a crow."}]


def _chat(served: Served, **fields) -> dict:  # noqa: ANN003
    body = {"model": served.model, "messages": MESSAGES, "max_tokens": 40, "temperature": 0, **fields}
    response = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_stop_string_ends_the_choice_at_the_ingress(served: Served) -> None:
    plain = _chat(served, logprobs=True, ignore_eos=True)
    text = plain["choices"][0]["message"]["content"]
    token_bytes = [bytes(item["bytes"]) for item in plain["choices"][0]["logprobs"]["content"]]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3 and text.find(stop) > 0
    # the token that completes the stop string is the last one counted
    num_tokens = next(
        count for count in range(1, len(token_bytes) + 1)
        if stop in b"".join(token_bytes[:count]).decode(errors="ignore")
    )  # fmt: skip
    cut = _chat(served, logprobs=True, ignore_eos=True, stop=[stop])
    assert cut["choices"][0]["message"]["content"] == text[: text.find(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["usage"]["completion_tokens"] == num_tokens
    assert len(cut["choices"][0]["logprobs"]["content"]) == num_tokens
    body = {"model": served.model, "messages": MESSAGES, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stop": [stop], "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    streamed, reasons, usage = "", [], None
    with httpx.stream("POST", served.base_url + "/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk["choices"]:
                streamed += choice["delta"].get("content") or ""
                reasons += [choice["finish_reason"]] if choice["finish_reason"] else []
            usage = chunk.get("usage") or usage
    assert streamed == text[: text.find(stop)] and reasons == ["stop"]
    assert usage["completion_tokens"] == num_tokens


def test_serve_load_http_mode(served: Served, tmp_path) -> None:  # noqa: ANN001
    payload = serve_load.main(
        ["--url", served.base_url, "--concurrency", "1,3", "--prompt-tokens", "16", "--output-tokens", "6",
         "--requests", "6", "--vocab", "100:40000", "--out", str(tmp_path)]
    )  # fmt: skip
    for row in payload["results"]["http"].values():
        assert row["errors"] == 0 and row["output_tokens"] == 6 * 6
        # the engine's own TTFT, from /metrics, is part of what the clients saw
        assert 0 < row["engine_ttft_mean_ms"] < row["ttft_mean_ms"], row
