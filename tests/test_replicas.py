"""Engine replicas on a two-node Ray cluster on this machine: a head and a worker, each with its own
resources, two SmolLM2 engine replicas, each with its n-gram proposer actor beside it (the pair reserves
a node's one CPU, so one pair lands on each node), served by `serve run` (deployments/launch/launcher.py) over
HTTP. Requests reach both, and both draft; a conversation's turns reach one replica, which its metrics
show; an engine replica killed under load loses no request that had no token yet, hangs none, and new
requests are served."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from serving import ROOT, _free_port, _wait_healthy, ray_env

pytestmark = pytest.mark.slow

APP = "replicas"  # its engine replicas' processes are titled ray::ServeReplica:replicas:Engine
MODEL = "smollm2-135m"
WORDS = ("apple", "river", "stone", "cloud", "green", "paper", "light", "music", "table", "window",
         "garden", "silver")  # fmt: skip


@pytest.fixture(scope="module")
def replicas_url(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Iterator[str]:
    """The app on a head and a worker node, both on 127.0.0.1. Ray's own multi-node test cluster
    (ray.cluster_utils) starts them: `ray start --address=127.0.0.1:...` for the worker cannot stay on
    loopback (Ray 2.60 refuses a second node under RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which keeps Ray on
    127.0.0.1, and without it rewrites the head's 127.0.0.1 to this machine's external address)."""
    from ray.cluster_utils import Cluster

    workdir = tmp_path_factory.mktemp("replicas")
    http_port = _free_port()
    # Ray's files in a folder of its own, with token authentication on (as `make run` has it)
    temp_dir = Path(tempfile.mkdtemp(prefix="ti-ray-", dir="/tmp"))  # short: socket paths fit in 107 bytes
    env = {
        **ray_env(temp_dir), "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # the nodes inherit this process's environment
    _reread_ray_auth()  # and this process, which talks to them, reads its token mode anew
    (temp_dir / "ray").mkdir()  # Cluster() writes the head's address there without making the folder
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "resources": {"head_node": 1}, "node_ip_address": "127.0.0.1",
                            "include_dashboard": False},
        )  # fmt: skip
        worker = {"num_cpus": 1, "resources": {"worker_node": 1}, "node_ip_address": "127.0.0.1"}
        cluster.add_node(**worker)
        cluster.wait_for_nodes()
        ray_port = int(cluster.address.rpartition(":")[2])
        config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
        config["proxy_location"] = "HeadOnly"  # one machine: a proxy per node would bind one port twice
        config["http_options"]["port"] = http_port
        app = config["applications"][0]
        app["name"] = APP
        app["args"] = {
            **app["args"], "num_engine_replicas": 2, "engine_num_cpus": 0.5, "kv_cache_tokens": 4096,
            "max_model_len": 2048, "max_num_seqs": 8, "proposer": "ngram", "proposer_num_cpus": 0.5,
        }  # fmt: skip
        config_path = workdir / "serve_config.yaml"
        config_path.write_text(yaml.safe_dump(config))
        log = workdir / "serve.log"
        with log.open("w") as log_file:  # the launcher serves on the running cluster and leaves it running
            launcher = subprocess.Popen(
                [sys.executable, "-m", "tileinfer.deployments.launch.launcher", str(config_path),
                 f"--ray-port={ray_port}"], env=env, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT,
            )  # fmt: skip
        url = f"http://127.0.0.1:{http_port}"
        try:
            _wait_healthy([url], launcher, log)
            _wait_for_engines(url, 2)
            yield url
        finally:  # `make run`'s stop: the launcher stops the app, and leaves the cluster it did not start
            launcher.terminate()
            try:
                launcher.wait(timeout=120)
            except subprocess.TimeoutExpired:
                launcher.kill()
    finally:
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _reread_ray_auth()


def _reread_ray_auth() -> None:
    """Make this process's Ray read RAY_AUTH_MODE and the token from the environment again (it keeps the
    first reading; Ray's own switch to token mode does the same)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _health(base_url: str) -> httpx.Response:
    return httpx.get(base_url + "/health", timeout=30)


def _wait_for_engines(base_url: str, count: int, timeout_s: float = 300) -> list[dict]:
    """The /health body's engines, once `count` of them are ready."""
    for _ in range(int(timeout_s)):
        response = _health(base_url)
        engines = response.json().get("engines", [])
        if response.status_code == 200 and sum(engine["state"] == "ready" for engine in engines) == count:
            return engines
        time.sleep(1)
    raise AssertionError(f"{count} engine replicas were not ready: {response.text}")


def _by_engine(base_url: str, name: str) -> dict[str, float]:
    """A counter's value for each engine replica (its `engine` label)."""
    text = httpx.get(base_url + "/metrics", timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                engine = sample.labels["engine"]
                values[engine] = values.get(engine, 0.0) + sample.value
    return values


def _decisions(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == "tileinfer_router_decisions":
            return {sample.labels["decision"]: sample.value for sample in family.samples}
    raise AssertionError("no tileinfer_router_decisions_total in /metrics")


def _complete(base_url: str, prompt: str, max_tokens: int = 4) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_replicas_run_on_both_nodes_and_both_serve(replicas_url: str) -> None:
    engines = _wait_for_engines(replicas_url, 2)
    assert {engine["engine"] for engine in engines} == {"0", "1"}
    assert len({engine["node"] for engine in engines}) == 2  # one on the head, one on the worker
    before = _by_engine(replicas_url, "tileinfer_requests_total")
    rng = random.Random(1)
    sent, served = 0, {"0": 0.0, "1": 0.0}
    while sent < 16 and not all(served.values()):  # new prompts go to the least loaded, ties broken at random
        phrase = " ".join(rng.choice(WORDS) for _ in range(5))
        _complete(replicas_url, " ".join([phrase] * 8), max_tokens=8)  # repeated: n-gram drafts
        sent += 1
        after = _by_engine(replicas_url, "tileinfer_requests_total")
        served = {engine: after.get(engine, 0) - before.get(engine, 0) for engine in ("0", "1")}
    assert sum(served.values()) == sent
    assert all(count > 0 for count in served.values()), served  # all 16 on one replica: 1 in 32,768
    drafted = _by_engine(replicas_url, "tileinfer_spec_drafts_proposed_total")
    assert all(drafted.get(engine, 0) > 0 for engine in ("0", "1")), drafted  # each has its proposer


def test_a_conversations_turns_reach_the_replica_of_its_first(replicas_url: str) -> None:
    rng = random.Random(2)
    hits_before = _by_engine(replicas_url, "tileinfer_prefix_cache_hit_tokens_total")
    decisions_before = _decisions(replicas_url)
    conversations = [" ".join(rng.choice(WORDS) for _ in range(300)) for _ in range(2)]
    for turn in range(3):
        for index, prompt in enumerate(conversations):
            answer = _complete(replicas_url, prompt)
            conversations[index] = prompt + answer + " " + " ".join(rng.choice(WORDS) for _ in range(20))
        if turn == 0:
            hits_after_first = _by_engine(replicas_url, "tileinfer_prefix_cache_hit_tokens_total")
    hits = _by_engine(replicas_url, "tileinfer_prefix_cache_hit_tokens_total")
    decisions = _decisions(replicas_url)
    assert decisions["affinity"] - decisions_before.get("affinity", 0) == 4  # turns 2 and 3 of both
    later_hits = sum(hits.values()) - sum(hits_after_first.values())
    first_hits = sum(hits_after_first.values()) - sum(hits_before.values())
    # turns 2 and 3 reuse what turns 1 and 2 computed (300+ tokens each), the first turns nothing of each
    # other's; on the wrong replica a turn would reuse nothing
    assert later_hits >= 4 * 250, (first_hits, later_hits)


def _engine_pids() -> list[int]:
    found = subprocess.run(["pgrep", "-f", f"ServeReplica:{APP}:Engine"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


async def _stream(client: httpx.AsyncClient, replicas_url: str, index: int) -> tuple[int, str | None]:
    """(text chunks received, the in-band or HTTP error) of one streamed completion."""
    body = {"model": MODEL, "prompt": f"Tale {index}: once upon a time", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    chunks, error = 0, None
    async with client.stream("POST", replicas_url + "/v1/completions", json=body, timeout=120) as response:
        if response.status_code != 200:
            return 0, f"HTTP {response.status_code}"
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    error = event["error"]["message"]
                elif event["choices"] and event["choices"][0]["text"]:
                    chunks += 1
    return chunks, error


def test_a_replica_killed_under_load_loses_no_request_without_tokens(replicas_url: str) -> None:
    _wait_for_engines(replicas_url, 2)
    pids = _engine_pids()
    assert len(pids) == 2, pids

    async def load() -> tuple[list, list]:
        async with httpx.AsyncClient() as client:
            streams = [asyncio.create_task(_stream(client, replicas_url, index)) for index in range(8)]
            await asyncio.sleep(1.0)
            os.kill(pids[0], signal.SIGKILL)
            # none hangs: every stream ends, complete or with an error event
            ended = await asyncio.wait_for(asyncio.gather(*streams), 240)
            after = await asyncio.wait_for(
                asyncio.gather(*(_stream(client, replicas_url, 100 + index) for index in range(3))), 240
            )
        return ended, after

    ended, after = asyncio.run(load())
    for chunks, error in ended:
        # a request that had streamed no text went to the other replica and finished; one that had
        # streamed text ended with OpenAI's error in band
        assert (error is None and chunks > 0) or (error is not None and chunks > 0), (chunks, error)
    assert any(error is None for _, error in ended)
    assert all(error is None and chunks > 0 for chunks, error in after), after  # the survivor serves
    assert _health(replicas_url).status_code == 200
