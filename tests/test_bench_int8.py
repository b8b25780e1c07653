"""bench/bench_int8.py end to end on the CPU (tiny shape): every mode measured in one run, each against
its own roofline, and the INT8 ones reading fewer bytes a token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_int8_tiny_cpu(tmp_path: Path) -> None:
    command = [sys.executable, "bench/bench_int8.py", "--device", "cpu", "--tiny", "--dtype", "float32",
               "--out", str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.splitlines()[-1].startswith("| tiny | int8-both |")  # the table is printed last
    (record,) = json.loads((tmp_path / "bench_int8.json").read_text())["models"]
    for mode in ("base", "int8", "int8-kv", "int8-both"):
        assert record[mode]["decode"]["tok_s"] > 0 and record[mode]["prefill"]["tok_s"] > 0, record[mode]
    for mode in ("int8", "int8-kv"):  # each halves some of the bytes a token reads, both the most
        assert record[mode]["bytes_per_token"] < record["base"]["bytes_per_token"]
        assert record["int8-both"]["bytes_per_token"] < record[mode]["bytes_per_token"]
    assert record["int8"]["roofline_tok_s"] > record["base"]["roofline_tok_s"]
