"""The GGUF loader: spec from metadata, weights dequantized and un-permuted into the HF layout.

The real SmolLM2 file is checked against transformers' own GGUF loader; every quant type against a
block-by-block transliteration of ggml-quants.c written here; synthetic Qwen2 / Qwen3 / Apertus files
are written the way convert_hf_to_gguf.py writes them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tileinfer.engine.errors import ModelLoadError
from tileinfer.engine.models.gguf_loader import load_gguf_weights, read_gguf, spec_from_gguf
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.models.shape import ModelSpec

QuantType = gguf.GGMLQuantizationType


# ---- the real SmolLM2 file ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_reader(smollm2_gguf: Path) -> gguf.GGUFReader:
    return read_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2_weights(smollm2_model: LoadedModel) -> dict[str, torch.Tensor]:
    """load_gguf_weights(reader, spec, torch.float32) as tileinfer.engine.models.loader.load_model calls it,
    loaded once for the session (tests/conftest.py)."""
    return smollm2_model.weights


def test_the_reader_reads_what_ggufs_own_reader_reads(
    smollm2_gguf: Path, smollm2_reader: gguf.GGUFReader
) -> None:
    """read_gguf's faster reader gives the same metadata and tensors as gguf.GGUFReader itself."""
    stock = gguf.GGUFReader(smollm2_gguf)
    assert type(smollm2_reader) is not gguf.GGUFReader and list(smollm2_reader.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        ours = smollm2_reader.fields[name]
        assert (ours.offset, ours.types, ours.data) == (field.offset, field.types, field.data), name
        assert all(np.array_equal(a, b) for a, b in zip(ours.parts, field.parts, strict=True)), name
    assert [(t.name, t.tensor_type, t.data_offset) for t in smollm2_reader.tensors] == [
        (t.name, t.tensor_type, t.data_offset) for t in stock.tensors
    ]
    assert all(
        np.array_equal(a.data, b.data) for a, b in zip(smollm2_reader.tensors, stock.tensors, strict=True)
    )


def test_smollm2_spec(smollm2_reader: gguf.GGUFReader) -> None:
    spec = spec_from_gguf(smollm2_reader)
    assert "output.weight" not in {tensor.name for tensor in smollm2_reader.tensors}
    assert (spec.family, spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (
        "llama",
        576,
        30,
        9,
        3,
    )
    assert (spec.vocab_size, spec.intermediate_size, spec.head_dim) == (49152, 1536, 64)
    assert spec.rope_theta == 100000.0
    assert spec.rms_norm_eps == pytest.approx(1e-5)
    assert spec.max_position_embeddings == 8192
    assert spec.rope_scaling is None
    assert spec.tie_word_embeddings
    assert not (spec.qkv_bias or spec.o_bias or spec.qk_norm or spec.mlp_bias)
    assert (spec.bos_token_id, spec.eos_token_ids) == (1, (2,))


def test_smollm2_weights_equal_transformers(
    transformers_smollm2: tuple[dict, dict],
    smollm2_reader: gguf.GGUFReader,
    smollm2_weights: dict[str, torch.Tensor],
) -> None:
    reference = transformers_smollm2[1]  # transformers' own dequantization of the same file
    assert "lm_head.weight" not in smollm2_weights
    assert set(smollm2_weights) == set(reference)
    for name, weight in smollm2_weights.items():
        assert weight.dtype == torch.float32
        assert torch.equal(weight, reference[name]), name
    # The file exercises Q8_0 (embedding) and Q4_1 (linears) dequantization and the q/k un-permute:
    types = {tensor.name: tensor.tensor_type for tensor in smollm2_reader.tensors}
    assert (types["token_embd.weight"], types["blk.0.attn_q.weight"]) == (QuantType.Q8_0, QuantType.Q4_1)
    raw_q = next(tensor for tensor in smollm2_reader.tensors if tensor.name == "blk.0.attn_q.weight")
    file_rows = torch.from_numpy(gguf.quants.dequantize(raw_q.data, raw_q.tensor_type).copy())
    assert not torch.equal(file_rows, smollm2_weights["model.layers.0.self_attn.q_proj.weight"])


def test_only_the_weights_asked_for(
    smollm2_reader: gguf.GGUFReader, smollm2_weights: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    embedding_and_head = ("model.embed_tokens.weight", "lm_head.weight")
    tied = load_gguf_weights(
        smollm2_reader, spec_from_gguf(smollm2_reader), torch.float32, names=embedding_and_head
    )
    assert list(tied) == ["model.embed_tokens.weight"]  # its LM head is the embedding
    assert torch.equal(tied["model.embed_tokens.weight"], smollm2_weights["model.embed_tokens.weight"])
    tiny = Tiny(architecture="apertus")  # its own LM head, and xIELU parameters besides the tensors
    original = hf_weights(tiny, tied=False)
    xielu = {"alpha_p": 0.3, "alpha_n": 0.1, "beta": 0.5, "eps": -1e-6}

    def metadata(writer: gguf.GGUFWriter) -> None:
        keys = gguf.Keys.xIELU
        for key, value in zip((keys.ALPHA_P, keys.ALPHA_N, keys.BETA, keys.EPS), xielu.values(), strict=True):
            writer.add_float32(key, value)

    reader = read_gguf(
        write_gguf(tmp_path / "untied.gguf", tiny, float_tensors(gguf_layout(tiny, original)), metadata)
    )
    weights = load_gguf_weights(reader, spec_from_gguf(reader), torch.float32, names=embedding_and_head)
    assert set(weights) == set(embedding_and_head)
    for name, weight in weights.items():
        assert torch.equal(weight, torch.from_numpy(original[name])), name


def test_smollm2_bfloat16(smollm2_reader: gguf.GGUFReader, smollm2_weights: dict[str, torch.Tensor]) -> None:
    weights = load_gguf_weights(smollm2_reader, spec_from_gguf(smollm2_reader), torch.bfloat16)
    for name in ("model.embed_tokens.weight", "model.layers.29.self_attn.k_proj.weight", "model.norm.weight"):
        assert weights[name].dtype == torch.bfloat16
        assert torch.equal(weights[name], smollm2_weights[name].to(torch.bfloat16))


# ---- writing small GGUFs the way convert_hf_to_gguf.py does ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tiny:
    architecture: str = "llama"
    vocab_size: int = 32
    hidden_size: int = 256  # a K-quant block is 256 values along a row
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 1e6


# canonical suffix -> GGUF suffix, written out here rather than taken from the loader
LAYER_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def hf_weights(tiny: Tiny, *, seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """Random float32 weights in the HF layout for the tiny model of `tiny.architecture`."""
    rng = np.random.default_rng(seed)
    q_size, kv_size = tiny.num_heads * tiny.head_dim, tiny.num_kv_heads * tiny.head_dim
    hidden, intermediate = tiny.hidden_size, tiny.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (tiny.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not tied:
        shapes["lm_head.weight"] = (tiny.vocab_size, hidden)
    layer = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_size, hidden),
        "self_attn.k_proj.weight": (kv_size, hidden),
        "self_attn.v_proj.weight": (kv_size, hidden),
        "self_attn.o_proj.weight": (hidden, q_size),
        "mlp.up_proj.weight": (intermediate, hidden),
        "mlp.down_proj.weight": (hidden, intermediate),
    }
    if tiny.architecture != "apertus":
        layer["mlp.gate_proj.weight"] = (intermediate, hidden)
    if tiny.architecture == "qwen2":
        layer |= {"self_attn.q_proj.bias": (q_size,), "self_attn.k_proj.bias": (kv_size,)}
        layer["self_attn.v_proj.bias"] = (kv_size,)
    if tiny.architecture in ("qwen3", "apertus"):
        layer |= {"self_attn.q_norm.weight": (tiny.head_dim,), "self_attn.k_norm.weight": (tiny.head_dim,)}
    for index in range(tiny.num_layers):
        shapes |= {f"model.layers.{index}.{name}": shape for name, shape in layer.items()}
    return {name: rng.uniform(-1, 1, size=shape).astype(np.float32) for name, shape in shapes.items()}


def convert_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: interleave each head's two RoPE halves."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(canonical: str) -> str:
    if canonical in GLOBAL_GGUF_NAMES:
        return GLOBAL_GGUF_NAMES[canonical]
    _, _, index, rest = canonical.split(".", 3)
    return f"blk.{index}.{LAYER_GGUF_NAMES[rest]}"


def gguf_layout(tiny: Tiny, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF weights renamed (and, for llama, q/k permuted) as convert_hf_to_gguf.py writes them."""
    tensors = {}
    for name, weight in weights.items():
        if tiny.architecture == "llama" and name.endswith("q_proj.weight"):
            weight = convert_permute(weight, tiny.num_heads)
        elif tiny.architecture == "llama" and name.endswith("k_proj.weight"):
            weight = convert_permute(weight, tiny.num_kv_heads)
        tensors[gguf_name(name)] = weight
    return tensors


def write_gguf(
    path: Path,
    tiny: Tiny,
    tensors: dict[str, tuple[np.ndarray, QuantType]],
    extra_metadata: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """Write metadata as convert_hf_to_gguf.py does; each tensor is (float array or raw blocks, type)."""
    writer = gguf.GGUFWriter(path, tiny.architecture)
    writer.add_block_count(tiny.num_layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(tiny.hidden_size)
    writer.add_feed_forward_length(tiny.intermediate_size)
    writer.add_head_count(tiny.num_heads)
    writer.add_head_count_kv(tiny.num_kv_heads)
    writer.add_key_length(tiny.head_dim)
    writer.add_value_length(tiny.head_dim)
    writer.add_rope_freq_base(tiny.rope_theta)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{index}" for index in range(tiny.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if extra_metadata:
        extra_metadata(writer)
    for name, (array, quant_type) in tensors.items():
        if array.dtype == np.uint8:  # raw quantized blocks, [rows, bytes per row]
            writer.add_tensor(name, array, raw_dtype=quant_type)
        else:
            writer.add_tensor(name, array.astype(np.float16 if quant_type == QuantType.F16 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def float_tensors(tensors: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, QuantType]]:
    return {name: (array, QuantType.F32) for name, array in tensors.items()}


def load(path: Path, dtype: torch.dtype = torch.float32) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """Every tensor dequantized (Q8_0 layer linears too: tests/test_gguf_int8.py covers them kept INT8)."""
    reader = read_gguf(path)
    spec = spec_from_gguf(reader)
    return spec, load_gguf_weights(reader, spec, dtype, keep_q8_0=False)


# ---- every quant type against an independent reference ---------------------------------------------------

# Offsets of the fp16 scale fields inside one block; every other byte may be any value.
BLOCK_F16_OFFSETS = {
    QuantType.Q4_0: (0,),
    QuantType.Q4_1: (0, 2),
    QuantType.Q5_0: (0,),
    QuantType.Q5_1: (0, 2),
    QuantType.Q8_0: (0,),
    QuantType.Q4_K: (0, 2),
    QuantType.Q5_K: (0, 2),
    QuantType.Q6_K: (208,),
}


def f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[:, offset : offset + 2].copy().view(np.float16).astype(np.float32)  # [n_blocks, 1]


def k_scale_min(scales: np.ndarray, index: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml-quants.c get_scale_min_k4: the 6-bit scale and min of sub-block `index` (0..7)."""
    if index < 4:
        return scales[:, index] & 63, scales[:, index + 4] & 63
    scale = (scales[:, index + 4] & 0xF) | ((scales[:, index - 4] >> 6) << 4)
    minimum = (scales[:, index + 4] >> 4) | ((scales[:, index] >> 6) << 4)
    return scale, minimum


def reference_dequantize(blocks: np.ndarray, quant_type: QuantType) -> np.ndarray:
    """ggml-quants.c dequantize_row_*, loop for loop, vectorised only across blocks. [n_blocks, block_size]"""
    blocks = blocks.astype(np.int64)  # room for shifts; bytes stay 0..255
    raw = blocks.astype(np.uint8)
    count = blocks.shape[0]
    if quant_type in (QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1, QuantType.Q8_0):
        out = np.zeros((count, 32), np.float32)
        d = f16_field(raw, 0)[:, 0]
        if quant_type == QuantType.Q8_0:
            quants = raw[:, 2:34].view(np.int8).astype(np.float32)
            return quants * d[:, None]
        has_min = quant_type in (QuantType.Q4_1, QuantType.Q5_1)
        m = f16_field(raw, 2)[:, 0] if has_min else np.zeros(count, np.float32)
        is_q5 = quant_type in (QuantType.Q5_0, QuantType.Q5_1)
        qh_start = 4 if has_min else 2
        qh = sum(blocks[:, qh_start + byte] << (8 * byte) for byte in range(4)) if is_q5 else 0
        qs = blocks[:, qh_start + (4 if is_q5 else 0) :]
        offset = 0 if has_min else (16 if is_q5 else 8)
        for j in range(16):
            x0, x1 = qs[:, j] & 0x0F, qs[:, j] >> 4
            if is_q5:
                x0 = x0 | (((qh >> j) << 4) & 0x10)
                x1 = x1 | ((qh >> (j + 12)) & 0x10)
            out[:, j] = (x0 - offset).astype(np.float32) * d + m
            out[:, j + 16] = (x1 - offset).astype(np.float32) * d + m
        return out
    out = np.zeros((count, 256), np.float32)
    if quant_type in (QuantType.Q4_K, QuantType.Q5_K):
        d, dmin = f16_field(raw, 0)[:, 0], f16_field(raw, 2)[:, 0]
        scales = blocks[:, 4:16]
        qh = blocks[:, 16:48]
        qs = blocks[:, 48:176] if quant_type == QuantType.Q5_K else blocks[:, 16:144]
        position, low_bit, high_bit = 0, 1, 2
        for sub in range(0, 8, 2):
            chunk = qs[:, 16 * sub : 16 * sub + 32]  # 32 bytes hold two sub-blocks of 32
            for half, index in ((0, sub), (1, sub + 1)):
                scale, minimum = k_scale_min(scales, index)
                d_sub, m_sub = d * scale.astype(np.float32), dmin * minimum.astype(np.float32)
                quants = chunk & 0xF if half == 0 else chunk >> 4
                if quant_type == QuantType.Q5_K:
                    quants = quants + np.where(qh & (low_bit if half == 0 else high_bit), 16, 0)
                out[:, position : position + 32] = d_sub[:, None] * quants.astype(np.float32) - m_sub[:, None]
                position += 32
            low_bit, high_bit = low_bit << 2, high_bit << 2
        return out
    # Q6_K: ql[128], qh[64], int8 scales[16], fp16 d
    d = f16_field(raw, 208)[:, 0]
    scales = raw[:, 192:208].view(np.int8).astype(np.float32)
    for n in range(2):
        ql, qh, sc = (
            blocks[:, 64 * n : 64 * n + 64],
            blocks[:, 128 + 32 * n : 160 + 32 * n],
            scales[:, 8 * n :],
        )
        for lane in range(32):
            group = lane // 16
            q1 = ((ql[:, lane] & 0xF) | (((qh[:, lane] >> 0) & 3) << 4)) - 32
            q2 = ((ql[:, lane + 32] & 0xF) | (((qh[:, lane] >> 2) & 3) << 4)) - 32
            q3 = ((ql[:, lane] >> 4) | (((qh[:, lane] >> 4) & 3) << 4)) - 32
            q4 = ((ql[:, lane + 32] >> 4) | (((qh[:, lane] >> 6) & 3) << 4)) - 32
            base = 128 * n + lane
            out[:, base] = d * sc[:, group] * q1
            out[:, base + 32] = d * sc[:, group + 2] * q2
            out[:, base + 64] = d * sc[:, group + 4] * q3
            out[:, base + 96] = d * sc[:, group + 6] * q4
    return out


def random_tensor(
    rng: np.random.Generator, shape: tuple[int, ...], quant_type: QuantType
) -> tuple[np.ndarray, np.ndarray]:
    """(what to write, what it must dequantize to): random valid bytes for block types."""
    rows, columns = math.prod(shape[:-1]), shape[-1]
    if quant_type in (QuantType.F32, QuantType.F16):
        values = rng.uniform(-2, 2, size=shape).astype(
            np.float16 if quant_type == QuantType.F16 else np.float32
        )
        return values, values.astype(np.float32)
    if quant_type == QuantType.BF16:
        bits = (rng.uniform(-2, 2, size=shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(np.uint8).reshape(rows, columns * 2), (bits.astype(np.uint32) << 16).view(np.float32)
    block_size, type_size = gguf.GGML_QUANT_SIZES[quant_type]
    count = rows * columns // block_size
    blocks = rng.integers(0, 256, size=(count, type_size), dtype=np.uint8)
    for offset in BLOCK_F16_OFFSETS[quant_type]:
        scale = rng.uniform(-0.05, 0.05, size=count).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(count, 2)
    expected = reference_dequantize(blocks, quant_type).reshape(shape)
    return blocks.reshape(rows, -1), expected


ALL_TYPES = [QuantType.F32, QuantType.F16, QuantType.BF16, QuantType.Q8_0, QuantType.Q4_0, QuantType.Q4_1]
ALL_TYPES += [QuantType.Q5_0, QuantType.Q5_1, QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K]


@pytest.mark.parametrize("quant_type", ALL_TYPES, ids=lambda quant_type: quant_type.name)
def test_every_quant_type_matches_ggml_reference(tmp_path: Path, quant_type: QuantType) -> None:
    tiny = Tiny()
    rng = np.random.default_rng(int(quant_type))
    tensors, expected = {}, {}  # expected: GGUF name -> float32 in the file's row order
    for name, weight in gguf_layout(tiny, hf_weights(tiny)).items():
        kind = quant_type if weight.ndim == 2 else QuantType.F32  # norms stay F32, as llama.cpp keeps them
        written, expected[name] = random_tensor(rng, weight.shape, kind)
        tensors[name] = (written, kind)
    spec, weights = load(write_gguf(tmp_path / "tiny.gguf", tiny, tensors))
    assert spec.tie_word_embeddings and len(weights) == 2 + 9 * tiny.num_layers
    for index in range(tiny.num_layers):
        layer = f"model.layers.{index}."
        # the loader must have un-permuted q/k: permuting them again gives back the file's rows
        q = weights[layer + "self_attn.q_proj.weight"].numpy()
        k = weights[layer + "self_attn.k_proj.weight"].numpy()
        np.testing.assert_allclose(
            convert_permute(q, tiny.num_heads), expected[f"blk.{index}.attn_q.weight"], rtol=1e-6
        )
        np.testing.assert_allclose(
            convert_permute(k, tiny.num_kv_heads), expected[f"blk.{index}.attn_k.weight"], rtol=1e-6
        )
    for canonical, weight in weights.items():
        if not canonical.endswith(("q_proj.weight", "k_proj.weight")):
            np.testing.assert_allclose(
                weight.numpy(), expected[gguf_name(canonical)], rtol=1e-6, err_msg=canonical
            )


# ---- round trip: HF weights -> convert-style GGUF -> back to HF ------------------------------------------

# Largest error each type may add to values in [-1, 1]: about half a quantization step.
ROUND_TRIP_TOLERANCE = {
    QuantType.F16: 1e-3,
    QuantType.BF16: 4e-3,
    QuantType.Q8_0: 5e-3,
    QuantType.Q5_0: 0.065,  # symmetric types clip the far extreme by one whole step
    QuantType.Q5_1: 0.04,
    QuantType.Q4_0: 0.13,
    QuantType.Q4_1: 0.08,
}


@pytest.mark.parametrize("quant_type", list(ROUND_TRIP_TOLERANCE), ids=lambda quant_type: quant_type.name)
def test_llama_round_trip_through_gguf_quants(tmp_path: Path, quant_type: QuantType) -> None:
    tiny = Tiny()
    original = hf_weights(tiny, tied=False)
    tensors = {}
    for name, weight in gguf_layout(tiny, original).items():
        if weight.ndim == 1:
            tensors[name] = (weight, QuantType.F32)
        elif quant_type == QuantType.F16:
            tensors[name] = (weight, QuantType.F16)
        else:
            tensors[name] = (gguf.quants.quantize(weight, quant_type), quant_type)
    spec, weights = load(write_gguf(tmp_path / "tiny.gguf", tiny, tensors))
    assert not spec.tie_word_embeddings
    assert set(weights) == set(original)
    for name, weight in weights.items():
        error = np.abs(weight.numpy() - original[name]).max()
        assert error <= ROUND_TRIP_TOLERANCE[quant_type], f"{name}: error {error}"


# ---- Qwen2 / Qwen3 / Apertus: no permutation, their own extra tensors ---------------------------------


def test_qwen2_biases_and_no_permutation(tmp_path: Path) -> None:
    tiny = Tiny(architecture="qwen2", num_kv_heads=1)
    original = hf_weights(tiny, tied=False)
    spec, weights = load(
        write_gguf(tmp_path / "qwen2.gguf", tiny, float_tensors(gguf_layout(tiny, original)))
    )
    assert (spec.family, spec.qkv_bias, spec.o_bias, spec.qk_norm, spec.tie_word_embeddings) == (
        "qwen2",
        True,
        False,
        False,
        False,
    )
    assert (spec.num_heads, spec.num_kv_heads, spec.rope_theta, spec.eos_token_ids) == (4, 1, 1e6, (2,))
    assert set(weights) == set(original)
    for name, weight in weights.items():
        assert torch.equal(weight, torch.from_numpy(original[name])), name


def test_qwen3_qk_norm_and_head_dim_from_key_length(tmp_path: Path) -> None:
    # head_dim * num_heads != hidden_size, as in Qwen3-0.6B (16 x 128 over 1024)
    tiny = Tiny(architecture="qwen3", num_heads=8, num_kv_heads=2, head_dim=64)
    original = hf_weights(tiny)
    spec, weights = load(
        write_gguf(tmp_path / "qwen3.gguf", tiny, float_tensors(gguf_layout(tiny, original)))
    )
    assert (spec.family, spec.qk_norm, spec.qkv_bias, spec.head_dim, spec.q_size) == (
        "qwen3",
        True,
        False,
        64,
        512,
    )
    assert weights["model.layers.1.self_attn.o_proj.weight"].shape == (256, 512)
    assert set(weights) == set(original)
    for name, weight in weights.items():
        assert torch.equal(weight, torch.from_numpy(original[name])), name


def llama3_rope_freqs(theta: float, head_dim: int, factor: float, original_context: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors for rope_type llama3 (low 1, high 4)."""
    factors = []
    for frequency in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelength = 2 * math.pi / frequency
        if wavelength < original_context / 4.0:
            factors.append(1.0)
        elif wavelength > original_context / 1.0:
            factors.append(factor)
        else:
            smooth = (original_context / wavelength - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.parametrize("per_layer", [True, False], ids=["per-layer", "one-scalar"])
def test_apertus_xielu_qk_norm_and_llama3_rope(tmp_path: Path, per_layer: bool) -> None:
    tiny = Tiny(architecture="apertus")
    original = hf_weights(tiny)
    xielu = {  # raw HF parameters per layer: alpha_p / alpha_n before softplus
        "alpha_p": [0.3, -0.2] if per_layer else [0.3, 0.3],
        "alpha_n": [0.1, 0.7] if per_layer else [0.1, 0.1],
        "beta": [0.5, 0.5],
        "eps": [-1e-6, -1e-6],
    }

    def metadata(writer: gguf.GGUFWriter) -> None:
        keys = gguf.Keys.xIELU
        for key, values in zip(
            (keys.ALPHA_P, keys.ALPHA_N, keys.BETA, keys.EPS), xielu.values(), strict=True
        ):
            if per_layer:  # what convert_hf_to_gguf.py ApertusModel writes
                writer.add_array(key, values)
            else:  # one value for every layer, which llama.cpp also accepts
                writer.add_float32(key, values[0])

    tensors = float_tensors(gguf_layout(tiny, original))
    tensors["rope_freqs.weight"] = (llama3_rope_freqs(1e6, tiny.head_dim, 8.0, 8192), QuantType.F32)
    spec, weights = load(write_gguf(tmp_path / "apertus.gguf", tiny, tensors, metadata))
    assert (spec.family, spec.mlp, spec.qk_norm) == ("apertus", "xielu", True)
    assert spec.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "model.layers.0.mlp.gate_proj.weight" not in weights
    for name, array in original.items():  # Apertus is not permuted either
        assert torch.equal(weights[name], torch.from_numpy(array)), name
    for name, values in xielu.items():
        for index, value in enumerate(values):
            parameter = weights[f"model.layers.{index}.mlp.act_fn.{name}"]
            assert parameter.shape == ((1,) if name.startswith("alpha") else ())
            assert parameter.item() == pytest.approx(value, rel=1e-6)


@pytest.mark.parametrize(("factor", "original_context"), [(8.0, 8192), (32.0, 8192), (4.0, 4096)])
def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path, factor: float, original_context: int) -> None:
    # Llama 3.x GGUFs carry llama3 RoPE only as a rope_freqs tensor of per-frequency divisors
    tiny = Tiny(head_dim=128, num_heads=2, num_kv_heads=1, rope_theta=500000.0)
    tensors = float_tensors(gguf_layout(tiny, hf_weights(tiny)))
    tensors["rope_freqs.weight"] = (llama3_rope_freqs(500000.0, 128, factor, original_context), QuantType.F32)
    spec, weights = load(write_gguf(tmp_path / "llama3.gguf", tiny, tensors))
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling == {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original_context,
    }
    assert not any("rope" in name for name in weights)


def test_mistral_sliding_window_and_end_of_turn_ids(tmp_path: Path) -> None:
    def metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_sliding_window(4096)
        writer.add_eot_token_id(7)

    tiny = Tiny()
    path = write_gguf(
        tmp_path / "mistral.gguf", tiny, float_tensors(gguf_layout(tiny, hf_weights(tiny))), metadata
    )
    spec, weights = load(path)
    assert (spec.family, spec.sliding_window, spec.bos_token_id, spec.eos_token_ids) == (
        "mistral",
        4096,
        1,
        (2, 7),
    )
    # Mistral GGUFs are llama GGUFs: q/k come back un-permuted
    original = hf_weights(tiny)
    assert torch.equal(
        weights["model.layers.0.self_attn.k_proj.weight"],
        torch.from_numpy(original["model.layers.0.self_attn.k_proj.weight"]),
    )


# ---- what a user can get wrong ---------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="GGUF file not found: .*nowhere.gguf"):
        read_gguf(tmp_path / "nowhere.gguf")


def test_text_file_named_gguf(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("these are not the weights you are looking for\n" * 20)
    with pytest.raises(ModelLoadError, match="notes.gguf is not a readable GGUF file"):
        read_gguf(path)


def test_truncated_gguf(tmp_path: Path) -> None:
    tiny = Tiny()
    path = write_gguf(tmp_path / "cut.gguf", tiny, float_tensors(gguf_layout(tiny, hf_weights(tiny))))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cut.gguf is not a readable GGUF file .*truncated"):
        read_gguf(path)


def test_unknown_architecture(tmp_path: Path) -> None:
    tiny = Tiny(architecture="gpt2")
    path = write_gguf(tmp_path / "gpt2.gguf", tiny, {})
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'") as caught:
        spec_from_gguf(read_gguf(path))
    assert "llama, qwen2, qwen3, apertus" in str(caught.value)
    assert "Qwen3ForCausalLM" in str(caught.value)


_TINY = Tiny()
_Q2_K_BLOCK_SIZE, _Q2_K_TYPE_SIZE = gguf.GGML_QUANT_SIZES[QuantType.Q2_K]


@pytest.mark.parametrize(
    ("name", "tensor", "error"),
    [
        (
            "blk.1.ffn_up.weight",
            (
                np.zeros(
                    (_TINY.intermediate_size, _TINY.hidden_size // _Q2_K_BLOCK_SIZE * _Q2_K_TYPE_SIZE),
                    np.uint8,
                ),
                QuantType.Q2_K,
            ),
            "'blk.1.ffn_up.weight' has type Q2_K.*supported types: .*Q6_K",
        ),
        ("blk.1.ffn_down.weight", None, r"lacks weights .*model\.layers\.1\.mlp\.down_proj\.weight"),
        (
            "blk.0.ffn_gate.weight",
            (np.zeros((384, _TINY.hidden_size), np.float32), QuantType.F32),
            r"'blk.0.ffn_gate.weight' .* has shape \(384, 256\), expected \(512, 256\)",
        ),
        (
            "blk.0.ffn_gate_exps.weight",
            (np.zeros((4, _TINY.hidden_size), np.float32), QuantType.F32),
            "'blk.0.ffn_gate_exps.weight' is not part of a supported model",
        ),
        (
            "rope_freqs.weight",
            (np.full(_TINY.head_dim // 2, 2.0, np.float32), QuantType.F32),
            "rope_freqs tensor does not match llama3 RoPE scaling",
        ),
    ],
    ids=["unsupported quant type", "missing", "wrong shape", "unknown", "rope_freqs not llama3"],
)
def test_a_tensor_the_loader_cannot_take_is_named(
    tmp_path: Path, name: str, tensor: tuple[np.ndarray, QuantType] | None, error: str
) -> None:
    """One tensor of the tiny model replaced (None: removed); the spec or the weights refuse it by name."""
    tensors = float_tensors(gguf_layout(_TINY, hf_weights(_TINY)))
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    reader = read_gguf(write_gguf(tmp_path / "edited.gguf", _TINY, tensors))
    with pytest.raises(ModelLoadError, match=error):
        load_gguf_weights(reader, spec_from_gguf(reader), torch.float32)
