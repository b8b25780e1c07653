"""TileInfer's Ray Serve deployments: the OpenAI API, the replicas, and starting the service."""

import sys

if __name__ != "tileinfer.deployments":  # the folder imported by its bare name: kernels/bare_names.py
    from tileinfer.kernels.bare_names import defer

    defer(__name__, __file__)
elif "ray" in sys.modules:
    # Every replica that runs this package's code imports it before its inter-deployment server starts. A
    # replica is a Ray worker, which has imported Ray by then; the command line (deployments/launch/cli.py)
    # never imports Ray, and starts without it.
    from tileinfer.deployments.replicas.listeners import bind_replica_grpc_to_node_address

    bind_replica_grpc_to_node_address()
