"""Named model shapes and random weights for them: an engine of a real model's size without its checkpoint.

Random weights are enough for speed and memory: every kernel moves the same bytes and does the same FLOPs
as with the real ones. The benchmarks time and size these shapes, and the tests build engines on them.
Weights are drawn directly on the device, scaled like a fresh init (linears and embeddings
normal(0, 0.02), norms 1, biases 0) so that bf16 activations stay finite.
"""

from __future__ import annotations

import dataclasses

import torch
from tileinfer.engine.models.decoder import weight_shapes
from tileinfer.engine.models.shape import ModelSpec

# From the models' config.json files.
QWEN3_0_6B = ModelSpec(
    family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
    num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
    tie_word_embeddings=True, qk_norm=True, bos_token_id=None, eos_token_ids=(151645, 151643),
)  # fmt: skip
QWEN3_1_7B = dataclasses.replace(QWEN3_0_6B, hidden_size=2048, intermediate_size=6144, num_layers=28)
QWEN3_4B = dataclasses.replace(
    QWEN3_0_6B, hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32
)
QWEN3_8B = dataclasses.replace(
    QWEN3_4B, hidden_size=4096, intermediate_size=12288, num_layers=36, tie_word_embeddings=False
)
QWEN3_14B = dataclasses.replace(
    QWEN3_8B, hidden_size=5120, intermediate_size=17408, num_layers=40, num_heads=40
)
QWEN3_32B = dataclasses.replace(
    QWEN3_8B, hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64
)
# The Qwen3 dense family, by its model cards' names.
QWEN3_SIZES: dict[str, ModelSpec] = {
    "Qwen3-0.6B": QWEN3_0_6B, "Qwen3-1.7B": QWEN3_1_7B, "Qwen3-4B": QWEN3_4B, "Qwen3-8B": QWEN3_8B,
    "Qwen3-14B": QWEN3_14B, "Qwen3-32B": QWEN3_32B,
}  # fmt: skip

SMOLLM2_135M = ModelSpec(
    family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
    tie_word_embeddings=True, bos_token_id=0, eos_token_ids=(0,),
)  # fmt: skip

# A Qwen3-style model small enough for a CPU smoke run in seconds (GQA, q/k norm, tied head).
TINY = dataclasses.replace(
    QWEN3_0_6B, vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=32, max_position_embeddings=4096, eos_token_ids=(),
)  # fmt: skip

# The names the benchmarks' --model(s) flags take.
SHAPES: dict[str, ModelSpec] = {
    "qwen3-0.6b": QWEN3_0_6B,
    "qwen3-4b": QWEN3_4B,
    "smollm2-135m": SMOLLM2_135M,
    "tiny": TINY,
}


def random_weights(
    spec: ModelSpec, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Canonical weight dict (tileinfer.engine.models.decoder.weight_shapes names and shapes), drawn on
    `device`."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(spec).items():
        tensor = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith(".bias"):
            tensor.zero_()
        else:
            tensor.normal_(0.0, 0.02, generator=generator)
        weights[name] = tensor
    return weights
