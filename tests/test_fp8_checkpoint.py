"""FP8 checkpoints in Qwen's layout (engine/models/fp8_checkpoint.py): made here from SmolLM2-135M's real
weights (its first two layers), they load with no option as their values times their block scales, and
decode as those weights do; other quantized checkpoints fail at load, naming their method."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tileinfer.engine.errors import ModelLoadError
from tileinfer.engine.models.decoder import Decoder, is_layer_linear
from tileinfer.engine.models.fp8_checkpoint import E4M3_MAX, quantize_fp8
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.models.safetensors_loader import load_safetensors_folder
from tileinfer.kernels.paged_attention import AttentionMetadata

LAYERS, BLOCK = 2, 128


def _config(model: LoadedModel, quantization: dict | None) -> dict:
    spec = model.spec
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": LAYERS,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta, "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings, "tie_word_embeddings": True,
    }  # fmt: skip
    return config | ({"quantization_config": quantization} if quantization else {})


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 values, the scale of each 128 x 128 block, what they stand for), as Qwen's FP8 releases are
    made (quantize_fp8: each block's largest magnitude maps to e4m3's largest); edge blocks are partial
    (576 columns). What they stand for is multiplied out here a block at a time."""
    values, scales = quantize_fp8(weight)
    assert scales.shape == (-(-weight.shape[0] // BLOCK), -(-weight.shape[1] // BLOCK))
    meant = torch.empty(weight.shape)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, columns = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            block = weight[rows, columns]
            assert values[rows, columns].float().abs().max() == E4M3_MAX or block.abs().max() == 0
            meant[rows, columns] = values[rows, columns].float() * scales[i, j]
    return values, scales, meant


def _save_fp8_folder(model: LoadedModel, folder: Path) -> dict[str, torch.Tensor]:
    """The first LAYERS layers in Qwen's FP8 layout; returns the float weights the values and scales mean."""
    tensors, meant = {}, {}
    for name, weight in model.weights.items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= LAYERS or name == "lm_head.weight":
            continue
        if is_layer_linear(name):
            tensors[name], tensors[name + "_scale_inv"], meant[name] = _quantize(weight.float())
        else:
            tensors[name] = meant[name] = weight.float().contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    fp8 = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (folder / "config.json").write_text(json.dumps(_config(model, fp8)))
    return meant


@torch.no_grad()
def _last_logits(spec: object, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The last position's logits for a 6-token prompt (one prefill through the paged cache)."""
    decoder = Decoder.from_weights(spec, weights, max_positions=64)
    cache = torch.zeros(LAYERS, 2, 4, 16, spec.num_kv_heads, spec.head_dim)
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(6), query_start_loc=torch.tensor([0, 6], dtype=torch.int32),
        seq_lens=torch.tensor([6], dtype=torch.int32), block_tables=torch.tensor([[0]], dtype=torch.int32),
    )  # fmt: skip
    hidden, residual = decoder(torch.tensor([1, 9690, 28, 1534, 314, 30]), torch.arange(6), cache, metadata)
    return decoder.compute_logits(hidden[-1:], residual[-1:])


def test_an_fp8_checkpoint_loads_as_its_values_times_their_block_scales(
    smollm2_model: LoadedModel, tmp_path: Path
) -> None:
    meant = _save_fp8_folder(smollm2_model, tmp_path)
    spec, weights = load_safetensors_folder(tmp_path, torch.float32)
    assert weights.keys() == meant.keys()
    assert all(torch.equal(weights[name], meant[name]) for name in meant)
    # it decodes as those weights do, and near the unquantized ones (e4m3 keeps 3 mantissa bits)
    logits = _last_logits(spec, weights)
    assert torch.allclose(logits, _last_logits(spec, meant), rtol=0, atol=1e-5 * logits.abs().max())
    original = {name: smollm2_model.weights[name].float() for name in meant}
    unquantized = _last_logits(spec, original)
    assert (logits - unquantized).abs().max() <= 0.1 * unquantized.abs().max()


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method is 'gptq'"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "without block scales"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "format 'e5m2'"),
    ],
)
def test_a_checkpoint_quantized_otherwise_fails_at_load_naming_it(
    smollm2_model: LoadedModel, tmp_path: Path, quantization: dict, message: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_config(smollm2_model, quantization)))
    save_file(
        {"model.norm.weight": torch.ones(smollm2_model.spec.hidden_size)}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(ModelLoadError, match=message):
        load_safetensors_folder(tmp_path, torch.float32)
