"""Linear kernels against cuBLAS on every GEMV/GEMM shape the engine runs, replayed in CUDA graphs.

    python bench/bench_linear.py [OUT_DIR] [--models qwen3-0.6b,...] [--sweep] [--replays N]

For Qwen3-0.6B, Qwen3-4B and SmolLM2-135M shapes (fused qkv, o, fused gate_up, down, lm_head) at M = 1
(decode) and M = 512 (prefill) (--m adds others: batched decode and verify steps take the skinny GEMM
at 2 <= M <= 64), times
linear_triton / gate_up_silu_triton against
torch.nn.functional.linear (cuBLAS; for gate_up: F.linear on [2I, H], then silu(gate) * up). Each side is
captured in one CUDA graph that calls it once per copy of the weight, the copies together exceeding
256 MB so that no weight is served from the 50 MB L2; the figure is the median replay time divided by the
number of copies. Copy bandwidth (a 2 GiB device-to-device copy, bytes read + written) is measured in
the same run; "% of copy bw" counts the weight, x and the output once each.

--int8 times TileInfer's kernels on INT8 weights (a scale per row, kernels/int8.py) against cuBLAS on the
bf16 ones; "% of copy bw" then counts the INT8 bytes and the scales, and the tuned rows say "weights": "int8".

--fp8 also times the same product in FP8 (e4m3, weights and activations scaled per tensor) through
cuBLASLt (torch._scaled_mm; x padded to 16 rows): a speed reference at 1 byte a weight.

--sweep also times every candidate tile configuration per shape (GEMV block sizes and warps, the skinny
GEMM's tiles and K splits, the GEMM candidate tiles) and reports the heuristic's pick beside the fastest,
to tune the linear kernels (kernels/linear_*.py).

The last thing printed is the table; the full results go to OUT_DIR/bench_linear.json (OUT_DIR: the
argument, else $OUT, else ./bench_out).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tileinfer.kernels import linear, linear_gemm, linear_gemv, linear_skinny, linear_tuned  # noqa: E402
from tileinfer.kernels.int8 import quantize_int8, split  # noqa: E402
from tileinfer.kernels.linear import LinearWorkspace  # noqa: E402
from tileinfer.kernels.linear_dequant import DequantWorkspace  # noqa: E402
from tileinfer.kernels.linear_skinny import SplitKScratch  # noqa: E402

# Layer shapes per model: (out_features, in_features); gate_up is [2 * intermediate, hidden].
MODELS: dict[str, dict[str, tuple[int, int]]] = {
    "qwen3-0.6b": {
        "qkv": (2048 + 2 * 1024, 1024),
        "o": (1024, 2048),
        "gate_up": (2 * 3072, 1024),
        "down": (1024, 3072),
        "lm_head": (151936, 1024),
    },
    "qwen3-4b": {
        "qkv": (4096 + 2 * 1024, 2560),
        "o": (2560, 4096),
        "gate_up": (2 * 9728, 2560),
        "down": (2560, 9728),
        "lm_head": (151936, 2560),
    },
    "smollm2-135m": {
        "qkv": (576 + 2 * 192, 576),
        "o": (576, 576),
        "gate_up": (2 * 1536, 576),
        "down": (576, 1536),
        "lm_head": (49152, 576),
    },
}
M_VALUES = (1, 512)
ROTATE_BYTES = 256 * 2**20  # weight copies per graph: together more than 5x the H200's 50 MB L2
DTYPE = torch.bfloat16
DEVICE = "cuda"


def copy_bandwidth(replays: int = 20) -> float:
    """Bytes per second of a 2 GiB device-to-device copy, counting bytes read plus bytes written; printed."""
    size = 2 * 2**30
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    bandwidth = 2 * size / statistics.median(times)
    print(f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s (2 GiB device-to-device, read + write)", flush=True)
    return bandwidth


def shapes_parser(description: str | None) -> argparse.ArgumentParser:
    """A parser with the flags the linear benchmarks share: the output folder and --models."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", nargs="?", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS)
    )
    return parser


def time_in_graph(call: Callable[[int], object], copies: int, replays: int) -> float:
    """Seconds per call: call(i) for every weight copy i captured in one graph, median replay / copies."""
    call(0)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            call(i)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)
    ]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    seconds = statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)
    del graph
    return seconds / copies


def sweep_configs(
    configs: list, call_for: Callable[[object], Callable[[int], object]], copies: int, replays: int
) -> list[dict]:
    """Time call_for(config) for each tile config, fastest first, as {"config", "us"}; a config that
    does not compile or fit is reported and left out."""
    timings = []
    for config in configs:
        try:
            seconds = time_in_graph(call_for(config), copies, replays)
        except Exception as exc:  # noqa: BLE001 - report, go on
            print(f"    {config}: failed ({type(exc).__name__}: {exc})"[:200], flush=True)
            continue
        timings.append({"config": config._asdict(), "us": seconds * 1e6})
    return sorted(timings, key=lambda t: t["us"])


class Case:
    """One layer shape at one M: its weight copies, input and output buffers, and the calls to time."""

    def __init__(
        self,
        model: str,
        layer: str,
        n_rows: int,
        k: int,
        m: int,
        int8: bool = False,
        swapped: bool = False,
        workspace: LinearWorkspace | None = None,
    ) -> None:
        """workspace: what our kernels draw on, as a decoder's (split-K scratch, dequantization buffers);
        None: none (K unsplit, INT8 weights multiplied as stored)."""
        self.model, self.layer, self.n_rows, self.k, self.m = model, layer, n_rows, k, m
        self.workspace = workspace
        self.gate_up = layer == "gate_up"
        self.n_out = n_rows // 2 if self.gate_up else n_rows
        weight_bytes = n_rows * k * DTYPE.itemsize
        self.copies = max(2, math.ceil(ROTATE_BYTES / weight_bytes))
        gen = torch.Generator(device=DEVICE).manual_seed(n_rows * 31 + k)
        first = (torch.randn(n_rows, k, device=DEVICE, generator=gen) / k**0.5).to(DTYPE)
        self.weights = [first] + [first.clone() for _ in range(self.copies - 1)]  # cuBLAS's
        self.int8 = int8
        self.swapped = swapped  # INT8 prefill rows through the swapped-operand GEMM (no dequantized weight)
        self.ours = [quantize_int8(weight) for weight in self.weights] if int8 else self.weights
        if int8:
            weight_bytes = self.ours[0].nbytes()  # values and fp32 scales
        self.x = torch.randn(m, k, device=DEVICE, generator=gen).to(DTYPE)
        self.out = torch.empty(m, self.n_out, device=DEVICE, dtype=DTYPE)
        self.bytes = weight_bytes + self.x.numel() * DTYPE.itemsize + self.out.numel() * DTYPE.itemsize

    def triton_call(self, config: TileConfig | None = None) -> Callable[[int], object]:
        if config is None:
            fn = linear.gate_up_silu_triton if self.gate_up else linear.linear_triton
            return lambda i: fn(self.x, self.ours[i], out=self.out, workspace=self.workspace)
        launch = LAUNCHES[type(config)]
        if isinstance(config, linear_skinny.SkinnyConfig) and self.workspace is not None:
            launch = functools.partial(launch, scratch=self.workspace.split_k)

        def call(i: int) -> None:
            values, scale, scale_group, mma_order = split(self.ours[i])
            launch(self.x, values, None, self.out, self.gate_up, config, scale=scale, scale_group=scale_group,
                   mma_order=mma_order)  # fmt: skip

        return call

    def fp8_call(self) -> Callable[[int], object]:
        """The same product in FP8 (e4m3) through cuBLASLt (torch._scaled_mm), weights and activations
        quantized with one scale each, rows of x padded to 16 (its smallest); the GEMM only (no SwiGLU).
        A speed reference for the INT8 kernels (1 byte a weight too), not a numerics one."""
        fp8 = torch.float8_e4m3fn
        weights = [weight.to(fp8) for weight in self.weights]  # [N, K] rows: .t() is column-major
        x = torch.zeros(max(16, -(-self.m // 16) * 16), self.k, device=DEVICE, dtype=fp8)
        x[: self.m] = self.x.to(fp8)
        one = torch.ones((), device=DEVICE)
        return lambda i: torch._scaled_mm(x, weights[i].t(), scale_a=one, scale_b=one, out_dtype=DTYPE)

    def cublas_call(self) -> Callable[[int], object]:
        if self.gate_up:

            def gate_up_silu(i: int) -> torch.Tensor:
                gate_up = F.linear(self.x, self.weights[i])
                return F.silu(gate_up[:, : self.n_out]) * gate_up[:, self.n_out :]

            return gate_up_silu
        return lambda i: F.linear(self.x, self.weights[i])

    def relative_error(self) -> float:
        """|triton - cuBLAS| / |cuBLAS| over the output (Frobenius norms), both bf16 out."""
        ours = self.triton_call()(0)
        theirs = self.cublas_call()(0)
        return ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()

    def candidates(self, near: bool = False) -> list[TileConfig]:
        """Every tile configuration the sweep tries for this shape; near (GEMV only): the picked tile with
        half, the same and twice its rows and its K step, either warp count, its K loop in 1 to 6 stages."""
        if near and self.m <= linear.GEMV_MAX_M:
            picked = self.heuristic()
            return [
                linear_gemv.GemvConfig(block_n, block_k, num_warps, num_stages=num_stages)
                for block_n in {max(1, picked.block_n // 2), picked.block_n, picked.block_n * 2}
                for block_k in (picked.block_k // 2, picked.block_k, picked.block_k * 2)
                for num_warps in (4, 8)
                for num_stages in (1, 2, 3, 4, 6)
                if block_k >= 16
            ]
        if self.swapped and self.m > linear_skinny.SKINNY_MAX_M:  # weight rows x warps, K step, stages
            return [
                linear_skinny.SkinnyConfig(block_n, block_k, 1, num_warps, num_stages)
                for block_n, num_warps in ((64, 4), (128, 4), (128, 8), (256, 8))
                for block_k in (64, 128)
                for num_stages in (3, 4)
            ]
        if linear.GEMV_MAX_M < self.m <= linear_skinny.SKINNY_MAX_M:
            # INT8 weights: as many bytes a K step in 256 or 512 columns
            block_ks = (256, 512) if self.int8 else (128, 256)
            k_tiles = {block_k: -(-self.k // block_k) for block_k in block_ks}
            # stages: 4 of 128 K columns, or 3 of 256 (the 128-row tile's 4 x 64 KiB would not fit)
            return [
                linear_skinny.SkinnyConfig(block_n, block_k, split_k, 4, 4 if block_k == block_ks[0] else 3)
                for block_n in (16, 32, 64, 128)
                for block_k in block_ks
                for split_k in ((1,) if block_n == 128 else (1, 2, 4))
                if split_k <= k_tiles[block_k]
            ]
        if self.m <= linear.GEMV_MAX_M:
            configs = []
            k_cap = max(128, triton.next_power_of_2(self.k))
            for block_n in (1, 2, 4, 8, 16, 32):
                for num_warps in (4, 8):
                    for block_k in (128, 256, 512, 1024, 2048, 4096):
                        registers = gemv_elements_per_thread(
                            linear_gemv.GemvConfig(block_n, block_k, num_warps), self.gate_up
                        )
                        if block_k > k_cap or not 8 <= registers <= 128:
                            continue
                        for num_stages in (1, 3):
                            configs.append(linear_gemv.GemvConfig(block_n, block_k, num_warps, num_stages))
            return configs
        cap = max(16, triton.next_power_of_2(self.m))
        table = linear_gemm.GATE_UP_CANDIDATES if self.gate_up else linear_gemm.GEMM_CANDIDATES
        configs = []
        for config, _ in table:
            for num_stages in (3, 4):
                candidate = config._replace(block_m=min(config.block_m, cap), num_stages=num_stages)
                if candidate not in configs:
                    configs.append(candidate)
        if self.m <= 64:  # a verify step's few rows: narrow tiles and long K steps, for more programs
            for block_n in (16, 32, 64):
                for block_k in (64, 128, 256):
                    for num_warps in (2, 4):
                        candidate = linear_gemm.GemmConfig(cap, block_n, block_k, num_warps, 3)
                        if candidate not in configs and block_k <= max(64, triton.next_power_of_2(self.k)):
                            configs.append(candidate)
        return configs

    def heuristic(self) -> TileConfig:
        if self.swapped and self.m > linear_skinny.SKINNY_MAX_M:
            return linear_skinny.skinny_config(self.m, self.n_out, self.k, self.gate_up, "int8")
        return heuristic_config(self.m, self.n_out, self.k, self.gate_up, "int8" if self.int8 else "float")


TileConfig = linear_gemv.GemvConfig | linear_skinny.SkinnyConfig | linear_gemm.GemmConfig


def gemv_elements_per_thread(config: linear_gemv.GemvConfig, gate_up: bool) -> int:
    """Weight tile elements a thread holds each K step (gate/up: both tiles): its fp32 accumulators."""
    tiles = 2 if gate_up else 1
    return config.block_n * tiles * config.block_k // (32 * config.num_warps)


LAUNCHES = {
    linear_gemv.GemvConfig: linear_gemv.launch_gemv,
    linear_skinny.SkinnyConfig: linear_skinny.launch_skinny,
    linear_gemm.GemmConfig: linear_gemm.launch_gemm,
}
KINDS = {linear_gemv.GemvConfig: "gemv", linear_skinny.SkinnyConfig: "skinny", linear_gemm.GemmConfig: "gemm"}


def heuristic_config(m: int, n: int, k: int, gate_up: bool, weights: str = "float") -> TileConfig:
    """The tiles kernels/linear.py picks for this call (its kernel follows from M)."""
    if m <= linear.GEMV_MAX_M:
        return linear_gemv.gemv_config(m, n, k, gate_up, weights)
    if m <= linear_skinny.SKINNY_MAX_M:
        return linear_skinny.skinny_config(m, n, k, gate_up, weights)
    return linear_gemm.gemm_config(m, n, k, gate_up, weights=weights)


def run_record(bandwidth: float, replays: int) -> dict:
    """What a results file says about the run: when, on what, with which limit and settings."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "rotate_bytes": ROTATE_BYTES,
        "replays": replays,
    }


def case_row(case: Case, **measured: float) -> dict[str, Any]:
    """A row of the results: the case's model, layer, shape and M, what was measured, then the bytes it
    moves, its weight copies and the tile config picked."""
    return {
        "model": case.model,
        "layer": case.layer,
        "shape": f"{case.n_rows}x{case.k}",
        "M": case.m,
        **measured,
        "bytes": case.bytes,
        "weight_copies": case.copies,
        "config": case.heuristic()._asdict(),
    }


def write_results(out_dir: str, name: str, result: dict[str, Any]) -> Path:
    """result as out_dir/name (the folder made if need be); the path written."""
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path


def print_table_header(columns: tuple[str, ...]) -> None:
    """A Markdown table's header row and its rule, each column as wide as its title."""
    header = "| " + " | ".join(columns) + " |"
    print(header)
    print("|" + "|".join("-" * len(part) for part in header.split("|")[1:-1]) + "|")


def tuned_rows(sweeps: list[dict], int8: bool = False) -> list[dict]:
    """The fastest candidate of each swept shape, in kernels/linear_tuned.py's table format."""
    rows = []
    for sweep in sweeps:
        if sweep["timings"]:
            rows.append({
                "kind": sweep["kind"],
                "m": linear_tuned.tuned_m(sweep["kind"], sweep["M"]),
                "n": sweep["n"],
                "k": sweep["k"],
                "gate_up": sweep["gate_up"],
                **({"weights": "int8"} if int8 else {}),
                "config": sweep["timings"][0]["config"],
                "us": round(sweep["timings"][0]["us"], 2),
            })  # fmt: skip
    return rows


def merge_tuned(path: Path, rows: list[dict]) -> list[dict]:
    """The table at path (if any) with rows for the same kernel, shape and weights replaced by these."""
    fresh = {linear_tuned.tuned_key(row) for row in rows}
    table = json.loads(path.read_text()) if path.exists() else []
    kept = [row for row in table if linear_tuned.tuned_key(row) not in fresh]
    return kept + rows


def main() -> None:
    parser = shapes_parser(__doc__)
    parser.add_argument("--m", default=",".join(map(str, M_VALUES)), help="comma-separated M values")
    parser.add_argument("--layers", help="comma-separated subset of qkv,o,gate_up,down,lm_head")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="also time every candidate tile config")
    parser.add_argument("--int8", action="store_true", help="INT8 weights (a scale per row) on our side")
    parser.add_argument("--fp8", action="store_true", help="also time the GEMM in FP8 through cuBLASLt")
    parser.add_argument(
        "--near", action="store_true", help="with --sweep: only the GEMV tiles next to the one picked"
    )
    parser.add_argument(
        "--no-dequant",
        action="store_true",
        help="with --int8: no dequantization workspace, so prefill rows take the swapped-operand GEMM",
    )
    parser.add_argument(
        "--write-tuned",
        metavar="PATH",
        help="with --sweep: merge the fastest config per shape into a kernels/tuned/<device>.json table",
    )
    args = parser.parse_args()
    assert torch.cuda.is_available(), "the linear benchmark needs a GPU"

    device = torch.device("cuda", torch.cuda.current_device())
    dequant = None
    if args.int8 and not args.no_dequant:  # prefill rows dequantize each weight into it (one buffer)
        largest = max(rows * k for model in args.models.split(",") for rows, k in MODELS[model].values())
        dequant = DequantWorkspace(device, 2 * largest, num_buffers=1)
    workspace = LinearWorkspace(SplitKScratch.allocate(device), dequant)
    bandwidth = copy_bandwidth()
    rows, sweeps = [], []
    for model in args.models.split(","):
        for layer, (n_rows, k) in MODELS[model].items():
            if args.layers and layer not in args.layers.split(","):
                continue
            for m in map(int, args.m.split(",")):
                started = time.perf_counter()
                swapped = args.int8 and args.no_dequant
                case = Case(model, layer, n_rows, k, m, args.int8, swapped, workspace)
                error = case.relative_error()
                ours = time_in_graph(case.triton_call(), case.copies, args.replays)
                theirs = time_in_graph(case.cublas_call(), case.copies, args.replays)
                row = case_row(
                    case,
                    triton_us=ours * 1e6,
                    cublas_us=theirs * 1e6,
                    speedup=theirs / ours,
                    triton_pct_copy_bw=100 * case.bytes / ours / bandwidth,
                    cublas_pct_copy_bw=100 * case.bytes / theirs / bandwidth,
                )
                row.update(kernel=KINDS[type(case.heuristic())], relative_error_vs_cublas=error)
                if args.fp8:
                    row["fp8_cublaslt_us"] = time_in_graph(case.fp8_call(), case.copies, args.replays) * 1e6
                rows.append(row)
                print(
                    f"{model:13s} {layer:8s} {row['shape']:>12s} M={m:<4d} triton {row['triton_us']:8.2f} us"
                    f"  cuBLAS {row['cublas_us']:8.2f} us  x{row['speedup']:.2f}"
                    f"  {row['triton_pct_copy_bw']:5.1f}% bw  err {error:.1e}  {case.heuristic()}"
                    f"  ({time.perf_counter() - started:.1f} s)",
                    flush=True,
                )
                if args.sweep:
                    timings = sweep_configs(
                        case.candidates(args.near), case.triton_call, case.copies, max(10, args.replays // 3)
                    )
                    sweeps.append({"model": model, "layer": layer, "M": m, "n": case.n_out, "k": k,
                                   "kind": KINDS[type(case.heuristic())],
                                   "gate_up": case.gate_up, "heuristic_us": row["triton_us"],
                                   "heuristic": row["config"], "timings": timings})  # fmt: skip
                    for t in timings[:3]:
                        print(f"    sweep {t['us']:8.2f} us  {t['config']}", flush=True)
                del case
                torch.cuda.empty_cache()

    result = {**run_record(bandwidth, args.replays), "rows": rows, "sweeps": sweeps}
    out_path = write_results(args.out_dir, "bench_linear.json", result)

    if args.write_tuned and sweeps:
        merged = merge_tuned(Path(args.write_tuned), tuned_rows(sweeps, args.int8))
        Path(args.write_tuned).write_text(json.dumps(merged, indent=1) + "\n")
        print(f"tuned configs merged into {args.write_tuned}")
    if sweeps:
        print("\nsweep: heuristic pick vs fastest candidate")
        for sweep in sweeps:
            best = sweep["timings"][0] if sweep["timings"] else {"us": float("nan"), "config": {}}
            print(
                f"{sweep['model']:13s} {sweep['layer']:8s} M={sweep['M']:<4d}"
                f"  heuristic {sweep['heuristic_us']:8.2f} us"
                f"  best {best['us']:8.2f} us  {best['config']}"
            )
    print(
        f"\nlinear kernels vs cuBLAS, CUDA graphs, bf16{' (ours: INT8 weights)' if args.int8 else ''}, "
        f"{torch.cuda.get_device_name()}, "
        f"copy bw {bandwidth / 1e12:.2f} TB/s; results in {out_path}"
    )
    columns = ("shape".ljust(30), "M".rjust(4), "triton µs", "cuBLAS µs", "speedup", "% copy bw")
    columns += ("FP8 µs",) if args.fp8 else ()
    print_table_header(columns)
    for row in rows:
        shape = f"{row['model']} {row['layer']} {row['shape']}"
        print(
            f"| {shape:30s} | {row['M']:4d} | {row['triton_us']:9.2f} | {row['cublas_us']:9.2f} "
            f"| {row['speedup']:6.2f}x | {row['triton_pct_copy_bw']:8.1f}% |"
            + (f" {row['fp8_cublaslt_us']:6.2f} |" if args.fp8 else "")
        )


if __name__ == "__main__":
    main()
