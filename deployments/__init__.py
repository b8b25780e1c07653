"""TileInfer deployments."""

from deployments.listeners import bind_replica_grpc_to_node_address

# every replica that runs this package's code imports it before its inter-deployment server starts
bind_replica_grpc_to_node_address()
