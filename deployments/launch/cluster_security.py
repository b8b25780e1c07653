"""Ray's own guard: its token authentication, and where the cluster listens.

Whoever reaches a Ray cluster's ports can run code on it. Ray 2.60 guards them with a token when
RAY_AUTH_MODE=token (read from RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token),
and keeps them on loopback only when the node's address is 127.0.0.1 (`ray start --node-ip-address=
127.0.0.1`, or RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 for a cluster that `serve run` or `ray.init()` starts);
otherwise it listens on every interface.

- `make run`'s launcher decides the token mode once, for its Ray head and for every client it starts
  (`auth_env`): token authentication unless the environment says otherwise, with a token only the user
  can read. A head and a client that decided apart would disagree whenever a token file exists (Ray turns
  token mode on for `ray start` when it finds one, but not for a client given an explicit address).
- The app checks the cluster it is built on (`check_cluster`, from deployments/app.py): it refuses a
  cluster that listens beyond loopback with no token unless the args say `allow_open_cluster: true`, and
  logs a warning for one that listens beyond loopback with a token, or on loopback with none. Whether the
  cluster wants a token is asked of the cluster itself (its GCS refuses a call without one), not read
  from this process's settings, which may differ from the cluster's.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

AUTH_MODE = "RAY_AUTH_MODE"
TOKEN = "RAY_AUTH_TOKEN"
TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
PROBE_TIMEOUT_S = 5.0
LOOPBACK_COMMAND = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 serve run serve_config.yaml"


def token_file(environ: Mapping[str, str]) -> Path:
    """Where Ray reads its token from: RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token."""
    return Path(environ.get(TOKEN_PATH) or Path.home() / ".ray" / "auth_token")


def auth_env(environ: Mapping[str, str]) -> dict[str, str]:
    """RAY_AUTH_MODE for a Ray head and every client of it: the environment's own choice where it makes
    one, else token. In token mode without RAY_AUTH_TOKEN, the token file is made (mode 0600, a random
    256-bit token, as Ray's own) when missing, and made private to the user when others can read it."""
    mode = environ.get(AUTH_MODE, "").strip().lower() or "token"
    if mode == "token" and not environ.get(TOKEN):
        private_token(token_file(environ))
    return {AUTH_MODE: mode}


def private_token(path: Path) -> None:
    """A token in `path`, readable by its owner only."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            path.chmod(0o600)
            print(f"Ray's token file {path} was readable by others (mode {mode:o}): now 600", flush=True)
        if not path.read_text().strip():
            raise ValueError(f"Ray's token file {path} is empty: remove it, or write a token in it") from None
        return
    with os.fdopen(descriptor, "w") as file:
        file.write(secrets.token_hex(32))
    print(f"Ray's token authentication: a new token in {path} (mode 600)", flush=True)


def requires_token(gcs_address: str) -> bool | None:
    """Whether the cluster whose GCS is at `gcs_address` refuses a caller without Ray's token: a call
    with no token is made and its answer read. None when the GCS does not answer."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs_address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                return True
            return None
    return False


def is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host == "localhost"
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def open_addresses() -> list[str]:
    """The connected cluster's node addresses (and its GCS's) that are not loopback: Ray's servers listen
    on every interface of such a node."""
    import ray

    hosts = {ray.get_runtime_context().gcs_address.rpartition(":")[0]}
    hosts |= {node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")}
    return sorted(host for host in hosts if not is_loopback(host))


def check_cluster(allow_open_cluster: bool) -> None:
    """Refuse to serve on a Ray cluster that listens beyond loopback and takes callers without a token,
    unless allowed; warn where the cluster is reachable beyond this user. Call it connected to Ray."""
    import ray

    addresses = open_addresses()
    refusal, warning = judge(addresses, requires_token(ray.get_runtime_context().gcs_address))
    if refusal is not None and not allow_open_cluster:
        raise ValueError(refusal)
    if refusal is not None:
        logger.warning("%s (allow_open_cluster: true)", refusal)
    elif warning is not None:
        logger.warning("%s", warning)


def judge(open_addresses: list[str], wants_token: bool | None) -> tuple[str | None, str | None]:
    """(why to refuse, or None; else what to warn of, or None) for a cluster listening on these addresses
    beyond loopback, that asks for a token (True), does not (False), or did not answer (None)."""
    if open_addresses:
        where = f"The Ray cluster listens on {', '.join(open_addresses)} (every interface)"
        if wants_token:
            return None, (
                f"{where}, guarded by its token: whoever holds the token (Ray's token file) can run code on "
                f"it. On one machine, `{LOOPBACK_COMMAND}` or `make run` keeps it on loopback."
            )
        answer = "takes callers without a token" if wants_token is False else "did not say if it wants one"
        return (
            f"{where} and {answer}: anyone who can reach it may run code on it. Start it with token "
            "authentication (RAY_AUTH_MODE=token for `ray start` and every client, the token in "
            f"~/.ray/auth_token or RAY_AUTH_TOKEN_PATH), or on loopback (`{LOOPBACK_COMMAND}`, or `make "
            "run`); or, if its network is closed to others, set `allow_open_cluster: true` in the app's args."
        ), None
    if wants_token is False:
        return None, (
            "The Ray cluster takes callers without a token (RAY_AUTH_MODE=disabled): every user of this "
            "machine can run code on it. `make run` starts it with token authentication."
        )
    return None, None
