"""The graph cache (engine/graphs.py) on the CPU, where capture records each step and replay calls it on
the same static buffers a GPU's graphs read: the inputs' layout, one copy per step from alternating
staging buffers, padding rows and padding sequences, fed-back rows, sampling inside a decode replay and
after a step replay, and verify steps. Outputs equal the eager engine's exactly, on the real
SmolLM2-135M-Instruct. (The CUDA graphs themselves: tests/test_graphs_cuda.py.)"""

from __future__ import annotations

import collections
import json
import time

import jsonschema
import pytest
from test_run_ahead import Arrivals, mixed_arrivals
from test_structured_engine import JSON_SPEC, SCHEMA
from tileinfer.deployments.replicas.proposer_build import build_engine
from tileinfer.engine import engine as engine_module
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.sampling import masked_sampling
from tileinfer.engine.sampling.grammar import MaskFiller
from tileinfer.engine.sampling.params import GrammarSpec, SamplingParams
from tileinfer.engine.step import LateSamples, PendingStep


@pytest.fixture(scope="module")
def model(smollm2_model: LoadedModel) -> LoadedModel:
    return smollm2_model  # loaded once for the session (tests/conftest.py)


def _with_graph_cache(engine: Engine) -> collections.Counter:
    """Rebuild the engine's runner with a graph cache on the CPU; returns the count of replays by kind
    ("decode", "step", "masked"), which grows as the engine steps."""
    config, runner = engine.config, engine.runner
    max_logit_rows = config.max_num_seqs * (1 + config.num_draft if engine.speculator is not None else 1)
    engine.runner = ModelRunner(
        runner.decoder, engine.block_manager.num_blocks, config.block_size, config.torch_dtype(),
        config.max_num_seqs, engine.max_model_len, graphs=True,
        max_num_batched_tokens=engine.max_num_batched_tokens, max_logit_rows=max_logit_rows,
    )  # fmt: skip
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.decode_buckets and graphs.step_buckets
    replays: collections.Counter = collections.Counter()
    kinds = (
        ("decode", graphs.decode_buckets),
        ("step", graphs.step_buckets),
        ("masked", graphs.masked.buckets),
    )
    for kind, buckets in kinds:
        for bucket in buckets.values():
            replay = bucket.replay

            def counted(replay=replay, kind=kind) -> None:  # noqa: ANN001 - the bucket's own replay
                replays[kind] += 1
                replay()

            bucket.replay = counted
    return replays


def _run(engine: Engine, requests: Arrivals) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    step = 0
    while step <= max(requests) or engine.has_unfinished():
        for request_id, prompt, params in requests.get(step, []):
            engine.add_request(prompt, params, request_id)
            tokens[request_id] = []
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
        step += 1
    return tokens


def _graphed_and_eager(
    model: LoadedModel, run_ahead: bool, requests: Arrivals
) -> tuple[collections.Counter, dict[str, list[int]], dict[str, list[int]]]:
    """The requests run by an engine with a CPU graph cache (48-token steps, 4 sequences) and by the same
    engine eager: the graphed one's replays by kind, then each one's tokens."""

    def engine() -> Engine:
        config = EngineConfig(
            run_ahead=run_ahead, max_num_batched_tokens=48, max_num_seqs=4, max_model_len=512
        )
        return Engine(model, config)

    graphed = engine()
    replays = _with_graph_cache(graphed)
    return replays, _run(graphed, requests), _run(engine(), requests)


@pytest.mark.parametrize("run_ahead", [False, True], ids=["step-by-step", "run-ahead"])
def test_graph_cache_steps_equal_eager_steps(model: LoadedModel, run_ahead: bool) -> None:
    """Prompts chunked by a 48-token budget beside decoding sequences (step buckets of 16-48 tokens, then
    sampling), batches of 1-4 decoding sequences (decode buckets 1, 2, 4: padding rows), greedy, seeded,
    penalized and stopped requests; with run-ahead, rows fed back from the launch before on the device."""
    replays, graphed_tokens, eager_tokens = _graphed_and_eager(
        model, run_ahead, mixed_arrivals(model.tokenizer)
    )
    assert graphed_tokens == eager_tokens
    assert replays["decode"] > 5 and replays["step"] > 3, replays


def test_verify_steps_from_the_graph_cache_equal_eager_ones(model: LoadedModel) -> None:
    """N-gram drafts on a repetitive prompt: verify steps replay step buckets (greedy and sampled rows)."""
    config = dict(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=512, run_ahead=False)
    prompt = model.tokenizer.encode("one two three four, one two three four, one two three four, one two")
    requests = {
        0: [
            ("greedy", prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)),
            ("sampled", prompt, SamplingParams(max_tokens=16, temperature=0.7, seed=5, ignore_eos=True)),
        ]
    }
    graphed = build_engine(model, EngineConfig(**config, proposer="ngram", num_draft=3))
    replays = _with_graph_cache(graphed)
    eager = build_engine(model, EngineConfig(**config, proposer="ngram", num_draft=3))
    assert _run(graphed, requests) == _run(eager, requests)
    assert graphed.speculator.stats.drafts_proposed > 0 and replays["step"] > 3, replays


@pytest.mark.parametrize(
    ("run_ahead", "late"), [(False, False), (True, False), (True, True)],
    ids=["step-by-step", "run-ahead", "run-ahead-late-masks"],
)  # fmt: skip
def test_constrained_rows_sample_from_masked_replays(
    model: LoadedModel, run_ahead: bool, late: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three constrained rows (greedy JSON, sampled JSON, a regex) beside a free one: decode replays sample
    every row, then masked-sampling replays of at most two rows (two of them here: padding rows) sample
    the constrained ones again. Outputs equal the eager engine's, and the JSON validates. With every fill
    late (50 ms), the constrained rows sit launches out while the free one goes on; their masks and the
    next step's take the bitmask staging's two halves in turn, and the outputs are the same."""
    monkeypatch.setattr(masked_sampling, "MAX_MASKED_ROWS", 2)
    monkeypatch.setattr(engine_module, "LATE_ROWS_SIT_OUT", late)  # off: every constrained row replayed
    if late:
        fill = MaskFiller.fill

        def late_fill(self: MaskFiller, *args: object) -> None:
            time.sleep(0.05)
            fill(self, *args)

        monkeypatch.setattr(MaskFiller, "fill", late_fill)
    deferred = []  # the rows of each step whose masks came late
    defer_masks = ModelRunner.defer_masks

    def counted_defer(self: ModelRunner, launched: PendingStep) -> LateSamples | None:
        taken = defer_masks(self, launched)
        deferred.extend([] if taken is None else [len(taken.seqs)])
        return taken

    monkeypatch.setattr(ModelRunner, "defer_masks", counted_defer)
    prompt = model.tokenizer.encode_chat(
        [{"role": "user", "content": "Name a European river and its length in km, as JSON."}]
    )
    requests = {
        0: [
            ("json", prompt, SamplingParams(max_tokens=24, temperature=0.0, grammar=JSON_SPEC)),
            ("sampled", prompt, SamplingParams(max_tokens=24, temperature=0.8, seed=7, grammar=JSON_SPEC)),
            (
                "digits",
                prompt,
                SamplingParams(max_tokens=6, temperature=0.0, grammar=GrammarSpec("regex", "[0-9]{3,5}")),
            ),
            ("free", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
        ]
    }

    replays, got, eager_tokens = _graphed_and_eager(model, run_ahead, requests)
    assert got == eager_tokens
    assert replays["decode"] > 5 and replays["masked"] >= (0 if late else 2 * 5), replays
    assert (len(deferred) >= 5) if late else not deferred, deferred
    for request_id in ("json", "sampled"):
        jsonschema.validate(
            json.loads(model.tokenizer.decode(got[request_id], skip_special_tokens=True)), SCHEMA
        )
