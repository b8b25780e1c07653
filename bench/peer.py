"""The gpt-fast-style peer: the same decoder in plain PyTorch, a static KV cache and SDPA attention.

It loads the canonical weight dict (tileinfer.engine.models.decoder.weight_shapes names) without copying it,
except q/k/v, which it fuses into one linear as gpt-fast does. Llama and Qwen3 (q/k RMSNorm) are covered:
RMSNorm, RoPE in the rotate-half layout, GQA, SwiGLU, a tied or separate LM head.

    prefill(prompt)            one forward over a fresh prompt from position 0 (causal SDPA);
                               returns the last position's logits (the only ones a prompt needs)
    decode(token, input_pos)   one token per sequence against the cache (SDPA with a mask row), at
                               one position for all (input_pos [1]) or one per sequence ([batch])
    greedy_step(...)           decode + argmax: the function the benchmark compiles with
                               torch.compile(mode="reduce-overhead", fullgraph=True)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tileinfer.engine.models.rope import rope_cos_sin_cache
from tileinfer.engine.models.shape import ModelSpec
from torch import nn


def _parameter(tensor: torch.Tensor | None) -> nn.Parameter | None:
    """The tensor itself as a frozen parameter: torch.compile's CUDA graphs treat parameters as static
    inputs (a plain tensor attribute could be copied into the graph's input buffers at every replay)."""
    return None if tensor is None else nn.Parameter(tensor, requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Statistics in float32, rounded back to x's dtype before the weight (as HF does)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, tokens, head_dim]; cos, sin [tokens, head_dim] (a decode: [1 or batch, 1, 1,
    head_dim]) in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class KVCache(nn.Module):
    """One layer's static cache: keys and values [batch, kv_heads, max_len, head_dim]."""

    def __init__(self, batch: int, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        shape = (batch, spec.num_kv_heads, max_len, spec.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys, values [batch, kv_heads, tokens, head_dim] at positions input_pos [tokens], or one
        token per sequence at its own position (input_pos [batch], batch > 1)."""
        if keys.shape[2] == 1 and input_pos.shape[0] > 1:
            rows = torch.arange(keys.shape[0], device=keys.device)
            self.k_cache[rows, :, input_pos] = keys[:, :, 0]
            self.v_cache[rows, :, input_pos] = values[:, :, 0]
            return
        self.k_cache.index_copy_(2, input_pos, keys)
        self.v_cache.index_copy_(2, input_pos, values)


class PeerLayer(nn.Module):
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        self.spec = spec

        def take(name: str) -> nn.Parameter | None:
            return _parameter(weights.get(prefix + name))

        attn = "self_attn."
        # q, k and v fused into one linear [q_size + 2 * kv_size, hidden] (a copy; the rest are shared)
        self.wqkv = _parameter(torch.cat([weights[f"{prefix}{attn}{p}_proj.weight"] for p in "qkv"]))
        biases = [weights.get(f"{prefix}{attn}{p}_proj.bias") for p in "qkv"]
        self.bqkv = _parameter(torch.cat(biases)) if biases[0] is not None else None
        self.wo, self.bo = take(attn + "o_proj.weight"), take(attn + "o_proj.bias")
        self.q_norm, self.k_norm = take(attn + "q_norm.weight"), take(attn + "k_norm.weight")
        self.w_gate, self.b_gate = take("mlp.gate_proj.weight"), take("mlp.gate_proj.bias")
        self.w_up, self.b_up = take("mlp.up_proj.weight"), take("mlp.up_proj.bias")
        self.w_down, self.b_down = take("mlp.down_proj.weight"), take("mlp.down_proj.bias")
        self.attention_norm = take("input_layernorm.weight")
        self.ffn_norm = take("post_attention_layernorm.weight")
        self.kv_cache: KVCache | None = None

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [batch, tokens, hidden] -> q [batch, heads, tokens, dim], k, v [batch, kv_heads, tokens, dim]."""
        spec = self.spec
        batch, num_tokens, _ = x.shape
        q, k, v = F.linear(x, self.wqkv, self.bqkv).split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        q = q.view(batch, num_tokens, spec.num_heads, spec.head_dim)
        k = k.view(batch, num_tokens, spec.num_kv_heads, spec.head_dim)
        v = v.view(batch, num_tokens, spec.num_kv_heads, spec.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, spec.rms_norm_eps)
            k = rms_norm(k, self.k_norm, spec.rms_norm_eps)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self, x: torch.Tensor, input_pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, prefill: bool
    ) -> torch.Tensor:
        spec = self.spec
        batch, num_tokens, _ = x.shape
        group = spec.num_heads // spec.num_kv_heads
        q, k, v = self.qkv(rms_norm(x, self.attention_norm, spec.rms_norm_eps), cos, sin)
        self.kv_cache.update(input_pos, k, v)
        if prefill:
            # A fresh prompt attends only to itself: causal SDPA over its own keys (flash-eligible once
            # the KV heads are repeated to the query heads).
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # One query per sequence: fold each KV head's query heads into the query-length axis, so
            # the cache is read as it is (no repeat), masked to the positions written so far.
            q = q.reshape(batch, spec.num_kv_heads, group, spec.head_dim)
            max_len = self.kv_cache.k_cache.shape[2]
            mask = torch.arange(max_len, device=x.device) <= input_pos[:, None]  # [1 or batch, max_len]
            attn = F.scaled_dot_product_attention(
                q, self.kv_cache.k_cache, self.kv_cache.v_cache, attn_mask=mask.view(-1, 1, 1, max_len)
            )
        attn = attn.reshape(batch, spec.num_heads, num_tokens, spec.head_dim).transpose(1, 2)
        hidden = x + F.linear(attn.reshape(batch, num_tokens, spec.q_size), self.wo, self.bo)
        normed = rms_norm(hidden, self.ffn_norm, spec.rms_norm_eps)
        gated = F.silu(F.linear(normed, self.w_gate, self.b_gate)) * F.linear(normed, self.w_up, self.b_up)
        return hidden + F.linear(gated, self.w_down, self.b_down)


class PeerModel(nn.Module):
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        if spec.mlp != "swiglu" or spec.sliding_window is not None:
            raise ValueError(f"the peer covers llama/qwen3-style decoders, not {spec.family}")
        self.spec = spec
        self.embedding = _parameter(weights["model.embed_tokens.weight"])
        self.norm = _parameter(weights["model.norm.weight"])
        self.lm_head = self.embedding if spec.tie_word_embeddings else _parameter(weights["lm_head.weight"])
        self.layers = nn.ModuleList(
            PeerLayer(spec, weights, f"model.layers.{i}.") for i in range(spec.num_layers)
        )
        self.device = self.embedding.device
        self.dtype = self.embedding.dtype
        self.register_buffer("rope_cache", torch.empty(0), persistent=False)
        self.max_len = 0

    def setup_cache(self, batch: int, max_len: int) -> None:
        """(Re)allocate every layer's static cache for `max_len` positions."""
        self.max_len = max_len
        for layer in self.layers:
            layer.kv_cache = None  # free the old cache before allocating the new one
        for layer in self.layers:
            layer.kv_cache = KVCache(batch, self.spec, max_len, self.dtype, self.device)
        # [max_len, head_dim] in the activation dtype: cos in the first half, sin in the second
        self.rope_cache = rope_cos_sin_cache(self.spec, max_len, self.device).to(self.dtype)

    def _forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, prefill: bool) -> torch.Tensor:
        """tokens [batch, tokens] at positions input_pos [tokens] (a decode: [1] or [batch], one each)
        -> final hidden [batch, tokens, hidden]."""
        half = self.spec.head_dim // 2
        cos_sin = self.rope_cache[input_pos]
        cos = torch.cat([cos_sin[:, :half], cos_sin[:, :half]], dim=-1)
        sin = torch.cat([cos_sin[:, half:], cos_sin[:, half:]], dim=-1)
        if not prefill:  # [1 or batch, 1, 1, head_dim]: each sequence's own rotation
            cos, sin = cos[:, None, None], sin[:, None, None]
        x = F.embedding(tokens, self.embedding)
        for layer in self.layers:
            x = layer(x, input_pos, cos, sin, prefill)
        return rms_norm(x, self.norm, self.spec.rms_norm_eps)

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """prompt [batch, tokens], written at positions 0.. -> last position's logits [batch, vocab]."""
        input_pos = torch.arange(prompt.shape[1], device=prompt.device)
        hidden = self._forward(prompt, input_pos, prefill=True)
        return F.linear(hidden[:, -1], self.lm_head).float()

    def decode(self, token: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """token [batch, 1] at positions input_pos [1] or [batch] -> logits [batch, vocab] (float32)."""
        hidden = self._forward(token, input_pos, prefill=False)
        return F.linear(hidden[:, -1], self.lm_head).float()


def greedy_step(model: PeerModel, token: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """One greedy decode step: token [batch, 1] -> the next token [batch, 1]."""
    return model.decode(token, input_pos).argmax(dim=-1, keepdim=True)


def compile_greedy_step(backend: str = "inductor"):  # noqa: ANN201 (torch.compile's callable)
    """greedy_step under torch.compile: reduce-overhead (CUDA graphs on a GPU), one graph, no breaks."""
    if backend == "inductor":
        return torch.compile(greedy_step, mode="reduce-overhead", fullgraph=True)
    return torch.compile(greedy_step, backend=backend, fullgraph=True)
