"""The app under Ray Serve for the serving benches, started and stopped as `make run` starts it.

`serve_and_load` writes a serve config, starts Ray's head on 127.0.0.1 and `serve run` on that config,
waits until /health answers, runs the bench's load against it, and stops that Ray cluster (only that one:
its head runs with --block). The app's environment is make run's (deployments/launch/launcher.py: Ray
Serve's HAProxy mode where ray[serve] brought HAProxy, throughput-optimized), or Ray Serve's own defaults.
A bench names its model as `--model` does: a named shape (tileinfer.engine.models.random_model.SHAPES)
becomes a folder of random weights with the real Qwen3 tokenizer.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from bench.load_client import log

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RAY_PORT = 6390
T = TypeVar("T")


# --- the model and the app's args ---------------------------------------------------------------------


def qwen3_tokenizer_folder() -> Path:
    """The Qwen3 tokenizer the tests fetch once (tests/assets.py), which the named shapes' models take."""
    sys.path.insert(0, str(ROOT / "tests"))
    from assets import qwen3_tokenizer_dir

    return qwen3_tokenizer_dir()


def model_source(name: str, dtype: str) -> str:
    """A named shape (not the real default model) as a folder of random weights with the Qwen3 tokenizer,
    written once under the cache; anything else as given."""
    from tileinfer.engine.models.default_model import DEFAULT_MODEL_ALIAS, cache_dir
    from tileinfer.engine.models.random_model import SHAPES, random_weights

    if name == DEFAULT_MODEL_ALIAS or name not in SHAPES:
        return name
    import torch
    from safetensors.torch import save_file

    spec = SHAPES[name]
    storage = "bfloat16" if dtype in ("auto", "bfloat16") else dtype
    folder = cache_dir() / "bench-models" / f"{name}-random-{storage}"
    if (folder / "model.safetensors").is_file():
        return str(folder)
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    config = {
        "architectures": ["Qwen3ForCausalLM" if spec.family == "qwen3" else "LlamaForCausalLM"],
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings, "bos_token_id": spec.bos_token_id,
        "eos_token_id": list(spec.eos_token_ids),
    }  # fmt: skip
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    weights = random_weights(spec, getattr(torch, storage), "cpu")
    save_file({key: value.contiguous() for key, value in weights.items()}, str(staging / "model.safetensors"))
    for path in qwen3_tokenizer_folder().iterdir():
        shutil.copy(path, staging / path.name)
    staging.rename(folder)
    return str(folder)


def model_spec(model: str) -> Any:
    """The model's ModelSpec, from its config.json or GGUF, without loading weights."""
    from tileinfer.engine.models.loader import resolve_model_source

    source = resolve_model_source(model)
    if source.is_dir():
        from tileinfer.engine.models.shape import ModelSpec

        return ModelSpec.from_config_file(source / "config.json")
    from tileinfer.engine.models.gguf_loader import read_gguf, spec_from_gguf

    return spec_from_gguf(read_gguf(source))


def app_config(serve_config: str | Path | None, app_args: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """The serve config (parsed; default the repository's serve_config.yaml) with `app_args` written into
    its first application's args, and those args as the app parses them (AppArgs)."""
    import yaml
    from tileinfer.deployments.launch.app_args import parse_app_args

    config = yaml.safe_load(Path(serve_config or ROOT / "serve_config.yaml").read_text())
    raw = {**(config["applications"][0].get("args") or {}), **app_args}
    config["applications"] = [{**config["applications"][0], "args": raw}]
    return config, parse_app_args(raw)


def with_app_args(config: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The config with `extra` written into its first application's args."""
    app = config["applications"][0]
    return {**config, "applications": [{**app, "args": {**app["args"], **extra}}]}


def num_gpus(device: str) -> int:
    """The GPUs the engine replicas share: this machine's, where serve run starts its Ray."""
    if device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count()


def serve_setup(app_args: Any, env: Mapping[str, str]) -> dict[str, Any]:
    """What the JSON and the tables say of the served app: its engine replicas (and the GPU share each
    was given; null: the app's default), ingress replicas and router, and Serve's mode, from the
    environment serve run starts with."""
    optimized = env.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1"  # Ray Serve reads "1" as on, else off
    haproxy = env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"
    return {
        "engine_replicas": app_args.num_engine_replicas,
        "engine_num_gpus": app_args.engine_num_gpus,
        "ingress_replicas": app_args.num_ingress_replicas,
        "engine_router": app_args.engine_router,
        "serve_mode": ("throughput-optimized" if optimized else "default") + (", HAProxy" if haproxy else ""),
    }


def describe_serve(serve: dict[str, Any] | None) -> str:
    """The served app's engine replicas, ingress replicas and Serve's mode, in words."""
    if serve is None:
        return "a running server (--url): replicas and Serve's mode its own"
    share = f" at {serve['engine_num_gpus']:.3g} GPU each" if serve["engine_num_gpus"] is not None else ""
    return (
        f"{serve['engine_replicas']} engine replica(s){share}, {serve['ingress_replicas']} ingress "
        f"replica(s), Serve {serve['serve_mode']}"
    )


# --- Ray and serve run ------------------------------------------------------------------------------------


def make_run_env(serve_proxy: bool = False, ray_defaults: bool = False) -> dict[str, str]:
    """The environment `make run` starts Ray with (deployments/launch/launcher.py: HAProxy mode where HAProxy
    is here, unless serve_proxy), with the project first on the path and then the caller's (the GPU
    machine's wheels: Ray); HAProxy's script folder goes when this process exits. ray_defaults: Ray
    Serve's own settings instead, as a plain `serve run serve_config.yaml` gets them (Serve's proxy, its
    default mode, logs on stderr), on loopback and with make run's token mode."""
    from tileinfer.deployments.launch import cluster_security
    from tileinfer.deployments.launch.launcher import RAY_ENV, cluster_env

    if ray_defaults:
        env = {**os.environ, **RAY_ENV, **cluster_security.auth_env(os.environ)}
    else:
        env, haproxy_dir = cluster_env(serve_proxy)
        if haproxy_dir is not None:
            atexit.register(shutil.rmtree, haproxy_dir, True)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    return env


def _ray_cli(name: str) -> list[str]:
    """`ray` / `serve`, or their modules where the console scripts are missing (the GPU machine)."""
    script = Path(sys.executable).parent / name
    module = {"ray": "ray.scripts.scripts", "serve": "ray.serve.scripts"}[name]
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def start_serve(
    config_path: Path, env: dict[str, str], log_path: Path, ray_port: int, http_port: int
) -> list[subprocess.Popen]:
    """Ray's head on 127.0.0.1 (--block: stopping that process stops this cluster only, where `ray stop`
    would stop every cluster on a shared machine), then `serve run`; both processes, head first. Refuses
    when something listens on either port already: a run cut short can leave its app serving there, and
    the load would then measure that one."""
    from tileinfer.deployments.launch.launcher import listening

    for port in (ray_port, http_port):
        if listening(port):
            raise RuntimeError(f"port {port} on 127.0.0.1 is in use already (an earlier run's app?)")
    with log_path.open("w") as log_file:
        head = subprocess.Popen(
            [*_ray_cli("ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
             f"--port={ray_port}", "--disable-usage-stats", "--include-dashboard=false"],
            env=env, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", ray_port), timeout=1).close()
            break
        except OSError:
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start failed:\n{log_path.read_text()[-3000:]}") from None
            time.sleep(0.5)
    with log_path.open("a") as log_file:
        serve = subprocess.Popen(
            [*_ray_cli("serve"), "run", "--address", f"127.0.0.1:{ray_port}", str(config_path)],
            env=env, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return [head, serve]


def stop_serve(processes: list[subprocess.Popen]) -> None:
    for process in reversed(processes):  # serve run, then the head (it stops its cluster's processes)
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def wait_healthy(base_url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Until the app's /health answers 200; RuntimeError with the log's end when serve run exits first or
    timeout_s passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"serve run exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(
        f"the application did not become healthy in {timeout_s:.0f} s:\n{log_path.read_text()[-3000:]}"
    )


def serve_and_load(
    config: dict[str, Any],
    config_path: Path,
    log_path: Path,
    env: dict[str, str],
    load: Callable[[str], T] | None,
    ray_port: int = DEFAULT_RAY_PORT,
    health_timeout_s: float = 900,
) -> tuple[T | None, float]:
    """Write the config, serve run it, wait until it is healthy, run load(base_url) (None: only time the
    start), stop it; what load returned, and the seconds to a healthy app."""
    import yaml

    config_path.write_text(yaml.safe_dump(config))
    http = config.get("http_options") or {}
    http_port = int(http.get("port", 8000))
    base_url = f"http://{http.get('host', '127.0.0.1')}:{http_port}"
    base_url += (config["applications"][0].get("route_prefix") or "/").rstrip("/")
    started = time.monotonic()
    processes = start_serve(config_path, env, log_path, ray_port, http_port)
    try:
        wait_healthy(base_url, processes[1], log_path, health_timeout_s)
        ready_s = time.monotonic() - started
        log(f"serve run ({config_path.name}) ready in {ready_s:.1f} s")
        return (load(base_url) if load is not None else None), ready_s
    finally:
        stop_serve(processes)


def serve_and_record(
    name: str, args: Any, config: dict[str, Any], out: Path, load: Callable[[str], T]
) -> dict[str, Any]:
    """serve_and_load under make run's environment, its config and log at out/<name>_config.yaml and
    out/<name>_serve.log; the bench's args, the seconds to a healthy app and what load returned are
    written to out/<name>.json and returned."""
    result, ready_s = serve_and_load(
        config, out / f"{name}_config.yaml", out / f"{name}_serve.log", make_run_env(), load
    )
    payload = {"args": vars(args), "ready_s": ready_s, "result": result}
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2))
    return payload


def served_model(base_url: str) -> str:
    """The name the server serves its model under (its /v1/models' first)."""
    import httpx

    return httpx.get(base_url.rstrip("/") + "/v1/models", timeout=60).json()["data"][0]["id"]


def exit_on_sigterm() -> None:
    """`timeout` stops a run with SIGTERM: exit through the finally blocks, which stop the app."""
    import signal

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
