"""The engine on a CUDA device (Triton kernels, CUDA-graph decode, sampling on the device) against the
CPU reference path and against itself without graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from divergence import describe
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.sampling.params import SamplingParams

pytestmark = pytest.mark.gpu

CHATS = [
    [{"role": "user", "content": "Explain in one sentence what a GPU is."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers."}],
]
GREEDY = SamplingParams(max_tokens=32, temperature=0)


def _engine(path: Path, **config: object) -> Engine:
    # step-graph buckets up to 256 tokens (the chat prompts are shorter): fewer graphs to capture
    defaults = dict(device="cuda", kv_cache_tokens=4096, max_model_len=2048, max_num_seqs=8,
                    max_num_batched_tokens=256)  # fmt: skip
    return Engine.load(str(path), EngineConfig(**{**defaults, **config}))


def test_cuda_float32_greedy_equals_cpu(smollm2_gguf: Path) -> None:
    cuda = _engine(smollm2_gguf, dtype="float32")
    cpu = _engine(smollm2_gguf, dtype="float32", device="cpu")
    for chat in CHATS:
        prompt = cpu.tokenizer.encode_chat(chat)
        got, expected = cuda.generate(prompt, GREEDY)[0], cpu.generate(prompt, GREEDY)[0]
        assert got == expected, describe(cpu, prompt, got, expected)


def test_cuda_graphs_equal_eager(smollm2_gguf: Path) -> None:
    graphs = _engine(smollm2_gguf, dtype="bfloat16")
    eager = _engine(smollm2_gguf, dtype="bfloat16", cuda_graphs=False)
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    for chat in CHATS:
        prompt = graphs.tokenizer.encode_chat(chat)
        got, expected = graphs.generate(prompt, GREEDY)[0], eager.generate(prompt, GREEDY)[0]
        assert got == expected, describe(eager, prompt, got, expected)


def test_cuda_batch_equals_solo_runs(smollm2_gguf: Path) -> None:
    """A batch of 3 replays the 4-sequence graph with a padded row. In float32 (bf16 GEMVs round
    differently at other batch sizes, so near-ties may flip there) each sequence equals its solo run."""
    engine = _engine(smollm2_gguf, dtype="float32")
    prompts = [engine.tokenizer.encode_chat(chat) for chat in CHATS]
    solo = [engine.generate(prompt, GREEDY)[0] for prompt in prompts]
    ids = [engine.add_request(prompt, GREEDY) for prompt in prompts]
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    for prompt, request_id, alone in zip(prompts, ids, solo, strict=True):
        assert tokens[request_id] == alone, describe(engine, prompt, tokens[request_id], alone)


def test_cuda_seeded_sampling_and_logprobs(smollm2_gguf: Path) -> None:
    # float32: the repeat's prompt comes from the prefix cache, and in bf16 that prefill rounds its logits
    # otherwise, which can move a top-p boundary (measured on the H200: the same noise, other tokens)
    engine = _engine(smollm2_gguf, dtype="float32")
    prompt = engine.tokenizer.encode_chat(CHATS[1])
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=11, logprobs=2)
    first = list(engine.stream(prompt, params))
    second = list(engine.stream(prompt, params))
    assert [o.new_token_ids for o in first] == [o.new_token_ids for o in second]
    penalized = SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5)
    token_ids, _, _ = engine.generate(prompt, penalized)
    assert len(token_ids) > 0
    for output in first:
        (logprob,) = output.new_logprobs
        assert logprob.token_id == output.new_token_ids[0] and len(logprob.top) == 2
        assert torch.isfinite(torch.tensor(logprob.logprob))
