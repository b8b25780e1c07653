"""How many tokens the KV cache holds on a GPU: what is left of the free device memory, once the weights
are loaded, after a reserve for the step's activations, graphs and logits buffers.

Like vLLM's gpu_memory_utilization, a fraction of the memory is the engine's to take; unlike vLLM, the
reserve is an estimate from the shapes rather than a profiled step, so it errs on the large side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.models.shape import ModelSpec
from tileinfer.kernels.int8 import Int8Weight, fits_mma_order
from tileinfer.kernels.kv_cache import kv_bytes_per_slot
from tileinfer.kernels.linear_dequant import DEQUANT_BUFFERS, dequantized_at_prefill

if TYPE_CHECKING:
    from tileinfer.engine.config import EngineConfig

# cuBLAS and Triton workspaces, the CUDA graphs' own bookkeeping, the decode attention's split partials
# and the allocator's fragmentation: beyond what the shapes below account for.
FIXED_RESERVE_BYTES = 1 << 30
# Per logit: the graphs' float32 logits and the sampler's work row (4 + 4), the penalty counts and mask
# (4 + 1), and an eager step's temporaries (log-softmax, sorted values and int64 indices, probabilities).
BYTES_PER_LOGIT = 32
FLOAT32_BYTES = 4


def kv_bytes_per_token(spec: ModelSpec, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """One token's keys and values in every layer (INT8: with their scales)."""
    return spec.num_layers * kv_bytes_per_slot(spec.num_kv_heads, spec.head_dim, dtype, kv_cache_dtype)


def step_reserve_bytes(
    spec: ModelSpec, max_num_batched_tokens: int, max_logit_rows: int, logit_vocab_size: int
) -> int:
    """A conservative bound on what a step needs beside the weights and the KV cache."""
    # per token of a step: the residual stream, hidden and normed input (3 x hidden), q/k/v and the
    # attention output, gate/up and the activation; counted in float32 and twice (eager temporaries
    # beside the graphs' pool)
    per_token = 3 * spec.hidden_size + 2 * spec.q_size + 2 * spec.kv_size + 3 * spec.intermediate_size
    activations = 2 * max_num_batched_tokens * per_token * FLOAT32_BYTES
    logits = max_logit_rows * logit_vocab_size * BYTES_PER_LOGIT
    return FIXED_RESERVE_BYTES + activations + logits


def layer_linear_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """(rows, in_features) of the weights a decoder layer multiplies by, q/k/v and gate/up fused."""
    up_rows = (2 if spec.mlp == "swiglu" else 1) * spec.intermediate_size
    return [
        (spec.q_size + 2 * spec.kv_size, spec.hidden_size),
        (spec.hidden_size, spec.q_size),
        (up_rows, spec.hidden_size),
        (spec.hidden_size, spec.intermediate_size),
    ]


def largest_dequantized_linear(spec: ModelSpec, group_scales: bool = False) -> int:
    """Elements of the largest INT8 layer weight that a prefill dequantizes (kernels/linear_dequant.py);
    0 if every one takes the swapped-operand GEMM. group_scales: the weights hold a scale for each group
    of inputs (Q8_0), which keeps them out of the MMA order (kernels/int8.py)."""
    return max(
        (
            rows * k
            for rows, k in layer_linear_shapes(spec)
            if dequantized_at_prefill(rows, mma_order=fits_mma_order(k, group_scales))
        ),
        default=0,
    )


def dequant_buffer_bytes(spec: ModelSpec, dtype: torch.dtype, group_scales: bool = False) -> int:
    """What the decoder's LinearWorkspace (kernels/linear.py) allocates for INT8 layer weights that a
    prefill dequantizes: DEQUANT_BUFFERS buffers, each the largest such weight in the activations' dtype.
    The decoder is built once the KV cache is sized, so the budget keeps these bytes out of it."""
    return DEQUANT_BUFFERS * largest_dequantized_linear(spec, group_scales) * dtype.itemsize


def engine_free_bytes(device: torch.device, gpu_share: float = 1.0) -> int:
    """The device memory this engine may still take: what is free; with a share of the GPU (engine
    replicas side by side on one GPU), no more than that share of the whole less what this process holds
    already, so that replicas that start together do not each count the others' part as free."""
    free, total = torch.cuda.mem_get_info(device)
    if gpu_share >= 1:
        return free
    return max(0, min(free, int(gpu_share * total) - torch.cuda.memory_reserved(device)))


def kv_cache_tokens_from_memory(
    free_bytes: int,
    fraction: float,
    bytes_per_token: int,
    reserve_bytes: int,
    block_size: int,
    max_tokens: int,
) -> int:
    """The KV cache's tokens, whole blocks of block_size: fraction of the free bytes less the reserve,
    never more than max_tokens needs (max_num_seqs sequences of max_model_len, rounded up to a block)."""
    if not 0 < fraction <= 1:
        raise InvalidRequestError(f"gpu_memory_utilization must be in (0, 1], got {fraction!r}")
    budget = int(free_bytes * fraction) - reserve_bytes
    num_blocks = max(budget, 0) // (bytes_per_token * block_size)
    if num_blocks == 0:
        raise InvalidRequestError(
            f"no GPU memory left for the KV cache: {fraction:g} of the {free_bytes / 2**30:.1f} GiB free, "
            f"less {reserve_bytes / 2**30:.1f} GiB for the steps, holds not one block of {block_size} "
            "tokens; "
            "raise gpu_memory_utilization, or lower max_num_seqs or max_num_batched_tokens"
        )
    return min(num_blocks, -(-max_tokens // block_size)) * block_size


def gpu_kv_cache_tokens(
    spec: ModelSpec,
    weights: dict[str, torch.Tensor | Int8Weight],
    config: EngineConfig,
    quantization: str | None,
    max_logit_rows: int,
    max_model_len: int,
    logit_vocab_size: int,
) -> int:
    """An engine's KV-cache tokens on its GPU, its weights (and an in-process proposer) on the device
    already: what the free memory holds after the step reserve and, with INT8 weights, the buffers the
    decoder's prefill steps dequantize its narrower layer weights into (kernels/linear.py, allocated after
    the cache is sized, so not left to it)."""
    device = config.torch_device()
    dequant_bytes = 0
    if quantization == "int8":
        grouped = any(isinstance(w, Int8Weight) and w.scale.dim() == 2 for w in weights.values())
        dequant_bytes = dequant_buffer_bytes(spec, config.torch_dtype(), group_scales=grouped)
    return kv_cache_tokens_from_memory(
        engine_free_bytes(device, config.gpu_memory_share) - dequant_bytes,
        config.gpu_memory_utilization,
        kv_bytes_per_token(spec, config.torch_dtype(), config.kv_cache_dtype),
        step_reserve_bytes(spec, config.max_num_batched_tokens, max_logit_rows, logit_vocab_size),
        config.block_size, max_tokens=config.max_num_seqs * max_model_len,
    )  # fmt: skip
