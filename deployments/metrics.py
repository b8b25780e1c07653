"""Serving metrics, rendered in the Prometheus text exposition format."""

from __future__ import annotations

import bisect
import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.speculator import SpeculationStats

PREFIX = "tileinfer"


@dataclasses.dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = dataclasses.field(default_factory=list)  # per bucket, not cumulative
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip([*self.buckets, float("inf")], self.counts, strict=True):
            cumulative += count
            label = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{le="{label}"}} {cumulative}')
        lines += [f"{name}_sum {self.total}", f"{name}_count {self.count}"]
        return lines


_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclasses.dataclass
class ServingMetrics:
    """Kept by the engine actor; every field is updated on its engine thread or under its lock."""

    requests_by_finish_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    requests_rejected: int = 0
    prompt_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    generation_tokens: int = 0
    time_to_first_token: Histogram = dataclasses.field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    time_per_output_token: Histogram = dataclasses.field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))

    def count_finished(self, reason: str) -> None:
        self.requests_by_finish_reason[reason] = self.requests_by_finish_reason.get(reason, 0) + 1

    def render(self, gauges: dict[str, tuple[float, str]], model_name: str, num_preemptions: int) -> str:
        """The exposition text; gauges maps a name to (value, help)."""
        lines = [
            f"# HELP {PREFIX}_requests_total Finished requests, by finish reason.",
            f"# TYPE {PREFIX}_requests_total counter",
        ]
        for reason, count in sorted(self.requests_by_finish_reason.items()):
            lines.append(f'{PREFIX}_requests_total{{model="{model_name}",finish_reason="{reason}"}} {count}')
        counters = {
            "requests_rejected_total": (self.requests_rejected, "Requests refused: the queue was full."),
            "prompt_tokens_total": (self.prompt_tokens, "Prompt tokens of admitted requests."),
            "prefix_cache_hit_tokens_total": (self.prefix_cache_hit_tokens, "Prompt tokens from cache."),
            "generation_tokens_total": (self.generation_tokens, "Generated tokens."),
            "preemptions_total": (num_preemptions, "Sequences preempted for KV cache space."),
        }
        for name, (value, help_text) in counters.items():
            lines += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} counter"]
            lines.append(f"{PREFIX}_{name} {value}")
        lines += self.time_to_first_token.render(
            f"{PREFIX}_time_to_first_token_seconds", "From arrival at the engine to the first token."
        )
        lines += self.time_per_output_token.render(
            f"{PREFIX}_time_per_output_token_seconds", "Mean time between tokens, per finished request."
        )
        for name, (value, help_text) in gauges.items():
            lines += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} gauge"]
            lines.append(f"{PREFIX}_{name} {value}")
        return "\n".join(lines) + "\n"


def render_speculation(
    stats: SpeculationStats | None, step_cost: float = 1.0, rows_in_gpu_memory: bool = False
) -> str:
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
            round(stats.ring_wait_seconds, 6) if stats else 0, "Seconds the engine's host waited for them."
        ),
    }  # fmt: skip
    gauges = {
        "spec_step_cost": (
            f"{step_cost:.4g}",
            "A step that verifies drafts over a plain decode step, measured (1 until both ran).",
        ),
        "spec_hidden_rows_in_gpu_memory": (
            int(rows_in_gpu_memory), "1: DFlash's hidden rows cross to the proposer in GPU memory (CUDA IPC)."
        ),
    }  # fmt: skip
    lines = []
    for kind, metrics in (("counter", counters), ("gauge", gauges)):
        for name, (value, help_text) in metrics.items():
            lines += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} {kind}"]
            lines.append(f"{PREFIX}_{name} {value}")
    return "\n".join(lines) + "\n"
