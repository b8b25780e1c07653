"""DFlash (arXiv 2602.06036): a block-diffusion drafter that proposes a whole block in one forward pass.

The target's hidden states at a few chosen layers, for every token it has run, are concatenated, projected
by `fc` and RMS-normed (`hidden_norm`) into one context row per token. Every draft layer turns those rows
into extra keys and values (its own k/v projections, k RMSNorm, RoPE at the tokens' positions) in front of
the block's own. The block is the last token followed by block_size - 1 mask tokens, embedded with the
target's embedding; it runs through the draft layers with non-causal attention (each block token sees the
whole context and the whole block), then the drafter's own final norm and the target's LM head. The
argmax at block position i is the draft for the token at that position (not the one after it).

Context keys and values only depend on verified tokens, so each request keeps them (ContextCache) and a
step projects only the hidden states of the tokens accepted since the last one.

Checkpoints are the published format: config.json with architectures ["DFlashDraftModel"], block_size and
dflash_config {mask_token_id, target_layer_ids} beside Qwen3 fields; safetensors named fc.weight,
hidden_norm.weight, norm.weight and layers.{i}.* (Qwen3 layer names), without embedding or LM head.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tileinfer.engine.errors import InvalidRequestError, ModelLoadError
from tileinfer.engine.kv.block_manager import common_prefix_length
from tileinfer.engine.models import decoder
from tileinfer.engine.models.rope import rope_cos_sin_cache
from tileinfer.engine.models.safetensors_loader import read_safetensors_file, safetensors_files
from tileinfer.engine.models.shape import ModelSpec
from tileinfer.engine.spec_decode.proposer_interface import AheadStats, DraftRequest, Proposer
from tileinfer.kernels.activation import silu_and_mul_reference
from tileinfer.kernels.embedding import embedding_reference
from tileinfer.kernels.linear import linear_reference
from tileinfer.kernels.rmsnorm import rms_norm_reference
from tileinfer.kernels.rope import apply_rope_reference
from torch import nn

ARCHITECTURE = "DFlashDraftModel"
WARM_UP_ID, WARM_UP_TOKENS = "tileinfer-warm-up", 16  # DFlashProposer.warm_up's throwaway request


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    spec: ModelSpec  # the draft layers (Qwen3-style: q/k RMSNorm, SwiGLU); hidden_size is the target's
    block_size: int  # tokens per drafted block: the last token + block_size - 1 masks
    mask_token_id: int  # a row of the target's embedding
    target_layer_ids: tuple[int, ...]  # whose outputs (residual stream after that decoder layer) feed fc
    num_target_layers: int | None = None
    input_embedding_scale: float = 1.0  # optional extras of the reference's config, multiplied in
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @property
    def num_drafts(self) -> int:
        return self.block_size - 1

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> DFlashConfig:
        architectures = config.get("architectures") or []
        if ARCHITECTURE not in architectures:
            raise ModelLoadError(
                f"not a DFlash draft checkpoint: architectures is {architectures}, "
                f"expected [{ARCHITECTURE!r}]"
            )
        dflash = config.get("dflash_config")
        if not isinstance(dflash, dict):
            raise ModelLoadError("DFlash config.json has no dflash_config object")

        def value(name: str, default: Any = None) -> Any:
            # the reference reads dflash_config first, then the top level
            return dflash.get(name, config.get(name, default))

        layer_ids = value("target_layer_ids")
        if (
            not isinstance(layer_ids, list)
            or not layer_ids
            or not all(isinstance(layer, int) and layer >= 0 for layer in layer_ids)
        ):
            raise ModelLoadError(
                "dflash_config.target_layer_ids must be a non-empty list of target layer indices, "
                f"got {layer_ids!r}"
            )
        mask_token_id, block_size = value("mask_token_id"), value("block_size")
        if not isinstance(mask_token_id, int) or mask_token_id < 0:
            raise ModelLoadError(f"dflash_config.mask_token_id must be a token id, got {mask_token_id!r}")
        if not isinstance(block_size, int) or block_size < 2:
            raise ModelLoadError(f"block_size must be an integer >= 2, got {block_size!r}")
        layer_types = config.get("layer_types") or []
        if config.get("use_sliding_window") or "sliding_attention" in layer_types or config.get("is_causal"):
            raise ModelLoadError("sliding-window or causal DFlash draft layers are not supported")
        num_target_layers = value("num_target_layers")
        if num_target_layers is not None and max(layer_ids) >= num_target_layers:
            raise ModelLoadError(
                f"target_layer_ids {layer_ids} reach past the target's {num_target_layers} layers"
            )
        # The draft layers are Qwen3 layers; the vocabulary is the target's (only mask_token_id is checked).
        spec = ModelSpec.from_hf_config({"vocab_size": 0, **config, "architectures": ["Qwen3ForCausalLM"]})
        softcap = value("final_logit_softcapping")
        return cls(
            spec=dataclasses.replace(spec, mlp_bias=False),  # Qwen3MLP has no biases
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=tuple(layer_ids),
            num_target_layers=num_target_layers,
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
        )


def load_dflash_checkpoint(
    folder: Path | str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """A local DFlash checkpoint folder -> (config, weights named as in the checkpoint). Safetensors only."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder} is not a folder")
    config_path = folder / "config.json"
    try:
        config = DFlashConfig.from_hf_config(json.loads(config_path.read_text()))
    except FileNotFoundError as error:
        raise ModelLoadError(f"no config.json in {folder}") from error
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{config_path} is not valid JSON: {error}") from error
    expected_shapes = weight_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):  # refuses pickle-only folders
        weights.update(read_safetensors_file(path, expected_shapes, dtype, device))
    missing = [name for name in expected_shapes if name not in weights]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{folder} is missing {len(missing)} DFlash tensor(s): {shown}")
    return config, weights


def weight_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the checkpoint format, with its shape."""
    with torch.device("meta"):
        drafter = DFlashDrafter(config, max_positions=1)
    return {name: tuple(tensor.shape) for name, tensor in drafter.state_dict().items()}


class ContextCache:
    """One request's context keys (k-normed, rotated) and values for every draft layer, grown in place.
    Rolling back only moves num_tokens back."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, capacity: int = 64) -> None:
        shape = (spec.num_layers, capacity, spec.num_kv_heads, spec.head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.num_tokens = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values: [num_layers, num_new, num_kv_heads, head_dim]."""
        end = self.num_tokens + keys.shape[1]
        if end > self.keys.shape[1]:  # double the capacity, so appends cost amortised O(new tokens)
            capacity = max(end, 2 * self.keys.shape[1])
            for name in ("keys", "values"):
                old = getattr(self, name)
                grown = old.new_empty((old.shape[0], capacity, *old.shape[2:]))
                grown[:, : self.num_tokens] = old[:, : self.num_tokens]
                setattr(self, name, grown)
        self.keys[:, self.num_tokens : end] = keys
        self.values[:, self.num_tokens : end] = values
        self.num_tokens = end

    def truncate(self, num_tokens: int) -> None:
        """Forget every context token from num_tokens on (drafts that were rejected after all)."""
        self.num_tokens = min(self.num_tokens, num_tokens)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """That layer's [num_tokens, num_kv_heads, head_dim] keys and values."""
        return self.keys[index, : self.num_tokens], self.values[index, : self.num_tokens]


class RMSNorm(decoder.RMSNorm):
    """The decoder's norm (a weight and eps), applied here with the reference op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(x, self.weight, self.eps)


class DFlashAttention(decoder.AttentionProjections):
    """Qwen3's attention weights (q/k RMSNorm: the drafter's spec is Qwen3's), run with reference ops."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec, norm=RMSNorm)

    def keys_values(
        self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows x [num_tokens, hidden] (context features or the normed block) -> rotated keys and values,
        each [num_tokens, num_kv_heads, head_dim]."""
        spec = self.spec
        keys = linear_reference(x, self.k_proj.weight, self.k_proj.bias)
        keys = self.k_norm(keys.view(-1, spec.num_kv_heads, spec.head_dim))
        values = linear_reference(x, self.v_proj.weight, self.v_proj.bias)
        keys = apply_rope_reference(keys, positions, cos_sin_cache)
        return keys, values.view(-1, spec.num_kv_heads, spec.head_dim)

    def forward(
        self,
        x: torch.Tensor,  # [block_len, hidden]: the normed block
        positions: torch.Tensor,  # [block_len]
        context_keys: torch.Tensor,  # [num_context, num_kv_heads, head_dim], rotated
        context_values: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        spec = self.spec
        query = linear_reference(x, self.q_proj.weight, self.q_proj.bias)
        query = self.q_norm(query.view(-1, spec.num_heads, spec.head_dim))
        query = apply_rope_reference(query, positions, cos_sin_cache)
        block_keys, block_values = self.keys_values(x, positions, cos_sin_cache)
        keys = torch.cat([context_keys, block_keys])
        values = torch.cat([context_values, block_values])
        # No mask: every block token sees the whole context and the whole block.
        output = F.scaled_dot_product_attention(
            query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), enable_gqa=True
        )  # [num_heads, block_len, head_dim]
        output = output.transpose(0, 1).reshape(-1, spec.q_size)
        return linear_reference(output, self.o_proj.weight, self.o_proj.bias)


class DFlashMLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear_reference(x, self.gate_proj.weight), linear_reference(x, self.up_proj.weight)
        return linear_reference(silu_and_mul_reference(gate, up), self.down_proj.weight)


class DFlashLayer(decoder.PreNormLayer):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec, DFlashAttention(spec), DFlashMLP(spec), norm=RMSNorm)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        context_keys: torch.Tensor,
        context_values: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        hidden = hidden + self.self_attn(normed, positions, context_keys, context_values, cos_sin_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDrafter(nn.Module):
    """The draft network (torch reference ops). Module names are the checkpoint's tensor names."""

    def __init__(self, config: DFlashConfig, max_positions: int) -> None:
        super().__init__()
        spec = config.spec
        self.config = config
        self.layers = nn.ModuleList(DFlashLayer(spec) for _ in range(spec.num_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * spec.hidden_size, spec.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.max_positions = max_positions
        self.cos_sin_cache = torch.empty(0)

    @classmethod
    def from_weights(
        cls, config: DFlashConfig, weights: dict[str, torch.Tensor], max_positions: int
    ) -> DFlashDrafter:
        with torch.device("meta"):
            drafter = cls(config, max_positions)
        drafter.load_state_dict(weights, strict=True, assign=True)
        device = drafter.fc.weight.device
        drafter.cos_sin_cache = rope_cos_sin_cache(config.spec, max_positions, device)
        return drafter.eval().requires_grad_(False)

    def new_cache(self) -> ContextCache:
        return ContextCache(self.config.spec, self.fc.weight.dtype, self.fc.weight.device)

    def extend_context(
        self, cache: ContextCache, target_hidden: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Project target_hidden [num_new, len(target_layer_ids) * hidden] of the tokens at positions
        [num_new] into every layer's context keys and values, appended to cache."""
        features = self.hidden_norm(linear_reference(target_hidden.to(self.fc.weight.dtype), self.fc.weight))
        keys_values = [
            layer.self_attn.keys_values(features, positions, self.cos_sin_cache) for layer in self.layers
        ]
        keys, values = zip(*keys_values, strict=True)
        cache.append(torch.stack(keys), torch.stack(values))

    def forward(
        self,
        target_hidden: torch.Tensor,  # [num_new, len(target_layer_ids) * hidden]: context tokens not in cache
        context_positions: torch.Tensor,  # [num_new]
        block_token_ids: torch.Tensor,  # [block_len]: the last token, then mask tokens
        block_positions: torch.Tensor,  # [block_len]
        embed_weight: torch.Tensor,  # the target's [vocab, hidden]
        lm_head_weight: torch.Tensor,  # the target's rows that get logits: [logit_vocab, hidden]
        cache: ContextCache | None = None,  # the context so far; target_hidden is appended to it
    ) -> torch.Tensor:
        """Float32 logits [block_len - 1, logit_vocab] for block positions 1.. (the drafts)."""
        config = self.config
        if cache is None:
            cache = self.new_cache()
        self.extend_context(cache, target_hidden, context_positions)
        hidden = embedding_reference(block_token_ids, embed_weight).to(self.fc.weight.dtype)
        if config.input_embedding_scale != 1.0:
            hidden = hidden * config.input_embedding_scale
        for index, layer in enumerate(self.layers):
            context_keys, context_values = cache.layer(index)
            hidden = layer(hidden, block_positions, context_keys, context_values, self.cos_sin_cache)
        logits = linear_reference(self.norm(hidden[1:]), lm_head_weight.to(hidden.dtype)).float()
        logits = logits * config.output_multiplier
        if config.final_logit_softcapping:
            cap = config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


class DFlashProposer(Proposer):
    """The Proposer for DFlash: each request's DraftRequest.target_hidden carries the target's
    hidden states (at target_layer_ids) of the tokens run since the last call; drafts are greedy.

    A forgotten request's context (the draft layers' keys and values of its tokens) is kept a while, up to
    retired_tokens tokens in all: a new request whose tokens start with the same ones (the next turn of
    a chat, which the target serves from its prefix cache and so never runs again) takes it over.

    draft_ahead() (a proposer actor on a GPU of its own calls it after answering) drafts each request's
    next block while the engine verifies: anchored at the drafter's own guess of the target's token
    after the drafts, as if the engine accepted them all. The target's hidden states of those tokens do
    not exist yet, so that block sees the context without them. The next call returns it if the engine
    did accept every draft and its token was the guess; otherwise it drafts afresh. Whether such
    drafts are accepted often enough to pay needs a trained checkpoint to tell."""

    drafts_from_model = True  # in another process, its drafts cross in the draft ring (proposers/channel.py)

    def __init__(
        self,
        drafter: DFlashDrafter,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        retired_tokens: int = 65536,
    ) -> None:
        config = drafter.config
        vocab_size, hidden_size = embed_weight.shape
        # the head may have fewer rows than the embedding: only the tokenizer's ids get logits (Decoder)
        head_rows, head_size = lm_head_weight.shape
        if hidden_size != config.spec.hidden_size or head_size != hidden_size or head_rows > vocab_size:
            raise ModelLoadError(
                f"the DFlash drafter has hidden size {config.spec.hidden_size}, but the target's embedding "
                f"is {list(embed_weight.shape)} and its LM head {list(lm_head_weight.shape)}"
            )
        if config.mask_token_id >= vocab_size:
            raise ModelLoadError(
                f"the DFlash mask token {config.mask_token_id} is outside the target's vocabulary "
                f"({vocab_size} tokens)"
            )
        self.drafter = drafter
        self.embed_weight = embed_weight
        self.lm_head_weight = lm_head_weight
        self._caches: dict[str, ContextCache] = {}
        self._token_ids: dict[str, Sequence[int]] = {}  # each request's token list, as of its last call
        # forgotten requests' contexts, least recently retired first: (the tokens they cover, context)
        self._retired: collections.OrderedDict[str, tuple[list[int], ContextCache]] = (
            collections.OrderedDict()
        )
        self.retired_tokens = retired_tokens
        # request id -> (its token count at the last call, that call's block predictions, drafts asked)
        self._last_blocks: dict[str, tuple[int, list[int], int]] = {}
        # request id -> (token count, the tokens assumed after it, predictions of the block drafted ahead)
        self._ahead: dict[str, tuple[int, list[int], list[int]]] = {}
        self.ahead_stats = AheadStats()

    @classmethod
    def from_checkpoint(
        cls,
        folder: Path | str,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        max_positions: int,
        dtype: torch.dtype = torch.float32,
    ) -> DFlashProposer:
        config, weights = load_dflash_checkpoint(folder, dtype, embed_weight.device)
        return cls(DFlashDrafter.from_weights(config, weights, max_positions), embed_weight, lm_head_weight)

    @property
    def hidden_width(self) -> int:
        """Columns of a target_hidden row: the target layers' outputs side by side."""
        return self.drafter.fc.in_features

    @property
    def hidden_dtype(self) -> torch.dtype:
        return self.drafter.fc.weight.dtype

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """The target decoder layers whose outputs (residual stream after the layer) make target_hidden."""
        return self.drafter.config.target_layer_ids

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        with torch.inference_mode():
            return [self._propose_one(request) for request in requests]

    def warm_up(self, num_drafts: int) -> None:
        """One throwaway proposal, leaving no context behind: on a GPU the first calls set up libraries
        and allocate (once longer than an engine's wait for a step's drafts)."""
        tokens = list(range(WARM_UP_TOKENS))
        hidden = torch.zeros(len(tokens) - 1, self.hidden_width, dtype=self.hidden_dtype)
        try:
            self.propose([DraftRequest(WARM_UP_ID, tokens, num_drafts, hidden, hidden_start=0)])
        finally:
            self._caches.pop(WARM_UP_ID, None)
            self._token_ids.pop(WARM_UP_ID, None)
            self._last_blocks.pop(WARM_UP_ID, None)

    def draft_ahead(self) -> None:
        """Draft the next block of each request of the last call (see the class)."""
        device = self.drafter.fc.weight.device
        no_rows = torch.empty(0, self.hidden_width, dtype=self.hidden_dtype, device=device)
        no_positions = torch.empty(0, dtype=torch.int64, device=device)
        with torch.inference_mode():
            for request_id, (num_tokens, predictions, num_drafts) in self._last_blocks.items():
                cache = self._caches.get(request_id)
                if cache is None or num_drafts == 0 or len(predictions) <= num_drafts:
                    continue  # forgotten, no drafts to build on, or no guess past them
                assumed = predictions[: num_drafts + 1]  # the drafts, then the guess of the target's token
                anchor = num_tokens + num_drafts  # the guess's position
                if self._block_len(anchor) < 2:
                    continue
                ahead = self._draft_block(cache, no_rows, no_positions, assumed[-1], anchor)
                self._ahead[request_id] = (num_tokens, assumed, ahead)
                self.ahead_stats.drafts_made += len(ahead)
        self._last_blocks.clear()

    def forget(self, request_id: str) -> None:
        self._last_blocks.pop(request_id, None)
        self._ahead.pop(request_id, None)
        cache = self._caches.pop(request_id, None)
        token_ids = self._token_ids.pop(request_id, None)
        if cache is None or token_ids is None or cache.num_tokens == 0:
            return
        self._retired[request_id] = (list(token_ids[: cache.num_tokens]), cache)
        while sum(len(tokens) for tokens, _ in self._retired.values()) > self.retired_tokens:
            self._retired.popitem(last=False)

    def _take_over(self, token_ids: Sequence[int], num_context: int, hidden_start: int) -> ContextCache:
        """A context for a new request: the retired one that shares the longest prefix with its tokens,
        if that covers the positions before its first hidden row; else an empty one."""
        best, best_length = None, 0
        for request_id, (tokens, _) in self._retired.items():
            length = common_prefix_length(tokens, token_ids[: min(len(tokens), num_context)])
            if length > best_length:
                best, best_length = request_id, length
        if best is not None and best_length >= hidden_start:
            _, cache = self._retired.pop(best)
            cache.truncate(best_length)
            return cache
        return self.drafter.new_cache()

    def _propose_one(self, request: DraftRequest) -> list[int]:
        drafter = self.drafter
        num_context = len(request.token_ids) - 1  # the last token has not been through the target yet
        cache = self._caches.get(request.request_id)
        if cache is None:
            cache = self._caches[request.request_id] = self._take_over(
                request.token_ids, num_context, request.hidden_start or 0
            )
        self._token_ids[request.request_id] = request.token_ids
        cache.truncate(num_context)  # the engine rolled the sequence back: its prefix's context still holds
        hidden_start = cache.num_tokens if request.hidden_start is None else request.hidden_start
        if hidden_start > cache.num_tokens:
            return []  # rows start past this context (a prefix-cache hit on a prefix it never saw)
        new_hidden = self._new_hidden(request, cache.num_tokens, num_context, hidden_start)
        device = drafter.fc.weight.device
        context_positions = torch.arange(cache.num_tokens, num_context, device=device)
        ahead = self._ahead.pop(request.request_id, None)
        if request.num_drafts <= 0:  # still take the context, so that the next call needs only its new rows
            drafter.extend_context(cache, new_hidden, context_positions)
            return []
        if self._block_len(num_context) < 2:
            return []  # no room for a draft inside the position table
        if ahead is not None and self._ahead_holds(ahead, request):
            drafter.extend_context(cache, new_hidden, context_positions)
            predictions = ahead[2]
            self.ahead_stats.drafts_reused += request.num_drafts
        else:
            predictions = self._draft_block(
                cache, new_hidden, context_positions, request.token_ids[-1], num_context
            )
        self._last_blocks[request.request_id] = (len(request.token_ids), predictions, request.num_drafts)
        return predictions[: request.num_drafts]

    def _block_len(self, anchor_position: int) -> int:
        """The length of a block anchored at anchor_position: the checkpoint's, within the positions."""
        return min(self.drafter.config.block_size, self.drafter.max_positions - anchor_position)

    def _draft_block(
        self,
        cache: ContextCache,
        new_hidden: torch.Tensor,
        context_positions: torch.Tensor,
        anchor_token: int,
        anchor_position: int,
    ) -> list[int]:
        """The drafter's guess at each position after anchor_token (at anchor_position) in one block,
        the new context rows appended to cache first."""
        drafter, config = self.drafter, self.drafter.config
        device = drafter.fc.weight.device
        block_len = self._block_len(anchor_position)
        block_token_ids = torch.full((block_len,), config.mask_token_id, device=device)
        block_token_ids[0] = anchor_token
        block_positions = torch.arange(anchor_position, anchor_position + block_len, device=device)
        logits = drafter(
            new_hidden, context_positions, block_token_ids, block_positions,
            self.embed_weight, self.lm_head_weight, cache,
        )  # fmt: skip
        return logits.argmax(dim=-1).tolist()

    @staticmethod
    def _ahead_holds(ahead: tuple[int, list[int], list[int]], request: DraftRequest) -> bool:
        """Whether a block drafted ahead fits the request: the engine accepted every draft it was built
        on, then took the guessed token, and it asks for no more drafts than the block has."""
        num_tokens, assumed, predictions = ahead
        token_ids = request.token_ids
        return (
            len(token_ids) == num_tokens + len(assumed)
            and list(token_ids[num_tokens:]) == assumed
            and request.num_drafts <= len(predictions)
        )

    def _new_hidden(
        self, request: DraftRequest, num_cached: int, num_context: int, hidden_start: int
    ) -> torch.Tensor:
        """The rows of request.target_hidden (its first at hidden_start <= num_cached) for context tokens
        num_cached..num_context - 1, validated."""
        config = self.drafter.config
        width = len(config.target_layer_ids) * config.spec.hidden_size
        hidden = request.target_hidden
        num_needed = num_context - num_cached
        if hidden is None:
            hidden = torch.empty(0, width)
        if hidden.dim() != 2 or hidden.shape[1] != width:
            raise InvalidRequestError(
                f"request {request.request_id}: DFlash target_hidden must be [num_tokens, {width}] "
                f"({len(config.target_layer_ids)} layers x {config.spec.hidden_size}), "
                f"got {list(hidden.shape)}"
            )
        hidden = hidden[num_cached - hidden_start :]  # rows this context holds already
        if hidden.shape[0] < num_needed:
            raise InvalidRequestError(
                f"request {request.request_id}: DFlash needs the target's hidden states of tokens "
                f"{num_cached}..{num_context - 1} ({num_needed} rows), got {hidden.shape[0]}"
            )
        if num_context >= self.drafter.max_positions:
            raise InvalidRequestError(
                f"request {request.request_id}: {num_context + 1} tokens exceed the DFlash drafter's "
                f"{self.drafter.max_positions} positions"
            )
        return hidden[:num_needed].to(self.drafter.fc.weight.device)
