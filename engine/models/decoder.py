"""The decoder: one pre-norm transformer that every supported family is an instance of.

Module names mirror HF llama's, so the canonical weight dict loads with strict checking; then q/k/v
and gate/up are fused into one weight each, so a layer runs five matrix products. The ops (torch
references or Triton kernels, engine/ops.py) are chosen once, when the decoder is built; Triton's linears
then draw on a LinearWorkspace of the decoder's own (kernels/linear.py).
"""

from __future__ import annotations

import torch
from tileinfer.engine.models.rope import rope_cos_sin_cache
from tileinfer.engine.models.shape import ModelSpec
from tileinfer.engine.ops import REFERENCE_OPS, Ops
from tileinfer.kernels.activation import xielu_reference
from tileinfer.kernels.int8 import Int8Weight, LinearWeight, quantize_int8, stack_rows
from tileinfer.kernels.linear import LinearWorkspace
from tileinfer.kernels.paged_attention import AttentionMetadata
from tileinfer.kernels.persistent_decode import (
    LayerStack,
    PersistentDecodeWorkspace,
    persistent_decode_supported,
)
from torch import nn

# The layers' linear weights (HF names after "model.layers.N."), in the groups fuse() joins
FUSED_LINEARS = (
    ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ("self_attn.o_proj.weight",),
    ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    ("mlp.down_proj.weight",),
)
_LAYER_LINEARS = frozenset(suffix for group in FUSED_LINEARS for suffix in group)


def is_layer_linear(name: str) -> bool:
    """Whether a canonical weight name is one of a layer's linear weights (what INT8 quantizes)."""
    return name.startswith("model.layers.") and name.split(".", 3)[3] in _LAYER_LINEARS


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps


class AttentionProjections(nn.Module):
    """Attention's weights under HF-llama's names: the q/k/v/o projections, and the q/k RMSNorms where the
    family has them (the decoder's Attention, and DFlash's drafter attention in proposers/dflash.py)."""

    def __init__(self, spec: ModelSpec, norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.spec = spec
        self.q_proj = nn.Linear(spec.hidden_size, spec.q_size, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, spec.kv_size, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, spec.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = norm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = norm(spec.head_dim, spec.rms_norm_eps)


class Attention(AttentionProjections):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        self.scale = spec.head_dim**-0.5

    def fuse(self) -> None:
        """One [q + 2 kv, hidden] weight (and bias) for the three projections."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight: LinearWeight = torch.cat([projection.weight for projection in projections])
        self.qkv_bias = torch.cat([p.bias for p in projections]) if self.spec.qkv_bias else None
        del self.q_proj, self.k_proj, self.v_proj
        self.o_weight: LinearWeight = self.o_proj.weight

    def take_int8(self, weights: dict[str, Int8Weight]) -> None:
        """After fuse: the INT8 weights given (q_proj/k_proj/v_proj together, o_proj) replace the float
        placeholders the state dict held for them."""
        if "q_proj" in weights:
            self.qkv_weight = stack_rows([weights["q_proj"], weights["k_proj"], weights["v_proj"]])
        if "o_proj" in weights:
            del self.o_weight, self.o_proj.weight  # registered parameters until now
            self.o_weight = weights["o_proj"]

    def forward(
        self,
        qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size]: the fused projection of the normed input
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,  # this layer's [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
        ops: Ops,
    ) -> torch.Tensor:
        spec = self.spec
        num_tokens = qkv.shape[0]
        q_norm, k_norm = (self.q_norm.weight, self.k_norm.weight) if spec.qk_norm else (None, None)
        query = ops.qkv_epilogue(
            qkv, positions, cos_sin_cache, q_norm, k_norm, spec.rms_norm_eps, kv_cache,
            metadata.slot_mapping, spec.num_heads, spec.num_kv_heads, spec.head_dim,
        )  # fmt: skip
        if metadata.is_decode and ops.decode_attention is not None:
            output = ops.decode_attention(
                query, kv_cache, metadata.block_tables, metadata.seq_lens, self.scale, spec.sliding_window,
                num_splits=metadata.decode_num_splits, workspace=metadata.decode_workspace,
            )  # fmt: skip
        else:
            output = ops.attention(query, kv_cache, metadata, self.scale, spec.sliding_window)
        o_bias = self.o_proj.bias if spec.o_bias else None
        return ops.linear(output.view(num_tokens, spec.q_size), self.o_weight, o_bias)


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
        self.has_bias = spec.mlp_bias
        if self.gated:
            self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        else:
            self.act_fn = XIELU()
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def fuse(self) -> None:
        """One [2 * intermediate, hidden] weight for gate and up (gate rows first); without a gate, up's."""
        if self.gated:
            self.in_weight: LinearWeight = torch.cat([self.gate_proj.weight, self.up_proj.weight])
            self.in_bias = torch.cat([self.gate_proj.bias, self.up_proj.bias]) if self.has_bias else None
            del self.gate_proj, self.up_proj
        else:
            self.in_weight = self.up_proj.weight
            self.in_bias = self.up_proj.bias if self.has_bias else None
        self.down_weight: LinearWeight = self.down_proj.weight

    def take_int8(self, weights: dict[str, Int8Weight]) -> None:
        """After fuse: the INT8 weights given (gate_proj/up_proj together, or up_proj alone; down_proj)
        replace the float placeholders the state dict held for them."""
        if "up_proj" in weights:
            in_weight = (
                stack_rows([weights["gate_proj"], weights["up_proj"]]) if self.gated else weights["up_proj"]
            )
            del self.in_weight  # a registered parameter until now without a gate
            if not self.gated:
                del self.up_proj.weight
            self.in_weight = in_weight
        if "down_proj" in weights:
            del self.down_weight, self.down_proj.weight
            self.down_weight = weights["down_proj"]

    def input_projection(self) -> tuple[LinearWeight, torch.Tensor | None]:
        """The weight and bias applied to the normed input: gate/up (SwiGLU fused in) or up alone."""
        return self.in_weight, self.in_bias

    def forward(self, projected: torch.Tensor, ops: Ops) -> torch.Tensor:
        """projected: silu(gate) * up (gated), or up before its activation (Apertus)."""
        act = projected if self.gated else self.act_fn(projected)
        down_bias = self.down_proj.bias if self.has_bias else None
        return ops.linear(act, self.down_weight, down_bias)


class PreNormLayer(nn.Module):
    """A pre-norm layer's modules under HF-llama's names: RMSNorm then attention, RMSNorm then the MLP
    (the decoder's layers here, DFlash's drafter layers in proposers/dflash.py)."""

    def __init__(
        self, spec: ModelSpec, self_attn: nn.Module, mlp: nn.Module, norm: type[RMSNorm] = RMSNorm
    ) -> None:
        super().__init__()
        self.input_layernorm = norm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = norm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = mlp


class DecoderLayer(PreNormLayer):
    self_attn: Attention
    mlp: MLP

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec, Attention(spec), MLP(spec))

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
        ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it), i.e. the inputs of the next norm."""
        attn, norm = self.self_attn, self.input_layernorm
        qkv, residual = ops.add_rms_norm_linear(
            hidden, residual, norm.weight, norm.eps, attn.qkv_weight, attn.qkv_bias
        )
        hidden = attn(qkv, positions, kv_cache, metadata, cos_sin_cache, ops)
        norm = self.post_attention_layernorm
        weight, bias = self.mlp.input_projection()
        projected, residual = ops.add_rms_norm_linear(
            hidden, residual, norm.weight, norm.eps, weight, bias, gate_up=self.mlp.gated
        )
        return self.mlp(projected, ops), residual


class DecoderBody(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class Decoder(nn.Module):
    """Token ids in, the last layer's output and residual out; compute_logits applies the final norm and
    the LM head (fused, and only to the rows that need logits).

    Logits cover the first logit_vocab_size ids only (LoadedModel.logit_vocab_size: the tokenizer's), so
    no sampler, logprob or verification ever sees a padding row of the embedding."""

    def __init__(
        self,
        spec: ModelSpec,
        max_positions: int,
        ops: Ops = REFERENCE_OPS,
        logit_vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.ops = ops
        self.logit_vocab_size = logit_vocab_size or spec.vocab_size
        assert 0 < self.logit_vocab_size <= spec.vocab_size, (self.logit_vocab_size, spec.vocab_size)
        self.model = DecoderBody(spec)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.max_positions = max_positions
        self.cos_sin_cache = torch.empty(0)
        self.linear_workspace: LinearWorkspace | None = None  # what the ops' linears draw on (from_weights)
        # One-sequence decode steps in one persistent kernel (stack_layers): its weights and scratch
        self.layer_stack: LayerStack | None = None
        self.persistent_workspace: PersistentDecodeWorkspace | None = None

    def layer_linears(self) -> list[LinearWeight]:
        """The decoder layers' weights in the order a forward multiplies by them."""
        weights: list[LinearWeight] = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights += [attn.qkv_weight, attn.o_weight, mlp.input_projection()[0], mlp.down_weight]
        return weights

    @classmethod
    def from_weights(
        cls,
        spec: ModelSpec,
        weights: dict[str, LinearWeight],
        max_positions: int,
        ops: Ops = REFERENCE_OPS,
        logit_vocab_size: int | None = None,
        quantization: str | None = None,
    ) -> Decoder:
        """Build on the meta device, take the given tensors as parameters, then fuse q/k/v and gate/up.
        Layer linears given as Int8Weight (as the loaders give them with quantization int8) stay INT8.
        quantization "int8" (engine/config.py QUANTIZATIONS, checked by EngineConfig.validate): the float
        layer linears given are quantized first, as the loaders quantize them (a scale per row); the
        embedding and the LM head keep their dtype. Ops that take a linear workspace (Triton's) get one of
        the decoder's own, allocated here, before any CUDA graph is captured: split-K scratch, and buffers
        for the INT8 weights that a prefill dequantizes, in forward order."""
        if quantization == "int8":
            weights = {
                name: quantize_int8(weight)
                if is_layer_linear(name) and isinstance(weight, torch.Tensor)
                else weight
                for name, weight in weights.items()
            }
        int8 = {name: weight for name, weight in weights.items() if isinstance(weight, Int8Weight)}
        dense = {name: weight for name, weight in weights.items() if not isinstance(weight, Int8Weight)}
        # placeholders for the INT8 ones, replaced after fusing
        dense |= {name: torch.empty(weight.shape, device="meta") for name, weight in int8.items()}
        with torch.device("meta"):
            decoder = cls(spec, max_positions, ops, logit_vocab_size)
        decoder.load_state_dict(dense, strict=True, assign=True)
        for index, layer in enumerate(decoder.model.layers):
            layer.self_attn.fuse()
            layer.mlp.fuse()
            prefix = f"model.layers.{index}."
            taken = {name[len(prefix) :]: w for name, w in int8.items() if name.startswith(prefix)}
            layer.self_attn.take_int8(
                {n.split(".")[1]: w for n, w in taken.items() if n.startswith("self_attn.")}
            )
            layer.mlp.take_int8({n.split(".")[1]: w for n, w in taken.items() if n.startswith("mlp.")})
        embedding = decoder.model.embed_tokens.weight
        device = embedding.device
        decoder.cos_sin_cache = rope_cos_sin_cache(spec, max_positions, device)
        if ops.takes_linear_workspace:
            workspace = LinearWorkspace.for_weights(decoder.layer_linears(), embedding.dtype, device)
            decoder.linear_workspace, decoder.ops = workspace, ops.bind(workspace)
        return decoder.eval().requires_grad_(False)

    def can_stack_layers(self) -> bool:
        """Whether the persistent decode kernel covers this decoder: dense float layer weights, a SwiGLU
        MLP without biases, no o_proj bias, and ops that have the kernel."""
        spec = self.spec
        dense = all(isinstance(weight, torch.Tensor) for weight in self.layer_linears())
        plain = spec.mlp == "swiglu" and not spec.mlp_bias and not spec.o_bias
        return dense and plain and self.ops.persistent_decode is not None

    def stack_layers(self) -> None:
        """Move each kind of layer weight into one tensor [num_layers, ...] (the persistent decode kernel's
        operands, LayerStack) and make the layers' own weights views of it: no memory is added once the
        old tensors are freed. Before any CUDA graph is captured (the graphs read the weights)."""
        assert self.can_stack_layers(), "the persistent decode kernel does not cover this decoder"
        layers, spec = self.model.layers, self.spec

        def parameters(modules: list[nn.Module]) -> torch.Tensor:
            """The modules' weights stacked; each module's weight becomes its view (a parameter still)."""
            stacked = torch.stack([module.weight for module in modules])
            for index, module in enumerate(modules):
                module.weight = nn.Parameter(stacked[index], requires_grad=False)
            return stacked

        attentions = [layer.self_attn for layer in layers]
        mlps = [layer.mlp for layer in layers]
        qkv = torch.stack([attn.qkv_weight for attn in attentions])
        qkv_bias = torch.stack([attn.qkv_bias for attn in attentions]) if spec.qkv_bias else None
        for index, attn in enumerate(attentions):
            attn.qkv_weight = qkv[index]
            if qkv_bias is not None:
                attn.qkv_bias = qkv_bias[index]
        o = parameters([attn.o_proj for attn in attentions])
        down = parameters([mlp.down_proj for mlp in mlps])
        gate_up = torch.stack([mlp.in_weight for mlp in mlps])
        for index, (attn, mlp) in enumerate(zip(attentions, mlps, strict=True)):
            attn.o_weight, mlp.down_weight = attn.o_proj.weight, mlp.down_proj.weight  # registered parameters
            mlp.in_weight = gate_up[index]
        self.layer_stack = LayerStack(
            input_norm=parameters([layer.input_layernorm for layer in layers]),
            qkv=qkv,
            qkv_bias=qkv_bias,
            q_norm=parameters([attn.q_norm for attn in attentions]) if spec.qk_norm else None,
            k_norm=parameters([attn.k_norm for attn in attentions]) if spec.qk_norm else None,
            o=o,
            post_norm=parameters([layer.post_attention_layernorm for layer in layers]),
            gate_up=gate_up,
            down=down,
            eps=spec.rms_norm_eps,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
        )
        embedding = self.model.embed_tokens.weight
        self.persistent_workspace = PersistentDecodeWorkspace.allocate(
            self.layer_stack, embedding.dtype, embedding.device
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's rows that get logits: [logit_vocab_size, hidden], a contiguous view."""
        weight = self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
        return weight[: self.logit_vocab_size]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        capture: dict[int, torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """capture: layer index -> filled with the residual stream after that layer [num_tokens, hidden]
        (what a DFlash drafter reads)."""
        ops = self.ops
        hidden = ops.embedding(input_ids, self.model.embed_tokens.weight)
        if (
            metadata.is_decode
            and capture is None
            and self.persistent_workspace is not None
            and persistent_decode_supported(self.layer_stack, kv_cache, input_ids.shape[0])
        ):
            return ops.persistent_decode(
                self.layer_stack, self.persistent_workspace, hidden, positions, self.cos_sin_cache, kv_cache,
                metadata.slot_mapping, metadata.block_tables, metadata.seq_lens,
                self.model.layers[0].self_attn.scale, self.spec.sliding_window, metadata.decode_num_splits,
                metadata.decode_workspace,
            )  # fmt: skip
        residual = None
        for index, (layer, layer_cache) in enumerate(zip(self.model.layers, kv_cache, strict=True)):
            hidden, residual = layer(
                hidden, residual, positions, layer_cache, metadata, self.cos_sin_cache, ops
            )
            if capture is not None and index in capture:
                capture[index] = hidden + residual
        assert residual is not None, "a decoder has at least one layer"
        return hidden, residual  # each [num_tokens, hidden_size]

    def compute_logits(
        self, hidden: torch.Tensor, residual: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows of forward()'s (hidden, residual) -> float32 logits [rows, logit_vocab_size] (into out)."""
        if out is None:
            rows = hidden.shape[0]
            out = torch.empty(rows, self.logit_vocab_size, dtype=torch.float32, device=hidden.device)
        norm = self.model.norm
        logits, _ = self.ops.add_rms_norm_linear(
            hidden, residual, norm.weight, norm.eps, self.lm_head_weight, out=out
        )
        return logits


def weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every canonical weight name the spec's decoder takes, with its shape (HF layout)."""
    with torch.device("meta"):
        decoder = Decoder(spec, max_positions=1)
    return {name: tuple(tensor.shape) for name, tensor in decoder.state_dict().items()}
