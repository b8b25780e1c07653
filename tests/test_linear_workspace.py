"""Each decoder's Triton linears draw on a LinearWorkspace of its own (kernels/linear.py): split-K scratch,
and the buffers its INT8 weights are dequantized into for prefill, the next one ahead. Two INT8 decoders
of different weights and widths in one process, their forwards interleaved, compute exactly what each
computes alone: on a GPU (marked gpu) with the side stream's prefetch, and then two engines with their CUDA
graphs. On the CPU (a 260-token prefill in Triton's interpreter costs a minute) only that each decoder's
workspace is its own."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.kv.block_manager import BlockManager
from tileinfer.engine.models.decoder import Decoder
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.models.random_model import SMOLLM2_135M, TINY, random_weights
from tileinfer.engine.ops import TRITON_OPS
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.sequence import Sequence
from tileinfer.engine.step import ScheduledRow
from tileinfer.kernels.int8 import Int8Weight
from tileinfer.kernels.linear_dequant import INT8_DEQUANT_MIN_M

BLOCK_SIZE = 16
MAX_MODEL_LEN = 384
PROMPT_LEN = INT8_DEQUANT_MIN_M + 4  # a prefill that dequantizes its INT8 weights
DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors: Triton's interpreter only"),
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def _decoder(spec: object, seed: int, device: str) -> Decoder:
    weights = random_weights(spec, torch.bfloat16, device, seed=seed)
    return Decoder.from_weights(spec, weights, MAX_MODEL_LEN, TRITON_OPS, quantization="int8")


def _steps(decoder: Decoder, seed: int) -> Iterator[torch.Tensor]:
    """A sequence of its own through decoder, a step a next(): its prompt's prefill, then a verify-shaped
    step of 5 tokens (the skinny GEMM, K split where it pays); every row's logits. (A decode step's GEMV
    uses no workspace.)"""
    runner = ModelRunner(
        decoder, MAX_MODEL_LEN // BLOCK_SIZE, BLOCK_SIZE, torch.bfloat16, max_num_seqs=1,
        max_model_len=MAX_MODEL_LEN, graphs=False,
    )  # fmt: skip
    manager = BlockManager(MAX_MODEL_LEN // BLOCK_SIZE, BLOCK_SIZE)
    vocab = decoder.logit_vocab_size
    prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()
    seq = Sequence("s", prompt, SamplingParams())
    manager.allocate(seq)
    yield runner.forward_eager([ScheduledRow(seq, PROMPT_LEN)], num_logits={seq: PROMPT_LEN}).clone()
    seq.num_computed_tokens = seq.num_tokens
    seq.token_ids += [7, 8, 9, 10, 11]
    manager.append_slots(seq, 0)
    yield runner.forward_eager([ScheduledRow(seq, 5)], num_logits={seq: 5}).clone()


def _two_decoders(device: str) -> list[Decoder]:
    # one layer each; the first one's down projection reads K = 1024, which the skinny GEMM splits
    specs = (
        dataclasses.replace(TINY, num_layers=1, intermediate_size=1024),
        dataclasses.replace(TINY, num_layers=1),
    )
    return [_decoder(spec, seed, device) for seed, spec in enumerate(specs)]


@pytest.mark.parametrize("device", DEVICES)
def test_each_decoder_owns_its_workspace(device: str) -> None:
    decoders = _two_decoders(device)
    first, second = (decoder.linear_workspace for decoder in decoders)
    assert first.split_k.partials.data_ptr() != second.split_k.partials.data_ptr()
    for decoder in decoders:  # dequantization buffers and a prefetch order of its own weights
        int8 = [weight for weight in decoder.layer_linears() if isinstance(weight, Int8Weight)]
        own = {weight.values.data_ptr() for weight in int8}
        dequant = decoder.linear_workspace.dequant
        assert dequant is not None and len(dequant.buffers) == 2
        assert dequant.successor and set(dequant.successor) <= own
    assert first.dequant.buffers[0].numel() > second.dequant.buffers[0].numel()


@pytest.mark.gpu
def test_two_decoders_interleaved_compute_what_each_computes_alone() -> None:
    decoders = _two_decoders("cuda")
    alone = [list(_steps(decoder, seed)) for seed, decoder in enumerate(decoders)]
    interleaved: list[list[torch.Tensor]] = [[], []]
    runs = [_steps(decoder, seed) for seed, decoder in enumerate(decoders)]
    for step_logits in zip(*runs, strict=True):  # a step of the first decoder, then one of the second
        for index, logits in enumerate(step_logits):
            interleaved[index].append(logits)
    for index in range(2):
        for step, (expected, logits) in enumerate(zip(alone[index], interleaved[index], strict=True)):
            assert torch.isfinite(logits).all()
            assert torch.equal(logits, expected), (index, step)


@pytest.mark.gpu
def test_two_int8_engines_interleaved_generate_what_each_generates_alone() -> None:
    """Two engines on INT8 weights with their CUDA graphs (prefill steps replayed from step graphs that
    dequantize the next weight ahead), stepped in turns: each greedy output is its engine's alone."""
    spec = dataclasses.replace(SMOLLM2_135M, num_layers=2)
    models = [
        LoadedModel(name=f"random{seed}", source=Path("random"), spec=spec,
                    weights=random_weights(spec, torch.float32, "cuda", seed=seed), tokenizer=None)
        for seed in range(2)
    ]  # fmt: skip
    config = EngineConfig(device="cuda", dtype="float32", max_model_len=1024, kv_cache_tokens=4096,
                          max_num_seqs=4, max_num_batched_tokens=512, quantization="int8")  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=generator).tolist() for n in (300, 280)]
    engines = [Engine(model, config) for model in models]
    pairs = list(zip(engines, prompts, strict=True))
    alone = [engine.generate(prompt, params)[0] for engine, prompt in pairs]
    request_ids = [engine.add_request(prompt, params) for engine, prompt in pairs]
    tokens: list[list[int]] = [[], []]
    while any(engine.has_unfinished() for engine in engines):
        for index, engine in enumerate(engines):
            for output in engine.step() if engine.has_unfinished() else []:
                if output.request_id == request_ids[index]:
                    tokens[index] += output.new_token_ids
    assert tokens == alone
