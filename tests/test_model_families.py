"""Every supported family, random weights saved by transformers: our float32 logits, through the
paged KV cache (a prefill, then one token at a time), equal transformers' within 1e-4 of scale."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tileinfer.engine.kv.block_manager import BlockManager
from tileinfer.engine.models.decoder import Decoder
from tileinfer.engine.models.safetensors_loader import load_safetensors_folder
from tileinfer.engine.ops import ops_for
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.sequence import Sequence
from tileinfer.engine.step import ScheduledRow

_COMMON = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip

CONFIGS = {
    "llama3": lambda: transformers.LlamaConfig(
        **_COMMON,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },  # fmt: skip
        tie_word_embeddings=False,
    ),
    "smollm2-tied-llama": lambda: transformers.LlamaConfig(**_COMMON, tie_word_embeddings=True),
    "mistral-sliding-window": lambda: transformers.MistralConfig(**_COMMON, sliding_window=7),
    "qwen2-qkv-bias": lambda: transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True),
    "qwen3-qk-norm": lambda: transformers.Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=False),
    "qwen3-yarn": lambda: transformers.Qwen3Config(
        **_COMMON,
        head_dim=16,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ),
    "apertus-xielu": lambda: transformers.ApertusConfig(**_COMMON),
}


def _save_random_model(config: transformers.PretrainedConfig, folder: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "act_fn" not in name:  # keep xIELU's parameters in their trained range
                parameter.normal_(0.0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu, id="cuda-triton")])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_logits_match_transformers(family: str, device: str, tmp_path: Path) -> None:
    """On the CPU the torch reference ops run; on CUDA the Triton kernels (fp32, exact dots)."""
    reference = _save_random_model(CONFIGS[family](), tmp_path)
    spec, weights = load_safetensors_folder(tmp_path, torch.float32, device)
    block_size, num_tokens, num_prompt = 4, 23, 13
    decoder = Decoder.from_weights(spec, weights, max_positions=64, ops=ops_for(torch.device(device)))
    runner = ModelRunner(
        decoder, 12, block_size, torch.float32, max_num_seqs=1, max_model_len=64, graphs=False
    )
    manager = BlockManager(num_blocks=12, block_size=block_size)
    manager.allocate(Sequence("pad", [1] * 7, SamplingParams()))  # so block ids are not just 0, 1, 2...
    token_ids = torch.randint(0, spec.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(token_ids[None]).logits[0, num_prompt - 1 :]
    seq = Sequence("s", token_ids[:num_prompt].tolist(), SamplingParams())
    manager.allocate(seq)
    got = [runner.forward_eager([ScheduledRow(seq, num_prompt)])]
    seq.num_computed_tokens = num_prompt
    for token in token_ids[num_prompt:].tolist():  # teacher-forced decode steps
        seq.token_ids.append(token)
        manager.append_slots(seq, 0)
        got.append(runner.forward_eager([ScheduledRow(seq, 1)]))
        seq.num_computed_tokens += 1
    got_logits = torch.cat(got).cpu()
    scale = expected.abs().max()
    assert (got_logits - expected).abs().max() <= 1e-4 * scale
    assert torch.equal(got_logits.argmax(-1), expected.argmax(-1))
