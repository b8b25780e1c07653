"""The decoder: one pre-norm transformer that every supported family is an instance of.

Module names mirror HF llama's, so the canonical weight dict loads with strict checking.
The ops come from kernels/ (torch references today, Triton kernels beside them later).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.rope import rope_cos_sin_cache
from engine.spec import ModelSpec
from kernels.activation import silu_and_mul_reference, xielu_reference
from kernels.attention import AttentionMetadata, paged_attention_reference
from kernels.kv_cache import write_kv_cache_reference
from kernels.rmsnorm import add_rms_norm_reference, rms_norm_reference
from kernels.rope import apply_rope_reference


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.q_proj = nn.Linear(spec.hidden_size, spec.q_size, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, spec.kv_size, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, spec.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.scale = spec.head_dim**-0.5

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,  # this layer's [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        spec = self.spec
        num_tokens = hidden.shape[0]
        query = self.q_proj(hidden).view(num_tokens, spec.num_heads, spec.head_dim)
        key = self.k_proj(hidden).view(num_tokens, spec.num_kv_heads, spec.head_dim)
        value = self.v_proj(hidden).view(num_tokens, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query = apply_rope_reference(query, positions, cos_sin_cache)
        key = apply_rope_reference(key, positions, cos_sin_cache)
        write_kv_cache_reference(key, value, kv_cache, metadata.slot_mapping)
        output = paged_attention_reference(query, kv_cache, metadata, self.scale, spec.sliding_window)
        return self.o_proj(output.view(num_tokens, spec.q_size))


class XIELU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.empty(1))
        self.alpha_n = nn.Parameter(torch.empty(1))
        self.beta = nn.Parameter(torch.empty(()))
        self.eps = nn.Parameter(torch.empty(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return xielu_reference(x, self.alpha_p, self.alpha_n, self.beta, self.eps)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gated = spec.mlp == "swiglu"
        if self.gated:
            self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        else:
            self.act_fn = XIELU()
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(silu_and_mul_reference(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.act_fn(self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self.input_layernorm
        if residual is None:
            residual, hidden = hidden, norm(hidden)
        else:
            hidden, residual = add_rms_norm_reference(hidden, residual, norm.weight, norm.eps)
        hidden = self.self_attn(hidden, positions, kv_cache, metadata, cos_sin_cache)
        norm = self.post_attention_layernorm
        hidden, residual = add_rms_norm_reference(hidden, residual, norm.weight, norm.eps)
        return self.mlp(hidden), residual


class DecoderBody(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class Decoder(nn.Module):
    """Token ids in, final hidden states out; compute_logits applies the LM head."""

    def __init__(self, spec: ModelSpec, max_positions: int) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderBody(spec)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.max_positions = max_positions
        self.cos_sin_cache = torch.empty(0)

    @classmethod
    def from_weights(cls, spec: ModelSpec, weights: dict[str, torch.Tensor], max_positions: int) -> Decoder:
        """Build on the meta device, then take the given tensors as parameters (no copies)."""
        with torch.device("meta"):
            decoder = cls(spec, max_positions)
        decoder.load_state_dict(weights, strict=True, assign=True)
        device = decoder.model.embed_tokens.weight.device
        decoder.cos_sin_cache = rope_cos_sin_cache(spec, max_positions, device)
        return decoder.eval().requires_grad_(False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.spec.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        residual = None
        for layer, layer_cache in zip(self.model.layers, kv_cache, strict=True):
            hidden, residual = layer(hidden, residual, positions, layer_cache, metadata, self.cos_sin_cache)
        hidden, _ = add_rms_norm_reference(hidden, residual, self.model.norm.weight, self.model.norm.eps)
        return hidden  # [num_tokens, hidden_size]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden_size] -> float32 logits [num_rows, vocab_size]."""
        return F.linear(hidden, self.lm_head_weight).float()


def weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every canonical weight name the spec's decoder takes, with its shape (HF layout)."""
    with torch.device("meta"):
        decoder = Decoder(spec, max_positions=1)
    return {name: tuple(tensor.shape) for name, tensor in decoder.state_dict().items()}
