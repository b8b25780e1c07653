"""The ingress's hardening: bad inputs get a 4xx (never a 5xx), the API key comes from a file
or the environment and never shows in the args' logs, what the key covers, 503s with Retry-After, and
/health, /v1/models and /metrics answering at once while the engine replica restarts.

Most run the ingress's own HTTP app in process (tests/ingress_harness.py: no Ray); the last ones run
against the real application (the `served` fixture)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from ingress_harness import MODEL, build, make_ingress
from ray.serve._private.constants import (
    RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT,
    RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT,
)
from ray.util.client.server.proxier import MAX_SPECIFIC_SERVER_PORT, MIN_SPECIFIC_SERVER_PORT
from serving import API_KEY, Served
from tileinfer.deployments.launch import cluster_security, haproxy
from tileinfer.deployments.launch.app_args import API_KEY_ENV, parse_app_args
from tileinfer.deployments.openai_api import ingress as ingress_module
from tileinfer.deployments.openai_api.errors import RETRY_AFTER_S, OpenAIError
from tileinfer.engine.errors import CapacityError
from tileinfer.engine.models.loader import load_tokenizer
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.text.tokenizer import Tokenizer

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
NO_KEY_MESSAGE = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header using "
    "Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return load_tokenizer("smollm2-135m")


def _chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                       **fields}).encode()  # fmt: skip


def _completion(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}).encode()


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _nested_list(depth: int) -> list:
    nested: list = []
    for _ in range(depth - 1):
        nested = [nested]
    return nested


_MODEL = MODEL.encode()
# (name, path, raw body): inputs that once got a 5xx, and bad inputs that must keep their 4xx
BAD_INPUTS = [
    ("lone surrogate in chat content", CHAT,
     b'{"model":"%s","messages":[{"role":"user","content":"\\ud800"}]}' % _MODEL),
    ("lone surrogate in a prompt", COMPLETIONS, b'{"model":"%s","prompt":"\\udfff abc"}' % _MODEL),
    ("1,000 deep in an unknown field", CHAT, _chat()[:-1] + b',"extra":' + _nested(1000) + b"}"),
    ("100,000 deep in an unknown field", CHAT, _chat()[:-1] + b',"extra":' + _nested(100_000) + b"}"),
    ("50,000 deep in messages", CHAT, b'{"model":"%s","messages":' % _MODEL + _nested(50_000) + b"}"),
    ("lone surrogate in a prompt list", COMPLETIONS, b'{"model":"%s","prompt":["ok","\\udfff"]}' % _MODEL),
    ("lone surrogate in a stop string", CHAT, _chat()[:-1] + b',"stop":"\\udbff"}'),
    ("lone surrogate in a key", CHAT, _chat()[:-1] + b',"\\ud800":1}'),
    ("lone surrogate in chat_template_kwargs", CHAT,
     _chat()[:-1] + b',"chat_template_kwargs":{"x":"\\ud800"}}'),
    ("top_k past int32", CHAT, _chat(top_k=10**18)),  # the engine's step buffers hold top_k as int32
    ("NaN", CHAT, _chat()[:-1] + b',"temperature":NaN}'),
    ("Infinity", CHAT, _chat()[:-1] + b',"repetition_penalty":Infinity}'),
    ("1e999 (inf)", CHAT, _chat()[:-1] + b',"repetition_penalty":1e999}'),
    ("invalid UTF-8", CHAT, b'{"model":"%s","messages":[{"role":"user","content":"\xff\xfe"}]}' % _MODEL),
    ("empty body", CHAT, b""),
    ("an array", CHAT, b"[" + _chat() + b"]"),
    ("a string", COMPLETIONS, b'"hi"'),
    ("a 5,000-digit number", CHAT, _chat()[:-1] + b',"seed":1' + b"0" * 5000 + b"}"),
    ("seed past 64 bits", CHAT, _chat(seed=10**30)),
    ("negative max_tokens", CHAT, _chat(max_tokens=-1)),
    ("max_tokens 10**40", CHAT, _chat(max_tokens=10**40)),
    ("n=0", CHAT, _chat(n=0)),
    ("huge n", COMPLETIONS, _completion(n=10**9)),
    ("prompts x n over 128", COMPLETIONS, _completion(prompt=["a"] * 65, n=2)),
    ("top_logprobs 99", CHAT, _chat(logprobs=True, top_logprobs=99)),
    ("completions logprobs 6", COMPLETIONS, _completion(logprobs=6)),
    ("five stop strings", CHAT, _chat(stop=["a", "b", "c", "d", "e"])),
    ("stop of the wrong type", CHAT, _chat(stop=[["a"]])),
    ("messages as an object", CHAT, _chat(messages={"role": "user", "content": "hi"})),
    ("content of the wrong type", CHAT, _chat(messages=[{"role": "user", "content": 5}])),
    ("prompt token ids past the vocabulary", COMPLETIONS, _completion(prompt=[10**30])),
    ("prompt of floats", COMPLETIONS, _completion(prompt=[1.5])),
    ("a string for a number", CHAT, _chat(temperature="1")),
    ("prompt over the context", COMPLETIONS, _completion(prompt="word " * 600)),
]  # fmt: skip


def _run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


@pytest.mark.parametrize(
    ("path", "body"), [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS]
)
def test_bad_inputs_get_a_4xx_error_object(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, path: str, body: bytes
) -> None:
    async def run() -> httpx.Response:
        client, _ = build(tokenizer, monkeypatch)
        async with client:
            return await client.post(path, content=body, headers={"content-type": "application/json"})

    response = _run(run())
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_chunked_body_over_the_limit_gets_413(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def chunks() -> Any:  # no Content-Length: sent as Transfer-Encoding: chunked
        for _ in range(5):
            yield b" " * 1000
        yield _chat()

    async def run() -> tuple[httpx.Response, httpx.Response]:
        client, _ = build(tokenizer, monkeypatch, max_request_bytes=4096)
        async with client:
            over = await client.post(CHAT, content=chunks())
            under = await client.post(CHAT, content=b" " * 3000 + _chat())
            return over, under

    over, under = _run(run())
    assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"
    assert under.status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "prompt": "\udfff abc"},  # the tokenizer's TypeError, a 500 before
        {"model": MODEL, "prompt": "hi", "extra": _nested_list(5000)},
        {"model": MODEL, "prompt": "hi", "temperature": float("nan")},
        {"model": MODEL, "prompt": "hi", "seed": b"bytes"},
        ["not", "a", "dict"],
    ],
    ids=["lone surrogate", "5,000 deep", "NaN", "bytes", "a list"],
)
def test_handle_bodies_are_held_to_what_json_holds(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, body: Any
) -> None:
    ingress, _ = make_ingress(tokenizer, monkeypatch)
    with pytest.raises(OpenAIError) as raised:
        _run(ingress.complete(body))
    assert raised.value.status_code == 400


# ---- the API key -------------------------------------------------------------------------------


def _statuses(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, requests: list[tuple[str, str, dict]],
              **args: Any) -> list[httpx.Response]:  # fmt: skip
    async def run() -> list[httpx.Response]:
        client, _ = build(tokenizer, monkeypatch, **args)
        async with client:
            return [
                await client.request(
                    method, path, headers=headers, content=_chat() if method == "POST" else None
                )
                for method, path, headers in requests
            ]

    return _run(run())


def test_what_the_key_covers(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    good, lower = {"Authorization": "Bearer s3cret"}, {"Authorization": "bearer s3cret"}
    requests = [
        ("POST", CHAT, {}),  # no key
        ("POST", CHAT, {"Authorization": "Bearer "}),  # an empty one
        ("POST", CHAT, {"Authorization": "Basic czNjcmV0"}),  # not Bearer auth
        ("POST", CHAT, {"Authorization": "Bearer nope"}),
        ("POST", CHAT, {"Authorization": "Bearer s3cr\u00e9t".encode()}),  # compare_digest raised: a 500
        ("POST", CHAT, good),
        ("POST", CHAT, lower),  # RFC 7235: the scheme is case-insensitive
        ("GET", "/v1/models", {}),
        ("GET", "/v1/models", good),
        ("GET", "/health", {}),
        ("GET", "/openapi.json", {}),
        ("GET", "/metrics", {}),
    ]
    responses = _statuses(tokenizer, monkeypatch, requests, api_key="s3cret")
    assert [response.status_code for response in responses] == [401] * 5 + [200, 200, 401, 200, 200, 200, 200]
    messages = [response.json()["error"]["message"] for response in responses[:5]]
    assert messages[:3] == [NO_KEY_MESSAGE] * 3
    assert messages[3].startswith("Incorrect API key provided") and messages[4] == messages[3]
    assert all(response.json()["error"]["code"] == "invalid_api_key" for response in responses[:5])
    guarded_metrics = _statuses(tokenizer, monkeypatch, [("GET", "/metrics", {}), ("GET", "/metrics", good)],
                                api_key="s3cret", metrics_require_key=True)  # fmt: skip
    assert [response.status_code for response in guarded_metrics] == [401, 200]


def test_the_key_from_a_file_or_the_environment_and_masked_in_the_args(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-a-file\n")
    monkeypatch.setenv(API_KEY_ENV, "from-the-env")
    assert parse_app_args({"api_key_file": str(key_file)}).resolve_api_key() == "from-a-file"
    assert parse_app_args({}).resolve_api_key() == "from-the-env"
    in_args = parse_app_args({"api_key": "in-the-args"})
    assert in_args.resolve_api_key() == "in-the-args"
    for shown in (repr(in_args), str(in_args), in_args.model_dump_json(), str(in_args.model_dump())):
        assert "in-the-args" not in shown
    monkeypatch.delenv(API_KEY_ENV)
    assert parse_app_args({}).resolve_api_key() is None
    with pytest.raises(ValueError, match="not both"):
        parse_app_args({"api_key": "a", "api_key_file": str(key_file)})
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        parse_app_args({"api_key_file": str(key_file)}).resolve_api_key()
    with pytest.raises(ValueError, match="cannot read"):
        parse_app_args({"api_key_file": str(tmp_path / "missing")}).resolve_api_key()


# ---- 503s: Retry-After, and no hanging while the engine restarts -------------------------------


def test_engine_calls_answer_503_with_retry_after_when_the_engine_does_not_answer(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ingress_module, "HEALTH_TIMEOUT_S", 0.05)
    monkeypatch.setattr(ingress_module, "CONTROL_CALL_TIMEOUT_S", 0.05)

    async def run() -> list[httpx.Response]:
        client, engine = build(tokenizer, monkeypatch)
        async with client:
            healthy = await client.get("/health")
            engine.stalled.clear()  # its replica restarting: Serve holds every call
            stalled = [await client.get(path) for path in ("/health", "/v1/models", "/metrics")]
            engine.stalled.set()
            return [healthy, *stalled, await client.get("/health"), await client.get("/v1/models")]

    responses = _run(run())
    assert [response.status_code for response in responses] == [200, 503, 503, 503, 200, 200]
    for response in responses[1:4]:
        assert response.headers["retry-after"] == str(RETRY_AFTER_S)
        assert "restarting" in response.json()["error"]["message"]


def test_queue_full_503_carries_retry_after(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    async def run() -> httpx.Response:
        client, engine = build(tokenizer, monkeypatch)

        async def refuse(requests: list, _: str) -> list[CapacityError]:
            return [CapacityError("full") for _ in requests]  # the engine refuses each request it cannot take

        engine._submit = refuse
        async with client:
            return await client.post(CHAT, content=_chat())

    response = _run(run())
    assert response.status_code == 503 and response.json()["error"]["code"] == "queue_full"
    assert response.headers["retry-after"] == str(RETRY_AFTER_S)


# ---- the real application ----------------------------------------------------------------------


@pytest.mark.slow
def test_an_abort_is_not_made_in_the_request_context_it_is_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve cancels the handle calls made in a request's context when that request is cancelled (its
    client went away); an abort made there could be cancelled with it, and the sequence ran on."""
    from ingress_harness import FakeEngine
    from ray.serve import context as serve_context
    from tileinfer.deployments.replicas.engine_client import EngineClient, Inbox

    contexts = []

    async def abort(request_id: str, reason: str = "abort") -> None:
        contexts.append(serve_context._serve_request_context.get())

    async def submit(requests: list, subscriber_id: str) -> list[None]:
        return [None] * len(requests)  # queued, and running: no output yet

    engine = FakeEngine(token_id=1)
    monkeypatch.setattr(engine, "_abort", abort)
    monkeypatch.setattr(engine, "_submit", submit)

    async def run() -> None:
        client = EngineClient(engine)
        request_id = await client.submit([1, 2, 3], SamplingParams(max_tokens=4), Inbox(), None)
        serve_context._serve_request_context.set(serve_context._RequestContext(request_id="the-request"))
        client.abort(request_id)
        await asyncio.gather(*client._calls)

    asyncio.run(run())
    assert len(contexts) == 1 and contexts[0] is None  # made outside "the-request"'s context


def test_bad_inputs_over_http(served: Served) -> None:
    headers = {"content-type": "application/json"}
    for name, path, body in BAD_INPUTS[:5]:
        response = httpx.post(served.base_url + path, content=body, headers=headers, timeout=60)
        assert response.status_code == 400, (name, response.text)

    def chunks() -> Any:
        yield b" " * 3000
        yield b" " * 3000 + _chat()

    keyed = {"Authorization": f"Bearer {API_KEY}", **headers}
    over = httpx.post(served.guarded_url + CHAT, content=chunks(), headers=keyed, timeout=60)
    assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"
    missing = httpx.post(served.guarded_url + CHAT, content=_chat(), headers=headers, timeout=60)
    assert missing.status_code == 401 and missing.json()["error"]["message"] == NO_KEY_MESSAGE
    lower = httpx.post(served.guarded_url + CHAT, content=_chat(), timeout=60,
                       headers={**headers, "Authorization": f"bearer {API_KEY}"})  # fmt: skip
    assert lower.status_code == 200


def _engine_replica_pids(app_name: str) -> list[int]:
    """The processes of an app's engine replica (Ray titles a replica ray::ServeReplica:<app>:Engine)."""
    title = f"ServeReplica:{app_name}:Engine".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if title in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.slow
def test_health_answers_503_at_once_while_the_engine_restarts(served: Served) -> None:
    """Kill the guarded app's engine replica: /health answers 503 (with Retry-After) again and again until
    the new replica is up, where it used to hang until then; the app serves again before this returns."""
    health = served.guarded_url + "/health"
    assert httpx.get(health, timeout=60).status_code == 200
    pids = _engine_replica_pids("guarded")
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    statuses: list[int] = []
    deadline = time.monotonic() + 240  # a bound on the test, not a threshold it asserts
    while time.monotonic() < deadline:
        response = httpx.get(health, timeout=120)
        statuses.append(response.status_code)
        if response.status_code == 200 and len(statuses) > 1:
            break
        assert response.status_code == 503 and response.headers["retry-after"] == str(RETRY_AFTER_S)
        time.sleep(0.2)
    assert statuses[-1] == 200
    # the replica takes seconds to load and warm up; a hanging /health would answer once (or twice: the
    # dead replica's error) and then wait for it
    assert statuses.count(503) >= 3, statuses
    metrics = httpx.get(served.guarded_url + "/metrics", timeout=60)
    assert metrics.status_code == 200
    keyed = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    for _ in range(30):  # the ingress subscribes to the new replica on its next request
        chat = httpx.post(served.guarded_url + CHAT, content=_chat(), headers=keyed, timeout=120)
        if chat.status_code == 200:
            break
        time.sleep(1)
    assert chat.status_code == 200, chat.text


def _listening_sockets() -> dict[int, tuple[str, int]]:
    """inode -> (host, port) of every listening TCP socket of this machine (/proc/net/tcp and tcp6)."""
    import socket

    sockets = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[index : index + 4][::-1] for index in range(0, len(raw), 4))
            sockets[int(fields[9])] = (socket.inet_ntop(family, raw), int(port, 16))
    return sockets


def _processes() -> dict[int, tuple[int, str, list[tuple[str, int]]]]:
    """pid -> (parent pid, command line, the (host, port)s it listens on) of this user's processes."""
    sockets = _listening_sockets()
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            links = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:  # gone, or another user's
            continue
        inodes = [int(link[8:-1]) for link in links if link.startswith("socket:[")]
        found[int(proc.name)] = (parent, command, [sockets[inode] for inode in inodes if inode in sockets])
    return found


def _ray_listeners() -> list[tuple[str, int, str]]:
    """(host, port, process) of the sockets that this user's Ray processes listen on."""
    return [
        (host, port, command[:80])
        for _, command, held in _processes().values()
        if "ray" in command
        for host, port in held
    ]


def _cluster_listeners(ray_address: str) -> list[tuple[int, str]]:
    """(port, process) of the sockets that the cluster at ray_address listens on: every process under the
    launcher that started it (tests/serving.py), Ray's, `serve run` and HAProxy."""
    processes = _processes()
    gcs_port = int(ray_address.rsplit(":", 1)[1])
    gcs = next(pid for pid, (_, _, held) in processes.items() if any(port == gcs_port for _, port in held))
    launcher = processes[processes[gcs][0]][0]  # gcs_server <- `ray start --block` <- the launcher

    def started_by_launcher(pid: int) -> bool:
        while pid in processes and pid != launcher:
            pid = processes[pid][0]
        return pid == launcher

    return [
        (port, command[:80])
        for pid, (_, command, held) in processes.items()
        if started_by_launcher(pid)
        for _, port in held
    ]


def test_every_listener_is_on_loopback(served: Served) -> None:
    """Ray on 127.0.0.1, each Serve replica's inter-deployment gRPC server on the node's address
    (deployments/replicas/listeners.py), not on [::] as Ray binds it, and HAProxy's stats and Prometheus pages
    on 127.0.0.1 (deployments/launch/haproxy.py): nothing of the app listens beyond loopback."""
    listeners = _ray_listeners()
    replicas = [listener for listener in listeners if "ServeReplica" in listener[2]]
    assert len(replicas) >= 8  # four apps' engines and ingresses, each with its servers: the scan sees them
    if haproxy.available():  # `make run` serves in HAProxy mode, whose own pages Ray binds on every interface
        assert any("haproxy" in listener[2] for listener in listeners)
    loopback = ("127.", "::ffff:127.", "::1")
    assert [listener for listener in listeners if not listener[0].startswith(loopback)] == []


# Ray's workers' ports (`ray start`'s --min-worker-port and --max-worker-port), and the ranges that the
# README's table names by their first port
RAY_WORKER_PORTS = range(10002, 20000)
NAMED_RANGES = (
    range(RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT, RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT + 1),
    range(MIN_SPECIFIC_SERVER_PORT, MAX_SPECIFIC_SERVER_PORT),
)


def test_the_readme_names_every_port_the_app_listens_on(served: Served) -> None:
    """Each port that the app's processes listen on is in the README's table of listeners (Security), but
    those the system picks (a bind to port 0: its ephemeral range) and Ray's workers'. Serve's HTTP proxy
    beside HAProxy, on 8500, serving the whole API, was once missing."""
    low, high = (int(bound) for bound in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    after = readme[readme.index("**What listens where.**") :].splitlines()
    start = next(index for index, line in enumerate(after) if line.startswith("|"))
    table = itertools.takewhile(lambda line: line.startswith("|"), after[start:])
    named = {int(number) for line in table for number in re.findall(r"\d+", line)}
    fixed = [
        (port, command)
        for port, command in _cluster_listeners(served.ray_address)
        if not (low <= port <= high or port in RAY_WORKER_PORTS)
    ]
    assert fixed  # an ingress replica's own HTTP server (HAProxy mode) or Serve's proxy, at least
    unnamed = [
        (port, command)
        for port, command in fixed
        if next((ports.start for ports in NAMED_RANGES if port in ports), port) not in named
    ]
    assert unnamed == []


def test_ray_takes_no_caller_without_its_token(served: Served) -> None:
    """`make run`'s Ray (tests/serving.py: started where a token file exists and RAY_AUTH_MODE is unset)
    runs with token authentication: its GCS refuses a call without the token (the app's own check at
    build time asks the same)."""
    assert cluster_security.requires_token(served.ray_address) is True


@pytest.mark.slow
def test_the_key_is_in_no_log(served: Served) -> None:
    """The guarded app's key (from its api_key_file), and Ray's token, show neither in `serve run`'s
    output nor in Ray's session logs (the controller's build log, the replicas' stdout and stderr). Last
    in this module, so that the restart above is in the logs too."""
    keyed = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    assert (
        httpx.post(served.guarded_url + CHAT, content=_chat(), headers=keyed, timeout=120).status_code == 200
    )
    logs = [served.log, *(served.ray_dir / "session_latest" / "logs").rglob("*")]
    scanned = [path for path in logs if path.is_file()]
    assert any("controller" in path.name for path in scanned)  # the session's logs are there
    for secret in (API_KEY, served.ray_token):  # nor does Ray's own token
        holding = [str(path) for path in scanned if secret.encode() in path.read_bytes()]
        assert holding == []
