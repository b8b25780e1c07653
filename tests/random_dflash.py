"""A DFlash checkpoint with random weights, in the published format (config.json with
`architectures: ["DFlashDraftModel"]`, `block_size`, `dflash_config`; safetensors without an embedding
or LM head), shaped for any target. Its drafts are mostly rejected: it exercises the DFlash path
(placement, the hand-off of hidden rows, exact verification), never speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def draft_config(
    *,
    vocab_size: int,
    hidden_size: int,
    num_target_layers: int,
    target_layer_ids: list[int],
    num_layers: int = 1,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 96,
    block_size: int = 4,
    mask_token_id: int = 0,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
) -> dict:
    """The checkpoint's config.json, as the published DFlash drafters write it."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids},
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "num_target_layers": num_target_layers,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "max_position_embeddings": 512,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
    }


def smollm2_135m_config() -> dict:
    """A one-layer drafter for SmolLM2-135M (vocabulary 49152, hidden size 576, 30 layers) that reads
    three of its layers."""
    return draft_config(
        vocab_size=49152, hidden_size=576, num_target_layers=30, target_layer_ids=[1, 15, 28],
        num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, block_size=4,
    )  # fmt: skip


def random_draft_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """The published tensor names for `config` (no embedding, no LM head), random values."""
    generator = torch.Generator().manual_seed(seed)
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    intermediate = config["intermediate_size"]

    def matrix(rows: int, columns: int) -> torch.Tensor:
        return torch.randn(rows, columns, generator=generator) * columns**-0.5

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=generator)

    num_target_ids = len(config["dflash_config"]["target_layer_ids"])
    weights = {
        "fc.weight": matrix(hidden, num_target_ids * hidden),
        "hidden_norm.weight": norm(hidden),
        "norm.weight": norm(hidden),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"layers.{layer}."
        weights |= {
            prefix + "input_layernorm.weight": norm(hidden),
            prefix + "post_attention_layernorm.weight": norm(hidden),
            prefix + "self_attn.q_proj.weight": matrix(heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": matrix(kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": matrix(kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": matrix(hidden, heads * head_dim),
            prefix + "self_attn.q_norm.weight": norm(head_dim),
            prefix + "self_attn.k_norm.weight": norm(head_dim),
            prefix + "mlp.gate_proj.weight": matrix(intermediate, hidden),
            prefix + "mlp.up_proj.weight": matrix(intermediate, hidden),
            prefix + "mlp.down_proj.weight": matrix(hidden, intermediate),
        }
    return weights


def write_checkpoint(folder: Path, config: dict, weights: dict[str, torch.Tensor] | None = None) -> Path:
    """config.json and model.safetensors in `folder` (random weights unless given)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(
        weights if weights is not None else random_draft_weights(config), str(folder / "model.safetensors")
    )
    return folder
