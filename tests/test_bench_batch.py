"""bench/bench_batch.py end to end on the CPU (tiny shape, two small batches): the JSON holds a row per
batch with positive rates; and the peer's batch path (a position per sequence) computes what batch 1 does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tileinfer.engine.models.random_model import TINY, random_weights  # noqa: E402

from bench.peer import PeerModel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_bench_batch_tiny_cpu(tmp_path: Path) -> None:
    command = [
        sys.executable, "bench/bench_batch.py", "--device", "cpu", "--tiny", "--batches", "1,3",
        "--peer-batches", "1,3", "--peer-eager", "--out", str(tmp_path), "--budget-s", "600",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "| batch | tiny | 3 |" in result.stdout.splitlines()[-1]  # the table is printed last
    results = json.loads((tmp_path / "bench_batch.json").read_text())
    (record,) = results["models"]
    assert set(record["tileinfer"]["batches"]) == set(record["peer"]["batches"]) == {"1", "3"}
    settings = results["settings"]
    for batch in (1, 3):
        ours = record["tileinfer"]["batches"][str(batch)]
        assert ours["num_output_tokens"] == batch * settings["output_len"]
        assert ours["num_decode_steps"] >= 1
        assert ours["decode_tok_s"] > 0 and ours["e2e_tok_s"] > 0 and ours["median_decode_step_ms"] > 0
        theirs = record["peer"]["batches"][str(batch)]
        assert theirs["tok_s"] > 0 and theirs["num_steps"] == settings["output_len"] - 3
        assert record["limits"]["roofline_tok_s"][str(batch)] > 0
    rooflines = record["limits"]["roofline_tok_s"]
    assert rooflines["3"] > rooflines["1"]  # the weights are read once for the whole batch


def test_peer_positions_per_sequence() -> None:
    """Decoding two sequences with a position each ([batch]) gives each one's batch-1 logits."""
    weights = random_weights(TINY, torch.float32, "cpu")
    peer = PeerModel(TINY, weights)
    prompts = torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([[5], [7]])
    with torch.no_grad():
        peer.setup_cache(batch=2, max_len=16)
        peer.prefill(prompts)
        batched = peer.decode(tokens, torch.tensor([12, 12]))
        shared = peer.decode(tokens, torch.tensor([13]))  # one position for all: the batch-1 path
        batched_next = peer.decode(tokens, torch.tensor([14, 14]))
        for row in range(2):
            peer.setup_cache(batch=1, max_len=16)
            peer.prefill(prompts[row : row + 1])
            alone = [peer.decode(tokens[row : row + 1], torch.tensor([12 + step])) for step in range(3)]
            torch.testing.assert_close(batched[row], alone[0][0])
            torch.testing.assert_close(shared[row], alone[1][0])
            torch.testing.assert_close(batched_next[row], alone[2][0])
