"""Starts the real application for the tests: Ray on 127.0.0.1, then `serve run` on a copy of
serve_config.yaml, plus a second, guarded application (API key, a tiny queue, a small body limit), a
third, speculative one (an n-gram proposer in its own actor) and a fourth with a DFlash proposer (a
random checkpoint shaped for SmolLM2: it drafts badly, but its drafts cross and are verified).

Ray runs as `make run` runs it on a machine where Ray's own `serve run` has run before: a token file
written as Ray writes it (readable by all) and RAY_AUTH_MODE unset, so the launcher must decide token
authentication for its head and its `serve run` alike. Ray's files live in a folder of the run's own
(RAY_TMPDIR, the token through RAY_AUTH_TOKEN_PATH), removed at the end: the suite leaves no Ray state
on the machine."""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml
from random_dflash import smollm2_135m_config, write_checkpoint
from tileinfer.deployments.launch.launcher import listening

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
API_KEY = "test-key"
GUARDED_ARGS = {  # its key comes from a file (api_key_file, written at start): Serve logs the args
    "max_num_seqs": 1,
    "max_queue_len": 1,
    "max_request_bytes": 4096,
    "max_model_len": 512,
    "kv_cache_tokens": 1024,
    "engine_num_cpus": 0,
}
SPECULATIVE_ARGS = {
    "proposer": "ngram",
    "num_draft": 4,
    "proposer_num_cpus": 0,
    "max_model_len": 2048,
    "kv_cache_tokens": 4096,
}

DFLASH_ARGS = {**SPECULATIVE_ARGS, "proposer": "dflash", "num_draft": 3}  # draft_model: written at start


@dataclasses.dataclass
class Served:
    base_url: str  # the main application, at /
    guarded_url: str  # the guarded one, at /guarded
    speculative_url: str  # the speculative one, at /speculative
    dflash_url: str  # the DFlash one, at /dflash
    ray_address: str
    ray_client_address: str  # ray://..., the cluster's Ray Client server
    model: str
    env: dict[str, str]  # a Ray client's, token authentication included
    log: Path
    ray_dir: Path  # Ray's session folders (RAY_TMPDIR/ray)
    ray_token: str


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(urls: list[str], process: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        if process.poll() is not None:
            raise RuntimeError(f"serve run exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the application did not become healthy:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(pending[0] + "/health", timeout=5).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        time.sleep(1)


def ray_env(ray_tmpdir: Path) -> dict[str, str]:
    """This process's environment with Ray's files in `ray_tmpdir` (short: Ray's socket paths must fit in
    107 bytes), its token in a file there, written as Ray writes one (readable by all), and no
    RAY_AUTH_MODE: whoever starts Ray must decide it."""
    token_path = ray_tmpdir / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    token_path.chmod(0o644)
    env = {name: value for name, value in os.environ.items() if not name.startswith("RAY_AUTH")}
    return {**env, "RAY_TMPDIR": str(ray_tmpdir), "RAY_AUTH_TOKEN_PATH": str(token_path)}


def serve_application(workdir: Path) -> Iterator[Served]:
    ray_port, http_port, client_port = _free_port(), _free_port(), _free_port()
    ray_tmpdir = Path(tempfile.mkdtemp(prefix="ti-ray-", dir="/tmp"))
    env = {
        **ray_env(ray_tmpdir),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # makes Ray take 127.0.0.1 as this node's address
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        # a Ray Client connection starts a server process; on a busy two-core machine (four apps and two
        # proposer actors) that has taken more than Ray's default 30 s
        "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S": "180",
        # the Ray Client proxy forks a server per connection; with gRPC's fork handlers on, the child
        # once segfaulted in gRPC's event engine before exec (seen in dmesg in a CI run)
        "GRPC_ENABLE_FORK_SUPPORT": "0",
    }
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = http_port
    main_app = config["applications"][0]
    main_app["args"]["engine_num_cpus"] = 0  # four engines on a two-core machine
    guarded = {**main_app, "name": "guarded", "route_prefix": "/guarded"}
    key_file = workdir / "api-key"
    key_file.write_text(API_KEY + "\n")
    guarded["args"] = {**main_app["args"], **GUARDED_ARGS, "api_key_file": str(key_file)}
    speculative = {**main_app, "name": "speculative", "route_prefix": "/speculative"}
    speculative["args"] = {**main_app["args"], **SPECULATIVE_ARGS}
    dflash = {**main_app, "name": "dflash", "route_prefix": "/dflash"}
    checkpoint = write_checkpoint(workdir / "dflash-checkpoint", smollm2_135m_config())
    dflash["args"] = {**main_app["args"], **DFLASH_ARGS, "draft_model": str(checkpoint)}
    config["applications"] += [guarded, speculative, dflash]
    config_path = workdir / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log = workdir / "serve.log"
    ray_address = f"127.0.0.1:{ray_port}"
    with log.open("w") as log_file:  # what `make run` runs: Ray's head, then `serve run`
        process = subprocess.Popen(
            [sys.executable, "-m", "tileinfer.deployments.launch.launcher", str(config_path),
             f"--ray-port={ray_port}", f"--ray-client-server-port={client_port}", "--num-cpus=2"],
            env=env, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
    base_url = f"http://127.0.0.1:{http_port}"
    token_path = Path(env["RAY_AUTH_TOKEN_PATH"])
    try:
        app_urls = tuple(base_url + route for route in ("", "/guarded", "/speculative", "/dflash"))
        _wait_healthy(list(app_urls), process, log)
        assert stat.S_IMODE(token_path.stat().st_mode) == 0o600  # the launcher made it the user's alone
        client_address = f"ray://127.0.0.1:{client_port}"
        model = main_app["args"]["served_model_name"]
        client_env = {**env, "RAY_AUTH_MODE": "token"}
        token = token_path.read_text()
        ray_dir = ray_tmpdir / "ray"
        yield Served(*app_urls, ray_address, client_address, model, client_env, log, ray_dir, token)
    finally:
        try:
            _stop_and_check(process, env, log, (ray_port, http_port, client_port))
            _check_cluster_forgotten(ray_tmpdir / "ray", ray_address)
        finally:
            shutil.rmtree(ray_tmpdir, ignore_errors=True)


def _kill_cluster(ray_tmpdir: str) -> None:
    """SIGKILL what is left of this run's Ray: the processes whose environment names its RAY_TMPDIR (`ray stop
    --force` would stop every Ray cluster on the machine)."""
    marker = f"RAY_TMPDIR={ray_tmpdir}".encode()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:  # gone, or another user's
            continue


def _check_cluster_forgotten(ray_dir: Path, ray_address: str) -> None:
    """Ray's record of the latest cluster (what a plain `serve run` or `ray.init()` connects to) does not
    name the stopped one: `serve run serve_config.yaml` then starts a Ray of its own, as on a fresh
    machine, where it once tried the stopped cluster's address for ever."""
    record = ray_dir / "ray_current_cluster"
    named = record.read_text().strip() if record.exists() else None
    assert named != ray_address, f"{record} still names the stopped cluster {ray_address}"


def _stop_and_check(
    process: subprocess.Popen, env: dict[str, str], log: Path, ports: tuple[int, ...]
) -> None:
    """`make run`'s stop path, tested at the end of every run: a SIGTERM to the launcher stops the app and
    the Ray it started, so nothing listens on their ports afterwards (an error at this fixture's teardown
    says otherwise; what was left of this cluster is then killed)."""
    process.terminate()
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
    deadline = time.monotonic() + 30  # the workers exit once they see their raylet gone
    while (left := [port for port in ports if listening(port)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left or process.returncode != 0:
        _kill_cluster(env["RAY_TMPDIR"])
        raise AssertionError(
            f"after SIGTERM the launcher exited with {process.returncode} and ports {left} still listened:\n"
            + log.read_text()[-3000:]
        )
