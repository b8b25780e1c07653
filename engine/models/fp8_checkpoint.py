"""FP8 checkpoints as Qwen and DeepSeek publish them (config.json `quantization_config.quant_method: fp8`).

Each quantized linear weight is stored in float8 e4m3 beside `<name>_scale_inv`, fp32, one value per
block of `weight_block_size` (128 x 128) weights. Despite its name the scale multiplies: a weight is its
e4m3 value times its block's scale. The last blocks of a row or column may be partial (SmolLM2's 576-wide
layers end in half a block). The embedding, the LM head and the norms are not quantized.

The loader reads such a weight here as float, one tensor at a time (its values times the scales, in the
engine's dtype), so the peak memory is the float weights'. A checkpoint quantized in a way the engine does
not read fails at load with a message that names the method: it would otherwise generate wrong text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from tileinfer.engine.errors import ModelLoadError

SCALE_SUFFIX = "_scale_inv"
FLOAT8_DTYPES = (torch.float8_e4m3fn,)


@dataclasses.dataclass(frozen=True)
class Fp8Blocks:
    """How a checkpoint's FP8 weights are scaled: one multiplier per block of rows x columns."""

    rows: int = 128
    columns: int = 128


def checkpoint_quantization(config: dict[str, Any]) -> Fp8Blocks | None:
    """The FP8 block scaling a config.json declares; None for an unquantized checkpoint. Raises
    ModelLoadError for any other quantization (GPTQ, AWQ, bitsandbytes, compressed-tensors...), or FP8 in a
    form the loader does not read, naming what it found."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    if not isinstance(quantization, dict):
        raise ModelLoadError(f"config.json's quantization_config is not an object: {quantization!r}")
    method = quantization.get("quant_method")
    if method != "fp8":
        raise ModelLoadError(
            f"config.json's quantization_config.quant_method is {method!r}: TileInfer reads unquantized "
            "checkpoints and FP8 ones (quant_method fp8, e4m3 with block scales); use the model's bf16 "
            "release, with `quantization: int8` for smaller weights"
        )
    fmt = quantization.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"an FP8 checkpoint in format {fmt!r}: TileInfer reads e4m3 only")
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(n, int) and n > 0 for n in block)):
        raise ModelLoadError(
            f"an FP8 checkpoint without block scales (weight_block_size {block!r}): TileInfer reads "
            "one scale per block, as Qwen's and DeepSeek's FP8 releases store them"
        )
    return Fp8Blocks(rows=block[0], columns=block[1])


def dequantize_fp8(
    values: torch.Tensor, scale_inv: torch.Tensor, blocks: Fp8Blocks = Fp8Blocks()
) -> torch.Tensor:
    """values [N, K] in float8 times each block's scale (scale_inv [ceil(N / rows), ceil(K / columns)]),
    as float32."""
    rows, columns = values.shape
    expected = (-(-rows // blocks.rows), -(-columns // blocks.columns))
    if tuple(scale_inv.shape) != expected:
        raise ModelLoadError(
            f"an FP8 weight of shape {[rows, columns]} has scales of shape {list(scale_inv.shape)}, but "
            f"{blocks.rows} x {blocks.columns} blocks need {list(expected)}"
        )
    scales = scale_inv.float().repeat_interleave(blocks.rows, 0).repeat_interleave(blocks.columns, 1)
    return values.float() * scales[:rows, :columns]


E4M3_MAX = 448.0  # float8 e4m3's largest finite value


def quantize_fp8(weight: torch.Tensor, blocks: Fp8Blocks = Fp8Blocks()) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] as FP8 checkpoints store it: (e4m3 values, scale_inv [ceil(N / rows), ceil(K /
    columns)]), each block's largest magnitude mapped to e4m3's largest (as Qwen's and DeepSeek's
    releases are made); dequantize_fp8 reads them back."""
    rows, columns = weight.shape
    padded = torch.zeros(
        -(-rows // blocks.rows) * blocks.rows, -(-columns // blocks.columns) * blocks.columns,
        dtype=torch.float32, device=weight.device,
    )  # fmt: skip
    padded[:rows, :columns] = weight.float()
    tiles = padded.unflatten(0, (-1, blocks.rows)).unflatten(2, (-1, blocks.columns))  # [bn, r, bk, c]
    scale_inv = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    values = (tiles / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn).flatten(2).flatten(0, 1)
    return values[:rows, :columns].contiguous(), scale_inv
