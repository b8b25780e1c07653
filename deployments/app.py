"""The application builder named in serve_config.yaml: `deployments.app:build_app`.

It validates the args, decides where the engine runs, and binds the deployments. A Python
program passes its result to `serve.run(...)` just the same.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.serve import Application

from deployments.config import AppArgs, parse_app_args
from deployments.engine import EngineDeployment
from deployments.ingress import OpenAIIngress
from deployments.proposer import ProposerDeployment

# Calls beyond the request streams (info, metrics, health) that the engine actor must still take.
_CONTROL_CALLS = 32


def _cluster_gpus() -> float:
    """GPUs in the Ray cluster (outside Ray: on this machine)."""
    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0))
    import torch

    return float(torch.cuda.device_count())


def resolve_device(requested: str) -> str:
    """auto: cuda when the Ray cluster (or, outside Ray, this machine) has a GPU."""
    has_gpu = _cluster_gpus() >= 1
    if requested == "auto":
        return "cuda" if has_gpu else "cpu"
    if requested == "cuda" and not has_gpu:
        raise ValueError("args.device is cuda, but the Ray cluster has no GPU")
    return requested


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    app_args = args if isinstance(args, AppArgs) else parse_app_args(args)
    device = resolve_device(app_args.device)
    dtype = app_args.dtype if app_args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    capacity = app_args.max_num_seqs + app_args.max_queue_len
    on_gpu = device == "cuda"
    proposer = None
    # With 2+ GPUs the proposer takes a GPU of its own; on one GPU both share it. Either way the two
    # actors' channel is this node's host memory.
    own_gpu = on_gpu and _cluster_gpus() >= 2
    proposer_gpus = 0.0
    if app_args.proposer_actor:
        proposer_gpus = app_args.proposer_num_gpus
        if proposer_gpus is None:
            proposer_gpus = 1 if own_gpu else 0.5
        proposer = ProposerDeployment.options(
            ray_actor_options={
                "num_cpus": app_args.proposer_num_cpus,
                "num_gpus": proposer_gpus if on_gpu else 0,
            }
        ).bind(app_args, device, dtype)
    engine_gpus = app_args.engine_num_gpus
    if engine_gpus is None:
        engine_gpus = 0.5 if proposer is not None and proposer_gpus < 1 else 1
    engine = EngineDeployment.options(
        ray_actor_options={"num_cpus": app_args.engine_num_cpus, "num_gpus": engine_gpus if on_gpu else 0},
        max_ongoing_requests=capacity + _CONTROL_CALLS,
    ).bind(app_args, device, dtype, proposer)
    return OpenAIIngress.options(
        num_replicas=app_args.num_ingress_replicas,
        ray_actor_options={"num_cpus": app_args.ingress_num_cpus},
        max_ongoing_requests=capacity + _CONTROL_CALLS,
    ).bind(app_args, engine)
