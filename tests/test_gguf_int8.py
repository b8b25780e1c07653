"""GGUF Q8_0 served as INT8: a Q8_0 file's layer weights load as their blocks are (int8 values, group-32
scales, q/k rows un-permuted with their scales), never dequantized, whether or not int8 is asked for;
the decoder keeps them INT8 and computes what the dequantized file computes. With int8 asked for, other
quantized types are dequantized and re-quantized, with a warning about the double rounding; without it,
they and any fused group they share with Q8_0 are dequantized."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tileinfer.engine.kv.block_manager import BlockManager
from tileinfer.engine.models.decoder import Decoder, is_layer_linear
from tileinfer.engine.models.gguf_loader import load_gguf_weights, read_gguf, spec_from_gguf
from tileinfer.engine.models.safetensors_loader import load_safetensors_folder
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.sequence import Sequence
from tileinfer.engine.step import ScheduledRow
from tileinfer.kernels.int8 import Int8Weight, dequantize, quantize_int8

from tests.test_gguf_loader import QuantType, Tiny, gguf_layout, hf_weights, write_gguf


def _write(path: Path, tiny: Tiny, linear_type: dict[str, QuantType]) -> Path:
    """Every 2-D tensor quantized (Q8_0 unless linear_type names another for a GGUF name's suffix)."""
    tensors = {}
    for name, weight in gguf_layout(tiny, hf_weights(tiny, tied=False)).items():
        quant_type = next((t for suffix, t in linear_type.items() if name.endswith(suffix)), QuantType.Q8_0)
        tensors[name] = (
            (weight, QuantType.F32)
            if weight.ndim == 1
            else (gguf.quants.quantize(weight, quant_type), quant_type)
        )
    return write_gguf(path, tiny, tensors)


def _last_logits(spec, weights) -> torch.Tensor:
    decoder = Decoder.from_weights(spec, weights, max_positions=64)
    runner = ModelRunner(decoder, 8, 4, torch.float32, max_num_seqs=1, max_model_len=64, graphs=False)
    seq = Sequence("s", list(range(3, 20)), SamplingParams())
    BlockManager(8, 4).allocate(seq)
    return runner.forward_eager([ScheduledRow(seq, seq.num_tokens)], num_logits={seq: seq.num_tokens})


def test_q8_0_loads_as_int8_and_computes_what_the_dequantized_file_does(tmp_path: Path) -> None:
    tiny = Tiny()  # llama: q and k rows permuted in the file
    reader = read_gguf(_write(tmp_path / "q8.gguf", tiny, {}))
    spec = spec_from_gguf(reader)
    dense = load_gguf_weights(reader, spec, torch.float32, keep_q8_0=False)
    int8 = load_gguf_weights(reader, spec, torch.float32, int8=True)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.1.mlp.down_proj.weight"):  # fmt: skip
        weight = int8[name]
        assert isinstance(weight, Int8Weight) and weight.group_size == 32, name
        assert torch.equal(dequantize(weight, torch.float32), dense[name]), name  # the blocks, unrounded
    assert isinstance(int8["model.embed_tokens.weight"], torch.Tensor)  # not a layer linear
    expected = _last_logits(spec, dense)
    got = _last_logits(spec, int8)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    layer = Decoder.from_weights(spec, int8, max_positions=64).model.layers[0]
    assert isinstance(layer.self_attn.qkv_weight, Int8Weight) and isinstance(
        layer.mlp.down_weight, Int8Weight
    )


def test_other_types_are_requantized_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tiny = Tiny(architecture="qwen2", num_kv_heads=1)
    # k_proj in Q4_1: its fused group (q, k, v) cannot be INT8 as it is; down_proj in Q4_1 alone
    types = {"attn_k.weight": QuantType.Q4_1, "ffn_down.weight": QuantType.Q4_1}
    reader = read_gguf(_write(tmp_path / "mixed.gguf", tiny, types))
    spec = spec_from_gguf(reader)
    with caplog.at_level(logging.WARNING, logger="tileinfer.engine.models.gguf_loader"):
        weights = load_gguf_weights(reader, spec, torch.float32, int8=True)
    assert "rounded twice" in caplog.text and "Q4_1" in caplog.text
    # q and v are Q8_0 beside a Q4_1 k: the three get one scale per row, like the Q4_1 down_proj
    for name in ("q_proj", "k_proj", "v_proj"):
        weight = weights[f"model.layers.0.self_attn.{name}.weight"]
        assert isinstance(weight, Int8Weight) and weight.scale.dim() == 1, name
    assert weights["model.layers.0.self_attn.o_proj.weight"].group_size == 32
    assert weights["model.layers.1.mlp.down_proj.weight"].scale.dim() == 1
    layer = Decoder.from_weights(spec, weights, max_positions=64).model.layers[0]
    assert isinstance(layer.self_attn.qkv_weight, Int8Weight) and layer.self_attn.qkv_weight.scale.dim() == 1
    assert np.isfinite(_last_logits(spec, weights).numpy()).all()


def test_float_files_load_as_int8_one_tensor_at_a_time(tmp_path: Path) -> None:
    """A float GGUF with int8: every layer linear quantized per row from the file's values, no warning."""
    tiny = Tiny(architecture="qwen3")
    original = hf_weights(tiny, tied=False)
    tensors = {name: (weight, QuantType.F32) for name, weight in gguf_layout(tiny, original).items()}
    reader = read_gguf(write_gguf(tmp_path / "f32.gguf", tiny, tensors))
    weights = load_gguf_weights(reader, spec_from_gguf(reader), torch.bfloat16, int8=True)
    for name, weight in weights.items():
        if is_layer_linear(name):
            expected = quantize_int8(torch.from_numpy(original[name]))
            assert torch.equal(weight.values, expected.values) and torch.equal(weight.scale, expected.scale)
        else:
            assert isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16, name


def test_safetensors_load_as_int8_one_tensor_at_a_time(tmp_path: Path) -> None:
    from tests.test_model_families import CONFIGS, _save_random_model

    _save_random_model(CONFIGS["qwen3-qk-norm"](), tmp_path)
    _, dense = load_safetensors_folder(tmp_path, torch.float32)
    spec, weights = load_safetensors_folder(tmp_path, torch.float32, int8=True)
    assert {name for name, w in weights.items() if isinstance(w, Int8Weight)} == {
        name for name in dense if is_layer_linear(name)
    }
    for name, weight in weights.items():
        if isinstance(weight, Int8Weight):
            assert torch.equal(weight.values, quantize_int8(dense[name]).values), name
    assert np.isfinite(_last_logits(spec, weights).numpy()).all()


def test_q8_0_serves_as_int8_unasked_and_mixed_groups_dequantize(tmp_path: Path) -> None:
    """Without int8: the Q8_0 layer weights are the same INT8 blocks; q/k/v, where k is Q4_1, and the
    Q4_1 down_proj are dequantized (no second rounding); the engine reports INT8."""
    from tileinfer.engine.config import EngineConfig
    from tileinfer.engine.engine import Engine
    from tileinfer.engine.models.loader import load_model

    tiny = Tiny(architecture="qwen2", num_kv_heads=1)
    path = _write(
        tmp_path / "mixed.gguf", tiny, {"attn_k.weight": QuantType.Q4_1, "ffn_down.weight": QuantType.Q4_1}
    )
    reader = read_gguf(path)
    spec = spec_from_gguf(reader)
    unasked = load_gguf_weights(reader, spec, torch.float32)
    asked = load_gguf_weights(reader, spec, torch.float32, int8=True)
    dense = load_gguf_weights(reader, spec, torch.float32, keep_q8_0=False)
    for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj"):  # Q8_0, in groups of Q8_0 only
        weight, same = unasked[f"model.layers.0.{name}.weight"], asked[f"model.layers.0.{name}.weight"]
        assert isinstance(weight, Int8Weight) and torch.equal(weight.values, same.values), name
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"):
        full = f"model.layers.0.{name}.weight"
        assert isinstance(unasked[full], torch.Tensor) and torch.equal(unasked[full], dense[full]), name
    torch.testing.assert_close(_last_logits(spec, unasked), _last_logits(spec, dense), rtol=1e-4, atol=1e-4)
    engine = Engine(load_model(str(path)), EngineConfig(max_model_len=64, max_num_seqs=1))
    assert engine.quantization == "int8"
