"""bench/serve_load.py, briefly: the engine-direct closed loop on a tiny random model (fast, no timing
assertions); its HTTP mode runs against the served app in tests/test_serve_stream.py."""

from __future__ import annotations

import json
from pathlib import Path

from bench import serve_load


def test_engine_direct_smoke(tmp_path: Path) -> None:
    payload = serve_load.main(
        ["--engine-direct", "--model", "tiny", "--device", "cpu", "--dtype", "float32",
         "--concurrency", "1,4", "--prompt-tokens", "32", "--output-tokens", "8", "--requests", "8",
         "--out", str(tmp_path)]
    )  # fmt: skip
    rows = payload["results"]["engine-direct"]
    assert set(rows) == {"1", "4"}
    for row in rows.values():
        assert row["errors"] == 0 and row["requests"] == 8 and row["output_tokens"] == 8 * 8
        assert row["tpot_p50_ms"] > 0 and row["ttft_p50_ms"] > 0
    assert json.loads((tmp_path / "serve_load.json").read_text())["results"] == payload["results"]
