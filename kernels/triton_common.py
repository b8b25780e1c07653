"""What every Triton kernel here shares: the interpreter switch and the device's shape."""

from __future__ import annotations

import functools
import os

import torch

# Triton's CPU interpreter (TRITON_INTERPRET=1, the CI path) computes bf16 arithmetic wrongly and
# without an error; kernels take this as a constexpr and upcast to fp32 when it is set.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotune_configs(configs: list) -> list:
    """The interpreter fails with more than one autotune config; keep the first there."""
    return configs[:1] if INTERPRET else configs


@functools.cache
def num_sms(device_index: int = 0) -> int:
    """Streaming multiprocessors of the GPU (132 on an H200); a nominal 8 without one."""
    if not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(device_index).multi_processor_count
