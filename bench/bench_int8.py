"""INT8 weights and the INT8 KV cache beside the model's own dtype, in one run: decode at batch 1 after
--cached positions (default 1,023; 32,767 for long contexts), and a 512-token prefill, for each model
shape; each mode against its own roofline (the copy bandwidth over its bytes per token: the layer
weights in INT8 or not, the bf16 embedding and LM head, and the KV at its own bytes).

    python bench/bench_int8.py [--models qwen3-0.6b,qwen3-4b] [--modes base,int8,int8-kv,int8-both]
        [--cached 1023] [--out DIR]
    python bench/bench_int8.py --models qwen3-4b --gguf q8_0.gguf   # also that file, as `serve run` loads it
    python bench/bench_int8.py --device cpu --tiny   # a smoke run

Modes: base (the dtype), int8 (INT8 weights), int8-kv (the INT8 KV cache), int8-both. Every engine
takes the same random weights (tileinfer.engine.models.random_model); the INT8 ones quantize them at
load. --gguf adds a row for a GGUF file of the (one) model's shape, loaded as the server loads it (a
Q8_0 file's layer weights as INT8 with group-32 scales), against the bytes its weights load as. The
table comes last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tileinfer.engine.config import DTYPES, torch_dtype  # noqa: E402
from tileinfer.engine.kv.budget import kv_bytes_per_token  # noqa: E402
from tileinfer.engine.models.loader import load_model  # noqa: E402
from tileinfer.engine.models.random_model import SHAPES, random_weights  # noqa: E402
from tileinfer.engine.models.shape import ModelSpec  # noqa: E402
from tileinfer.kernels.int8 import Int8Weight  # noqa: E402

from bench import limits  # noqa: E402
from bench.bench_engine import (  # noqa: E402
    GREEDY,
    Settings,
    attempt,
    build_engine,
    engine_decode,
    engine_prefill,
    free_memory,
    random_prompt,
    timed_build,
)

# mode -> (EngineConfig.quantization, EngineConfig.kv_cache_dtype)
MODES = {
    "base": (None, "auto"),
    "int8": ("int8", "auto"),
    "int8-kv": (None, "int8"),
    "int8-both": ("int8", "int8"),
}
PREFILL_LEN = 512


GGUF_MODE = "gguf"


def bench_mode(
    name: str,
    spec: ModelSpec,
    weights: dict,
    prompt: list[int],
    settings: Settings,
    part: dict[str, Any],
    key: str,
) -> None:
    """Build one engine (settings.quantization), time its decode and a prefill into part."""
    engine = timed_build(part, settings, lambda: build_engine(name, spec, weights, settings))
    if engine is None:
        return
    if attempt(part, "decode", settings, lambda: engine_decode(engine, prompt, settings, GREEDY)):
        print(f"{name} {key}: decode {part['decode']['tok_s']:,.1f} tok/s", flush=True)
    generator = torch.Generator().manual_seed(7)
    if attempt(
        part, "prefill", settings, lambda: engine_prefill(engine, spec, PREFILL_LEN, settings, generator)
    ):
        print(f"{name} {key}: prefill {PREFILL_LEN} {part['prefill']['tok_s']:,.0f} tok/s", flush=True)


def loaded_bytes(weights: dict) -> int:
    """Bytes of the weights as loaded (a tied head is the embedding, counted once)."""
    return sum(
        w.nbytes() if isinstance(w, Int8Weight) else w.numel() * w.element_size() for w in weights.values()
    )


def bench_gguf(
    name: str, path: str, prompt: list[int], settings: Settings, bandwidth: float
) -> dict[str, Any]:
    """The GGUF file's row: loaded as `serve run` loads it, against its own bytes a token."""
    started = time.perf_counter()
    loaded = load_model(path, settings.dtype, settings.device)
    spec = loaded.spec  # the file's own, as the server runs it
    assert spec.vocab_size == SHAPES[name].vocab_size and spec.hidden_size == SHAPES[name].hidden_size, path
    print(f"{name} {GGUF_MODE}: {path} loaded in {time.perf_counter() - started:.1f} s", flush=True)
    cached = settings.prompt_len - 1
    total = loaded_bytes(loaded.weights) + cached * kv_bytes_per_token(spec, settings.dtype)
    part: dict[str, Any] = {"roofline_tok_s": bandwidth / total, "bytes_per_token": total, "file": path}
    bench_mode(name, spec, loaded.weights, prompt, settings, part, GGUF_MODE)
    return part


def bench_model(
    name: str, settings: Settings, bandwidth: float, modes: list[str], gguf: str | None = None
) -> dict[str, Any]:
    spec = SHAPES[name]
    cached = settings.prompt_len - 1
    weights = random_weights(spec, settings.dtype, settings.device)
    prompt = random_prompt(torch.Generator().manual_seed(1234), spec.vocab_size, settings.prompt_len)
    record: dict[str, Any] = {"model": name}
    for mode in modes:
        quantization, kv_cache_dtype = MODES[mode]
        record[mode] = part = {
            "roofline_tok_s": limits.decode_roofline(
                spec, bandwidth, cached, settings.dtype, quantization, kv_cache_dtype
            ),
            "bytes_per_token": limits.decode_bytes_per_token(
                spec, cached, settings.dtype, quantization, kv_cache_dtype
            ),
        }
        changes = dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype)
        bench_mode(name, spec, weights, prompt, dataclasses.replace(settings, **changes), part, mode)
        free_memory()
    if gguf:
        del weights
        record[GGUF_MODE] = bench_gguf(name, gguf, prompt, settings, bandwidth)
        free_memory()
    return record


def _tok_s(part: dict[str, Any], key: str) -> float | None:
    return part.get(key, {}).get("tok_s") if isinstance(part.get(key), dict) else None


def print_table(results: dict[str, Any]) -> None:
    dtype = results["dtype"]
    print(f"\n{results['gpu']}, {dtype}; decode at batch 1 after {results['cached']} cached positions")
    print("| model | mode | decode tok/s | % of its roofline | × base | prefill 512 tok/s | × base |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for record in results["models"]:
        base = record.get("base", {})
        for mode in results["modes"] + ([GGUF_MODE] if GGUF_MODE in record else []):
            part = record.get(mode, {})
            decode, prefill = _tok_s(part, "decode"), _tok_s(part, "prefill")
            base_decode, base_prefill = _tok_s(base, "decode"), _tok_s(base, "prefill")
            share = f"{100 * decode / part['roofline_tok_s']:.1f} %" if decode else "—"
            speedup = f"{decode / base_decode:.2f}×" if decode and base_decode else "—"
            prefill_speedup = f"{prefill / base_prefill:.2f}×" if prefill and base_prefill else "—"
            name = (
                dtype if mode == "base" else f"GGUF {Path(part['file']).name}" if mode == GGUF_MODE else mode
            )
            print(
                f"| {record['model']} | {name} | {decode or 0:,.1f} | {share} | {speedup} | "
                f"{prefill or 0:,.0f} | {prefill_speedup} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-4b")
    parser.add_argument("--tiny", action="store_true", help="the tiny model, short runs (a CPU smoke run)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ",".join(MODES))
    parser.add_argument("--cached", type=int, default=None, help="positions before decoding (default 1023)")
    parser.add_argument("--gguf", help="also this GGUF file, of the one model named by --models")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args()
    if args.gguf and (args.tiny or "," in args.models):
        parser.error("--gguf: one model of the file's shape (--models NAME)")
    tiny = args.tiny
    modes = args.modes.split(",")
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or "base" not in modes:
        parser.error(f"--modes: base and any of {', '.join(MODES)}; got {args.modes}")
    settings = Settings(
        device=torch.device(args.device),
        dtype=torch_dtype(args.dtype),
        tiny=tiny,
        prompt_len=args.cached + 1 if args.cached else 64 if tiny else 1024,
        steps=8 if tiny else 200,
        warmup=2 if tiny else 20,
        prefill_lens=[PREFILL_LEN],
        prefill_repeats=1 if tiny else 10,
        peer_compile_prefill=False,
        compile_backend="inductor",
        budget_s=1e9,
    )
    device = settings.device
    machine = limits.measure(device, tiny)
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "cached": settings.prompt_len - 1,
        "modes": modes,
        "limits": machine,
        "models": [],
    }
    for name in ["tiny"] if tiny else args.models.split(","):
        bandwidth = machine["copy_bandwidth_bytes_per_s"]
        results["models"].append(bench_model(name, settings, bandwidth, modes, args.gguf))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_int8.json").write_text(json.dumps(results, indent=1, default=str))
    print_table(results)


if __name__ == "__main__":
    main()
