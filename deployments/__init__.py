"""TileInfer deployments."""

import sys

from deployments.listeners import bind_replica_grpc_to_node_address

# Every replica that runs this package's code imports it before its inter-deployment server starts. A
# replica is a Ray worker, which has imported Ray by then; the command line (deployments/cli.py) never
# imports Ray, and starts without it.
if "ray" in sys.modules:
    bind_replica_grpc_to_node_address()
