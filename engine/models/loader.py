"""Resolve what the user typed (the default alias, a folder, a .gguf file or a hub id) into a loaded model."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path

import torch
from tileinfer.engine.errors import ModelLoadError
from tileinfer.engine.models import hub
from tileinfer.engine.models.default_model import DEFAULT_MODEL_ALIAS, fetch_default_model
from tileinfer.engine.models.gguf_loader import load_gguf_weights, read_gguf, spec_from_gguf
from tileinfer.engine.models.safetensors_loader import load_safetensors_folder
from tileinfer.engine.models.shape import ModelSpec
from tileinfer.engine.text.tokenizer import Tokenizer


@dataclasses.dataclass
class LoadedModel:
    name: str  # what the user typed (or the alias)
    source: Path  # the folder or .gguf file actually read
    spec: ModelSpec
    # canonical HF-llama names (engine/models/safetensors_loader.py): all, or as asked
    weights: dict[str, torch.Tensor]
    # None only for benchmark models; its eos ids may differ from the spec's, and the engine merges them
    tokenizer: Tokenizer | None

    @property
    def logit_vocab_size(self) -> int:
        """The ids that get logits: the tokenizer's (an embedding may have padding rows beyond them, which
        untrained weights would sample), else every row of the spec's vocabulary."""
        if self.tokenizer is None:
            return self.spec.vocab_size
        return min(self.tokenizer.vocab_size, self.spec.vocab_size)


def resolve_model_source(model: str) -> Path:
    """The folder or .gguf file that `model` names, downloading it first when it is a hub id."""
    if model == DEFAULT_MODEL_ALIAS:
        return fetch_default_model()
    path = Path(model).expanduser()
    if path.exists():
        if path.is_dir() or path.suffix == ".gguf":
            return path
        raise ModelLoadError(f"{path} is neither a folder of safetensors nor a .gguf file")
    if hub.is_hub_id(model):
        return hub.resolve_hub_model(model)
    raise ModelLoadError(
        f"no such model: {model} (a folder, a .gguf file, a hub id, or {DEFAULT_MODEL_ALIAS})"
    )


def load_model(
    model: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    names: Collection[str] | None = None,
) -> LoadedModel:
    """quantization "int8": the layers' linear weights load as INT8 (kernels/int8.py), one tensor at a
    time. A GGUF's Q8_0 layer weights load as INT8 as they are either way
    (tileinfer.engine.models.gguf_loader). names: only those weights load (for a proposer that runs part of
    the model); one the model has not, such as a tied lm_head, is left out."""
    source = resolve_model_source(model)
    int8 = quantization == "int8"
    if source.is_dir():
        spec, weights = load_safetensors_folder(source, dtype, device, int8=int8, names=names)
        tokenizer = Tokenizer.from_folder(source)
    else:
        reader = read_gguf(source)
        tokenizer = Tokenizer.from_gguf(reader)
        spec = spec_from_gguf(reader)
        weights = load_gguf_weights(reader, spec, dtype, device, int8=int8, names=names)
    return LoadedModel(name=model, source=source, spec=spec, weights=weights, tokenizer=tokenizer)


def load_tokenizer(model: str) -> Tokenizer:
    """Only the tokenizer of a model (what the HTTP ingress needs), without its weights."""
    source = resolve_model_source(model)
    return Tokenizer.from_folder(source) if source.is_dir() else Tokenizer.from_gguf(read_gguf(source))
