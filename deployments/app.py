"""The application builder named in serve_config.yaml: `tileinfer.deployments.app:build_app`.

It validates the args, decides where the engine runs, and binds the deployments. A Python
program passes its result to `serve.run(...)` just the same.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from tileinfer.deployments.launch.app_args import AppArgs, parse_app_args
from tileinfer.deployments.launch.cluster_security import check_cluster
from tileinfer.deployments.openai_api.ingress import OpenAIIngress
from tileinfer.deployments.replicas.autoscaling import sequences_policy
from tileinfer.deployments.replicas.engine_replica import EngineDeployment
from tileinfer.deployments.replicas.engine_router import EngineRouter
from tileinfer.deployments.replicas.proposer_actor import SEE_ALL_GPUS
from tileinfer.deployments.replicas.routing import ROUTING_STATS_PERIOD_S

logger = logging.getLogger(__name__)

# Calls beyond the request streams (info, metrics, health) that the engine actor must still take.
_CONTROL_CALLS = 32


def _cluster_gpus() -> float:
    """GPUs in the Ray cluster (outside Ray: on this machine)."""
    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0))
    import torch

    return float(torch.cuda.device_count())


def _cluster_cpus() -> float:
    """CPUs in the Ray cluster (outside Ray: on this machine)."""
    if ray.is_initialized():
        return float(ray.cluster_resources().get("CPU", 0))
    return float(os.cpu_count() or 1)


def gpu_shares(app_args: AppArgs, cluster_gpus: float) -> tuple[float, float]:
    """The GPUs the engine and the proposer actors reserve (0 without GPUs or without a proposer actor).
    With 2+ GPUs the proposer takes a GPU of its own; on one both share it, half each. Either way their
    channel is this node's host memory."""
    if cluster_gpus < 1:
        return 0.0, 0.0
    if not app_args.proposer_actor:
        return app_args.engine_num_gpus if app_args.engine_num_gpus is not None else 1.0, 0.0
    proposer_gpus = app_args.proposer_num_gpus
    if proposer_gpus is None:
        proposer_gpus = 1.0 if cluster_gpus >= 2 else 0.5
    engine_gpus = app_args.engine_num_gpus
    if engine_gpus is None:
        engine_gpus = 1.0 if proposer_gpus >= 1 else 0.5
    return engine_gpus, proposer_gpus


def proposer_actor_options(app_args: AppArgs, proposer_gpus: float) -> dict[str, Any]:
    """The proposer actor's Ray options. With a GPU of its own it also sees the engine's GPU, so that it
    can map the engine's buffer of DFlash rows as a peer (deployments/replicas/proposer_actor.py picks its own
    GPU)."""
    options: dict[str, Any] = {"num_cpus": app_args.proposer_num_cpus, "num_gpus": proposer_gpus}
    if proposer_gpus >= 1:
        options["runtime_env"] = {"env_vars": {SEE_ALL_GPUS: "1"}}
    return options


def engine_bundles(engine: dict[str, Any], proposer: dict[str, Any]) -> list[dict[str, float]] | None:
    """The placement-group bundles of an engine replica and its proposer actor (their Ray options), which
    Serve reserves together on one node; None when either asks for no resources (Ray takes no empty
    bundle), and the proposer is then pinned to its engine's node instead."""
    bundles = []
    for options in (engine, proposer):
        bundle = {"CPU": float(options.get("num_cpus") or 0), "GPU": float(options.get("num_gpus") or 0)}
        bundle = {resource: amount for resource, amount in bundle.items() if amount > 0}
        if not bundle:
            return None
        bundles.append(bundle)
    return bundles


def resolve_device(requested: str) -> str:
    """auto: cuda when the Ray cluster (or, outside Ray, this machine) has a GPU."""
    has_gpu = _cluster_gpus() >= 1
    if requested == "auto":
        return "cuda" if has_gpu else "cpu"
    if requested == "cuda" and not has_gpu:
        raise ValueError("args.device is cuda, but the Ray cluster has no GPU")
    return requested


def engine_autoscaling_config(app_args: AppArgs) -> dict[str, Any] | None:
    """Serve's autoscaling_config for the engine deployment, as the args give it, scaled on the
    sequences the engines hold (deployments/replicas/autoscaling.py): target_ongoing_requests is sequences per
    replica, by default half of max_num_seqs."""
    if app_args.engine_autoscaling_config is None:
        return None
    config = {"target_ongoing_requests": max(1, (app_args.max_num_seqs or 2) // 2)}
    config.update(app_args.engine_autoscaling_config)
    policy = f"{sequences_policy.__module__}:{sequences_policy.__name__}"
    config.setdefault("policy", {"policy_function": policy})
    return config


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    app_args = args if isinstance(args, AppArgs) else parse_app_args(args)
    if app_args.api_key is not None:
        logger.warning(
            "args.api_key: Serve logs the application's args as given, key included; give the key in a "
            "file (api_key_file) or in TILEINFER_API_KEY where the ingress runs instead"
        )
    if ray.is_initialized():  # built for a cluster (not in Serve's local testing mode)
        check_cluster(app_args.allow_open_cluster)
    several_engines = app_args.num_engine_replicas > 1 or app_args.engine_autoscaling_config is not None
    device = resolve_device(app_args.device)
    app_args = app_args.for_device(device, _cluster_cpus())
    dtype = app_args.dtype if app_args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    capacity = app_args.max_num_seqs + app_args.max_queue_len
    on_gpu = device == "cuda"
    engine_gpus, proposer_gpus = gpu_shares(app_args, _cluster_gpus() if on_gpu else 0)
    engine_options = {"num_cpus": app_args.engine_num_cpus, "num_gpus": engine_gpus}
    placement: dict[str, Any] = {"max_replicas_per_node": app_args.engine_max_replicas_per_node}
    proposer_options = None
    draft_ahead = False
    if app_args.proposer_actor:  # each engine replica starts its own (deployments/replicas/proposer_actor.py)
        proposer_options = proposer_actor_options(app_args, proposer_gpus)
        draft_ahead = app_args.proposer_draft_ahead(device, proposer_gpus)
        bundles = engine_bundles(engine_options, proposer_options)
        if bundles is not None:  # the pair on one node, the proposer's share counted where replicas go
            if app_args.engine_max_replicas_per_node is not None:
                raise ValueError(
                    "engine_max_replicas_per_node cannot be combined with a proposer actor that reserves "
                    "resources (Serve places each engine replica and its proposer as one placement group): "
                    "leave it out, or set proposer_in_process: true"
                )
            placement = {"placement_group_bundles": bundles, "placement_group_strategy": "STRICT_PACK"}
    routing: dict[str, Any] = {}
    if several_engines:  # one replica needs no choice: Serve's own router, and no routing stats each second
        routing["request_router_config"] = RequestRouterConfig(
            # by name: Serve imports it where the ingress runs (a class object would be pickled by value)
            request_router_class=f"{EngineRouter.__module__}.{EngineRouter.__name__}",
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        )
    engine = EngineDeployment.options(
        num_replicas="auto" if app_args.engine_autoscaling_config else app_args.num_engine_replicas,
        autoscaling_config=engine_autoscaling_config(app_args),
        ray_actor_options=engine_options,
        max_ongoing_requests=capacity + _CONTROL_CALLS,
        **placement,
        **routing,
    ).bind(app_args, device, dtype, proposer_options, draft_ahead)
    return OpenAIIngress.options(
        num_replicas=app_args.num_ingress_replicas,
        ray_actor_options={"num_cpus": app_args.ingress_num_cpus},
        max_ongoing_requests=capacity + _CONTROL_CALLS,
    ).bind(app_args, engine)
