"""Load an HF safetensors folder (config.json + model.safetensors or a sharded index) into canonical weights.

Tensors are memory-mapped by safetensors and kept in the layout HF stores them ([out_features,
in_features] for linears); only their names are mapped to the canonical HF-llama names. Pickle
files (pytorch_model.bin, *.pt) are never opened.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tileinfer.engine.errors import ModelLoadError
from tileinfer.engine.models.decoder import is_layer_linear, weight_shapes
from tileinfer.engine.models.fp8_checkpoint import (
    FLOAT8_DTYPES,
    SCALE_SUFFIX,
    Fp8Blocks,
    checkpoint_quantization,
    dequantize_fp8,
)
from tileinfer.engine.models.shape import ModelSpec, read_config_file
from tileinfer.kernels.int8 import LinearWeight, quantize_int8

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")

# Apertus names its two pre-norms after what they precede; every other family uses the llama names.
_RENAMES = {
    ".attention_layernorm.": ".input_layernorm.",
    ".feedforward_layernorm.": ".post_attention_layernorm.",
}


def canonical_name(name: str) -> str:
    for old, new in _RENAMES.items():
        name = name.replace(old, new)
    return name


def safetensors_files(folder: Path) -> list[Path]:
    """The .safetensors files that hold the model: the shards of the index, or model.safetensors."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            return [folder / shard for shard in sorted(set(weight_map.values()))]
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
            raise ModelLoadError(f"{index_path} is not a valid safetensors index: {error}") from error
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    pickles = sorted(path.name for pattern in PICKLE_PATTERNS for path in folder.glob(pattern))
    if pickles:
        raise ModelLoadError(
            f"{folder} holds only pickle weights ({', '.join(pickles)}); TileInfer loads safetensors only "
            "and never unpickles. Convert the model to safetensors or use a repo that ships them."
        )
    raise ModelLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}")


def load_safetensors_folder(
    folder: Path,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    int8: bool = False,
    names: Collection[str] | None = None,
) -> tuple[ModelSpec, dict[str, LinearWeight]]:
    """int8: the layers' linear weights quantized to INT8 (kernels/int8.py) one tensor at a time, from
    the file's values, so the float copies never pile up on the device. names: only those of the
    model's weights are read (one the model has not, such as a tied lm_head, is left out). An FP8
    checkpoint's weights are read as float (engine/models/fp8_checkpoint.py); any other quantized one is
    refused, naming its method."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder} is not a folder")
    config = read_config_file(folder / "config.json")
    spec = ModelSpec.from_hf_config(config)
    fp8 = checkpoint_quantization(config)
    expected_shapes = weight_shapes(spec)
    if names is not None:
        expected_shapes = {name: shape for name, shape in expected_shapes.items() if name in names}
    files = safetensors_files(folder)
    scales = _fp8_scales(files) if fp8 is not None else {}
    weights: dict[str, LinearWeight] = {}
    for path in files:
        weights.update(read_safetensors_file(path, expected_shapes, dtype, device, int8, fp8, scales))
    missing = [name for name in expected_shapes if name not in weights]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(
            f"{folder} is missing {len(missing)} tensor(s) that the {spec.family} model needs: {shown}"
        )
    return spec, weights


def _fp8_scales(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every `<weight>_scale_inv` of an FP8 checkpoint, by the stored name of its weight (a shard may hold
    a weight whose scales are in another)."""
    scales: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as file:
                for stored_name in file.keys():  # noqa: SIM118 (safe_open has keys() but is not iterable)
                    if stored_name.endswith(SCALE_SUFFIX):
                        scales[stored_name.removesuffix(SCALE_SUFFIX)] = file.get_tensor(stored_name)
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"{path} is not a readable safetensors file: {error}") from error
    return scales


def read_safetensors_file(
    path: Path,
    expected_shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: str | torch.device,
    int8: bool = False,
    fp8: Fp8Blocks | None = None,
    fp8_scales: dict[str, torch.Tensor] | None = None,
) -> dict[str, LinearWeight]:
    """Canonical tensors of one file; names the model does not use (rotary inv_freq, a tied lm_head) are
    dropped. fp8: the checkpoint's block scaling, and its scales by weight name (_fp8_scales): its float8
    weights are read as float on the device."""
    if not path.is_file():
        raise ModelLoadError(f"safetensors shard {path} is listed in the index but does not exist")
    weights: dict[str, LinearWeight] = {}
    try:
        with safe_open(path, framework="pt", device="cpu") as file:
            for stored_name in file.keys():  # noqa: SIM118 (safe_open has keys() but is not iterable)
                name = canonical_name(stored_name)
                expected = expected_shapes.get(name)
                if expected is None:
                    continue
                shape = tuple(file.get_slice(stored_name).get_shape())
                if shape != expected and not (math.prod(shape) == math.prod(expected) == 1):
                    raise ModelLoadError(
                        f"tensor {stored_name} in {path} has shape {list(shape)}, "
                        f"but the config implies {list(expected)}"
                    )
                # Reshape only fixes a 1-element xIELU scalar stored as [] vs [1]; elsewhere it is a no-op.
                tensor = file.get_tensor(stored_name).reshape(expected)
                if tensor.dtype in FLOAT8_DTYPES:
                    tensor = _dequantized(stored_name, tensor, fp8, fp8_scales or {}, device)
                if int8 and is_layer_linear(name):
                    weights[name] = quantize_int8(tensor.to(device=device))
                    continue
                # .to() returns the memory-mapped tensor itself when dtype and device already match.
                weights[name] = tensor.to(device=device, dtype=dtype)
    except (SafetensorError, OSError) as error:
        raise ModelLoadError(
            f"{path} is not a readable safetensors file (corrupt or truncated?): {error}"
        ) from error
    return weights


def _dequantized(
    stored_name: str,
    values: torch.Tensor,
    fp8: Fp8Blocks | None,
    scales: dict[str, torch.Tensor],
    device: str | torch.device,
) -> torch.Tensor:
    """A float8 weight as float32 on the device: its values times its block scales."""
    if fp8 is None:
        raise ModelLoadError(f"tensor {stored_name} is float8, but config.json declares no FP8 quantization")
    scale_inv = scales.get(stored_name)
    if scale_inv is None:
        raise ModelLoadError(f"the FP8 weight {stored_name} has no {stored_name}{SCALE_SUFFIX}")
    return dequantize_fp8(values.to(device), scale_inv.to(device), fp8)
