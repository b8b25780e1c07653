"""A stream's SSE events are paced (AppArgs.max_stream_events_per_s): Serve's HTTP proxy forwards each
event on its own, so all streams together get at most that many a second, and a stream's tokens that
arrive between two of its events go out together. The first output never waits, nor does the one that
ends the request; stop strings are found as the tokens arrive. Driven through the ingress's own merge of
a request's Deltas (ChoiceRunner.merged, deployments/openai_api/choices.py), with the real tokenizer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from ingress_harness import make_ingress
from tileinfer.deployments.openai_api.choices import Choice, PreparedRequest
from tileinfer.deployments.replicas.engine_client import Inbox
from tileinfer.engine.models.loader import load_tokenizer
from tileinfer.engine.text.detokenizer import TextStream
from tileinfer.engine.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return load_tokenizer("smollm2-135m")


def _prepared(tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> PreparedRequest:
    choice = Choice(0, 0, 3, TextStream(tokenizer, stop), engine_request_id="r0")
    outputs = Inbox()
    outputs.eager = bool(stop)  # as ChoiceRunner.submit sets it: stop strings are looked for on arrival
    return PreparedRequest("cmpl-test", 0, [[1, 2, 3]], [choice], outputs)


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_tokens_between_events_go_together_and_the_first_and_last_never_wait(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        ingress, _ = make_ingress(tokenizer, monkeypatch, max_stream_events_per_s=0.001)  # 1000 s apart
        prepared = _prepared(tokenizer)
        merged = ingress.runner.merged(prepared, paced=True)
        one, two, three, four = _ids(tokenizer, " one two three four")
        prepared.outputs.put_nowait((prepared.choices[0], ("r0", [one], None, None, None)))
        _, first = await asyncio.wait_for(anext(merged), 30)
        assert first.new_token_ids == [one] and first.new_text == " one"
        assert ingress.runner.event_interval_s() == pytest.approx(1000.0)  # one open stream, one replica
        prepared.outputs.put_nowait((prepared.choices[0], ("r0", [two], None, None, None)))
        prepared.outputs.put_nowait((prepared.choices[0], ("r0", [three], None, None, None)))
        second = asyncio.ensure_future(anext(merged))
        await asyncio.sleep(0.05)  # the merge has read them by now; unpaced, it would have yielded them
        prepared.outputs.put_nowait((prepared.choices[0], ("r0", [four], "length", None, None)))
        _, last = await asyncio.wait_for(second, 30)  # the last output does not wait out the interval
        assert last.new_token_ids == [two, three, four] and last.finished and last.finish_reason == "length"
        assert last.new_text == " two three four"
        with pytest.raises(StopAsyncIteration):
            await anext(merged)
        assert ingress.runner.open_streams == 0

    asyncio.run(scenario())


def test_a_stop_string_stops_its_engine_request_at_once_while_the_next_event_waits(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two choices (n=2): the first hits its stop string while the second runs on, so the event that
    carries the stop waits for the interval, but the engine request is aborted as the tokens arrive."""

    async def scenario() -> None:
        ingress, _ = make_ingress(tokenizer, monkeypatch, max_stream_events_per_s=0.001)
        aborted: list[tuple[str, str]] = []
        monkeypatch.setattr(ingress.client, "abort", lambda request_id, reason="abort": aborted.append(
            (request_id, reason)))  # fmt: skip
        prepared = _prepared(tokenizer, stop=(" three",))
        running = Choice(1, 0, 3, TextStream(tokenizer, ()), engine_request_id="r1")
        prepared.choices.append(running)
        stopping = prepared.choices[0]
        merged = ingress.runner.merged(prepared, paced=True)
        one, two, three, four = _ids(tokenizer, " one two three four")
        prepared.outputs.put_nowait((stopping, ("r0", [one], None, None, None)))
        _, first = await asyncio.wait_for(anext(merged), 30)  # its text may wait: a stop could begin there
        prepared.outputs.put_nowait((stopping, ("r0", [two, three, four], None, None, None)))
        second = asyncio.ensure_future(anext(merged))
        for _ in range(3000):  # up to 30 s; at once where the stop is found as the tokens arrive
            if aborted:
                break
            await asyncio.sleep(0.01)
        assert aborted == [("r0", "stop")] and not second.done()  # stopped; its event still waits
        prepared.outputs.put_nowait((running, ("r1", [one], "length", None, None)))
        choice, last = await asyncio.wait_for(second, 30)
        assert choice is stopping and last.finish_reason == "stop" and last.new_token_ids == [two, three]
        assert first.new_text + last.new_text == " one two"
        _, other = await asyncio.wait_for(anext(merged), 30)
        assert other.new_token_ids == [one] and other.finished

    asyncio.run(scenario())


def test_without_a_limit_every_arrival_is_its_own_event(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        ingress, _ = make_ingress(tokenizer, monkeypatch, max_stream_events_per_s=0)
        prepared = _prepared(tokenizer)
        merged = ingress.runner.merged(prepared, paced=True)
        one, two = _ids(tokenizer, " one two")
        prepared.outputs.put_nowait((prepared.choices[0], ("r0", [one], None, None, None)))
        assert (await asyncio.wait_for(anext(merged), 30))[1].new_token_ids == [one]
        prepared.outputs.put_nowait((prepared.choices[0], ("r0", [two], None, None, None)))
        assert (await asyncio.wait_for(anext(merged), 30))[1].new_token_ids == [two]
        await merged.aclose()

    asyncio.run(scenario())


def test_the_interval_grows_with_the_streams_of_every_replica(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    ingress, _ = make_ingress(tokenizer, monkeypatch, max_stream_events_per_s=2000, num_ingress_replicas=4)
    ingress.runner.open_streams = 64  # this replica's share of 256 streams
    assert ingress.runner.event_interval_s() == pytest.approx(64 * 4 / 2000)
