"""Safetensors folders saved by transformers load into exactly its state_dict, under canonical names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tileinfer.engine.errors import ModelLoadError
from tileinfer.engine.models.decoder import weight_shapes
from tileinfer.engine.models.safetensors_loader import load_safetensors_folder

TINY_SIZES: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# name -> (config class, model class, config overrides): one per family and head kind.
TINY_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
}
# Sharded saves (an index file and several shards) for these.
SHARDED = {"qwen2", "apertus"}
EMBEDDING_AND_HEAD = ("model.embed_tokens.weight", "lm_head.weight")


def save_tiny_model(name: str, folder: Path) -> dict[str, torch.Tensor]:
    """Save a random-weight tiny model with transformers; returns its state_dict."""
    config_class, model_class, overrides = TINY_MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**TINY_SIZES, **overrides})
    model = getattr(transformers, model_class)(config)
    model.save_pretrained(folder, max_shard_size="20KB" if name in SHARDED else "50GB")
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def canonical_state_dict(state_dict: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """transformers' names -> canonical names, written out by hand so that it checks the loader's mapping."""
    canonical = {}
    for name, tensor in state_dict.items():
        if tied and name == "lm_head.weight":
            continue
        name = name.replace(".attention_layernorm.", ".input_layernorm.")
        name = name.replace(".feedforward_layernorm.", ".post_attention_layernorm.")
        canonical[name] = tensor
    return canonical


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: (root / name, save_tiny_model(name, root / name)) for name in TINY_MODELS}


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_weights_equal_transformers_state_dict(name: str, tiny_models) -> None:
    folder, state_dict = tiny_models[name]
    spec, weights = load_safetensors_folder(folder, torch.float32)
    expected = canonical_state_dict(state_dict, spec.tie_word_embeddings)
    assert sorted(weights) == sorted(expected)
    assert {key: tuple(value.shape) for key, value in weights.items()} == weight_shapes(spec)
    for key, tensor in expected.items():
        assert weights[key].dtype == torch.float32
        assert torch.equal(weights[key], tensor), key


@pytest.mark.parametrize("name", ["qwen3", "qwen2"])  # an LM head of its own; tied, in shards
def test_only_the_weights_asked_for(name: str, tiny_models) -> None:
    folder, state_dict = tiny_models[name]
    spec, weights = load_safetensors_folder(folder, torch.float32, names=EMBEDDING_AND_HEAD)
    expected = canonical_state_dict(state_dict, spec.tie_word_embeddings)
    assert set(weights) == set(EMBEDDING_AND_HEAD) & set(expected)
    assert ("lm_head.weight" in weights) is (name == "qwen3")
    for key, tensor in weights.items():
        assert torch.equal(tensor, expected[key]), key


def test_sharded_saves_have_an_index(tiny_models) -> None:
    for name in SHARDED:
        folder, _ = tiny_models[name]
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("model-*.safetensors"))) > 1


def test_spec_fields_per_family(tiny_models) -> None:
    specs = {name: load_safetensors_folder(tiny_models[name][0], torch.float32)[0] for name in TINY_MODELS}
    llama3 = specs["llama3"]
    assert (llama3.family, llama3.num_heads, llama3.num_kv_heads, llama3.head_dim) == ("llama", 4, 2, 8)
    assert llama3.rope_theta == 500000.0
    assert llama3.rope_scaling is not None and llama3.rope_scaling["rope_type"] == "llama3"
    assert llama3.rope_scaling["factor"] == 8.0 and not llama3.tie_word_embeddings
    assert specs["llama-tied"].tie_word_embeddings and specs["llama-tied"].rope_scaling is None
    assert specs["mistral"].sliding_window == 16
    assert specs["qwen2"].qkv_bias and not specs["qwen2"].o_bias and specs["qwen2"].tie_word_embeddings
    assert specs["qwen3"].qk_norm and specs["qwen3"].head_dim == 16 and not specs["qwen3"].qkv_bias
    apertus = specs["apertus"]
    assert (apertus.family, apertus.mlp, apertus.qk_norm) == ("apertus", "xielu", True)
    assert all(not spec.qk_norm for name, spec in specs.items() if name not in ("qwen3", "apertus"))


def test_casts_to_the_requested_dtype(tiny_models) -> None:
    folder, state_dict = tiny_models["qwen3"]
    _, weights = load_safetensors_folder(folder, torch.bfloat16)
    assert all(tensor.dtype == torch.bfloat16 for tensor in weights.values())
    assert torch.equal(weights["model.norm.weight"], state_dict["model.norm.weight"].bfloat16())


def test_unused_tensors_and_a_tied_head_in_the_file_are_dropped(tiny_models, tmp_path: Path) -> None:
    source, state_dict = tiny_models["llama-tied"]
    tensors = load_file(source / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn(320, 32)  # a tied checkpoint that still carries its head
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    folder = _folder_with(tmp_path, source, tensors)
    _, weights = load_safetensors_folder(folder, torch.float32)
    assert "lm_head.weight" not in weights and not any("inv_freq" in key for key in weights)
    assert torch.equal(weights["model.embed_tokens.weight"], state_dict["model.embed_tokens.weight"])


# --- bad input -------------------------------------------------------------------------------------------


def _folder_with(tmp_path: Path, source: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A copy of `source`'s config.json with `tensors` as its model.safetensors."""
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(source / "config.json", folder / "config.json")
    save_file(tensors, folder / "model.safetensors")
    return folder


def _load_error(folder: Path) -> str:
    with pytest.raises(ModelLoadError) as error:
        load_safetensors_folder(folder, torch.float32)
    return str(error.value)


def test_missing_folder(tmp_path: Path) -> None:
    assert "is not a folder" in _load_error(tmp_path / "nowhere")


def test_folder_without_config(tmp_path: Path) -> None:
    assert "no config.json" in _load_error(tmp_path)


def test_unsupported_architecture_names_the_supported_ones(tiny_models, tmp_path: Path) -> None:
    source, _ = tiny_models["llama3"]
    config = json.loads((source / "config.json").read_text()) | {"architectures": ["GPT2LMHeadModel"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = _load_error(tmp_path)
    assert "GPT2LMHeadModel" in message
    for architecture in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert architecture in message
    assert "ApertusForCausalLM" in message


def test_pickle_only_folder_is_refused_unopened(tiny_models, tmp_path: Path) -> None:
    shutil.copy(tiny_models["llama3"][0] / "config.json", tmp_path / "config.json")
    # Not a valid pickle at all: opening it would fail differently, so the message proves it was never read.
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle")
    message = _load_error(tmp_path)
    assert "pytorch_model.bin" in message and "safetensors only" in message and "never unpickles" in message


def test_truncated_file(tiny_models, tmp_path: Path) -> None:
    source, _ = tiny_models["llama3"]
    folder = _folder_with(tmp_path, source, {})
    data = (source / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    message = _load_error(folder)
    assert "model.safetensors" in message and "corrupt or truncated" in message


def test_corrupt_header(tiny_models, tmp_path: Path) -> None:
    source, _ = tiny_models["llama3"]
    folder = _folder_with(tmp_path, source, {})
    data = bytearray((source / "model.safetensors").read_bytes())
    data[8:12] = b"\x00\xff{]"  # the JSON header right after the 8-byte length
    (folder / "model.safetensors").write_bytes(bytes(data))
    message = _load_error(folder)
    assert "model.safetensors" in message and "corrupt or truncated" in message


def test_missing_tensor(tiny_models, tmp_path: Path) -> None:
    source, _ = tiny_models["llama3"]
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.1.mlp.gate_proj.weight"]
    message = _load_error(_folder_with(tmp_path, source, tensors))
    assert "missing 1 tensor" in message and "model.layers.1.mlp.gate_proj.weight" in message


def test_wrong_shape(tiny_models, tmp_path: Path) -> None:
    source, _ = tiny_models["llama3"]
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 32)  # 2 kv heads x 8 = 16 rows
    message = _load_error(_folder_with(tmp_path, source, tensors))
    assert (
        "model.layers.0.self_attn.k_proj.weight" in message
        and "[32, 32]" in message
        and "[16, 32]" in message
    )


def test_index_naming_a_missing_shard(tiny_models, tmp_path: Path) -> None:
    source, _ = tiny_models["qwen2"]
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    message = _load_error(folder)
    assert shard.name in message and "does not exist" in message
