"""Serve's request router for the engine deployment (deployments/replicas/routing.py says why and how).

Serve pickles this module by value into every process that routes to the engine, so it holds only the
router: its state lives in tileinfer.deployments.replicas.routing, imported by reference, where the ingress's
EngineClient finds the same RoutingPolicy.
"""

from __future__ import annotations

from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica
from tileinfer.deployments.replicas.routing import ROUTE_KWARG, policy_for


class EngineRouter(PowerOfTwoChoicesRequestRouter):
    """Serve's router for the engine deployment: honours a call's pinned replica (ROUTE_KWARG), routes
    the others by power of two choices, and keeps the RoutingPolicy's view of the replicas current."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = policy_for(self._deployment_id.app_name, self._deployment_id.name)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.policy.set_replicas(
            {replica.replica_id.unique_id: replica.routing_stats for replica in replicas}
        )

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        pinned = pending_request.kwargs.get(ROUTE_KWARG) if pending_request is not None else None
        if pinned is not None:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == pinned:
                    return [[replica]]
            # gone: any replica takes the call and refuses it (WrongReplicaError) rather than it waiting
            # here for a replica that will not come back
        return await super().choose_replicas(candidate_replicas, pending_request)
