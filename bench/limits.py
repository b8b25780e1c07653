"""The machine's limits, measured in the run that uses them (BENCH.md), and the rooflines they give.

    python bench/limits.py [--device cuda] [--tiny] [--models qwen3-0.6b,...]

copy_bandwidth: a device-to-device copy of a 2 GiB buffer, bytes read + written, median of repeats.
matmul_flops:   bf16 8192 x 8192 x 8192 torch.matmul, 2 * n^3 FLOPs, median of repeats.
decode_roofline: bandwidth / bytes one decode token reads (every weight, the LM head included, plus
                 the KV cache of the cached positions).
prefill_limit:  prompt tokens / the time their FLOPs take at matmul speed: 2 * (the layers' linear
                weights) per token, attention's QK^T and PV over the causal triangle, and the LM head
                for the last token only.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tileinfer.engine.kv.budget import kv_bytes_per_token  # noqa: E402
from tileinfer.engine.models.decoder import is_layer_linear, weight_shapes  # noqa: E402
from tileinfer.engine.models.random_model import SHAPES  # noqa: E402
from tileinfer.engine.models.shape import ModelSpec  # noqa: E402

GIB = 2**30


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_each(call: Callable[[], object], repeats: int, device: torch.device) -> list[float]:
    """Seconds of each of `repeats` back-to-back calls. On a GPU, CUDA events around each call: the
    stream's time per call (host gaps included when the GPU waits for the host), one sync at the end."""
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
        return times
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)
    ]
    for start, end in events:
        start.record()
        call()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def copy_bandwidth(device: torch.device, size_bytes: int = 2 * GIB, repeats: int = 20) -> float:
    """Bytes per second of a device-to-device copy, counting the bytes read plus the bytes written."""
    source = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    destination = torch.empty_like(source)
    for _ in range(3):
        destination.copy_(source)
    seconds = statistics.median(time_each(lambda: destination.copy_(source), repeats, device))
    return 2 * size_bytes / seconds


def matmul_flops(
    device: torch.device, size: int = 8192, repeats: int = 20, dtype: torch.dtype = torch.bfloat16
) -> float:
    """FLOP/s of a size x size x size matmul (2 * size^3 FLOPs) in `dtype`."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    out = torch.empty(size, size, device=device, dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    seconds = statistics.median(time_each(lambda: torch.matmul(a, b, out=out), repeats, device))
    return 2 * size**3 / seconds


def weight_bytes(
    spec: ModelSpec, dtype: torch.dtype = torch.bfloat16, quantization: str | None = None
) -> int:
    """Bytes of every weight, a tied LM head counted once (it is the embedding). quantization "int8":
    the layers' linear weights at one byte an element and an fp32 scale a row (kernels/int8.py)."""
    total = 0
    for name, shape in weight_shapes(spec).items():
        if quantization == "int8" and is_layer_linear(name):
            total += math.prod(shape) + shape[0] * 4
        else:
            total += math.prod(shape) * dtype.itemsize
    return total


def prefill_matmul_params(spec: ModelSpec) -> int:
    """Weights each prompt token multiplies: every linear inside the layers (norms are not matmuls)."""
    return sum(math.prod(shape) for name, shape in weight_shapes(spec).items() if is_layer_linear(name))


def decode_bytes_per_token(
    spec: ModelSpec,
    cached_positions: int,
    dtype: torch.dtype,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> int:
    kv = kv_bytes_per_token(spec, dtype, kv_cache_dtype)
    return weight_bytes(spec, dtype, quantization) + cached_positions * kv


def decode_roofline(
    spec: ModelSpec,
    bandwidth: float,
    cached_positions: int = 1023,
    dtype: torch.dtype = torch.bfloat16,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> float:
    """Tokens per second at batch 1 if a step took only the time to read its bytes once."""
    return bandwidth / decode_bytes_per_token(spec, cached_positions, dtype, quantization, kv_cache_dtype)


def prefill_flops(spec: ModelSpec, num_tokens: int) -> int:
    linears = 2 * prefill_matmul_params(spec) * num_tokens
    # QK^T and PV: 2 FLOPs per multiply-add each, over num_tokens * (num_tokens + 1) / 2 (query, key) pairs
    attention = 4 * spec.num_layers * spec.num_heads * spec.head_dim * num_tokens * (num_tokens + 1) // 2
    lm_head = 2 * spec.vocab_size * spec.hidden_size  # the last position's logits only
    return linears + attention + lm_head


def prefill_limit(spec: ModelSpec, flops_per_s: float, num_tokens: int) -> float:
    """Prompt tokens per second if a prefill took only its FLOPs at the measured matmul rate."""
    return num_tokens * flops_per_s / prefill_flops(spec, num_tokens)


def measure(device: torch.device, tiny: bool) -> dict[str, float]:
    """Both limits; tiny sizes (seconds on a CPU) when `tiny`."""
    size_bytes, matmul_size, repeats = (64 * 2**20, 512, 5) if tiny else (2 * GIB, 8192, 20)
    bandwidth = copy_bandwidth(device, size_bytes, repeats)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the 4 GiB of copy buffers
    flops = matmul_flops(device, matmul_size, repeats)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "copy_bandwidth_bytes_per_s": bandwidth,
        "copy_bytes": size_bytes,
        "matmul_flops_per_s": flops,
        "matmul_size": matmul_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="small buffers and the tiny model (CPU smoke)")
    parser.add_argument("--models", default=None, help="comma-separated subset of " + ",".join(SHAPES))
    args = parser.parse_args()
    device = torch.device(args.device)
    models = (args.models or ("tiny" if args.tiny else "qwen3-0.6b,qwen3-4b,smollm2-135m")).split(",")
    limits = measure(device, args.tiny)
    bandwidth, flops = limits["copy_bandwidth_bytes_per_s"], limits["matmul_flops_per_s"]
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s, bf16 matmul {flops / 1e12:.1f} TFLOP/s ({device})")
    for name in models:
        spec = SHAPES[name]
        print(
            f"{name:13s} decode roofline {decode_roofline(spec, bandwidth):10,.0f} tok/s "
            f"({decode_bytes_per_token(spec, 1023, torch.bfloat16) / 1e9:.3f} GB/token at 1,023 positions)"
            f"  prefill-512 limit {prefill_limit(spec, flops, 512):12,.0f} tok/s"
        )


if __name__ == "__main__":
    main()
