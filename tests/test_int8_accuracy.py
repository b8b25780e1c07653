"""INT8 weights on a real model: SmolLM2-135M (its GGUF dequantized to float32, the baseline's weights and
the quantizer's input) on the torch reference path, scored with bench/int8_accuracy.py against the
float32 weights: perplexity on real English text, logit error, top-1 and greedy agreement."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.models.loader import LoadedModel, load_model
from tileinfer.kernels.int8 import Int8Weight, quantize_int8

from bench.int8_accuracy import CHAT_PROMPTS, compare

CONFIG = EngineConfig(max_model_len=512, max_num_seqs=1)


@pytest.fixture(scope="module")
def figures(smollm2_model: LoadedModel) -> dict[str, dict[str, float]]:
    """INT8 weights and the INT8 KV cache, each against one float32 baseline run."""
    return compare(
        smollm2_model, CONFIG, tokens=256, max_tokens=12, prompts=CHAT_PROMPTS[:2], modes=("weights", "kv")
    )


def test_int8_weights_stay_close_to_the_float_weights(figures: dict[str, dict[str, float]]) -> None:
    weights = figures["weights"]
    assert weights["perplexity_increase"] <= 0.01, weights  # INT8 weights cost at most 1 % in perplexity
    assert weights["top1_agreement"] >= 0.95, weights
    assert weights["max_logit_error"] <= 0.06, weights
    assert weights["greedy_common_prefix"] >= 6, weights


def test_int8_engine_holds_int8_linears_and_refuses_other_modes(smollm2_model: LoadedModel) -> None:
    engine = Engine(smollm2_model, dataclasses.replace(CONFIG, quantization="int8"))
    layer = engine.runner.decoder.model.layers[0]
    weights = (layer.self_attn.qkv_weight, layer.self_attn.o_weight, *layer.mlp.input_projection()[:1])
    assert all(isinstance(weight, Int8Weight) for weight in (*weights, layer.mlp.down_weight))
    assert not hasattr(layer.self_attn.o_proj, "weight")  # the float copy is gone
    with pytest.raises(InvalidRequestError, match="quantization must be one of int8"):
        Engine(smollm2_model, dataclasses.replace(CONFIG, quantization="int4"))


def test_loading_as_int8_equals_quantizing_after_the_load(
    smollm2_model: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    """The file's Q4_1 linears, dequantized and quantized one at a time while loading (with the double
    rounding named), give the weights that quantizing the loaded float model gives."""
    with caplog.at_level(logging.WARNING, logger="tileinfer.engine.models.gguf_loader"):
        loaded = load_model("smollm2-135m", quantization="int8")
    assert "Q4_1" in caplog.text and "rounded twice" in caplog.text
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        expected = quantize_int8(smollm2_model.weights[name])
        assert torch.equal(loaded.weights[name].values, expected.values), name
        assert torch.equal(loaded.weights[name].scale, expected.scale), name


def test_the_int8_kv_cache_stays_close_to_the_float_cache(figures: dict[str, dict[str, float]]) -> None:
    kv = figures["kv"]
    assert abs(kv["perplexity_increase"]) <= 0.005, kv  # the INT8 KV cache costs at most 0.5 % either way
    assert kv["top1_agreement"] >= 0.97, kv
    assert kv["max_logit_error"] <= 0.03, kv
