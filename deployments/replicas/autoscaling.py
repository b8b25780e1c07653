"""Serve's autoscaling policy for the engine deployment (README, Scaling out).

Serve scales a deployment by the calls in flight to its replicas. An engine replica's calls are its
ingress replicas' long-lived output streams and short submits, whatever the number of sequences it runs,
so the engine reports its own load instead (EngineDeployment.record_autoscaling_stats: running plus
waiting sequences), and this policy asks for as many replicas as hold that many sequences at
`target_ongoing_requests` each. Serve applies min_replicas, max_replicas and the up- and downscale delays
around it. Serve pickles this module by value: it keeps to plain functions.
"""

from __future__ import annotations

from typing import Any

SEQUENCES_METRIC = "sequences"  # what each engine replica reports: its running and waiting sequences


def sequences_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """The replicas for the sequences the running replicas hold (ctx: Serve's AutoscalingContext)."""
    metrics = ctx.aggregated_metrics
    if callable(metrics):
        metrics = metrics()
    reported = (metrics or {}).get(SEQUENCES_METRIC, {})
    if ctx.current_num_replicas == 0 or not reported:
        return ctx.target_num_replicas, {}
    return sum(reported.values()) / ctx.config.get_target_ongoing_requests(), {}
