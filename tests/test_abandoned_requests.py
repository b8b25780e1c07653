"""Abandoned requests are aborted within a second, streamed or not: the engine frees the sequences and their
KV blocks, and counts the abort. A client abandons a request by closing its connection. The last test runs
the real application in `make run`'s HAProxy mode (the `served` fixture), with clients that send the body
after the headers, as httpx (and so the openai client) does; the ones before it, the two parts it relies on:
HAProxy's configuration, and the ingress's own watch of its client."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from ingress_harness import MODEL, make_ingress
from serving import Served
from test_serve_api import _metrics
from tileinfer.deployments.launch import haproxy
from tileinfer.engine.models.gguf_loader import read_gguf
from tileinfer.engine.text.tokenizer import Tokenizer

ABORTED = "tileinfer_requests_total{finish_reason=abort}"
ABORT_WITHIN_S = 1.0  # the product's bound
MARGIN_S = 1.5  # a loaded two-core machine: /metrics itself calls the engine
STORY = [{"role": "user", "content": "Tell me a story"}]


def test_haproxy_forwards_a_client_close_while_the_server_answers() -> None:
    """The rewrite of Ray's HAProxy configuration: no request splicing (HAProxy 2.8 then missed the close of
    a client whose body came after its headers), abortonclose kept, or added where a template lacks it."""
    ray_defaults = "defaults\n    mode http\n    option abortonclose\n    option splice-request\n"
    assert haproxy.abort_on_close(ray_defaults) == "defaults\n    mode http\n    option abortonclose\n"
    assert haproxy.abort_on_close("global\n    nbthread 4\ndefaults\n    mode http\n") == (
        "global\n    nbthread 4\ndefaults\n    option abortonclose\n    mode http\n"
    )


@pytest.mark.parametrize(("path", "extra"), [("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions",
                                           {"messages": STORY, "n": 2})])  # fmt: skip
def test_the_ingress_aborts_the_request_of_a_client_that_left(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch, path: str, extra: dict
) -> None:
    """A plain (not streamed) response's client goes away: the ingress aborts its engine requests and ends,
    though its server cancels nothing (Serve's part, which a client may turn off with
    x-request-disconnect-disabled: ?1). The ingress's own class on a stand-in engine that sends a token every
    5 ms (tests/ingress_harness.py)."""
    ingress, engine = make_ingress(Tokenizer.from_gguf(read_gguf(smollm2_gguf)), monkeypatch)
    engine.reply, engine.piecewise = engine.reply * 400, True
    aborted: list[str] = []
    monkeypatch.setattr(ingress.client, "abort", lambda request_id, reason="abort": aborted.append(reason))
    app = ingress.__serve_build_asgi_app__()
    body = json.dumps({"model": MODEL, "max_tokens": 400, **extra}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "server": ("ingress", 80),
             "client": ("client", 1)}  # fmt: skip
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await asyncio.sleep(0.3)  # the client leaves
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> float:
        start = time.monotonic()
        await asyncio.wait_for(app(scope, receive, send), timeout=10)  # the whole answer takes 2 s
        return time.monotonic() - start

    assert asyncio.run(run()) < 1.0
    assert aborted == ["abort"] * extra.get("n", 1) and sent == []


def _send(url: str, path: str, body: dict, headers: dict[str, str]) -> socket.socket:
    """A POST on a connection of its own, its body a moment after its headers."""
    address = urlsplit(url)
    connection = socket.create_connection((address.hostname, address.port), timeout=30)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = json.dumps(body).encode()
    head = {"Host": address.netloc, "Content-Type": "application/json", "Content-Length": str(len(data)),
            **headers}  # fmt: skip
    lines = "".join(f"{name}: {value}\r\n" for name, value in head.items())
    connection.sendall(f"POST {address.path}{path} HTTP/1.1\r\n{lines}\r\n".encode())
    time.sleep(0.05)
    connection.sendall(data)
    return connection


def _wait_for(
    served: Served, condition: Callable[[dict[str, float]], bool], timeout_s: float
) -> tuple[bool, float, dict[str, float]]:
    """Poll /metrics until condition(metrics) holds: whether it did, after how long, the last metrics."""
    start = time.monotonic()
    while True:
        metrics = _metrics(served.base_url)
        if condition(metrics) or time.monotonic() - start > timeout_s:
            return condition(metrics), time.monotonic() - start, metrics
        time.sleep(0.05)


def _idle(metrics: dict[str, float]) -> bool:
    return metrics["tileinfer_num_requests_running"] == 0 and metrics["tileinfer_kv_cache_used_blocks"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "extra", "headers"),
    [
        ("/v1/completions", {"prompt": "Tell me a story", "stream": True}, {}),
        ("/v1/chat/completions", {"messages": STORY, "n": 2, "stream": True}, {}),
        ("/v1/completions", {"prompt": "Tell me a story"}, {}),  # a bare curl command's request
        ("/v1/chat/completions", {"messages": STORY, "n": 2}, {}),
        # any client may ask Serve not to watch for its disconnect
        ("/v1/completions", {"prompt": "Tell me a story"}, {"x-request-disconnect-disabled": "?1"}),
    ],
    ids=["completion-stream", "chat-n2-stream", "completion", "chat-n2", "completion-disconnect-disabled"],
)
def test_an_abandoned_request_is_aborted_within_a_second(
    served: Served, path: str, extra: dict, headers: dict[str, str]
) -> None:
    n = extra.get("n", 1)
    body = {"model": served.model, "max_tokens": 2000, "ignore_eos": True, **extra}
    assert _wait_for(served, _idle, 60)[0], "an earlier request still runs"
    before = _metrics(served.base_url).get(ABORTED, 0)
    connection = _send(served.base_url, path, body, headers)
    try:
        assert _wait_for(served, lambda metrics: metrics["tileinfer_num_requests_running"] == n, 60)[0]
        if body.get("stream"):
            assert connection.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        connection.close()
    freed, seconds, after = _wait_for(served, _idle, ABORT_WITHIN_S + MARGIN_S)
    assert freed, f"still running {seconds:.1f} s after the client left: {after}"
    assert after.get(ABORTED, 0) == before + n
    print(f"aborted {seconds:.2f} s after the client left")
