"""make run's launcher: the environment it starts Ray with (the app itself is tested through it, in
tests/serving.py)."""

from __future__ import annotations

import re
import shutil
import socket
import stat
from pathlib import Path

import pytest
from tileinfer.deployments.launch import cluster_security, haproxy, launcher


def test_haproxy_pages_move_off_ports_another_app_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_SERVE_HAPROXY_STATS_PORT", raising=False)
    monkeypatch.delenv("RAY_SERVE_HAPROXY_METRICS_PORT", raising=False)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        monkeypatch.setattr(haproxy, "DEFAULT_PORTS", dict.fromkeys(haproxy.DEFAULT_PORTS, taken))
        ports = launcher._haproxy_ports({})
        assert set(ports) == set(haproxy.DEFAULT_PORTS)
        assert taken not in ports.values() and not any(launcher.listening(port) for port in ports.values())
        named = launcher._haproxy_ports({"RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(taken)})
        assert named["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"] == taken


@pytest.mark.skipif(not haproxy.available(), reason="no HAProxy (ray[serve] brings it on Linux)")
def test_haproxy_mode_unless_serve_proxy_is_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))  # not the user's ~/.ray
    env, folder = launcher.cluster_env()
    try:
        assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
        script = Path(env["RAY_SERVE_HAPROXY_BINARY_PATH"])
        assert script.parent == folder and script.stat().st_mode & 0o111
        # HAProxy's files (Ray's default: /tmp/haproxy-serve, shared and left behind) in the private folder
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        files = ("CONFIG_FILE_LOC", "SOCKET_PATH", "METRICS_SOCKET_PATH", "SERVER_STATE_FILE", "LOG_TARGET")
        assert all(Path(env[f"RAY_SERVE_HAPROXY_{name}"]).parent == folder for name in files)
    finally:
        shutil.rmtree(folder)
    env, folder = launcher.cluster_env(serve_proxy=True)
    assert folder is None and env.get("RAY_SERVE_ENABLE_HA_PROXY") != "1"


def test_token_authentication_unless_the_environment_turns_it_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's head and its `serve run` share one token mode: token, with a token file only the
    user can read, made where Ray looks when missing and made private when Ray left it readable to all
    (its `serve run` writes ~/.ray/auth_token so); the environment's own RAY_AUTH_MODE wins."""
    monkeypatch.setenv("HOME", str(tmp_path))
    token = tmp_path / ".ray" / "auth_token"
    assert cluster_security.auth_env({}) == {"RAY_AUTH_MODE": "token"}
    first = token.read_text()
    assert len(first) == 64 and stat.S_IMODE(token.stat().st_mode) == 0o600
    token.chmod(0o644)
    assert cluster_security.auth_env({"RAY_AUTH_MODE": "Token"}) == {"RAY_AUTH_MODE": "token"}
    assert token.read_text() == first and stat.S_IMODE(token.stat().st_mode) == 0o600
    elsewhere = tmp_path / "elsewhere" / "token"
    cluster_security.auth_env({"RAY_AUTH_TOKEN_PATH": str(elsewhere)})
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o600
    token.unlink()
    assert cluster_security.auth_env({"RAY_AUTH_MODE": "disabled"}) == {"RAY_AUTH_MODE": "disabled"}
    assert cluster_security.auth_env({"RAY_AUTH_TOKEN": "x" * 64}) == {"RAY_AUTH_MODE": "token"}
    assert not token.exists()
    token.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        cluster_security.auth_env({})


def test_the_app_refuses_a_cluster_open_to_the_network_without_a_token() -> None:
    """The verdict on the cluster an app is built on: refused when it listens beyond loopback and takes
    callers without a token (or does not say), a warning with a token there or without one on loopback,
    nothing on loopback with a token. The refusal names the ways out."""
    refusal, warning = cluster_security.judge(["192.0.2.2"], wants_token=False)
    assert warning is None and "192.0.2.2" in refusal and "without a token" in refusal
    assert "allow_open_cluster: true" in refusal and cluster_security.LOOPBACK_COMMAND in refusal
    assert cluster_security.judge(["192.0.2.2"], wants_token=None)[0] is not None
    refusal, warning = cluster_security.judge(["192.0.2.2"], wants_token=True)
    assert refusal is None and "192.0.2.2" in warning and cluster_security.LOOPBACK_COMMAND in warning
    refusal, warning = cluster_security.judge([], wants_token=False)
    assert refusal is None and "every user of this machine" in warning
    assert cluster_security.judge([], wants_token=True) == (None, None)
    assert not any(map(cluster_security.is_loopback, ["192.0.2.2", "fd00::2", "0.0.0.0"]))
    assert all(map(cluster_security.is_loopback, ["127.0.0.1", "[::1]", "::ffff:127.0.0.1", "localhost"]))


def test_a_stopped_cluster_is_no_longer_ray_s_latest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After its head stops, Ray's record of the latest cluster no longer names it (a plain `serve run`
    would connect to it for ever); a record of another cluster stays."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    record = tmp_path / "ray" / "ray_current_cluster"
    record.parent.mkdir()
    record.write_text("127.0.0.1:6379")
    launcher.forget_cluster("127.0.0.1:6380")
    assert record.read_text() == "127.0.0.1:6379"
    launcher.forget_cluster("127.0.0.1:6379")
    assert not record.exists()
    launcher.forget_cluster("127.0.0.1:6379")  # nothing to forget


def test_haproxy_starts_with_ray_s_configuration_made_safe(tmp_path: Path) -> None:
    """Ray's own HAProxy configuration, rendered by Ray, as deployments/launch/haproxy.py starts HAProxy with
    it: every bind on an address (Ray binds the stats and Prometheus pages on every interface), the admin
    socket (level admin) its owner's alone (Ray: mode 666), a client's close reaching the ingress (no
    request splicing, abortonclose)."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    http = HTTPOptions(host="127.0.0.1", port=8000)
    files = {"socket_path": "admin.sock", "server_state_file": "state", "metrics_socket_path": "metrics.sock"}
    paths = {key: str(tmp_path / name) for key, name in files.items()}  # not Ray's /tmp/haproxy-serve
    config = HAProxyConfig(http_options=http, server_state_base=str(tmp_path), **paths)
    HAProxyApi(cfg=config, config_file_path=str(tmp_path / "haproxy.cfg"))._generate_config_file_internal()
    ray_config = (tmp_path / "haproxy.cfg").read_text()
    assert "mode 666" in ray_config and re.search(r"bind :\d+", ray_config)  # what Ray writes
    started = haproxy.rewrite(ray_config)
    binds = re.findall(r"^\s*bind\s+(\S+)", started, re.MULTILINE)
    assert binds and all(bind.startswith("127.0.0.1:") for bind in binds)
    assert re.search(r"stats socket \S+ mode 600 level admin", started)
    assert "option abortonclose" in started and "splice-request" not in started
