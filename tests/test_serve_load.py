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


def test_levels_have_prompts_of_their_own() -> None:
    """A level that replayed an earlier level's prompts would find their KV in the prefix cache."""
    args = serve_load.parse_args(["--engine-direct", "--concurrency", "8,64", "--prompt-tokens", "16"])
    eight, sixty_four = (serve_load.level_prompts(args, level, (0, 1000)) for level in (8, 64))
    assert len(eight) == 32 and len(sixty_four) == 256
    assert not {tuple(prompt) for prompt in eight} & {tuple(prompt) for prompt in sixty_four}
    assert serve_load.level_prompts(args, 8, (0, 1000)) == eight  # the same run again: the same prompts
