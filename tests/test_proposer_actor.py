"""The n-gram proposer in its own Serve actor (the `speculative` app of tests/serving.py) over HTTP with
the real openai client: the same greedy text as the app without a proposer, accepted drafts in /metrics,
and a proposer actor killed mid-stream that costs nothing but speed and is used again once restarted.
Also the DFlash proposer in its own actor (the `dflash` app): the same greedy text, its drafts verified."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import Served

pytestmark = pytest.mark.slow

REPEAT = [
    {
        "role": "user",
        "content": "Repeat this sentence three times: The quick brown fox jumps over the lazy dog.",
    }
]
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]

# Run as its own Ray driver: find the speculative app's proposer actor (its engine replica names it), say
# "ready", and kill its process when a line arrives on stdin (Ray then restarts it).
KILLER = textwrap.dedent(
    """
    import sys, ray
    ray.init(address=sys.argv[1], log_to_driver=False)
    names = [actor for actor in ray.util.list_named_actors(all_namespaces=True)
             if "speculative#Proposer#" in actor["name"]]
    assert len(names) == 1, names
    replica = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])
    print("ready", flush=True)
    sys.stdin.readline()
    ray.kill(replica, no_restart=False)
    print("killed", flush=True)
    """
)


def _counters(app_url: str) -> dict[str, float]:
    text = httpx.get(app_url + "/metrics", timeout=30).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("tileinfer_spec_")
    }


def _client(app_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=app_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(app_url: str, model: str, messages: list[dict], max_tokens: int) -> str:
    response = _client(app_url).chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    return response.choices[0].message.content


def test_speculative_text_equals_plain_and_drafts_are_accepted(served: Served) -> None:
    before = _counters(served.speculative_url)
    without = _counters(served.base_url)
    assert without["tileinfer_spec_drafts_proposed_total"] == 0 and without["tileinfer_spec_step_cost"] == 1
    for messages in (REPEAT, CAPITAL):
        plain = _chat(served.base_url, served.model, messages, 48)
        assert _chat(served.speculative_url, served.model, messages, 48) == plain
    after = _counters(served.speculative_url)
    assert after["tileinfer_spec_drafts_accepted_total"] > before["tileinfer_spec_drafts_accepted_total"]
    assert after["tileinfer_spec_drafts_proposed_total"] >= after["tileinfer_spec_drafts_accepted_total"]
    assert after["tileinfer_spec_proposer_failures_total"] == before["tileinfer_spec_proposer_failures_total"]
    assert after["tileinfer_spec_step_cost"] != 1  # measured: both kinds of step ran and were timed
    assert after["tileinfer_spec_hidden_rows_in_gpu_memory"] == 0  # n-gram reads no hidden rows
    assert after["tileinfer_spec_ring_steps_total"] == 0  # n-gram's drafts are made on the host


def test_dflash_actor_text_equals_plain_and_its_drafts_are_verified(served: Served) -> None:
    """The engine asks the DFlash proposer which hidden rows it reads, then sends them each step (in host
    memory on the CPU), and the drafts come back in the draft ring (on by default; the host ring on the
    CPU). A random checkpoint drafts badly: the point is that its drafts cross and are verified, and that
    the text does not change."""
    before = _counters(served.dflash_url)
    for messages in (REPEAT, CAPITAL):
        assert _chat(served.dflash_url, served.model, messages, 32) == _chat(
            served.base_url, served.model, messages, 32
        )
    after = _counters(served.dflash_url)
    assert after["tileinfer_spec_drafts_proposed_total"] > before["tileinfer_spec_drafts_proposed_total"]
    assert after["tileinfer_spec_proposer_failures_total"] == before["tileinfer_spec_proposer_failures_total"]
    assert after["tileinfer_spec_hidden_rows_in_gpu_memory"] == 0
    assert after["tileinfer_spec_ring_steps_total"] > before["tileinfer_spec_ring_steps_total"]


def test_proposer_killed_mid_stream_changes_nothing_and_comes_back(served: Served) -> None:
    max_tokens = 160
    plain = _chat(served.base_url, served.model, REPEAT, max_tokens)
    killer = subprocess.Popen(
        [sys.executable, "-c", KILLER, served.ray_address],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=served.env,
    )  # fmt: skip
    try:
        assert killer.stdout.readline().strip() == "ready"
        before = _counters(served.speculative_url)
        stream = _client(served.speculative_url).chat.completions.create(
            model=served.model, messages=REPEAT, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        pieces = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                if len(pieces) == 3:
                    killer.stdin.write("kill\n")
                    killer.stdin.flush()
                    assert killer.stdout.readline().strip() == "killed"
        assert killer.wait(timeout=60) == 0
    finally:
        killer.kill()
    assert "".join(pieces) == plain
    during = _counters(served.speculative_url)
    # the kill landed while the stream still drafted: a step timed out, and the stream went on without
    assert during["tileinfer_spec_proposer_failures_total"] > before["tileinfer_spec_proposer_failures_total"]

    plain_short = _chat(served.base_url, served.model, REPEAT, 32)
    deadline = time.monotonic() + 180  # Ray restarts the actor, the engine attaches again
    while True:
        accepted_before = _counters(served.speculative_url)["tileinfer_spec_drafts_accepted_total"]
        assert _chat(served.speculative_url, served.model, REPEAT, 32) == plain_short
        if _counters(served.speculative_url)["tileinfer_spec_drafts_accepted_total"] > accepted_before:
            break
        assert time.monotonic() < deadline, "drafts were never accepted again after the proposer restarted"
        time.sleep(2)
