"""tests/divergence.py: where two greedy outputs part, and the reference's top-2 logprob gap there (the
GPU tests and bench_spec use it to tell a numerical near-tie from a bug)."""

from __future__ import annotations

from pathlib import Path

import pytest
from divergence import describe, first_difference, top2_gap
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.sampling.params import SamplingParams


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_gap_at_the_first_difference_on_smollm2(smollm2_gguf: Path) -> None:
    engine = Engine.load(str(smollm2_gguf), EngineConfig(kv_cache_tokens=1024))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "List three prime numbers."}])
    expected = engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    outputs = list(engine.stream(prompt, SamplingParams(max_tokens=4, temperature=0, logprobs=2)))
    (top1, top2) = outputs[3].new_logprobs[0].top[:2]
    # the same context, prefilled: the same gap up to the prefill and decode paths' rounding
    assert top2_gap(engine, prompt, expected, 3) == pytest.approx(top1[1] - top2[1], rel=1e-3, abs=1e-4)
    assert top1[1] > top2[1]
    # in another context (a different token 2), another gap
    assert top2_gap(engine, prompt, expected[:2] + [top1[0]], 3) != pytest.approx(top1[1] - top2[1], abs=1e-2)
    got = expected[:3] + [top2[0]] + expected[4:]
    assert describe(engine, prompt, got, expected).startswith(f"first difference at token 3: {top2[0]}")
    assert describe(engine, prompt, expected, expected) == "equal"
    assert describe(engine, prompt, expected[:2], expected).startswith("one is a prefix")
