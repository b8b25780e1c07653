"""Load a GGUF file: its ModelSpec from the metadata, and its weights dequantized under the HF-llama names.

GGUF stores every tensor with its dimensions reversed (ne0 first) and, for the llama architecture,
with the q/k rows permuted into llama.cpp's RoPE layout; both are undone here so that the weights
come back exactly as an HF checkpoint holds them.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tileinfer.engine.errors import ModelLoadError
from tileinfer.engine.models.decoder import FUSED_LINEARS, is_layer_linear, weight_shapes
from tileinfer.engine.models.shape import ModelSpec, supported_architectures_text
from tileinfer.kernels.int8 import Int8Weight, LinearWeight, dequantize, in_mma_order, quantize_int8

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> family. Mistral GGUFs are written as llama.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "apertus": "apertus",
}

_QUANT = gguf.GGMLQuantizationType
# The block formats TileInfer dequantizes (gguf.quants does the work); others are refused by name.
DEQUANTIZABLE_TYPES = tuple(
    _QUANT[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<key> -> model.layers.N.<value>
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
# Tensors that carry no weight of their own: llama3 RoPE factors (read into the spec) and old RoPE caches.
_IGNORED_TENSORS = re.compile(r"rope_freqs\.weight|blk\.\d+\.attn_rot_embd(\.weight)?")
# Apertus keeps its xIELU parameters as per-layer metadata arrays (convert_hf_to_gguf.py ApertusModel),
# holding the raw HF parameters: alpha_p and alpha_n before softplus, as transformers stores them.
_XIELU_KEYS = {
    "alpha_p": gguf.Keys.xIELU.ALPHA_P,
    "alpha_n": gguf.Keys.xIELU.ALPHA_N,
    "beta": gguf.Keys.xIELU.BETA,
    "eps": gguf.Keys.xIELU.EPS,
}
_MISSING = object()


class _PlainArrayReader(gguf.GGUFReader):
    """gguf's reader, slicing a plain array over its memory map: numpy's memmap subclass costs Python calls
    on each of the ~250,000 slices a tokenizer's metadata takes (SmolLM2's file: 2.1 s -> 0.6 s on a CPU)."""

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None
    ) -> np.ndarray:  # as GGUFReader._get, on self.data's plain view
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        array = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return array.view(
            array.dtype.newbyteorder(self.byte_order if override_order is None else override_order)
        )


def read_gguf(path: Path) -> gguf.GGUFReader:
    """Open a GGUF file (memory-mapped); anything that is not a whole GGUF file raises ModelLoadError."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        return _PlainArrayReader(path)
    except Exception:  # noqa: BLE001 - a gguf release whose reader differs: its own reader says what is wrong
        pass
    try:
        return gguf.GGUFReader(path)
    except Exception as error:  # the reader raises assorted errors (ValueError, IndexError, ...) on bad bytes
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (wrong format, corrupt or truncated): {error}"
        ) from error


def _field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ModelLoadError(f"GGUF metadata has no {key!r}")
        return default
    return field.contents()


def _architecture(reader: gguf.GGUFReader) -> str:
    architecture = _field(reader, gguf.Keys.General.ARCHITECTURE)
    if architecture not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {architecture!r}; supported GGUF architectures: "
            f"{', '.join(GGUF_ARCHITECTURES)} (Mistral is written as llama), "
            f"i.e. the families {supported_architectures_text()}"
        )
    return architecture


def spec_from_gguf(reader: gguf.GGUFReader) -> ModelSpec:
    """The ModelSpec described by a GGUF file's metadata (and, where only they tell, its tensor names)."""
    architecture = _architecture(reader)
    tensor_names = {tensor.name for tensor in reader.tensors}

    def arch_field(key: str, default: Any = _MISSING) -> Any:
        return _field(reader, key.format(arch=architecture), default)

    try:
        hidden_size = int(arch_field(gguf.Keys.LLM.EMBEDDING_LENGTH))
        num_heads = int(arch_field(gguf.Keys.Attention.HEAD_COUNT))
        vocab_size = arch_field(gguf.Keys.LLM.VOCAB_SIZE, None)
        if vocab_size is None:
            vocab_size = len(_field(reader, gguf.Keys.Tokenizer.LIST))
        head_dim = int(arch_field(gguf.Keys.Attention.KEY_LENGTH, hidden_size // num_heads))
        rope_theta = float(arch_field(gguf.Keys.Rope.FREQ_BASE, 10000.0))
        sliding_window = (
            arch_field(gguf.Keys.Attention.SLIDING_WINDOW, None) if architecture == "llama" else None
        )
        return ModelSpec(
            family="mistral" if sliding_window else GGUF_ARCHITECTURES[architecture],
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(arch_field(gguf.Keys.LLM.FEED_FORWARD_LENGTH)),
            num_layers=int(arch_field(gguf.Keys.LLM.BLOCK_COUNT)),
            num_heads=num_heads,
            num_kv_heads=int(arch_field(gguf.Keys.Attention.HEAD_COUNT_KV, num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(arch_field(gguf.Keys.Attention.LAYERNORM_RMS_EPS, 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(arch_field(gguf.Keys.LLM.CONTEXT_LENGTH, 4096)),
            rope_scaling=_rope_scaling(reader, architecture, head_dim, rope_theta),
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            o_bias="blk.0.attn_output.bias" in tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            mlp="xielu" if architecture == "apertus" else "swiglu",
            sliding_window=int(sliding_window) if sliding_window else None,
            bos_token_id=_field(reader, gguf.Keys.Tokenizer.BOS_ID, None),
            eos_token_ids=_eos_token_ids(reader),
        )
    except (TypeError, ValueError) as error:
        raise ModelLoadError(f"GGUF metadata has a bad field: {error}") from error


def _eos_token_ids(reader: gguf.GGUFReader) -> tuple[int, ...]:
    # End-of-turn / end-of-message ids also end generation (Llama 3 instruct lists all three in HF).
    keys = (gguf.Keys.Tokenizer.EOS_ID, gguf.Keys.Tokenizer.EOT_ID, gguf.Keys.Tokenizer.EOM_ID)
    ids = [_field(reader, key, None) for key in keys]
    return tuple(dict.fromkeys(int(token_id) for token_id in ids if token_id is not None))


def _rope_scaling(
    reader: gguf.GGUFReader, architecture: str, head_dim: int, rope_theta: float
) -> dict[str, Any] | None:
    """HF-style rope scaling (without rope_theta), from rope.scaling.* or a llama3 rope_freqs tensor."""

    def rope_field(name: str, default: Any = None) -> Any:
        return _field(reader, f"{architecture}.rope.scaling.{name}", default)

    rope_freqs = next((tensor for tensor in reader.tensors if tensor.name == "rope_freqs.weight"), None)
    scaling_type = rope_field("type", "none")
    if scaling_type == "none" and rope_freqs is None:
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(rope_field("factor"))}
    if scaling_type == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": float(rope_field("factor")),
            "original_max_position_embeddings": int(rope_field("original_context_length")),
        }
        for gguf_name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := rope_field(gguf_name)) is not None:
                scaling[hf_name] = float(value)
        return scaling
    if scaling_type in ("none", "llama3") and rope_freqs is not None:
        factors = np.asarray(
            gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type), dtype=np.float64
        )
        return _llama3_scaling(factors.reshape(-1), rope_field, head_dim, rope_theta)
    raise ModelLoadError(
        f"unsupported RoPE scaling {scaling_type!r} in GGUF metadata; supported: none, linear, yarn, llama3"
    )


def _llama3_scaling(
    factors: np.ndarray, rope_field: Any, head_dim: int, rope_theta: float
) -> dict[str, Any] | None:
    """Recover HF's llama3 rope_scaling from the per-frequency divisors convert_hf_to_gguf writes.

    The GGUF holds only the divisors (1 for high frequencies, `factor` for low ones, a smooth blend
    between). Llama 3.x always uses low/high freq factors 1 and 4; unless the metadata says otherwise
    we assume them, solve the original context from a blended frequency, and check that the recovered
    parameters reproduce every divisor.
    """
    factor = float(rope_field("factor", factors.max()))
    if factor == 1.0:
        return None
    low_freq_factor = float(rope_field("low_freq_factor", 1.0))
    high_freq_factor = float(rope_field("high_freq_factor", 4.0))
    # [head_dim // 2] wavelengths, in positions
    wavelengths = 2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    original_context = rope_field("original_context_length")
    blended = np.flatnonzero((factors > 1.0 + 1e-6) & (factors < factor - 1e-6))
    if original_context is None and len(blended):
        # divisor = 1 / ((1 - smooth) / factor + smooth), smooth = (context / wavelength - low) / (high - low)
        index = blended[0]
        smooth = (1 / factors[index] - 1 / factor) / (1 - 1 / factor)
        original_context = (smooth * (high_freq_factor - low_freq_factor) + low_freq_factor) * wavelengths[
            index
        ]
    original_context = round(float(original_context if original_context is not None else 8192))
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low_freq_factor,
        "high_freq_factor": high_freq_factor,
        "original_max_position_embeddings": original_context,
    }
    if factors.shape != wavelengths.shape or not np.allclose(
        _llama3_rope_divisors(scaling, wavelengths), factors, rtol=1e-4
    ):
        raise ModelLoadError(
            "the GGUF's rope_freqs tensor does not match llama3 RoPE scaling "
            f"(best fit {scaling}); this RoPE scaling is not supported"
        )
    return scaling


def _llama3_rope_divisors(scaling: dict[str, Any], wavelengths: np.ndarray) -> np.ndarray:
    """What each RoPE frequency is divided by under llama3 scaling (as convert_hf_to_gguf.py computes it)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_context = scaling["original_max_position_embeddings"]
    smooth = (original_context / wavelengths - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelengths > original_context / low, factor, blended)
    return np.where(wavelengths < original_context / high, 1.0, divisors)


def _canonical_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor; None for one that carries no weight; ModelLoadError if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if _IGNORED_TENSORS.fullmatch(gguf_name):
        return None
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} is not part of a supported model")


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute, which interleaves each head's two RoPE halves."""
    head_half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, head_half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _dequantize(tensor: Any, shape: tuple[int, ...]) -> np.ndarray:
    """One GGUF tensor as float32 numpy in HF layout (GGUF's ne0 is the last HF dimension)."""
    if tensor.tensor_type not in DEQUANTIZABLE_TYPES:
        supported = ", ".join(quant_type.name for quant_type in DEQUANTIZABLE_TYPES)
        raise ModelLoadError(
            f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which TileInfer cannot "
            f"dequantize; supported types: {supported}"
        )
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    # F32 comes back as a read-only view of the memory map; torch wants memory it may own.
    return array if array.flags.writeable else array.copy()


_Q8_0_BLOCK_VALUES = 32
_Q8_0_BLOCK_BYTES = 2 + _Q8_0_BLOCK_VALUES  # an fp16 scale, then 32 int8 values


def _q8_0_blocks(tensor: Any, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's blocks as they are: int8 values [N, K] and their fp16 scales as fp32 [N, K / 32]."""
    n, k = shape
    blocks = np.asarray(tensor.data).reshape(n * k // _Q8_0_BLOCK_VALUES, _Q8_0_BLOCK_BYTES)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(n, k // _Q8_0_BLOCK_VALUES)
    values = blocks[:, 2:].copy().view(np.int8).reshape(n, k)
    return torch.from_numpy(values), torch.from_numpy(scale)


def _mixed_groups(weights: dict[str, LinearWeight], spec: ModelSpec, kind: Callable) -> Iterator[list[str]]:
    """The names of each fused group (FUSED_LINEARS) whose members differ in kind(weight): fuse() joins
    them into one weight, which must be all of one kind."""
    for index in range(spec.num_layers):
        for group in FUSED_LINEARS:
            names = [name for suffix in group if (name := f"model.layers.{index}.{suffix}") in weights]
            if len({kind(weights[name]) for name in names}) > 1:
                yield names


def _whole_groups(weights: dict[str, LinearWeight], spec: ModelSpec) -> bool:
    """A fused group whose members hold different scales (Q8_0's groups of 32 beside per-row ones): all
    of it re-quantized with a scale per row from its float32 values, in place. Whether any group was."""
    requantized = False
    for names in _mixed_groups(weights, spec, lambda weight: weight.scale.dim()):
        for name in names:
            weights[name] = quantize_int8(dequantize(weights[name], torch.float32))
        requantized = True
    return requantized


def _dequantize_mixed_groups(weights: dict[str, LinearWeight], spec: ModelSpec, dtype: torch.dtype) -> None:
    """A fused group that mixes Q8_0 (INT8) with other types, dequantized whole into dtype, in place."""
    for names in _mixed_groups(weights, spec, lambda weight: isinstance(weight, Int8Weight)):
        for name in names:
            weights[name] = dequantize(weights[name], dtype)


def load_gguf_weights(
    reader: gguf.GGUFReader,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    int8: bool = False,
    keep_q8_0: bool = True,
    names: Collection[str] | None = None,
) -> dict[str, LinearWeight]:
    """All weights under their canonical HF names, one tensor at a time. Q8_0 layer linears load as INT8
    as they are (kernels/int8.py: int8 values, group-32 scales), never dequantized (keep_q8_0 False:
    dequantized like the rest); a q/k/v or gate/up group that mixes them with other types is dequantized
    whole. The other tensors are dequantized into `dtype`. int8: every layer linear INT8, the others
    quantized one tensor at a time with a scale per row (for a quantized type a warning says so: those
    weights are rounded twice), and so is a group that mixes Q8_0 with other types. names: only those of
    the model's weights are read (one the model has not, such as a tied lm_head, is left out); every
    tensor's name and shape are checked still."""
    wanted = weight_shapes(spec)
    selected = wanted if names is None else {name: wanted[name] for name in names if name in wanted}
    weights: dict[str, LinearWeight] = {}
    requantized: set[str] = set()
    for tensor in reader.tensors:
        name = _canonical_name(tensor.name)
        if name is None:
            continue
        shape = tuple(int(size) for size in reversed(tensor.shape.tolist()))
        if name not in wanted:
            raise ModelLoadError(
                f"GGUF tensor {tensor.name!r} ({name}) is not expected for this {spec.family} model"
            )
        if shape != wanted[name]:
            raise ModelLoadError(
                f"GGUF tensor {tensor.name!r} ({name}) has shape {shape}, expected {wanted[name]}"
            )
        if name not in selected:
            continue
        heads = None
        if spec.family in ("llama", "mistral") and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
            heads = spec.num_heads
        elif spec.family in ("llama", "mistral") and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
            heads = spec.num_kv_heads
        if (int8 or keep_q8_0) and is_layer_linear(name) and tensor.tensor_type == _QUANT.Q8_0:
            values, scale = _q8_0_blocks(tensor, shape)
            if heads is not None:  # the scales' rows move with their values' rows
                values, scale = _unpermute_rows(values, heads), _unpermute_rows(scale, heads)
            weights[name] = in_mma_order(Int8Weight(values.to(device), scale.to(device)))
            continue
        quantized_type = tensor.tensor_type not in (_QUANT.F32, _QUANT.F16, _QUANT.BF16)
        if int8 and is_layer_linear(name) and quantized_type:
            requantized.add(tensor.tensor_type.name)
        weight = torch.from_numpy(_dequantize(tensor, shape))
        if heads is not None:
            weight = _unpermute_rows(weight, heads)
        if int8 and is_layer_linear(name):  # from the file's values (float32), one tensor at a time
            weights[name] = quantize_int8(weight.to(device))
            continue
        weights[name] = weight.to(dtype).to(device)  # cast before the copy, so the device never holds float32
    if spec.mlp == "xielu":
        xielu = _xielu_parameters(reader, spec, wanted, dtype, device)
        weights |= {name: parameter for name, parameter in xielu.items() if name in selected}
    missing = [name for name in selected if name not in weights]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"GGUF file lacks weights the {spec.family} model needs: {shown}")
    if int8 and _whole_groups(weights, spec):
        requantized.add("Q8_0 (fused with other types)")
    if not int8:
        _dequantize_mixed_groups(weights, spec, dtype)
    if requantized:
        logger.warning(
            "INT8 weights from a GGUF file: its %s layer weights are dequantized, then quantized to INT8 "
            "again, so they are rounded twice (only Q8_0 loads as INT8 directly)",
            ", ".join(sorted(requantized)),
        )
    return weights


def _xielu_parameters(
    reader: gguf.GGUFReader,
    spec: ModelSpec,
    wanted: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: str | torch.device,
) -> dict[str, torch.Tensor]:
    parameters: dict[str, torch.Tensor] = {}
    for name, key in _XIELU_KEYS.items():
        values = _field(reader, key)
        # One scalar for the whole model is broadcast to every layer, as llama.cpp does.
        per_layer = list(values) if isinstance(values, list) else [values] * spec.num_layers
        if len(per_layer) != spec.num_layers:
            raise ModelLoadError(
                f"GGUF metadata {key!r} has {len(per_layer)} values for {spec.num_layers} layers"
            )
        for index, value in enumerate(per_layer):
            canonical = f"model.layers.{index}.mlp.act_fn.{name}"
            parameters[canonical] = torch.tensor(float(value), dtype=dtype, device=device).reshape(
                wanted[canonical]
            )
    return parameters
