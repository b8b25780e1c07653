"""What `make run` runs: Ray's head on 127.0.0.1, then `serve run serve_config.yaml`, and on Ctrl-C or
SIGTERM a stop that leaves nothing running.

Ray's token authentication is decided here once, for the head and for `serve run` alike
(deployments/launch/cluster_security.py): on, with a token only the user can read (~/.ray/auth_token, made
when missing), unless RAY_AUTH_MODE says otherwise; beside a cluster that runs already, whatever that cluster
asks for. Once the head has stopped, Ray's record of the latest cluster (ray_current_cluster, which a
plain `serve run` or `ray.init()` would connect to) no longer names it.

`serve run` shuts its app down on Ctrl-C only; a SIGTERM ends it and leaves the app serving in the Ray
cluster (Ray Serve's behaviour: the app belongs to the cluster). So this launcher hands either signal
to `serve run` as SIGINT, waits for it, then stops the Ray head it started. The head runs with --block
as a child process: stopping it stops this cluster only, where `ray stop` stops every Ray cluster on the
machine. When a Ray cluster already runs here (its GCS on the given port), `serve run` serves on it and
this launcher leaves it running. The head starts without Ray's dashboard (it can submit jobs).

The head it starts runs Ray Serve's HAProxy mode, HAProxy's own pages on 127.0.0.1 too
(deployments/launch/haproxy.py), where ray[serve] brought HAProxy (Linux); --serve-proxy (`make run
SERVE_PROXY=1`) keeps Serve's Python proxy instead.

    python -m tileinfer.deployments.launch.launcher [serve_config.yaml] [--ray-port 6379] [--serve-proxy]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

from tileinfer.deployments.launch import cluster_security, haproxy

RAY_ENV = {  # this machine's address is 127.0.0.1 (README, Security); no usage reports
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # the Ray Client proxy forks a server per connection; with gRPC's fork handlers on, the child once
    # segfaulted in gRPC's event engine before exec
    "GRPC_ENABLE_FORK_SUPPORT": "0",
}
# Ray Serve's throughput-optimized mode (Ray 2.60): gRPC from the HTTP proxy to the replicas and between
# deployments, user code on each replica's event loop, the GC frozen after start.
# Without it the one HTTP proxy capped streaming at about 5,000 tokens a second (BENCHMARKS.md,
# Serve-load). Its direct ingress is HAProxy mode's (deployments/launch/haproxy.py), off without it. Serve's
# replica and request logs go to files only (the mode's choice; on stderr they cost 7-20 % of the
# throughput at 8 to 256 clients), written as they come rather than 1,000 at a time, so that a
# warning shows when it happens. A variable already set in the environment wins.
SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_LOG_TO_STDERR": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
}
STOP_TIMEOUT_S = 60.0


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:port."""
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _bin(name: str) -> str:
    """The `ray` / `serve` script beside this Python (the virtual environment's)."""
    return str(Path(sys.executable).parent / name)


def _stop(process: subprocess.Popen, first: int) -> None:
    """Send `first`, then SIGKILL if it has not exited within STOP_TIMEOUT_S."""
    if process.poll() is None:
        process.send_signal(first)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", nargs="?", default="serve_config.yaml")
    parser.add_argument("--ray-port", type=int, default=6379, help="the Ray head's GCS port")
    parser.add_argument("--ray-client-server-port", type=int, default=10001, help="Ray Client's server")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs the head offers (default: all)")
    parser.add_argument("--serve-proxy", action="store_true", help="Serve's Python proxy, not HAProxy")
    args = parser.parse_args(argv)
    haproxy_dir: Path | None = None
    address = f"127.0.0.1:{args.ray_port}"
    head: subprocess.Popen | None = None  # the Ray head, when started here
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if serve is not None and serve.poll() is None:
            serve.send_signal(signal.SIGINT)  # `serve run` shuts its app down on SIGINT only

    # Before the children start: a process started in the background can inherit SIGINT ignored, and
    # would pass that on; with a handler here, they start with the default one.
    serve: subprocess.Popen | None = None
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        if listening(args.ray_port):
            print(f"a Ray cluster runs on {address} already: serving on it", flush=True)
            env = {**_settings_env(), **_client_auth_env(address)}
        else:
            env, haproxy_dir = cluster_env(args.serve_proxy)
            # each child in a session of its own: a terminal's Ctrl-C reaches this launcher only, which
            # stops them in order (the app, then the cluster), where all at once the head went first
            head = subprocess.Popen(
                [_bin("ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                 f"--port={args.ray_port}", f"--ray-client-server-port={args.ray_client_server_port}",
                 *([f"--num-cpus={args.num_cpus}"] if args.num_cpus is not None else []),
                 "--disable-usage-stats", "--include-dashboard=false"],
                env=env, start_new_session=True,
            )  # fmt: skip
            while not listening(args.ray_port):
                if head.poll() is not None:
                    print(f"ray start failed (exit {head.returncode})", file=sys.stderr)
                    return 1
                if stopping:
                    return 0
                time.sleep(0.5)
        if stopping:
            return 0
        serve = subprocess.Popen(
            [_bin("serve"), "run", "--address", address, args.config],
            env=env, start_new_session=True,
        )  # fmt: skip
        code = serve.wait()
    finally:
        if serve is not None:
            _stop(serve, signal.SIGINT)
        if head is not None:
            _stop(head, signal.SIGTERM)  # `ray start --block` stops its cluster's processes on SIGTERM
            forget_cluster(address)
        if haproxy_dir is not None:
            shutil.rmtree(haproxy_dir, ignore_errors=True)
    return 0 if stopping else code


def cluster_env(serve_proxy: bool = False) -> tuple[dict[str, str], Path | None]:
    """The environment a Ray head starts with to serve as `make run` does, and the folder of HAProxy's
    script (remove it once that cluster stops; None in Serve's proxy mode)."""
    env = {**_settings_env(), **cluster_security.auth_env(os.environ)}
    if serve_proxy or not haproxy.available():
        if not serve_proxy:
            print("no HAProxy here (ray[serve] brings it on Linux): Serve's proxy serves", flush=True)
        return env, None
    haproxy_dir = Path(tempfile.mkdtemp(prefix="ti-haproxy-"))  # short: Ray puts sockets 70 bytes below it
    haproxy_env = haproxy.serve_env(haproxy_dir, _haproxy_ports(os.environ))
    return {**env, **haproxy_env, **RAY_ENV}, haproxy_dir


def _settings_env() -> dict[str, str]:
    """Serve's settings under this environment's, and Ray's on top (also what `serve run` gets beside a
    cluster that was running already)."""
    return {**SERVE_ENV, **os.environ, **RAY_ENV}


def _client_auth_env(address: str) -> dict[str, str]:
    """The token mode of a client of the cluster at `address`: the one the cluster asks for."""
    wants_token = cluster_security.requires_token(address)
    return {cluster_security.AUTH_MODE: "token" if wants_token else "disabled"}


def forget_cluster(address: str) -> None:
    """Remove Ray's record of the latest cluster started on this machine when it names `address`, a
    cluster that has stopped: `ray start --block` leaves it behind when stopped by a signal, and a plain
    `serve run` would then try to connect to it for ever rather than start its own."""
    from ray._common.utils import get_ray_address_file

    record = Path(get_ray_address_file(None))
    try:
        if record.read_text().strip() == address:
            record.unlink()
    except FileNotFoundError:
        pass


def _haproxy_ports(env: Mapping[str, str]) -> dict[str, int]:
    """HAProxy mode's fixed ports (haproxy.DEFAULT_PORTS), by variable: those the environment names, else
    Ray's where free, else free ones (another app on this machine holds Ray's: HAProxy, or Serve's proxy
    beside it, would not start)."""
    ports = {}
    for variable, default in haproxy.DEFAULT_PORTS.items():
        if variable in env:
            ports[variable] = int(env[variable])
        elif not listening(default):
            ports[variable] = default
        else:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                ports[variable] = probe.getsockname()[1]
            print(f"{variable}: {ports[variable]} ({default} is taken)", flush=True)
    return ports


if __name__ == "__main__":
    sys.exit(main())
