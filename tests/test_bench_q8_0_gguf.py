"""bench/q8_0_gguf.py: a float GGUF rewritten with Q8_0 matrices loads as the same model, its layer linears
INT8 with group-32 scales, within Q8_0's rounding of the float weights."""

from __future__ import annotations

from pathlib import Path

import gguf
import torch
from tileinfer.engine.models.gguf_loader import load_gguf_weights, read_gguf, spec_from_gguf
from tileinfer.kernels.int8 import Int8Weight, dequantize

from bench.q8_0_gguf import convert
from tests.test_gguf_loader import Tiny, float_tensors, gguf_layout, hf_weights, write_gguf


def test_float_matrices_become_q8_0_and_load_as_int8(tmp_path: Path) -> None:
    tiny = Tiny(architecture="qwen3")
    source = write_gguf(tmp_path / "f32.gguf", tiny, float_tensors(gguf_layout(tiny, hf_weights(tiny))))
    converted, copied = convert(source, tmp_path / "q8_0.gguf")
    reader = read_gguf(tmp_path / "q8_0.gguf")
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {gguf.GGMLQuantizationType.Q8_0}
    assert (converted, copied) == (
        sum(len(t.shape) == 2 for t in reader.tensors),
        sum(len(t.shape) == 1 for t in reader.tensors),
    )
    spec = spec_from_gguf(reader)
    assert spec == spec_from_gguf(read_gguf(source))
    original = load_gguf_weights(read_gguf(source), spec, torch.float32)
    loaded = load_gguf_weights(reader, spec, torch.float32)
    assert original.keys() == loaded.keys()
    for name, weight in loaded.items():
        if name.endswith("proj.weight"):
            assert isinstance(weight, Int8Weight) and weight.group_size == 32, name
            weight = dequantize(weight, torch.float32)
        expected = original[name]
        # Q8_0: off by at most half its block's step (the block's max / 127), plus up to 127 times the
        # fp16 scale's rounding (2^-11 of the step): 0.563 steps
        step = expected.abs().reshape(-1, 32).amax(dim=1).repeat_interleave(32).reshape(expected.shape) / 127
        assert ((weight - expected).abs() <= step * 0.57 + 1e-6).all(), name
