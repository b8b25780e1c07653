"""The persistent decode kernel (kernels/persistent_decode.py): a decoder whose layers are stacked decodes
one sequence through it, and its logits and KV cache equal the torch reference decoder's (float32).

On the CPU the kernel runs in Triton's interpreter, one launch an operation (the barrier compiled out);
on CUDA the whole step is one launch with the grid barrier."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tileinfer.engine.kv.block_manager import BlockManager
from tileinfer.engine.models.decoder import Decoder
from tileinfer.engine.models.random_model import TINY, random_weights
from tileinfer.engine.models.shape import ModelSpec
from tileinfer.engine.ops import REFERENCE_OPS, TRITON_OPS
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.sequence import Sequence
from tileinfer.engine.step import ScheduledRow
from tileinfer.kernels import persistent_decode
from tileinfer.kernels.persistent_decode import persistent_decode_layers

SPECS = {
    # every path at once: Qwen3's q/k norms, GQA groups of 3 (SmolLM2's), a qkv bias (Qwen2's) and a
    # sliding window shorter than the context (Mistral's)
    "every-path": dataclasses.replace(TINY, num_heads=6, num_kv_heads=2, qkv_bias=True, sliding_window=7),
}
BLOCK_SIZE, NUM_BLOCKS, MAX_LEN = 4, 16, 64


def _weights(spec: ModelSpec, device: str) -> dict[str, torch.Tensor]:
    """Random weights whose norms and biases differ by layer, so a layer offset that is wrong shows."""
    weights = random_weights(spec, torch.float32, device)
    generator = torch.Generator(device=device).manual_seed(3)
    for name, tensor in weights.items():
        if name.endswith("norm.weight") or name.endswith(".bias"):
            tensor += 0.1 * torch.randn(tensor.shape, generator=generator, device=device)
    return weights


def _decode(decoder: Decoder, spec: ModelSpec, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A 9-token prefill, then 2 decode steps: (the decode steps' logits, the cache)."""
    runner = ModelRunner(
        decoder, NUM_BLOCKS, BLOCK_SIZE, torch.float32, max_num_seqs=1, max_model_len=MAX_LEN, graphs=False
    )
    manager = BlockManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    manager.allocate(Sequence("pad", [1] * 5, SamplingParams()))  # block ids that are not 0, 1, 2...
    tokens = torch.randint(0, spec.vocab_size, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = Sequence("s", tokens[:9], SamplingParams())
    manager.allocate(seq)
    runner.forward_eager([ScheduledRow(seq, 9)])
    seq.num_computed_tokens = 9
    logits = []
    for token in tokens[9:]:
        seq.token_ids.append(token)
        manager.append_slots(seq, 0)
        logits.append(runner.forward_eager([ScheduledRow(seq, 1)]))
        seq.num_computed_tokens += 1
    return torch.cat(logits).cpu(), runner.kv_cache.cpu()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", list(SPECS))
def test_persistent_decode_equals_reference(name: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMV tiles' fp32 partial sums capped at 512, so that o_proj's and down_proj's K loops (192 and
    160 inputs) take three 64-wide steps, the last one masked, as the real shapes' pipelined loops do."""
    monkeypatch.setattr(persistent_decode, "GEMV_ACCUMULATORS", 512)
    spec = SPECS[name]
    launches = []

    def counted(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        launches.append(args[2].shape)  # hidden
        return persistent_decode_layers(*args, **kwargs)

    ops = dataclasses.replace(TRITON_OPS, persistent_decode=counted)
    reference = Decoder.from_weights(spec, _weights(spec, device), MAX_LEN, REFERENCE_OPS)
    stacked = Decoder.from_weights(spec, _weights(spec, device), MAX_LEN, ops)
    stacked.stack_layers()
    expected_logits, expected_cache = _decode(reference, spec, device)
    logits, cache = _decode(stacked, spec, device)
    assert len(launches) == 2  # every decode step took the kernel; the prefill did not
    scale = expected_logits.abs().max()
    assert (logits - expected_logits).abs().max() <= 1e-4 * scale
    assert torch.allclose(cache, expected_cache, atol=1e-5, rtol=1e-4)


def test_stacked_layers_are_views() -> None:
    """Stacking moves the layer weights into one tensor a kind: each layer's weight is a view of it."""
    decoder = Decoder.from_weights(TINY, random_weights(TINY, torch.float32, "cpu"), MAX_LEN, TRITON_OPS)
    before = [weight.clone() for weight in decoder.layer_linears()]
    decoder.stack_layers()
    stack = decoder.layer_stack
    assert stack is not None
    layer = decoder.model.layers[1]
    assert layer.self_attn.qkv_weight.data_ptr() == stack.qkv[1].data_ptr()
    assert layer.mlp.down_weight.data_ptr() == stack.down[1].data_ptr()
    assert layer.input_layernorm.weight.data_ptr() == stack.input_norm[1].data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(before, decoder.layer_linears(), strict=True))
