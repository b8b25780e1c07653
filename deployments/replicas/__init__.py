"""The engine and proposer replicas: the actors, their clients, routing, autoscaling, metrics."""
