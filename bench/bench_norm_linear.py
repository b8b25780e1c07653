"""Residual add + RMSNorm fused into the following GEMV against the unfused pair, replayed in CUDA graphs.

    python bench/bench_norm_linear.py [OUT_DIR] [--models qwen3-0.6b,...] [--layers qkv,gate_up,lm_head]
        [--int8] [--sweep [--near]] [--replays N]

For Qwen3-0.6B, Qwen3-4B and SmolLM2-135M decode shapes, times the three places a norm feeds a matrix:
input_layernorm -> fused qkv, post_attention_layernorm -> fused gate_up (+ SwiGLU), and the final norm ->
LM head (float32 logits, as the engine wants them). "fused" is add_rms_norm_linear_triton (one launch);
"unfused" is add_rms_norm_triton then linear_triton / gate_up_silu_triton (two launches; the LM head
also casts to float32, a third). Each side is captured in one CUDA graph that calls it once per copy of
the weight, the copies together exceeding 256 MB so that no weight is served from the 50 MB L2
(bench/bench_linear.py's helpers); the figure is the median replay time divided by the number of copies.

--sweep also times every GEMV tile candidate for the fused kernel (bench_linear's list) and reports the
heuristic's pick beside the fastest. The last thing printed is the table; the full results go to
OUT_DIR/bench_norm_linear.json (OUT_DIR: the argument, else $OUT, else ./bench_out).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tileinfer.kernels import norm_linear  # noqa: E402
from tileinfer.kernels.int8 import split  # noqa: E402
from tileinfer.kernels.linear import GEMV_MAX_M, gate_up_silu_triton, linear_triton  # noqa: E402
from tileinfer.kernels.linear_gemv import GemvConfig  # noqa: E402
from tileinfer.kernels.rmsnorm import add_rms_norm_triton  # noqa: E402

from bench.bench_linear import (  # noqa: E402
    DEVICE,
    DTYPE,
    MODELS,
    Case,
    case_row,
    copy_bandwidth,
    print_table_header,
    run_record,
    shapes_parser,
    sweep_configs,
    time_in_graph,
    write_results,
)

LAYERS = ("qkv", "gate_up", "lm_head")  # the linears that follow a norm
EPS = 1e-6


class NormCase(Case):
    """A bench_linear Case (weight copies, x as the hidden input, out) plus the norm's tensors."""

    def __init__(self, model: str, layer: str, n_rows: int, k: int, m: int, int8: bool = False) -> None:
        super().__init__(model, layer, n_rows, k, m, int8)
        gen = torch.Generator(device=DEVICE).manual_seed(m * 7 + k)
        self.residual = torch.randn(m, k, device=DEVICE, generator=gen).to(DTYPE)
        self.norm_weight = (1 + 0.1 * torch.randn(k, device=DEVICE, generator=gen)).to(DTYPE)
        self.residual_out = self.residual.clone()
        self.normed = torch.empty_like(self.x)
        if layer == "lm_head":
            self.out = torch.empty(m, self.n_out, device=DEVICE, dtype=torch.float32)
            self.bf16_out = torch.empty(m, self.n_out, device=DEVICE, dtype=DTYPE)
        # The fused op also reads the residual and norm weight and writes the new residual.
        self.bytes += 2 * self.residual.numel() * DTYPE.itemsize + self.norm_weight.numel() * DTYPE.itemsize
        self.bytes += self.out.numel() * (self.out.element_size() - DTYPE.itemsize)

    def fused_call(self, config: GemvConfig | None = None) -> Callable[[int], object]:
        if config is None:
            return lambda i: norm_linear.add_rms_norm_linear_triton(
                self.x, self.residual, self.norm_weight, EPS, self.ours[i],
                gate_up=self.gate_up, out=self.out, residual_out=self.residual_out,
            )  # fmt: skip

        def call(i: int) -> None:
            values, scale, scale_group, mma_order = split(self.ours[i])
            norm_linear._launch_gemv(
                self.x, self.residual, self.norm_weight, EPS, values, None, self.gate_up,
                self.out, self.residual_out, config, scale=scale, scale_group=scale_group,
                mma_order=mma_order,
            )  # fmt: skip

        return call

    def unfused_call(self) -> Callable[[int], object]:
        # add_rms_norm_triton updates its residual in place: it gets residual_out, so that the fused
        # side's input residual is left alone (the values only drift, the bytes moved are the same).
        def call(i: int) -> None:
            add_rms_norm_triton(self.x, self.residual_out, self.norm_weight, EPS, out=self.normed)
            if self.gate_up:
                gate_up_silu_triton(self.normed, self.ours[i], out=self.out)
            elif self.layer == "lm_head":
                self.out.copy_(linear_triton(self.normed, self.ours[i], out=self.bf16_out))
            else:
                linear_triton(self.normed, self.ours[i], out=self.out)

        return call

    def relative_error(self) -> float:
        """|fused - reference chain| / |reference chain| (Frobenius norms) on the first weight copy."""
        self.fused_call()(0)
        expected, _ = norm_linear.add_rms_norm_linear_reference(
            self.x, self.residual, self.norm_weight, EPS, self.ours[0], gate_up=self.gate_up
        )
        expected = expected.float()
        return ((self.out.float() - expected).norm() / expected.norm()).item()


def main() -> None:
    parser = shapes_parser(__doc__)
    parser.add_argument("--m", default="1", help="comma-separated M values (<= 8: the fused GEMV)")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="also time every fused GEMV tile candidate")
    parser.add_argument(
        "--near", action="store_true", help="with --sweep: only the tiles next to the one picked"
    )
    parser.add_argument("--int8", action="store_true", help="INT8 weights (a scale per row; the LM head too)")
    parser.add_argument(
        "--layers", default=",".join(LAYERS), help="comma-separated subset of " + ",".join(LAYERS)
    )
    args = parser.parse_args()
    assert torch.cuda.is_available(), "the norm + linear benchmark needs a GPU"
    m_values = [int(m) for m in args.m.split(",")]
    assert all(1 <= m <= GEMV_MAX_M for m in m_values), f"--m: decode sizes 1..{GEMV_MAX_M} only"

    bandwidth = copy_bandwidth()
    rows = []
    for model in args.models.split(","):
        for layer in args.layers.split(","):
            n_rows, k = MODELS[model][layer]
            for m in m_values:
                started = time.perf_counter()
                case = NormCase(model, layer, n_rows, k, m, args.int8)
                error = case.relative_error()
                fused = time_in_graph(case.fused_call(), case.copies, args.replays)
                unfused = time_in_graph(case.unfused_call(), case.copies, args.replays)
                row = case_row(
                    case,
                    fused_us=fused * 1e6,
                    unfused_us=unfused * 1e6,
                    saved_us=(unfused - fused) * 1e6,
                    fused_pct_copy_bw=100 * case.bytes / fused / bandwidth,
                )
                row["relative_error_vs_reference"] = error
                if args.sweep:
                    row["sweep"] = sweep_configs(
                        case.candidates(args.near), case.fused_call, case.copies, max(10, args.replays // 3)
                    )
                rows.append(row)
                print(
                    f"{model:13s} {layer:8s} {row['shape']:>12s} M={m:<2d} fused {row['fused_us']:8.2f} us"
                    f"  unfused {row['unfused_us']:8.2f} us  saved {row['saved_us']:6.2f} us"
                    f"  {row['fused_pct_copy_bw']:5.1f}% bw  err {error:.1e}  {case.heuristic()}"
                    f"  ({time.perf_counter() - started:.1f} s)",
                    flush=True,
                )
                for timing in row.get("sweep", [])[:3]:
                    print(f"    sweep {timing['us']:8.2f} us  {timing['config']}", flush=True)
                del case
                torch.cuda.empty_cache()

    result = {**run_record(bandwidth, args.replays), "rows": rows}
    out_path = write_results(args.out_dir, "bench_norm_linear.json", result)

    print(
        f"\nadd + RMSNorm + linear, fused vs unfused, CUDA graphs, bf16{' (INT8 weights)' * args.int8}, "
        f"{torch.cuda.get_device_name()}, "
        f"copy bw {bandwidth / 1e12:.2f} TB/s; results in {out_path}"
    )
    columns = (
        "shape".ljust(30),
        "M".rjust(2),
        "fused µs",
        "unfused µs",
        "saved µs",
        "fused % bw",
        "best sweep µs",
    )
    print_table_header(columns)
    for row in rows:
        shape = f"{row['model']} {row['layer']} {row['shape']}"
        best = f"{row['sweep'][0]['us']:.2f}" if row.get("sweep") else "-"
        print(
            f"| {shape:30s} | {row['M']:2d} | {row['fused_us']:8.2f} | {row['unfused_us']:10.2f} "
            f"| {row['saved_us']:8.2f} | {row['fused_pct_copy_bw']:9.1f}% | {best:>13s} |"
        )


if __name__ == "__main__":
    main()
