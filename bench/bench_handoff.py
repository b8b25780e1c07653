"""The cost of one speculative step's hand-off between the engine's process and a proposer process
(issue 6: ≤ 50 us on one H200 host), measured on its own: a RemoteProposer and a ProposerServer in a
spawned process over the shared-memory channel, with a proposer that does no work (fixed drafts), so
the round trip is all hand-off.

    python bench/bench_handoff.py [OUT_DIR] [--steps 2000] [--hidden-width 20480]

For 1 and 8 sequences, each step sends one new token per sequence (what decoding sends) and gets 4 drafts
back; steps follow each other at once, or 1 ms apart (an engine's step doing GPU work in between). Prints
median and p90 round-trip microseconds; writes OUT_DIR/bench_handoff.json.

With a GPU, also DFlash's hand-off for one sequence: each step 5 new tokens (an accepted block) and their
rows of the target's hidden states (--hidden-width bf16 values each; 20480 = 5 layers x 4096, a Qwen3-8B
DFlash), the rows on the GPU, crossing in host memory or in GPU memory (CUDA IPC, proposers/device_rows.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from proposers.base import DraftRequest  # noqa: E402
from proposers.channel import ChannelCapacity  # noqa: E402
from proposers.remote import HiddenLayout, ProposerServer, RemoteProposer  # noqa: E402

CONTEXT = multiprocessing.get_context("spawn")
NUM_DRAFTS = 4


class FixedDrafts:
    """A proposer that costs nothing: the hand-off is all that is timed. With a hidden width it reads
    rows of the target's hidden states, as DFlash does (and touches them: their bytes must be there)."""

    def __init__(self, hidden_width: int = 0) -> None:
        self.hidden_width = hidden_width
        self.hidden_dtype = torch.bfloat16
        self.target_layer_ids = (0,) if hidden_width else ()

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        for request in requests:
            if request.target_hidden is not None and request.target_hidden.shape[0]:
                request.target_hidden[-1, :8].sum().item()  # waits for the rows' copy
        return [[1] * request.num_drafts for request in requests]

    def forget(self, request_id: str) -> None:
        pass


def _serve(channel_names: multiprocessing.Queue, attached: multiprocessing.Queue, hidden_width: int) -> None:
    proposer, lock = FixedDrafts(hidden_width), threading.Lock()
    while True:
        server = ProposerServer(proposer, channel_names.get(), lock)
        threading.Thread(target=server.serve, daemon=True).start()
        attached.put(True)


def measure(
    num_seqs: int, steps: int, gap_s: float = 0.0, hidden_width: int = 0, rows_on: str | None = None
) -> dict:
    """rows_on: with a hidden width, where the rows cross: "host" or "gpu" memory."""
    channel_names, attached = CONTEXT.Queue(), CONTEXT.Queue()
    process = CONTEXT.Process(target=_serve, args=(channel_names, attached, hidden_width), daemon=True)
    process.start()

    def connect(name: str) -> None:
        channel_names.put(name)
        attached.get(timeout=60)

    per_step = 5 if hidden_width else 1  # tokens a step: an accepted block with rows, else one
    hidden = HiddenLayout((0,), hidden_width, "bfloat16") if hidden_width else None
    device = torch.device("cuda") if rows_on == "gpu" else None
    capacity = ChannelCapacity(max_step_rows=256) if hidden_width else None
    remote = RemoteProposer(connect, capacity, timeout_s=5.0, hidden=hidden, device=device)
    pool = torch.randn(256, hidden_width, dtype=torch.bfloat16, device="cuda") if hidden_width else None
    try:
        assert remote.wait_attached(60), "the proposer process did not attach"
        tokens = {f"r{i}": list(range(100 + i, 164 + i)) for i in range(num_seqs)}
        sent = dict.fromkeys(tokens, 0)  # rows handed over per sequence
        times = []
        for step in range(steps + 100):
            for token_ids in tokens.values():
                token_ids.extend([step % 1000] * per_step)
            requests = []
            for rid, token_ids in tokens.items():
                rows = None
                if pool is not None:  # the rows of the tokens the target ran since the last step
                    rows, sent[rid] = pool[: len(token_ids) - 1 - sent[rid]], len(token_ids) - 1
                requests.append(DraftRequest(rid, token_ids, NUM_DRAFTS, rows))
            started = time.perf_counter()
            drafts = remote.propose(requests)
            elapsed = time.perf_counter() - started
            assert len(drafts) == num_seqs and all(len(d) == NUM_DRAFTS for d in drafts)
            if step >= 100:  # warm-up
                times.append(elapsed)
            pause_until = time.perf_counter() + gap_s
            while time.perf_counter() < pause_until:  # the engine's own work (busy, like a GPU sync)
                pass
        in_gpu_memory = bool(hidden_width) and remote.rows_in_gpu_memory
    finally:
        remote.close()
        process.kill()
    times.sort()
    return {
        "num_seqs": num_seqs,
        "hidden_width": hidden_width,
        "rows_on": rows_on,
        "rows_crossed_in_gpu_memory": in_gpu_memory,
        "gap_ms": 1e3 * gap_s,
        "median_us": 1e6 * statistics.median(times),
        "p90_us": 1e6 * times[int(0.9 * len(times))],
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--hidden-width", type=int, default=20480, help="DFlash rows' width (with a GPU)")
    args = parser.parse_args()
    rows = [measure(num_seqs, args.steps, gap_s) for gap_s in (0.0, 1e-3) for num_seqs in (1, 8)]
    if torch.cuda.is_available():
        rows += [measure(1, args.steps, 0.0, args.hidden_width, rows_on) for rows_on in ("host", "gpu")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_handoff.json").write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=2))
    print(
        f"hand-off round trip through shared memory ({os.cpu_count()} CPUs), {NUM_DRAFTS} drafts a sequence"
    )
    print("| sequences | gap between steps | DFlash rows (5 a step) | median us | p90 us |")
    print("| ---: | ---: | --- | ---: | ---: |")
    for row in rows:
        timing = f"{row['median_us']:.1f} | {row['p90_us']:.1f}"
        rows_cell = "none"
        if row["hidden_width"]:
            where = "GPU memory (CUDA IPC)" if row["rows_crossed_in_gpu_memory"] else "host memory"
            rows_cell = f"{row['hidden_width']} bf16 each, asked {row['rows_on']}, crossed in {where}"
        print(f"| {row['num_seqs']} | {row['gap_ms']:.0f} ms | {rows_cell} | {timing} |")


if __name__ == "__main__":
    main()
