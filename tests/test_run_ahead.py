"""Run-ahead decoding (EngineConfig.run_ahead): step n+1 is launched before step n's tokens are read.

On the CPU the launch is eager, but the bookkeeping is the one the GPU uses (pending tokens fed back by
row, one step of lag, stops found a step late, aborts and preemption in between), so the outputs must
equal step-by-step decoding exactly, on the real SmolLM2-135M-Instruct.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine, RequestOutput
from tileinfer.engine.models.loader import LoadedModel, load_model
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.text.tokenizer import Tokenizer

# step number -> the requests added before it: (request id, prompt, params)
Arrivals = dict[int, list[tuple[str, list[int], SamplingParams]]]


@pytest.fixture(scope="module")
def model(smollm2_model: LoadedModel) -> LoadedModel:
    return smollm2_model  # loaded once for the session (tests/conftest.py)


@pytest.fixture(scope="module")
def cuda_model(smollm2_gguf: Path) -> LoadedModel:
    return load_model(str(smollm2_gguf), device="cuda")  # fp32: graphs and eager agree exactly


def mixed_arrivals(tokenizer: Tokenizer) -> Arrivals:
    """Prompts that arrive while others decode: a story from step 0; a chat prompt and a 2-token request at
    step 3; a sampled request at 5, a penalized one at 7 and one with a stop string at 8."""
    chat = tokenizer.encode_chat([{"role": "user", "content": "Name three rivers in Europe, and say why."}])
    story = tokenizer.encode("Once upon a time, in a quiet village by the sea, there lived an old sailor")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return {
        0: [("first", story, greedy)],
        3: [("chat", chat, greedy), ("short", story, SamplingParams(max_tokens=2, temperature=0.0))],
        5: [("sampled", chat, SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=3))],
        7: [("penalized", story, SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=1.0))],
        8: [("stop-string", story, SamplingParams(max_tokens=12, temperature=0.0, stop=(" the",)))],
    }


def _run(engine: Engine, arrivals: Arrivals,
         abort_at: dict[int, str]) -> tuple[dict[str, list[RequestOutput]], int]:  # fmt: skip
    """Add requests and abort them at given step numbers; step until done. Returns the outputs per
    request and the number of steps that left a launch in flight."""
    outputs: dict[str, list[RequestOutput]] = {}
    step = 0
    steps_in_flight = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(prompt, params, request_id)
            outputs[request_id] = []
        if step in abort_at:
            engine.abort(abort_at[step])
        for output in engine.step():
            outputs[output.request_id].append(output)
        steps_in_flight += engine.in_flight is not None
        step += 1
    assert engine.in_flight is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outputs, steps_in_flight


def _summary(outputs: list[RequestOutput]) -> tuple[list[int], str, str | None]:
    return (
        [token for output in outputs for token in output.new_token_ids],
        "".join(output.new_text for output in outputs),
        outputs[-1].finish_reason if outputs else None,
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_run_ahead_equals_step_by_step(device: str, request: pytest.FixtureRequest) -> None:
    """On a GPU the run-ahead launches are CUDA-graph replays fed back on the device."""
    model: LoadedModel = request.getfixturevalue("model" if device == "cpu" else "cuda_model")

    def engine(run_ahead: bool) -> Engine:
        config = EngineConfig(device=device, run_ahead=run_ahead, max_num_batched_tokens=256, max_num_seqs=8)
        return Engine(model, config)  # 7 requests: 8 slots keep the graphs to capture few

    tokenizer = model.tokenizer
    chat = tokenizer.encode_chat([{"role": "user", "content": "Name three rivers in Europe."}])
    story = tokenizer.encode("Once upon a time, in a quiet village by the sea,")
    count = tokenizer.encode("Count from 1 to 20: 1, 2, 3,")
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    plain, _, _ = engine(run_ahead=False).generate(count, greedy)
    arrivals = {
        0: [
            ("greedy", chat, greedy),
            ("short", story, SamplingParams(max_tokens=3, temperature=0.0)),
            ("sampled", story, SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7)),
        ],
        4: [
            ("stop-token", count, SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(plain[6],))),
            ("stop-string", count, SamplingParams(max_tokens=24, temperature=0.0, stop=(" 9",))),
            ("aborted", chat, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)),
            ("penalized", story, SamplingParams(max_tokens=10, temperature=0.0, frequency_penalty=1.0)),
        ],
    }
    abort_at = {9: "aborted"}
    step_by_step, no_flight = _run(engine(run_ahead=False), arrivals, abort_at)
    run_ahead, in_flight = _run(engine(run_ahead=True), arrivals, abort_at)
    assert no_flight == 0 and in_flight > 10  # the run-ahead path really ran
    for request_id in ("greedy", "short", "sampled", "stop-token", "stop-string", "penalized"):
        assert _summary(run_ahead[request_id]) == _summary(step_by_step[request_id]), request_id
    assert _summary(run_ahead["short"])[2] == "length" and len(_summary(run_ahead["short"])[0]) == 3
    assert _summary(run_ahead["stop-token"])[0][-1] == plain[6]
    assert _summary(run_ahead["stop-string"])[2] == "stop"
    # an abort takes effect at once; what came before it is a prefix of the full greedy answer
    aborted = _summary(run_ahead["aborted"])[0]
    full = engine(run_ahead=False).generate(chat, arrivals[4][2][2])[0]
    assert 0 < len(aborted) < 30 and aborted == full[: len(aborted)]


def test_run_ahead_in_a_small_cache_waits_and_preempts_without_losing_tokens(model: LoadedModel) -> None:
    config = EngineConfig(block_size=16, kv_cache_tokens=112, max_num_seqs=8, run_ahead=True)
    engine = Engine(model, config)
    prompts = [model.tokenizer.encode(f"Count from {n} to {n + 9}:") for n in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = Engine(model, EngineConfig(run_ahead=False)).generate(prompts[0], params)[0]
    arrivals = {0: [(f"r{n}", prompt, params) for n, prompt in enumerate(prompts)]}
    outputs, in_flight = _run(engine, arrivals, {})
    assert in_flight > 0 and engine.scheduler.num_preemptions > 0
    assert all(len(_summary(outputs[f"r{n}"])[0]) == 24 for n in range(6))
    assert _summary(outputs["r0"])[0] == alone
    assert all(
        token >= 0 for seq_tokens in (_summary(o)[0] for o in outputs.values()) for token in seq_tokens
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_mixed_steps_run_ahead_and_equal_step_by_step(device: str, request: pytest.FixtureRequest) -> None:
    """Prompts that arrive while others decode, chunked by a small token budget, are launched ahead
    beside the decoding sequences (their inputs fed back from the launch in flight: on a GPU inside the
    step graph); a sequence that ends by length sits the next step out. Outputs equal step-by-step
    decoding exactly."""
    model: LoadedModel = request.getfixturevalue("model" if device == "cpu" else "cuda_model")
    arrivals = mixed_arrivals(model.tokenizer)

    def engine(run_ahead: bool) -> Engine:
        config = EngineConfig(device=device, run_ahead=run_ahead, max_num_batched_tokens=24, max_num_seqs=8)
        return Engine(model, config)

    ahead = engine(run_ahead=True)
    launched: list[list[int]] = []  # the new tokens per sequence of every launch
    launch = ahead.runner.launch

    def recording_launch(scheduled, previous):  # noqa: ANN001, ANN202 - the runner's own signature
        launched.append([item.num_new_tokens for item in scheduled])
        return launch(scheduled, previous)

    ahead.runner.launch = recording_launch
    step_by_step, _ = _run(engine(run_ahead=False), arrivals, {})
    run_ahead, _ = _run(ahead, arrivals, {})
    for request_id in step_by_step:
        assert _summary(run_ahead[request_id]) == _summary(step_by_step[request_id]), request_id
    # mixed launches: a prompt chunk beside decoding rows, some of them fed back from the launch before
    assert any(max(counts) > 1 and 1 in counts for counts in launched)
    assert _summary(run_ahead["short"])[0] and len(_summary(run_ahead["short"])[0]) == 2
