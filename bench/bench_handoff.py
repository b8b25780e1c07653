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
The proposer copies them to its own GPU, as DFlash does.

With two GPUs, the DFlash rows again with the proposer on the second GPU (its process sees both, as the
engine's GPU must be visible for a peer mapping): through host memory, through the engine's buffer mapped
into the proposer's GPU (CUDA IPC with peer access), and, for comparison, the same round trip through
NCCL (rows sent, drafts sent back; torch.distributed, one process a GPU).
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
    rows of the target's hidden states onto its GPU, as DFlash does (and touches them there: their bytes
    must have arrived)."""

    def __init__(self, hidden_width: int = 0, device: torch.device | None = None) -> None:
        self.hidden_width, self.device = hidden_width, device
        self.hidden_dtype = torch.bfloat16
        self.target_layer_ids = (0,) if hidden_width else ()

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        for request in requests:
            if request.target_hidden is not None and request.target_hidden.shape[0]:
                rows = request.target_hidden.to(self.device)
                rows[-1, :8].sum().item()  # waits for the rows' copy
        return [[1] * request.num_drafts for request in requests]

    def forget(self, request_id: str) -> None:
        pass


def _serve(
    channel_names: multiprocessing.Queue, attached: multiprocessing.Queue, hidden_width: int, gpu: int
) -> None:
    device = torch.device("cuda", gpu) if hidden_width else None
    if device is not None:
        torch.cuda.set_device(device)  # this thread's: the channel maps the engine's rows for this GPU
    proposer, lock = FixedDrafts(hidden_width, device), threading.Lock()
    while True:
        server = ProposerServer(proposer, channel_names.get(), lock)
        threading.Thread(target=server.serve, daemon=True).start()
        attached.put(True)


def measure(
    num_seqs: int,
    steps: int,
    gap_s: float = 0.0,
    hidden_width: int = 0,
    rows_on: str | None = None,
    proposer_gpu: int = 0,
) -> dict:
    """rows_on: with a hidden width, where the rows cross: "host" or "gpu" memory; the engine's rows are
    on GPU 0, the proposer's process works on proposer_gpu."""
    channel_names, attached = CONTEXT.Queue(), CONTEXT.Queue()
    process = CONTEXT.Process(
        target=_serve, args=(channel_names, attached, hidden_width, proposer_gpu), daemon=True
    )
    process.start()

    def connect(name: str) -> None:
        channel_names.put(name)
        attached.get(timeout=60)

    per_step = 5 if hidden_width else 1  # tokens a step: an accepted block with rows, else one
    hidden = HiddenLayout((0,), hidden_width, "bfloat16") if hidden_width else None
    device = torch.device("cuda", 0) if rows_on == "gpu" else None
    capacity = ChannelCapacity(max_step_rows=256) if hidden_width else None
    remote = RemoteProposer(connect, capacity, timeout_s=5.0, hidden=hidden, device=device)
    pool = torch.randn(256, hidden_width, dtype=torch.bfloat16, device="cuda:0") if hidden_width else None
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
    return _timing(times) | {
        "num_seqs": num_seqs,
        "hidden_width": hidden_width,
        "rows_on": rows_on,
        "rows_crossed_in_gpu_memory": in_gpu_memory,
        "proposer_gpu": proposer_gpu,
        "gap_ms": 1e3 * gap_s,
        "steps": steps,
    }


def _timing(times: list[float]) -> dict:
    times = sorted(times)
    return {"median_us": 1e6 * statistics.median(times), "p90_us": 1e6 * times[int(0.9 * len(times))]}


def _nccl_proposer(port: int, steps: int, rows: int, hidden_width: int) -> None:
    """Rank 1 on GPU 1: receive each step's rows, touch them, send the drafts back."""
    import torch.distributed as dist

    torch.cuda.set_device(1)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    buffer = torch.empty(rows, hidden_width, dtype=torch.bfloat16, device="cuda")
    drafts = torch.ones(NUM_DRAFTS, dtype=torch.int32, device="cuda")
    for _ in range(steps):
        dist.recv(buffer, 0)
        drafts[0] = buffer[-1, 0].float().int()  # the drafts depend on the rows, as DFlash's do
        dist.send(drafts, 0)
    torch.cuda.synchronize()
    dist.destroy_process_group()


def measure_nccl(steps: int, hidden_width: int, rows: int = 5) -> dict:
    """The DFlash round trip through NCCL: GPU 0 sends a step's rows to GPU 1 and waits for its drafts."""
    import socket

    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    total = steps + 100
    process = CONTEXT.Process(target=_nccl_proposer, args=(port, total, rows, hidden_width), daemon=True)
    process.start()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    pool = torch.randn(rows, hidden_width, dtype=torch.bfloat16, device="cuda")
    drafts = torch.empty(NUM_DRAFTS, dtype=torch.int32, device="cuda")
    times = []
    try:
        for step in range(total):
            torch.cuda.synchronize()  # the engine's step has ended
            started = time.perf_counter()
            dist.send(pool, 1)
            dist.recv(drafts, 1)
            drafts.tolist()
            if step >= 100:
                times.append(time.perf_counter() - started)
    finally:
        dist.destroy_process_group()
        process.join(timeout=30)
    return _timing(times) | {
        "num_seqs": 1, "hidden_width": hidden_width, "rows_on": "nccl", "rows_crossed_in_gpu_memory": True,
        "proposer_gpu": 1, "gap_ms": 0.0, "steps": steps,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--hidden-width", type=int, default=20480, help="DFlash rows' width (with a GPU)")
    args = parser.parse_args()
    rows = [measure(num_seqs, args.steps, gap_s) for gap_s in (0.0, 1e-3) for num_seqs in (1, 8)]
    gpus = torch.cuda.device_count()
    for proposer_gpu in range(min(gpus, 2)):
        for rows_on in ("host", "gpu"):
            rows.append(measure(1, args.steps, 0.0, args.hidden_width, rows_on, proposer_gpu))
    if gpus >= 2:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on a shared host
        rows.append(measure_nccl(args.steps, args.hidden_width))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_handoff.json").write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=2))
    print(
        f"hand-off round trip through shared memory ({os.cpu_count()} CPUs), {NUM_DRAFTS} drafts a sequence"
    )
    print("| sequences | gap between steps | DFlash rows (5 a step) | proposer's GPU | median us | p90 us |")
    print("| ---: | ---: | --- | --- | ---: | ---: |")
    for row in rows:
        timing = f"{row['median_us']:.1f} | {row['p90_us']:.1f}"
        rows_cell, gpu_cell = "none", "-"
        if row["hidden_width"]:
            where = "GPU memory (CUDA IPC)" if row["rows_crossed_in_gpu_memory"] else "host memory"
            if row["rows_on"] == "nccl":
                where = "NCCL send/recv, drafts back by NCCL"
            rows_cell = f"{row['hidden_width']} bf16 each, asked {row['rows_on']}, crossed in {where}"
            gpu_cell = "the engine's" if row["proposer_gpu"] == 0 else "a second"
        print(f"| {row['num_seqs']} | {row['gap_ms']:.0f} ms | {rows_cell} | {gpu_cell} | {timing} |")


if __name__ == "__main__":
    main()
