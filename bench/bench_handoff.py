"""The cost of one speculative step's hand-off between the engine's process and a proposer process
(issue 6: ≤ 50 us on one H200 host), measured on its own: a RemoteProposer and a ProposerServer in a
spawned process over the shared-memory channel, with a proposer that does no work (fixed drafts), so
the round trip is all hand-off.

    python bench/bench_handoff.py [OUT_DIR] [--steps 2000]

For 1 and 8 sequences, each step sends one new token per sequence (what decoding sends) and gets 4 drafts
back; steps follow each other at once, or 1 ms apart (an engine's step doing GPU work in between). Prints
median and p90 round-trip microseconds; writes OUT_DIR/bench_handoff.json.
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

from proposers.base import DraftRequest  # noqa: E402
from proposers.remote import ProposerServer, RemoteProposer  # noqa: E402

CONTEXT = multiprocessing.get_context("spawn")
NUM_DRAFTS = 4


class FixedDrafts:
    """A proposer that costs nothing: the hand-off is all that is timed."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [[1] * request.num_drafts for request in requests]

    def forget(self, request_id: str) -> None:
        pass


def _serve(channel_names: multiprocessing.Queue, attached: multiprocessing.Queue) -> None:
    proposer, lock = FixedDrafts(), threading.Lock()
    while True:
        server = ProposerServer(proposer, channel_names.get(), lock)
        threading.Thread(target=server.serve, daemon=True).start()
        attached.put(True)


def measure(num_seqs: int, steps: int, gap_s: float = 0.0) -> dict:
    channel_names, attached = CONTEXT.Queue(), CONTEXT.Queue()
    process = CONTEXT.Process(target=_serve, args=(channel_names, attached), daemon=True)
    process.start()

    def connect(name: str) -> None:
        channel_names.put(name)
        attached.get(timeout=60)

    remote = RemoteProposer(connect, timeout_s=5.0)
    try:
        assert remote.wait_attached(60), "the proposer process did not attach"
        tokens = {f"r{i}": list(range(100 + i, 164 + i)) for i in range(num_seqs)}
        times = []
        for step in range(steps + 100):
            for token_ids in tokens.values():
                token_ids.append(step % 1000)
            requests = [DraftRequest(rid, token_ids, NUM_DRAFTS) for rid, token_ids in tokens.items()]
            started = time.perf_counter()
            drafts = remote.propose(requests)
            elapsed = time.perf_counter() - started
            assert len(drafts) == num_seqs and all(len(d) == NUM_DRAFTS for d in drafts)
            if step >= 100:  # warm-up
                times.append(elapsed)
            pause_until = time.perf_counter() + gap_s
            while time.perf_counter() < pause_until:  # the engine's own work (busy, like a GPU sync)
                pass
    finally:
        remote.close()
        process.kill()
    times.sort()
    return {
        "num_seqs": num_seqs,
        "gap_ms": 1e3 * gap_s,
        "median_us": 1e6 * statistics.median(times),
        "p90_us": 1e6 * times[int(0.9 * len(times))],
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    rows = [measure(num_seqs, args.steps, gap_s) for gap_s in (0.0, 1e-3) for num_seqs in (1, 8)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_handoff.json").write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=2))
    print(
        f"hand-off round trip through shared memory ({os.cpu_count()} CPUs), {NUM_DRAFTS} drafts a sequence"
    )
    print("| sequences | gap between steps | median us | p90 us |")
    print("| ---: | ---: | ---: | ---: |")
    for row in rows:
        timing = f"{row['median_us']:.1f} | {row['p90_us']:.1f}"
        print(f"| {row['num_seqs']} | {row['gap_ms']:.0f} ms | {timing} |")


if __name__ == "__main__":
    main()
