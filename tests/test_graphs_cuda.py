"""A CUDA-graph decode step computes what the eager decode step computes (same runner, same cache
state), for several batch sizes and context lengths; random weights in float32."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tileinfer.deployments.replicas.proposer_build import build_engine
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.models.random_model import SMOLLM2_135M, random_weights
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.spec_decode.proposer_interface import DraftRequest, Proposer
from tileinfer.engine.step import ScheduledRow
from tileinfer.kernels.linear_dequant import INT8_DEQUANT_MIN_M

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("prompt_lens", [[37], [5, 300, 64]], ids=["one", "three"])
def test_graph_decode_step_equals_eager(prompt_lens: list[int]) -> None:
    spec = dataclasses.replace(SMOLLM2_135M, num_layers=4)
    weights = random_weights(spec, torch.float32, "cuda")
    model = LoadedModel(name="random", source=Path("random"), spec=spec, weights=weights, tokenizer=None)
    engine = Engine(model, EngineConfig(device="cuda", dtype="float32", max_model_len=1024,
                                        kv_cache_tokens=4096, max_num_seqs=8, run_ahead=False))  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    for length in prompt_lens:
        prompt = torch.randint(0, spec.vocab_size, (length,), generator=generator).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(3):  # prefill, then two graph decode steps
        engine.step()
    runner = engine.runner
    assert runner.graphs is not None
    seqs = list(engine.scheduler.running)
    for seq in seqs:
        engine.block_manager.append_slots(seq, 0)
    scheduled = [ScheduledRow(seq, 1) for seq in seqs]
    eager = runner.forward_eager(scheduled).clone()
    launch = runner.graphs.launch(runner.inputs.build(scheduled))
    launch.read()
    graph = runner.graphs.logits[: len(seqs)]
    difference = (eager - graph).abs().max().item()
    scale = eager.abs().max().item()
    print(f"max |eager - graph| = {difference:.3e} (logits up to {scale:.3e})")
    assert difference <= 1e-4 * scale
    assert torch.equal(eager.argmax(-1), graph.argmax(-1))


@pytest.mark.parametrize("quantization", [None, "int8"], ids=["float", "int8"])
@pytest.mark.parametrize("prompt_lens", [[37], [5, 300, 64]], ids=["one", "three"])
def test_step_graph_equals_eager(prompt_lens: list[int], quantization: str | None) -> None:
    """A prefill step (and a verify-shaped one: several logit rows per sequence) replayed from a step
    bucket of the graph cache gives the eager step's logits; then whole greedy runs agree. INT8 weights:
    a 369-token step dequantizes each weight for the GEMM, the next one ahead on a side stream, in the
    graph as eagerly; without the workspace (the INT8 GEMM) the step's logits are the same."""
    spec = dataclasses.replace(SMOLLM2_135M, num_layers=4)
    weights = random_weights(spec, torch.float32, "cuda")
    model = LoadedModel(name="random", source=Path("random"), spec=spec, weights=weights, tokenizer=None)

    def engine(step_graphs: bool) -> Engine:
        config = EngineConfig(device="cuda", dtype="float32", max_model_len=1024, kv_cache_tokens=4096,
                              max_num_seqs=8, step_graphs=step_graphs, num_draft=3,
                              max_num_batched_tokens=512, quantization=quantization)  # fmt: skip
        return Engine(model, config)

    graphed = engine(step_graphs=True)
    runner = graphed.runner
    assert runner.graphs is not None and runner.graphs.step_buckets
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=generator).tolist() for n in prompt_lens]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        graphed.add_request(prompt, params)
    batch = graphed.scheduler.schedule()
    runner.copy_blocks(batch.block_copies)
    seqs = [item.seq for item in batch.scheduled]
    # several logit rows per sequence, within the bucket's max_logit_rows (max_num_seqs: no proposer)
    for num_logits in (None, {seq: min(3, 8 // len(seqs)) for seq in seqs}):
        inputs = runner.inputs.build(batch.scheduled, num_logits)
        assert runner.graphs.fits(inputs)
        from_graph = runner.graphs.forward(inputs).clone()
        eager = runner.forward_eager(batch.scheduled, num_logits=num_logits)
        difference = (eager - from_graph).abs().max().item()
        print(f"max |eager - step graph| = {difference:.3e}")
        assert difference <= 1e-4 * eager.abs().max().item()
        if quantization and sum(prompt_lens) >= INT8_DEQUANT_MIN_M:
            workspace = runner.decoder.linear_workspace
            assert workspace is not None and workspace.dequant is not None
            dequant, workspace.dequant = workspace.dequant, None
            int8_gemm = runner.forward_eager(batch.scheduled, num_logits=num_logits)
            workspace.dequant = dequant
            assert (int8_gemm - eager).abs().max().item() <= 1e-4 * eager.abs().max().item()
    for seq in seqs:
        graphed.abort(seq.request_id)
    plain = engine(step_graphs=False)
    for prompt in prompts:
        assert graphed.generate(prompt, params)[0] == plain.generate(prompt, params)[0]


def test_a_step_graph_holds_more_tokens_than_a_context() -> None:
    """max_model_len below the step budget: one step prefills several whole prompts (its padding spread
    over padding sequences of at most a context each), and the greedy outputs are the eager steps'."""
    spec = dataclasses.replace(SMOLLM2_135M, num_layers=4)
    weights = random_weights(spec, torch.float32, "cuda")
    model = LoadedModel(name="random", source=Path("random"), spec=spec, weights=weights, tokenizer=None)

    def run(step_graphs: bool) -> tuple[list[list[int]], int]:
        config = EngineConfig(device="cuda", dtype="float32", max_model_len=100, kv_cache_tokens=4096,
                              max_num_seqs=8, step_graphs=step_graphs, max_num_batched_tokens=512,
                              run_ahead=False)  # fmt: skip
        engine = Engine(model, config)
        generator = torch.Generator().manual_seed(3)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        ids = [
            engine.add_request(torch.randint(0, spec.vocab_size, (n,), generator=generator).tolist(), params)
            for n in (90, 90, 90, 37, 5)
        ]
        tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
        first_outputs = 0
        while engine.has_unfinished():
            outputs = engine.step()
            first_outputs = first_outputs or len(outputs)
            for output in outputs:
                tokens[output.request_id] += output.new_token_ids
        return [tokens[request_id] for request_id in ids], first_outputs

    graphed, first_outputs = run(step_graphs=True)
    assert first_outputs == 5  # all 312 prompt tokens in the first step (the 512-token bucket)
    assert graphed == run(step_graphs=False)[0]


def test_verify_steps_from_step_graphs_equal_plain_decoding() -> None:
    """N-gram drafts on a repetitive prompt: each verify step (a few tokens, padded to the smallest
    bucket) is replayed from a step graph, and the greedy output equals plain decoding's."""
    spec = dataclasses.replace(SMOLLM2_135M, num_layers=4)
    weights = random_weights(spec, torch.float32, "cuda")
    model = LoadedModel(name="random", source=Path("random"), spec=spec, weights=weights, tokenizer=None)
    config = dict(device="cuda", dtype="float32", max_model_len=1024, kv_cache_tokens=4096, max_num_seqs=8,
                  max_num_batched_tokens=64)  # fmt: skip
    speculative = build_engine(model, EngineConfig(**config, proposer="ngram", num_draft=4))
    assert speculative.runner.graphs is not None and speculative.runner.graphs.step_buckets
    plain = Engine(model, EngineConfig(**config, step_graphs=False))
    prompt = list(range(100, 120)) * 4
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    assert speculative.generate(prompt, params)[0] == plain.generate(prompt, params)[0]
    assert speculative.speculator.stats.drafts_proposed > 0


class _RecordingProposer(Proposer):
    """Proposes the request's last token again (often right on a repetitive prompt) and keeps the
    target's hidden rows the engine hands over, as DFlash reads them."""

    def __init__(self, target_layer_ids: tuple[int, ...]) -> None:
        self.target_layer_ids = target_layer_ids
        self.rows: dict[str, list[torch.Tensor]] = {}

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        for request in requests:
            if request.target_hidden is not None:
                self.rows.setdefault(request.request_id, []).append(request.target_hidden.cpu())
        return [list(request.token_ids[-1:]) * request.num_drafts for request in requests]

    def forget(self, request_id: str) -> None:
        pass


def test_step_graphs_hand_over_the_hidden_states_that_eager_steps_do() -> None:
    """With a proposer that reads the target's layers (DFlash), prefill, decode and verify steps replay
    from step graphs that capture those layers too: the rows handed over, and the output, equal the
    eager steps'."""
    spec = dataclasses.replace(SMOLLM2_135M, num_layers=4)
    weights = random_weights(spec, torch.float32, "cuda")
    model = LoadedModel(name="random", source=Path("random"), spec=spec, weights=weights, tokenizer=None)
    config = dict(device="cuda", dtype="float32", max_model_len=1024, kv_cache_tokens=4096, max_num_seqs=8,
                  max_num_batched_tokens=64, num_draft=3)  # fmt: skip
    prompt = list(range(100, 120)) * 3
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    outputs, rows = {}, {}
    for graphed in (True, False):
        proposer = _RecordingProposer((1, 3))
        engine = Engine(model, EngineConfig(**config, step_graphs=graphed), proposer=proposer)
        graphs = engine.runner.graphs  # step buckets only: a decode bucket captures no layers
        assert (graphs is not None) == graphed and (graphs is None or not graphs.decode_buckets)
        outputs[graphed] = engine.generate(prompt, params)[0]
        assert engine.speculator.stats.drafts_proposed > 0
        (chunks,) = proposer.rows.values()
        rows[graphed] = torch.cat(chunks)
    plain = Engine(model, EngineConfig(**config))
    assert outputs[True] == outputs[False] == plain.generate(prompt, params)[0]
    # a row for every token but the last, from the two layers side by side
    assert rows[True].shape == (len(prompt) + len(outputs[True]) - 1, 2 * spec.hidden_size)
    scale = rows[False].abs().max().item()
    torch.testing.assert_close(rows[True], rows[False], atol=1e-4 * scale, rtol=0)
