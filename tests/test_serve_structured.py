"""bench/serve_structured.py, briefly: its engine-direct mode on SmolLM2 (the CPU, a small schema, short
phases; no timing assertions). Its served mode runs on the GPU machine (bench/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import serve_structured

SMALL_SCHEMA = {  # outputs of at most 22 characters: short requests on the CPU
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


def test_engine_direct_phases_validate_every_constrained_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serve_structured, "SCHEMA", SMALL_SCHEMA)
    results = serve_structured.main(
        ["--engine-direct", "--device", "cpu", "--dtype", "float32", "--concurrency", "2",
         "--mixed-clients", "2", "--mixed-runs", "1", "--requests-per-client", "1", "--min-requests", "2",
         "--prompt-tokens", "16", "--schema-probes", "1", "--out", str(tmp_path)]
    )  # fmt: skip
    assert results["serve"] is None and results["skipped"] == []
    level = results["levels"][2]
    assert level["constrained"]["valid"] == level["constrained"]["requests"] == 2
    assert level["unconstrained"]["requests"] == 2 and level["tpot_p50_ratio"] > 0
    assert results["mixed"]["unconstrained_tpot_p50_ratio"] > 0
    assert results["validity"]["valid_share"] == 1.0
    saved = json.loads((tmp_path / "serve_structured.json").read_text())
    assert saved["validity"] == results["validity"]
