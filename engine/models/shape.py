"""ModelSpec: the plain-data description of one decoder, read from an HF config.json.

Every supported family is the same pre-norm decoder; the spec's fields hold the places
where they really differ (biases, q/k norms, the MLP, RoPE scaling, sliding window).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from tileinfer.engine.errors import ModelLoadError

# HF `architectures[0]` -> family name.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "ApertusForCausalLM": "apertus",
}


def supported_architectures_text() -> str:
    return ", ".join(f"{arch} ({family})" for arch, family in SUPPORTED_ARCHITECTURES.items())


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    family: str  # llama | mistral | qwen2 | qwen3 | apertus
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None  # HF rope_parameters/rope_scaling, minus rope_theta
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False  # llama `attention_bias` also covers o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3, Apertus: RMSNorm over each head of q and k before RoPE
    mlp: str = "swiglu"  # swiglu: down(silu(gate(x)) * up(x)); xielu (Apertus): down(xielu(up(x)))
    sliding_window: int | None = None  # Mistral: a query sees at most this many keys, itself included
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelSpec:
        architectures = config.get("architectures") or []
        architecture = architectures[0] if architectures else config.get("model_type")
        family = SUPPORTED_ARCHITECTURES.get(architecture or "")
        if family is None and architecture in SUPPORTED_ARCHITECTURES.values():
            family = architecture  # a config without `architectures`, named by its model_type
        if family is None:
            raise ModelLoadError(
                f"unsupported architecture {architecture!r}; supported: {supported_architectures_text()}"
            )
        try:
            hidden_size = int(config["hidden_size"])
            num_heads = int(config["num_attention_heads"])
            head_dim = int(config.get("head_dim") or hidden_size // num_heads)
            rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
            rope_theta = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            sliding_window = config.get("sliding_window")
            if family == "qwen2" and not config.get("use_sliding_window", False):
                sliding_window = None
            if family in ("llama", "qwen3", "apertus") and not config.get("use_sliding_window", False):
                sliding_window = None
            eos = config.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            attention_bias = bool(config.get("attention_bias", False))
            return cls(
                family=family,
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
                rope_scaling=rope if rope_type != "default" else None,
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=family == "qwen2" or attention_bias,
                o_bias=attention_bias and family != "qwen2",
                mlp_bias=bool(config.get("mlp_bias", False)),
                qk_norm=family in ("qwen3", "apertus"),
                mlp="xielu" if family == "apertus" else "swiglu",
                sliding_window=int(sliding_window) if sliding_window else None,
                bos_token_id=config.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ModelLoadError(f"config.json is missing or has a bad field: {error}") from error

    @classmethod
    def from_config_file(cls, path: Path) -> ModelSpec:
        return cls.from_hf_config(read_config_file(path))


def read_config_file(path: Path) -> dict[str, Any]:
    """A config.json's fields; ModelLoadError where it is missing or not JSON."""
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise ModelLoadError(f"no config.json in {path.parent}") from error
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return config
