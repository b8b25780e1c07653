"""Keeps each Serve replica's inter-deployment gRPC server off the wildcard address.

Ray 2.60 starts, in every Serve replica, a gRPC server for calls between deployments on `[::]:0`: every
interface, plaintext unless the cluster runs with RAY_USE_TLS, and it unpickles what it receives. This
app's handles do not use it (Ray actor calls carry them, unless RAY_SERVE_USE_GRPC_BY_DEFAULT=1), and Ray
offers no setting for its address. So the deployments' modules bind it to the node's own address: the
one Ray advertises for this node, 127.0.0.1 under `make run`, the node's IP on a multi-node cluster, where
other nodes can still reach it.
"""

from __future__ import annotations

from typing import Any

WILDCARD = "[::]:"


def node_host() -> str:
    import ray

    host = ray.util.get_node_ip_address()
    return f"[{host}]" if ":" in host else host


def bind_replica_grpc_to_node_address() -> None:
    """Patch Serve's replica module once per process, before any replica there starts its server."""
    try:
        from ray.serve._private import replica
    except ModuleNotFoundError as error:
        if error.name != "ray":
            raise
        return  # no Ray in this process (a benchmark that reads the app's config): no replica to start

    original = replica.add_port_to_grpc_server
    if getattr(original, "binds_node_address", False):
        return

    def add_port(server: Any, address: str) -> int:
        if address.startswith(WILDCARD):
            address = node_host() + ":" + address[len(WILDCARD) :]
        return original(server, address)

    add_port.binds_node_address = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_port
