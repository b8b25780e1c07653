"""The application on a two-GPU host with a DFlash proposer, through Ray Serve and HTTP.

    python bench/serve_two_gpus.py [OUT_DIR] [--max-tokens 48] [--device cpu]

Starts Ray with two GPUs and serves two applications of SmolLM2-135M-Instruct (the GGUF must be in
TILEINFER_CACHE): `plain`, and `dflash`, whose proposer deployment takes a GPU of its own, sees the
engine's GPU too (build_app sets RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES for it) and maps the
engine's buffer of hidden rows as a peer. The DFlash checkpoint has random weights, shaped for
SmolLM2 (tests/random_dflash.py): its drafts are mostly rejected, so this shows placement and
exactness, not speed. Both engines take half of a GPU, so the proposer gets a whole one.

Checks, for each prompt, that greedy chat completions of both applications are the same text, and reads
the dflash application's /metrics: steps with drafts, proposer failures, and whether the rows crossed in
GPU memory. Lists the GPUs each actor's process holds memory on (NVML), where the container lets NVML
see the processes. Writes OUT_DIR/serve_two_gpus.json; exits 1 when a check fails. --device cpu runs
the same on the CPU (a smoke run of the script: the rows cross in host memory there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from bench.bench_spec import CODE_EDIT, OPEN_CHAT  # noqa: E402
from tests.random_dflash import smollm2_135m_config, write_checkpoint  # noqa: E402

PORT = 8000


def _chat(app: str, prompt: str, max_tokens: int) -> str:
    response = httpx.post(
        f"http://127.0.0.1:{PORT}/{app}/v1/chat/completions",
        json={
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
        timeout=300,
    )
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def _spec_metrics(app: str) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{PORT}/{app}/metrics", timeout=30).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tileinfer_spec_"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{", 1)[0].removeprefix("tileinfer_")  # summed over engines (one an app)
            values[name] = values.get(name, 0.0) + float(value)
    return values


def _gpus_by_process() -> dict[int, list[int]]:
    """pid -> indices of the GPUs where it holds memory (NVML; empty where the container hides pids)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - a diagnostic only
        return {}
    held: dict[int, list[int]] = {}
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            held.setdefault(process.pid, []).append(index)
    return held


def _actor_pids() -> dict[str, int]:
    """Class name -> pid of the live engine and proposer actors (from Ray's actor table)."""
    from ray._private.state import actors

    return {
        actor["ActorClassName"]: actor["Pid"]
        for actor in actors().values()
        if actor["State"] == "ALIVE"
        and ("Engine" in actor["ActorClassName"] or "Proposer" in actor["ActorClassName"])
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dtype", default="auto", help="float32: no bf16 near-ties between kernel paths")
    parser.add_argument("--no-ring", action="store_true", help="DFlash's drafts cross in host memory")
    args = parser.parse_args()
    on_gpu = args.device == "cuda"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on a shared host

    import ray
    from ray import serve
    from tileinfer.deployments.app import build_app

    checkpoint = write_checkpoint(Path("/tmp/dflash-random-smollm2"), smollm2_135m_config())
    ray.init(num_gpus=2 if on_gpu else 0, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    base = {
        "model": "smollm2-135m",
        "served_model_name": "smollm2-135m",
        "max_model_len": 2048,
        "kv_cache_tokens": 8192,
        "max_num_seqs": 8,
        "device": args.device,
        "dtype": args.dtype,
    } | ({"engine_num_gpus": 0.5} if on_gpu else {"engine_num_cpus": 0, "proposer_num_cpus": 0})
    serve.run(build_app(base), name="plain", route_prefix="/plain")
    dflash_args = base | {"proposer": "dflash", "draft_model": str(checkpoint), "num_draft": 3}
    dflash_args["draft_ring"] = not args.no_ring
    serve.run(build_app(dflash_args), name="dflash", route_prefix="/dflash")

    prompts = [*OPEN_CHAT[:2], *CODE_EDIT]
    seconds: dict[str, list[float]] = {"plain": [], "dflash": []}

    def timed_chat(app: str, prompt: str) -> str:
        started = time.perf_counter()
        text = _chat(app, prompt, args.max_tokens)
        seconds[app].append(round(time.perf_counter() - started, 3))
        return text

    same = [timed_chat("plain", prompt) == timed_chat("dflash", prompt) for prompt in prompts]
    metrics = _spec_metrics("dflash")
    pids, held = _actor_pids(), _gpus_by_process()
    placement = {name: held.get(pid, []) for name, pid in pids.items()}
    serve.shutdown()
    ray.shutdown()

    report = {"same_text": same, "metrics": metrics, "gpus_held": placement, "seconds": seconds}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_two_gpus.json").write_text(json.dumps(report, indent=2))
    print(f"greedy text equal to plain, per prompt: {same}")
    print(f"dflash metrics: {json.dumps(metrics)}")
    print(f"seconds per request (ring {'off' if args.no_ring else 'on'}): {json.dumps(seconds)}")
    print(f"GPUs each actor's process holds memory on (NVML): {json.dumps(placement)}")
    checks = {
        "outputs equal plain decoding": all(same),
        "drafts were verified": metrics.get("spec_steps_total", 0) > 0,
        "no proposer failures": metrics.get("spec_proposer_failures_total", 1) == 0,
        "rows crossed in GPU memory (on a GPU)": metrics.get("spec_hidden_rows_in_gpu_memory", 0)
        == int(on_gpu),
    }
    for name, passed in checks.items():
        print(f"{'ok  ' if passed else 'FAIL'} {name}")
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
