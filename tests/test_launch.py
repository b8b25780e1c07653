"""make run's launcher: the environment it starts Ray with (the app itself is tested through it, in
tests/serving.py)."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from deployments import haproxy, launch


def test_haproxy_pages_move_off_ports_another_app_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_SERVE_HAPROXY_STATS_PORT", raising=False)
    monkeypatch.delenv("RAY_SERVE_HAPROXY_METRICS_PORT", raising=False)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        monkeypatch.setattr(haproxy, "DEFAULT_PORTS", (taken, taken))
        ports = launch._haproxy_ports({})
        assert taken not in ports.values() and not any(launch.listening(port) for port in ports.values())
        assert launch._haproxy_ports({"RAY_SERVE_HAPROXY_STATS_PORT": str(taken)})["stats_port"] == taken


@pytest.mark.skipif(not haproxy.available(), reason="no HAProxy (ray[serve] brings it on Linux)")
def test_haproxy_mode_unless_serve_proxy_is_asked() -> None:
    env, folder = launch.cluster_env()
    try:
        assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
        script = Path(env["RAY_SERVE_HAPROXY_BINARY_PATH"])
        assert script.parent == folder and script.stat().st_mode & 0o111
    finally:
        shutil.rmtree(folder)
    env, folder = launch.cluster_env(serve_proxy=True)
    assert folder is None and env.get("RAY_SERVE_ENABLE_HA_PROXY") != "1"
