"""Tiles measured fastest per shape on a given GPU (`bench/bench_linear.py --sweep --write-tuned`), one
JSON file per device name (kernels/tuned/); shapes not in the file, and other GPUs, take each kernel's
heuristics (kernels/linear_gemv.py, linear_skinny.py, linear_gemm.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
from tileinfer.kernels.triton_common import INTERPRET

TUNED_DIR = Path(__file__).parent / "tuned"


def tuned_path(device_name: str) -> Path:
    return TUNED_DIR / f"{device_name.replace(' ', '_')}.json"


@functools.cache
def _tuned_table() -> dict[tuple[str, int, int, int, bool, str], dict[str, int]]:
    """(kind, next power of two of M, N, K, gate_up, weights) -> tile config, for the current GPU.
    weights: "int8" for INT8 weights, else "float" (a row without the field: tuned in bf16)."""
    if INTERPRET or not torch.cuda.is_available():
        return {}
    path = tuned_path(torch.cuda.get_device_name())
    if not path.exists():
        return {}
    return {tuned_key(row): row["config"] for row in json.loads(path.read_text())}


def tuned_key(row: dict) -> tuple[str, int, int, int, bool, str]:
    """A tuned-table row's kernel, M, shape and weights: what its config is looked up by."""
    return row["kind"], row["m"], row["n"], row["k"], row["gate_up"], row.get("weights", "float")


def tuned_config(
    kind: str, m: int, n: int, k: int, gate_up: bool, weights: str = "float"
) -> dict[str, int] | None:
    return _tuned_table().get((kind, tuned_m(kind, m), n, k, gate_up, weights))


def weights_kind(weight: torch.Tensor) -> str:
    """The tuned table's name for a weight's storage: "int8" or "float"."""
    return "int8" if weight.dtype == torch.int8 else "float"


def tuned_m(kind: str, m: int) -> int:
    """The M a tuned-table row stands for: the next power of two, and for the skinny GEMM the rows its
    tile holds (at least 16), since every M up to that runs the same tile."""
    return max(16, triton.next_power_of_2(m)) if kind == "skinny" else triton.next_power_of_2(m)
