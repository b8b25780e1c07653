"""Where the draft-model proposer runs: in a process of its own on the engine's GPU, or on a
second GPU; its drafts crossing in host memory or in the draft ring (proposers/draft_ring.py); with or
without drafting ahead; each beside plain decoding in the same run.

    python bench/bench_placement.py [OUT_DIR] [--draft-layers 15,30] [--max-tokens 256] [--device cpu]
        [--placements WORDS] [--dflash]

The engine runs in this process on GPU 0 (SmolLM2-135M-Instruct, greedy, bf16). The proposer, a
self-draft of the target's first N layers, runs in a spawned process that attaches to the engine's
shared-memory channel (as the proposer actor does under Serve) on GPU 0 ("one GPU") or GPU 1 ("two
GPUs"; the process sees both GPUs, as the actor does, so that it maps the engine's ring as a peer);
with draft-ahead it drafts the next block while the engine verifies. "host drafts": the engine's host
waits for the drafts and sends them with the step; "ring": it launches the verify step at once, and the
GPU waits for the proposer's drafts in the ring. Every placement asks for
drafts at every step (NUM_DRAFT, the speculator not adaptive), so that only the placement differs. Uses
bench_spec's prompt sets. Needs two GPUs for the two-GPU rows (they are skipped on one); --device cpu
runs the proposer in its own process on the CPU (a smoke run). --dflash: the proposer is DFlash with a
random SmolLM2-shaped checkpoint (tests/random_dflash.py; its drafts are rejected, so it measures the
path, not a speed-up), and the engine runs every step eagerly, capturing hidden states. Each row also
gives the median times of the latest plain and verify steps and how long the host waited for ring drafts.
Writes OUT_DIR/bench_placement*.json and prints one table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tileinfer.engine.config import EngineConfig  # noqa: E402
from tileinfer.engine.engine import Engine  # noqa: E402
from tileinfer.engine.models.default_model import default_model_path  # noqa: E402
from tileinfer.engine.models.loader import load_model  # noqa: E402
from tileinfer.proposers.remote import ProposerServer, RemoteProposer, hidden_layout  # noqa: E402

from bench.bench_spec import CODE_EDIT, OPEN_CHAT, run_set  # noqa: E402
from tests.random_dflash import smollm2_135m_config, write_checkpoint  # noqa: E402

CONTEXT = multiprocessing.get_context("spawn")
NUM_DRAFT = 6


def _serve(
    config: EngineConfig,
    gpu: int | None,
    draft_ahead: bool,
    channel_names: multiprocessing.Queue,
    attached: multiprocessing.Queue,
    stats: multiprocessing.Queue,
) -> None:
    """(attached first gets the proposer's hidden-state layout, then one True per channel served.)"""
    """The proposer process: a self-draft on this process's GPU, serving each channel that arrives."""
    from tileinfer.deployments.replicas.proposer_build import build_proposer

    def on_gpu(serve: Callable[[], None]) -> None:  # the current GPU is per thread
        if gpu is not None:
            torch.cuda.set_device(gpu)
        serve()

    if gpu is not None:
        torch.cuda.set_device(gpu)
    target = load_model(str(default_model_path()), dtype=config.torch_dtype(), device=config.torch_device())
    proposer = build_proposer(config, target)
    attached.put(hidden_layout(proposer))
    lock = threading.Lock()
    while (name := channel_names.get()) is not None:
        server = ProposerServer(proposer, name, lock, draft_ahead=draft_ahead)
        threading.Thread(target=on_gpu, args=(server.serve,), daemon=True).start()
        attached.put(True)
    stats.put(vars(proposer.ahead_stats))


@contextlib.contextmanager
def remote_proposer(
    config: EngineConfig, gpu: int | None, draft_ahead: bool, use_ring: bool
) -> Iterator[tuple[RemoteProposer, dict]]:
    """A proposer process on GPU `gpu` (None: as this process's device) and the RemoteProposer attached
    to it; on exit, the dict holds the proposer's drafting-ahead counts."""
    channel_names, attached, stats = CONTEXT.Queue(), CONTEXT.Queue(), CONTEXT.Queue()
    process = CONTEXT.Process(target=_serve, args=(config, gpu, draft_ahead, channel_names, attached, stats))
    process.start()

    def connect(name: str) -> None:
        channel_names.put(name)
        attached.get(timeout=300)

    layout = attached.get(timeout=600)
    remote = RemoteProposer(
        connect, timeout_s=5.0, connect_timeout_s=300, device=config.torch_device(), use_ring=use_ring,
        hidden=layout if layout.width else None,
    )  # fmt: skip
    counts: dict = {}
    try:
        if not remote.wait_attached(300):
            raise RuntimeError("the proposer process did not attach")
        yield remote, counts
    finally:
        remote.close()
        channel_names.put(None)
        with contextlib.suppress(Exception):
            counts.update(stats.get(timeout=30))
        process.join(timeout=30)
        if process.is_alive():
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--draft-layers", default="15,30", help="self-drafts: the target's first N layers")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--placements", default="", help="comma-separated words a placement's name must hold")
    parser.add_argument("--dflash", action="store_true", help="a random DFlash drafter, not self-drafts")
    args = parser.parse_args()
    num_gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    base = EngineConfig(device=args.device, dtype=dtype, max_model_len=4096, kv_cache_tokens=16384)
    model = load_model(str(default_model_path()), dtype=base.torch_dtype(), device=args.device)
    tokenizer = model.tokenizer
    sets = {
        "open chat": [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in OPEN_CHAT],
        "code edit": [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in CODE_EDIT],
    }
    plain_engine = Engine(model, base)
    placements: list[tuple[str, int | None, bool, bool]] = [  # name, GPU, draft ahead, ring
        ("one GPU, host drafts", 0, False, False), ("one GPU, ring", 0, False, True),
        ("two GPUs, host drafts", 1, False, False), ("two GPUs, ring", 1, False, True),
        ("two GPUs, ring, draft ahead", 1, True, True),
    ]  # fmt: skip
    if args.device == "cpu":
        placements = [
            ("own process, host drafts", None, False, False), ("own process, ring", None, False, True)
        ]  # fmt: skip
    for word in filter(None, args.placements.split(",")):
        placements = [placement for placement in placements if word in placement[0]]
    rows = []
    proposers = [{"proposer": "draft", "draft_layers": int(n)} for n in args.draft_layers.split(",")]
    if args.dflash:
        checkpoint = write_checkpoint(Path(args.out) / "dflash-random", smollm2_135m_config())
        proposers = [{"proposer": "dflash", "draft_model": str(checkpoint)}]
    for settings in proposers:
        layers = settings.get("draft_layers", "dflash")
        proposer_config = EngineConfig(**{**vars(base), **settings})
        for placement, gpu, draft_ahead, use_ring in placements:
            if gpu is not None and gpu >= num_gpus:
                print(f"skipped: {placement} needs {gpu + 1} GPUs, this machine has {num_gpus}")
                continue
            with remote_proposer(proposer_config, gpu, draft_ahead, use_ring) as (remote, ahead):
                # every placement asks for NUM_DRAFT drafts at every step: the placement is what differs
                config = EngineConfig(**{**vars(base), "num_draft": NUM_DRAFT})
                engine = Engine(model, config, proposer=remote)
                engine.speculator.adaptive = False
                for set_name, prompts in sets.items():
                    run_set(plain_engine, prompts[:1], 16)  # warm-up (compiles, captures)
                    run_set(engine, prompts[:1], 16)
                    plain = run_set(plain_engine, prompts, args.max_tokens)
                    spec = run_set(engine, prompts, args.max_tokens)
                    rows.append({
                        "prompts": set_name, "draft_layers": layers, "placement": placement,
                        "tau": spec["tokens"] / spec["steps"],
                        "plain_tok_s": plain["tokens"] / plain["seconds"],
                        "spec_tok_s": spec["tokens"] / spec["seconds"],
                        "speedup": plain["seconds"] / spec["seconds"],
                        "same_output": spec["outputs"] == plain["outputs"],
                        "ring_steps": engine.speculator.stats.ring_steps,
                        "ring_wait_s": engine.speculator.stats.ring_wait_seconds,
                        "proposer_failures": engine.speculator.stats.proposer_failures,
                        "plain_step_ms": 1e3 * (engine.speculator.median_step_seconds(False) or 0),
                        "verify_step_ms": 1e3 * (engine.speculator.median_step_seconds(True) or 0),
                    })  # fmt: skip
                    print(json.dumps(rows[-1]), flush=True)
                del engine
            for row in rows:
                if row["placement"] == placement and row["draft_layers"] == layers:
                    row["ahead"] = ahead  # drafts made ahead and reused, over both prompt sets
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    words = [word.replace(" ", "_") for word in args.placements.split(",") if word]
    name = "_".join(["bench_placement", *words])
    (out / f"{name}.json").write_text(json.dumps({"gpus": num_gpus, "rows": rows}, indent=2))
    drafter = "a random DFlash drafter" if args.dflash else "self-draft"
    print(f"\nproposer placement, SmolLM2-135M, {drafter}, greedy, {args.max_tokens} tokens a prompt")
    print("(drafts made ahead / reused: over both prompt sets of that placement; step times: the medians of")
    print("the latest plain and verify steps; ring wait: the host's, over both prompt sets)")
    print(
        "| prompts | drafter | placement | tau | plain tok/s | spec tok/s | speedup | same "
        "| plain / verify step | ring wait | drafts made ahead / reused |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for row in rows:
        ahead = row.get("ahead", {})
        print(
            f"| {row['prompts']} | {row['draft_layers']} | {row['placement']} | {row['tau']:.2f} | "
            f"{row['plain_tok_s']:.0f} | {row['spec_tok_s']:.0f} | {row['speedup']:.2f}x | "
            f"{'yes' if row['same_output'] else 'no'} | "
            f"{row['plain_step_ms']:.2f} / {row['verify_step_ms']:.2f} ms | {row['ring_wait_s']:.3f} s | "
            f"{ahead.get('drafts_made', '-')} / {ahead.get('drafts_reused', '-')} |"
        )


if __name__ == "__main__":
    main()
