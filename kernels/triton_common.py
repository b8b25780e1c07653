"""What every Triton kernel here shares: the interpreter switch, the device's shape, and where Triton
keeps its compiled kernels."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch


def cache_root() -> Path:
    """TileInfer's cache folder: $TILEINFER_CACHE, by default ~/.cache/tileinfer."""
    return Path(os.environ.get("TILEINFER_CACHE") or Path.home() / ".cache" / "tileinfer")


def use_triton_cache_dir() -> None:
    """Keep Triton's on-disk kernel cache under <cache root>/triton unless TRITON_CACHE_DIR is set. Triton
    (knobs.cache.dir) reads the variable at each compile, so this works even after triton was imported;
    compile subprocesses inherit it."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache_root() / "triton"))


# Every kernel module imports this one, so this runs before any of our kernels first compiles.
use_triton_cache_dir()

# Triton's CPU interpreter (TRITON_INTERPRET=1, the CI path) computes bf16 arithmetic wrongly and
# without an error; kernels take this as a constexpr and upcast to fp32 when it is set.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def specialization_sizes(most: int) -> tuple[int, ...]:
    """One value per variant Triton compiles for an integer launch argument (it specializes 1 and multiples
    of 16), up to `most`: running each once compiles every variant of launches sized by it."""
    return tuple(size for size in (1, 2, 16) if size <= most)


H200_SHARED_MEMORY_PER_BLOCK = 232448  # the most shared memory a block may take on sm_90 (227 KiB, opt-in)


@functools.cache
def shared_memory_per_block(device_index: int = 0) -> int:
    """The most shared memory one program may take (opt-in); without a GPU the H200's."""
    if not torch.cuda.is_available():
        return H200_SHARED_MEMORY_PER_BLOCK
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


@functools.cache
def num_sms(device_index: int = 0) -> int:
    """Streaming multiprocessors of the GPU (132 on an H200); a nominal 8 without one."""
    if not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(device_index).multi_processor_count
