"""The reference engine on a CUDA device: the same greedy tokens as on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams

pytestmark = pytest.mark.gpu

CHAT = [{"role": "user", "content": "Explain in one sentence what a GPU is."}]


def test_cuda_float32_greedy_equals_cpu(smollm2_gguf: Path) -> None:
    params = SamplingParams(max_tokens=32, temperature=0)
    outputs = {}
    for device in ("cpu", "cuda"):
        engine = Engine.load(str(smollm2_gguf), EngineConfig(device=device, kv_cache_tokens=2048))
        outputs[device] = engine.generate(engine.tokenizer.encode_chat(CHAT), params)
    assert outputs["cuda"] == outputs["cpu"]


def test_cuda_bfloat16_generates(smollm2_gguf: Path) -> None:
    engine = Engine.load(
        str(smollm2_gguf), EngineConfig(device="cuda", dtype="bfloat16", kv_cache_tokens=2048)
    )
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    token_ids, text, finish_reason = engine.generate(engine.tokenizer.encode_chat(CHAT), params)
    assert len(token_ids) == 16 and finish_reason == "length" and text.strip()
