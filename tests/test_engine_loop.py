"""The engine thread's hand-over (deployments/replicas/engine_loop.py), in process: one call_soon_threadsafe
per step for all subscribers, outputs equal to the engine's own, and a subscriber that goes away has its
requests aborted."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest
import torch
from assets import qwen3_tokenizer_dir
from prometheus_client.parser import text_string_to_metric_families
from tileinfer.deployments.replicas.engine_loop import EngineLoop, UnknownSubscriberError
from tileinfer.deployments.replicas.metrics import exposition
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.models.random_model import TINY, random_weights
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.text.tokenizer import Tokenizer

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _engine(detokenize: bool) -> Engine:
    model = LoadedModel("tiny", Path("random"), TINY, random_weights(TINY, torch.float32, "cpu", seed=1),
                        Tokenizer.from_folder(qwen3_tokenizer_dir()))  # fmt: skip
    config = EngineConfig(max_model_len=128, kv_cache_tokens=2048, max_num_seqs=8, detokenize=detokenize)
    return Engine(model, config)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, TINY.vocab_size, (5 + index,), generator=generator).tolist() for index in range(6)
    ]


def test_detokenize_off_gives_the_same_tokens_and_no_text(prompts: list[list[int]]) -> None:
    on, off = _engine(True), _engine(False)
    for prompt in prompts[:2]:
        tokens_on, text_on, reason_on = on.generate(prompt, PARAMS)
        assert (tokens_on, "", reason_on) == off.generate(prompt, PARAMS)
        assert text_on


def test_one_hand_over_per_step_and_outputs_equal_the_engines(prompts: list[list[int]]) -> None:
    engine = _engine(False)
    expected = [engine.generate(prompt, PARAMS)[0] for prompt in prompts]
    loop_under_test = EngineLoop(engine, max_queue_len=8)

    async def run() -> tuple[dict[str, list[int]], int, int]:
        event_loop = asyncio.get_running_loop()
        calls = 0
        original = event_loop.call_soon_threadsafe

        def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            nonlocal calls
            calls += 1
            return original(*args, **kwargs)

        event_loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        queues = {name: loop_under_test.subscribe(name) for name in ("a", "b")}
        with pytest.raises(UnknownSubscriberError):
            loop_under_test.submit("x", prompts[0], PARAMS, "nobody")
        for index, prompt in enumerate(prompts):
            loop_under_test.submit(f"r{index}", prompt, PARAMS, "ab"[index % 2])
        tokens: dict[str, list[int]] = {f"r{index}": [] for index in range(len(prompts))}
        finished, batches = 0, 0
        while finished < len(prompts):
            for queue in queues.values():
                while not queue.empty():
                    batches += 1
                    for request_id, token_ids, finish_reason, _, error in queue.get_nowait():
                        assert error is None
                        tokens[request_id] += token_ids
                        finished += finish_reason is not None
            await asyncio.sleep(0.01)
        return tokens, calls, batches

    tokens, calls, batches = asyncio.run(run())
    loop_under_test.stop()
    assert [tokens[f"r{index}"] for index in range(len(prompts))] == expected
    # both subscribers' batches of a step came with one call (at most one a step, and batches per call <= 2)
    assert calls * 2 >= batches > calls
    assert loop_under_test.gauges()["num_requests_waiting"][0] == 0


def test_a_subscriber_that_goes_away_has_its_requests_aborted(prompts: list[list[int]]) -> None:
    engine = _engine(False)
    loop_under_test = EngineLoop(engine, max_queue_len=8, model_name="tiny")
    long = dataclasses.replace(PARAMS, max_tokens=100)

    async def run() -> None:
        queue = loop_under_test.subscribe("gone")
        for index, prompt in enumerate(prompts):
            loop_under_test.submit(f"r{index}", prompt, long, "gone")
        await queue.get()  # it runs
        loop_under_test.unsubscribe("gone", queue)
        # right after a disconnect, before the engine thread takes the aborts (it went to -15 and -8)
        assert loop_under_test.gauges()["num_requests_waiting"][0] >= 0
        for _ in range(200):
            if not engine.requests and not engine.has_unfinished():
                return
            await asyncio.sleep(0.02)

    asyncio.run(run())
    loop_under_test.stop()
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    gauges = loop_under_test.gauges()
    assert gauges["num_requests_waiting"][0] == 0 and gauges["num_requests_running"][0] == 0
    finished = {family.name: family for family in loop_under_test.metric_families()}["tileinfer_requests"]
    by_reason = {sample.labels["finish_reason"]: sample.value for sample in finished.samples}
    assert by_reason == {"abort": len(prompts)}
    text = exposition([loop_under_test.metric_families()])  # what the ingress serves: each family once
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert len(families) == text.count("# TYPE ")
    labels = {"model": "tiny", "engine": "0", "finish_reason": "abort"}
    assert families["tileinfer_requests"].samples[0].labels == labels


def test_a_subscriber_lapses_without_heartbeats(monkeypatch: pytest.MonkeyPatch) -> None:
    loop_under_test = EngineLoop(_engine(False), max_queue_len=8)

    async def run() -> None:
        loop_under_test.subscribe("alive")
        assert not loop_under_test.lapsed("alive", lease_s=5)
        clock = time.monotonic() + 6
        monkeypatch.setattr(time, "monotonic", lambda: clock)
        assert loop_under_test.lapsed("alive", lease_s=5)
        loop_under_test.heartbeat("alive")
        assert not loop_under_test.lapsed("alive", lease_s=5)
        with pytest.raises(UnknownSubscriberError):
            loop_under_test.heartbeat("gone")
        assert loop_under_test.lapsed("gone", lease_s=5)

    asyncio.run(run())
    loop_under_test.stop()
