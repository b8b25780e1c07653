"""The two sets of ops the decoder runs: torch references (CPU, and the ground truth) and Triton
kernels (CUDA). Each pair shares a signature (kernels/*.py); the engine picks a set once, by device. The
Triton linears also take a LinearWorkspace, which each decoder binds its own of (Ops.bind)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from tileinfer.kernels.decode_attention import paged_decode_attention_triton
from tileinfer.kernels.embedding import embedding_reference, embedding_triton
from tileinfer.kernels.linear import LinearWorkspace, linear_reference, linear_triton
from tileinfer.kernels.norm_linear import add_rms_norm_linear_reference, add_rms_norm_linear_triton
from tileinfer.kernels.paged_attention import paged_attention_reference
from tileinfer.kernels.persistent_decode import persistent_decode_layers
from tileinfer.kernels.prefill_attention import paged_prefill_attention_triton
from tileinfer.kernels.qkv_epilogue import qkv_epilogue_reference, qkv_epilogue_triton


@dataclasses.dataclass(frozen=True)
class Ops:
    embedding: Callable
    add_rms_norm_linear: Callable  # residual add + RMSNorm + the linear layer (or gate/up + SwiGLU) after it
    linear: Callable
    qkv_epilogue: Callable  # q/k RMSNorm + RoPE + paged KV write, after the fused QKV projection
    attention: Callable  # any number of query tokens per sequence (prefill, mixed batches)
    decode_attention: Callable | None  # one query token per sequence; None: `attention` serves
    # every layer of a one-sequence decode step in one launch, for decoders that stack their layers
    persistent_decode: Callable | None = None
    takes_linear_workspace: bool = False  # the linears need a workspace bound (bind) before they run

    def bind(self, workspace: LinearWorkspace) -> Ops:
        """These ops with their linears (norm-fused too) drawing on workspace: one decoder's."""
        assert self.takes_linear_workspace, "these ops take no workspace, or have one bound already"
        return dataclasses.replace(
            self,
            add_rms_norm_linear=functools.partial(self.add_rms_norm_linear, workspace=workspace),
            linear=functools.partial(self.linear, workspace=workspace),
            takes_linear_workspace=False,
        )


REFERENCE_OPS = Ops(
    embedding=embedding_reference,
    add_rms_norm_linear=add_rms_norm_linear_reference,
    linear=linear_reference,
    qkv_epilogue=qkv_epilogue_reference,
    attention=paged_attention_reference,
    decode_attention=None,
)

TRITON_OPS = Ops(
    embedding=embedding_triton,
    add_rms_norm_linear=add_rms_norm_linear_triton,
    linear=linear_triton,
    qkv_epilogue=qkv_epilogue_triton,
    attention=paged_prefill_attention_triton,
    decode_attention=paged_decode_attention_triton,
    persistent_decode=persistent_decode_layers,
    takes_linear_workspace=True,
)


def ops_for(device: torch.device) -> Ops:
    return TRITON_OPS if device.type == "cuda" else REFERENCE_OPS
