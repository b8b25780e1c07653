"""Serving metrics through prometheus_client. Each engine replica keeps its own (EngineMetrics, in a
registry of its own, never the process's global one) and hands a snapshot of its families (families) to
whichever ingress replica answers /metrics, which shows every engine's together (exposition), told apart
by the label `engine`, as vLLM's data-parallel metrics are."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, Metric, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from tileinfer.engine.spec_decode.speculator import SpeculationStats

PREFIX = "tileinfer"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineMetrics:
    """One engine replica's metrics; the counts are updated on its engine thread or under its lock
    (deployments/replicas/engine_loop.py). Every family carries the labels `model` and `engine`, put on at
    snapshot time: the replica may learn its rank (set `engine`) after construction, and the hot path
    increments unlabelled counters."""

    def __init__(self, model_name: str, engine: str = "0") -> None:
        self.model_name = model_name
        self.engine = engine
        self._registry = registry = CollectorRegistry(auto_describe=False)
        self._requests = Counter(
            f"{PREFIX}_requests_total", "Finished requests, by finish reason.", ["finish_reason"],
            registry=registry,
        )  # fmt: skip
        self._finished: dict[str, Counter] = {}  # bound children of _requests, by finish reason
        self.requests_rejected = Counter(
            f"{PREFIX}_requests_rejected_total", "Requests refused: the queue was full.", registry=registry
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens_total", "Prompt tokens of admitted requests.", registry=registry
        )
        self.prefix_cache_hit_tokens = Counter(
            f"{PREFIX}_prefix_cache_hit_tokens_total", "Prompt tokens from cache.", registry=registry
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens_total", "Generated tokens.", registry=registry
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "From arrival at the engine to the first token.",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.time_per_output_token = Histogram(
            f"{PREFIX}_time_per_output_token_seconds", "Mean time between tokens, per finished request.",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip

    def count_finished(self, reason: str) -> None:
        child = self._finished.get(reason)
        if child is None:
            child = self._finished[reason] = self._requests.labels(finish_reason=reason)
        child.inc()

    def families(
        self,
        gauges: dict[str, tuple[float, str]],
        num_preemptions: int,
        stats: SpeculationStats | None = None,
        step_cost: float = 1.0,
        rows_in_gpu_memory: bool = False,
    ) -> list[Metric]:
        """A snapshot of all this engine's families (plain objects that pickle), labelled. gauges maps a
        name (without the prefix) to (value, help); what the scheduler and the speculator count
        themselves is read now, passed in."""
        read_now = [
            _counter("preemptions_total", num_preemptions, "Sequences preempted for KV cache space."),
            *(_gauge(name, value, text) for name, (value, text) in gauges.items()),
            *speculation_families(stats, step_cost, rows_in_gpu_memory),
        ]
        labels = {"model": self.model_name, "engine": self.engine}
        return [_labelled(family, labels) for family in itertools.chain(self._registry.collect(), read_now)]


def speculation_families(
    stats: SpeculationStats | None, step_cost: float = 1.0, rows_in_gpu_memory: bool = False
) -> list[Metric]:
    """Speculative decoding's counters, the measured cost of a step with drafts, and whether DFlash's
    hidden rows reach the proposer in GPU memory; present (0, and a cost of 1) without a proposer, so
    that dashboards and alerts need not know whether this server speculates. Acceptance = accepted /
    proposed."""
    counters = {
        "spec_steps_total": (stats.steps if stats else 0, "Sequence steps that verified drafts."),
        "spec_drafts_proposed_total": (stats.drafts_proposed if stats else 0, "Draft tokens verified."),
        "spec_drafts_accepted_total": (stats.drafts_accepted if stats else 0, "Draft tokens accepted."),
        "spec_proposer_failures_total": (
            stats.proposer_failures if stats else 0, "Steps without drafts: the proposer failed or stalled."
        ),
        "spec_ring_steps_total": (
            stats.ring_steps if stats else 0, "Steps whose drafts crossed in the draft ring (draft_ring)."
        ),
        "spec_ring_wait_seconds_total": (
            stats.ring_wait_seconds if stats else 0.0, "Seconds the engine's host waited for them."
        ),
    }  # fmt: skip
    gauges = {
        "spec_step_cost": (
            step_cost, "A step that verifies drafts over a plain decode step, measured (1 until both ran)."
        ),
        "spec_hidden_rows_in_gpu_memory": (
            int(rows_in_gpu_memory), "1: DFlash's hidden rows cross to the proposer in GPU memory (CUDA IPC)."
        ),
    }  # fmt: skip
    return [
        *(_counter(name, value, text) for name, (value, text) in counters.items()),
        *(_gauge(name, value, text) for name, (value, text) in gauges.items()),
    ]


def router_families(counts: dict[str, float]) -> list[Metric]:
    """The ingress's routing choices (counts by decision, summed over its replicas by the caller)."""
    family = CounterMetricFamily(
        f"{PREFIX}_router_decisions_total", "Requests routed to an engine replica, by how it was chosen.",
        labels=["decision"],
    )  # fmt: skip
    for decision, count in counts.items():
        family.add_metric([decision], count)
    return [family]


def exposition(families_of_each_engine: Iterable[Iterable[Metric]], extra: Iterable[Metric] = ()) -> str:
    """One Prometheus text exposition of several engines' snapshots (the same families, told apart by
    their `engine` label) and extra families: each family once, with all its samples."""
    merged: dict[str, Metric] = {}
    for family in itertools.chain(*families_of_each_engine, extra):
        into = merged.get(family.name)
        if into is None:
            into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
        into.samples += family.samples
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(list(merged.values())))
    return generate_latest(registry).decode()


class _Snapshot:
    """A collector of families already collected (what CollectorRegistry.register takes)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _counter(name: str, value: float, text: str) -> Metric:
    return CounterMetricFamily(f"{PREFIX}_{name}", text, value=value)


def _gauge(name: str, value: float, text: str) -> Metric:
    return GaugeMetricFamily(f"{PREFIX}_{name}", text, value=value)


def _labelled(family: Metric, labels: dict[str, str]) -> Metric:
    """The family with labels added to every sample, less the `_created` samples prometheus_client adds to
    counters and histograms (creation times of this process's objects, noise on a dashboard)."""
    out = Metric(family.name, family.documentation, family.type, family.unit)
    created = family.name + "_created"
    out.samples = [
        sample._replace(labels={**labels, **sample.labels})
        for sample in family.samples
        if sample.name != created
    ]
    return out
