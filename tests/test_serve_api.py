"""The real application over HTTP (`serve run serve_config.yaml`), through the official openai client
and raw SSE: output, streaming, usage, errors, disconnects and concurrency."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import API_KEY, BIN, Served
from tileinfer.engine.models.gguf_loader import read_gguf
from tileinfer.engine.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

HAIKU = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf(smollm2_gguf))


def _metrics(base_url: str) -> dict[str, float]:
    """Each sample by name and labels, summed over the engine replicas (less the labels engine and model)."""
    text = httpx.get(base_url + "/metrics", timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kept = {key: value for key, value in sample.labels.items() if key not in ("engine", "model")}
            labels = ",".join(f"{key}={value}" for key, value in sorted(kept.items()))
            key = sample.name + (f"{{{labels}}}" if labels else "")
            values[key] = values.get(key, 0.0) + sample.value
    return values


def _sse_events(response: httpx.Response):  # noqa: ANN202
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def test_greedy_chat_equals_cli_generate(client: openai.OpenAI, served: Served, tokenizer: Tokenizer) -> None:
    prompt = "What is the capital of France?"
    cli = subprocess.run(
        [BIN / "tileinfer", "generate", "smollm2-135m", "--chat", "--prompt", prompt, "--max-tokens", "32",
         "--json"],
        capture_output=True, text=True, check=True, env=served.env,
    )  # fmt: skip
    expected = json.loads(cli.stdout.strip().splitlines()[-1])
    response = client.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": prompt}], max_tokens=32, temperature=0,
        logprobs=True,
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.message.content == expected["text"]
    assert choice.finish_reason == expected["finish_reason"]
    assert response.usage.prompt_tokens == len(expected["prompt_token_ids"])
    assert response.usage.completion_tokens == len(expected["token_ids"])
    streamed_bytes = b"".join(bytes(item.bytes) for item in choice.logprobs.content)
    assert streamed_bytes == b"".join(tokenizer.token_bytes(token) for token in expected["token_ids"])


def test_stream_arrives_in_chunks_before_the_request_completes(served: Served, tokenizer: Tokenizer) -> None:
    body = {
        "model": served.model, "messages": HAIKU, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    contents, usage, finish_reasons = [], None, []
    running_at_first_token = None
    with httpx.stream("POST", served.base_url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(response)
        for event in events:
            if event == "[DONE]":
                break
            chunk = json.loads(event)
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                if running_at_first_token is None:
                    running_at_first_token = _metrics(served.base_url)["tileinfer_num_requests_running"]
                contents.append(chunk["choices"][0]["delta"]["content"])
            if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                finish_reasons.append(chunk["choices"][0]["finish_reason"])
            if chunk.get("usage"):
                usage = chunk["usage"]
        assert list(events) == []  # nothing after [DONE]
    assert running_at_first_token == 1  # the first token came while the request was still running
    assert len(contents) > 1 and finish_reasons == ["length"]
    assert usage == {
        "prompt_tokens": len(tokenizer.encode_chat(HAIKU)),
        "completion_tokens": 48,
        "total_tokens": len(tokenizer.encode_chat(HAIKU)) + 48,
    }


def test_completions_with_n_seed_echo_and_logprobs(client: openai.OpenAI, served: Served) -> None:
    kwargs = dict(model=served.model, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7, n=2)
    first = client.completions.create(**kwargs, logprobs=2)
    again = client.completions.create(**kwargs, logprobs=2)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text  # choice i draws with seed + i
    for choice in first.choices:
        assert len(choice.logprobs.tokens) == 12
        # the top 2, and the sampled token too when it is not among them (as OpenAI lists them): seed 7
        # draws " a" after "Once upon a time", third after "," and " in"
        top = choice.logprobs.top_logprobs[0]
        assert len(top) in (2, 3) and choice.logprobs.tokens[0] in top
    assert len(first.choices[0].logprobs.top_logprobs[0]) == 3
    echoed = client.completions.create(**{**kwargs, "n": 1}, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + first.choices[0].text
    stream = client.completions.create(**{**kwargs, "n": 1}, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == first.choices[0].text


def test_models_health_and_metrics(client: openai.OpenAI, served: Served) -> None:
    client.completions.create(model=served.model, prompt="Hello", max_tokens=2)  # something to count
    assert [model.id for model in client.models.list().data] == [served.model]
    health = httpx.get(served.base_url + "/health").json()
    assert health["status"] == "ok" and [engine["state"] for engine in health["engines"]] == ["ready"]
    metrics = _metrics(served.base_url)
    for name in (
        "tileinfer_prompt_tokens_total", "tileinfer_generation_tokens_total",
        "tileinfer_time_to_first_token_seconds_count", "tileinfer_time_per_output_token_seconds_count",
        "tileinfer_kv_cache_usage_ratio", "tileinfer_kv_cache_used_blocks", "tileinfer_preemptions_total",
    ):  # fmt: skip
        assert name in metrics
    assert metrics["tileinfer_generation_tokens_total"] > 0
    families = text_string_to_metric_families(httpx.get(served.base_url + "/metrics", timeout=30).text)
    generated = next(family for family in families if family.name == "tileinfer_generation_tokens").samples
    assert all(sample.labels["model"] == served.model and "engine" in sample.labels for sample in generated)
    # SmolLM2-135M in float32: 30 layers x (K and V) x 3 KV heads x 64 x 4 bytes
    assert metrics["tileinfer_kv_cache_bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    model = httpx.get(served.base_url + "/v1/models").json()["data"][0]
    assert model["quantization"] is None and model["kv_cache_dtype"] == "auto"


def test_the_engine_logs_its_start_in_its_replica_log(served: Served) -> None:
    """TileInfer's own INFO lines reach Serve's replica logs (deployments/replicas/serve_logs.py), as they
    come."""
    logs = sorted((served.ray_dir / "session_latest/logs/serve").glob("replica_tileinfer_Engine_*.log"))
    assert any("engine built in" in path.read_text() for path in logs), logs


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


@pytest.mark.parametrize(
    ("case", "status", "code_or_param"),
    [
        ("bad temperature", 400, "temperature"),
        ("tools", 400, "tool_choice.function.name"),
        ("logit_bias", 400, "logit_bias"),
        ("unknown field", 400, "frobnicate"),
        ("unknown model", 404, "model_not_found"),
        ("not json", 400, None),
        ("no such path", 404, None),
        ("wrong method", 405, None),
    ],
)
def test_bad_requests_get_openai_errors(
    served: Served, case: str, status: int, code_or_param: str | None
) -> None:
    body: dict = {"model": served.model, "messages": HAIKU, "max_tokens": 4}
    if case == "bad temperature":
        body["temperature"] = 5
    elif case == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        body["tool_choice"] = {"type": "function", "function": {"name": "g"}}  # no such tool
    elif case == "logit_bias":
        body["logit_bias"] = {"42": 10}
    elif case == "unknown field":
        body["frobnicate"] = True
    elif case == "unknown model":
        body["model"] = "gpt-17"
    url = served.base_url + "/v1/chat/completions"
    if case == "not json":
        response = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    elif case == "no such path":
        response = httpx.post(served.base_url + "/v1/chat/completion", json=body)
    elif case == "wrong method":
        response = httpx.get(url)
    else:
        response = httpx.post(url, json=body, timeout=60)
    assert response.status_code == status
    error = _error(response)
    if code_or_param is not None:
        assert code_or_param in (error["param"], error["code"])
        if error["param"]:
            assert error["param"] in error["message"]


def test_guarded_app_key_context_and_body_limit(served: Served) -> None:
    url = served.guarded_url + "/v1/chat/completions"
    body = {"model": served.model, "messages": HAIKU, "max_tokens": 4}
    assert httpx.post(url, json=body).status_code == 401
    wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and _error(wrong)["code"] == "invalid_api_key"
    good = httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert good.status_code == 200
    long_prompt = [{"role": "user", "content": "word " * 600}]  # over max_model_len 512, under 4 kB
    too_long = httpx.post(
        url, json={**body, "messages": long_prompt}, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert too_long.status_code == 400 and _error(too_long)["code"] == "context_length_exceeded"
    huge = httpx.post(
        url, json={**body, "messages": [{"role": "user", "content": "x" * 5000}]},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )  # fmt: skip
    assert huge.status_code == 413 and _error(huge)["code"] == "request_too_large"


def test_requests_beyond_the_queue_get_503(served: Served) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": served.model, "messages": HAIKU, "max_tokens": 200, "ignore_eos": True, "stream": True}
    url = served.guarded_url + "/v1/chat/completions"
    with (
        httpx.Client(timeout=120, headers=headers) as first,
        httpx.Client(timeout=120, headers=headers) as second,
        first.stream("POST", url, json=body) as running,
        second.stream("POST", url, json=body) as queued,
    ):
        assert running.status_code == 200 and queued.status_code == 200
        refused = httpx.post(url, json={**body, "stream": False}, headers=headers, timeout=60)
        assert refused.status_code == 503 and _error(refused)["code"] == "queue_full"
        assert refused.headers["retry-after"] == "1"


def test_disconnect_mid_stream_frees_the_sequence_and_its_blocks(served: Served) -> None:
    before = _metrics(served.base_url)
    aborted_key = "tileinfer_requests_total{finish_reason=abort}"
    body = {"model": served.model, "messages": HAIKU, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", served.base_url + "/v1/chat/completions", json=body, timeout=120) as response:
        events = _sse_events(response)
        for _ in range(4):
            next(events)
        assert _metrics(served.base_url)["tileinfer_kv_cache_used_blocks"] > 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        metrics = _metrics(served.base_url)
        if metrics["tileinfer_kv_cache_used_blocks"] == 0 and metrics["tileinfer_num_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert metrics["tileinfer_kv_cache_used_blocks"] == 0
    assert metrics["tileinfer_num_requests_running"] == 0
    assert metrics.get(aborted_key, 0) == before.get(aborted_key, 0) + 1
    assert metrics["tileinfer_generation_tokens_total"] - before["tileinfer_generation_tokens_total"] < 2000


def test_64_concurrent_streams_each_equal_their_solo_run(served: Served) -> None:
    prompts = [f"Give me one fact about the number {n}." for n in range(8)]

    async def run() -> tuple[list[str], list[str]]:
        client = openai.AsyncOpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)

        async def stream(prompt: str) -> str:
            chunks = await client.chat.completions.create(
                model=served.model, messages=[{"role": "user", "content": prompt}], max_tokens=12,
                temperature=0, stream=True,
            )  # fmt: skip
            return "".join([chunk.choices[0].delta.content or "" async for chunk in chunks if chunk.choices])

        solo = [await stream(prompt) for prompt in prompts]
        together = await asyncio.gather(*(stream(prompts[i % 8]) for i in range(64)))
        return solo, list(together)

    solo, together = asyncio.run(run())
    assert all(text for text in solo)
    assert together == [solo[i % 8] for i in range(64)]


@pytest.mark.parametrize("via", ["driver", "ray client"])
def test_python_handle_from_another_process(served: Served, via: str) -> None:
    """A Python program on the cluster calls the app through its handle, streaming included; through
    Ray Client, which does not carry Serve's streaming responses, the plain call works."""
    address = served.ray_address if via == "driver" else served.ray_client_address
    script = textwrap.dedent(
        f"""
        import json, ray
        from ray import serve
        ray.init(address="{address}", log_to_driver=False)
        handle = serve.get_app_handle("tileinfer")
        body = {{"model": "{served.model}", "messages": [{{"role": "user", "content": "Hi!"}}],
                 "max_tokens": 8, "temperature": 0}}
        reply = handle.chat.remote(body).result()["choices"][0]["message"]["content"]
        streamed = None
        if "{via}" == "driver":
            chunks = list(handle.options(stream=True).chat_stream.remote(body))
            streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        print(json.dumps({{"reply": reply, "streamed": streamed}}))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=served.env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["reply"]
    if via == "driver":
        assert payload["streamed"] == payload["reply"]


def _readme_example(after: str, language: str = "python") -> str:
    """The first block of `language` after the text `after` in README.md, as a user copies it."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    fence = f"```{language}\n"
    start = text.index(fence, text.index(after)) + len(fence)
    return text[start : text.index("\n```", start)]


MAKE_RUN_URL = "http://127.0.0.1:8000"  # where the README's examples find `make run`'s app


def test_readme_curl_examples_run_as_written(served: Served) -> None:
    """The README's curl commands ("With `make run` up, in another terminal"), against this app's port."""
    commands = _readme_example("With `make run` up, in another terminal", "sh")
    assert commands.count("curl ") == 4 and MAKE_RUN_URL in commands
    result = subprocess.run(
        ["bash", "-e", "-c", commands.replace(MAKE_RUN_URL, served.base_url)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for expected in ('"object":"chat.completion"', '"object":"text_completion"', "data: [DONE]",
                     '"object":"list"', "# TYPE tileinfer_"):  # fmt: skip
        assert expected in result.stdout, expected
    assert '"error"' not in result.stdout


def test_readme_openai_example_runs_as_written(served: Served) -> None:
    """The README's example with the official openai client, against this app's port."""
    script = _readme_example("With the official `openai` client")
    assert MAKE_RUN_URL in script
    result = subprocess.run(
        [sys.executable, "-c", script.replace(MAKE_RUN_URL, served.base_url)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.stdout.strip()) > 10  # the haiku, then the count


def test_readme_python_example_runs_as_written(served: Served) -> None:
    """The README's "From Python, through Ray" example, from a second process with a plain environment
    (no RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER): with ray.init(address="auto") it once retried for ever."""
    env = {key: value for key, value in served.env.items() if key != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    result = subprocess.run(
        [sys.executable, "-c", _readme_example("### From Python, through Ray")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.stdout.strip()) > 10  # the reply, then the same streamed
