"""A CUDA-graph decode step computes what the eager decode step computes (same runner, same cache
state), for several batch sizes and context lengths; random weights in float32."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from bench.model_shapes import SMOLLM2_135M, random_weights
from engine.engine import Engine, EngineConfig
from engine.loader import LoadedModel
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledSequence

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
    scheduled = [ScheduledSequence(seq, 1) for seq in seqs]
    eager = runner.forward_eager(scheduled, is_decode=True).clone()
    launch = runner.graphs.launch(scheduled, [-1] * len(seqs))
    launch.read()
    graph = runner.graphs.logits[: len(seqs)]
    difference = (eager - graph).abs().max().item()
    scale = eager.abs().max().item()
    print(f"max |eager - graph| = {difference:.3e} (logits up to {scale:.3e})")
    assert difference <= 1e-4 * scale
    assert torch.equal(eager.argmax(-1), graph.argmax(-1))
