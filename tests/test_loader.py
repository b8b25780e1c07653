"""load_model: the alias, a safetensors folder, a .gguf file and bad names, each resolved and loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_safetensors_loader import save_tiny_model
from tileinfer.engine.errors import ModelLoadError
from tileinfer.engine.models.default_model import DEFAULT_MODEL_ALIAS
from tileinfer.engine.models.loader import load_model, resolve_model_source
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def save_tiny_tokenizer(folder: Path) -> None:
    """A byte-level BPE (vocab < 320, the tiny models' vocab) with ChatML specials, saved as HF saves one."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["hello world, the tiny model says hello", "the world is tiny"], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    state_dict = save_tiny_model("qwen3", folder)
    save_tiny_tokenizer(folder)
    return folder, state_dict


def test_the_alias_resolves_to_the_default_gguf(smollm2_gguf: Path) -> None:
    assert resolve_model_source(DEFAULT_MODEL_ALIAS) == smollm2_gguf


def test_the_alias_loads_smollm2(smollm2_gguf: Path) -> None:
    model = load_model(DEFAULT_MODEL_ALIAS)
    assert (model.name, model.source) == (DEFAULT_MODEL_ALIAS, smollm2_gguf)
    spec = model.spec
    assert (spec.family, spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (
        "llama",
        576,
        30,
        9,
        3,
    )
    assert spec.vocab_size == 49152 and spec.tie_word_embeddings
    assert model.weights["model.layers.29.mlp.down_proj.weight"].shape == (576, spec.intermediate_size)
    assert model.weights["model.embed_tokens.weight"].dtype == torch.float32
    assert model.tokenizer.decode(model.tokenizer.encode("Hello, world!")) == "Hello, world!"


def test_a_safetensors_folder(tiny_folder) -> None:
    folder, state_dict = tiny_folder
    model = load_model(str(folder), dtype=torch.bfloat16)
    assert (model.name, model.source, model.spec.family) == (str(folder), folder, "qwen3")
    assert torch.equal(model.weights["lm_head.weight"], state_dict["lm_head.weight"].bfloat16())
    assert model.tokenizer.decode(model.tokenizer.encode("hello tiny world")) == "hello tiny world"


def test_missing_path_lists_what_a_model_can_be(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as error:
        load_model(str(tmp_path / "nowhere"))
    message = str(error.value)
    assert message.startswith(f"no such model: {tmp_path / 'nowhere'}")
    assert "a folder, a .gguf file, a hub id, or smollm2-135m" in message


def test_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x80\x04not loaded")
    with pytest.raises(ModelLoadError, match="neither a folder of safetensors nor a .gguf file"):
        load_model(str(path))


def test_a_corrupt_gguf(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00truncated")
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        load_model(str(path))


def test_a_folder_without_a_tokenizer(tiny_folder, tmp_path: Path) -> None:
    folder, _ = tiny_folder
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_model(str(tmp_path))
