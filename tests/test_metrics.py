"""deployments/replicas/metrics.py: two engines' snapshots and the router's counts in one exposition, each
family once with every engine's samples, read back by prometheus_client's own parser."""

from __future__ import annotations

import pickle
from collections import Counter

from prometheus_client.parser import text_string_to_metric_families
from tileinfer.deployments.replicas.metrics import EngineMetrics, exposition, router_families
from tileinfer.engine.spec_decode.speculator import SpeculationStats

GAUGES = {"num_requests_running": (3, "Sequences running."), "kv_cache_usage_ratio": (0.25, "Blocks in use.")}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _engine(label: str, ttfts: list[float]) -> EngineMetrics:
    metrics = EngineMetrics("tiny", label)
    for ttft in ttfts:
        metrics.time_to_first_token.observe(ttft)
    for reason in ("stop", "length", "stop"):
        metrics.count_finished(reason)
    metrics.generation_tokens.inc(10 * len(ttfts))
    metrics.requests_rejected.inc()
    return metrics


def _parse(text: str) -> Samples:
    """{(sample name, sorted labels): value}; fails when a family comes twice."""
    families = list(text_string_to_metric_families(text))
    assert [name for name, count in Counter(family.name for family in families).items() if count > 1] == []
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families
        for sample in family.samples
    }


def test_two_engines_and_the_router_in_one_exposition() -> None:
    zero, one = _engine("0", [0.004, 0.02]), _engine("1", [0.004, 0.3, 50.0])
    stats = SpeculationStats(steps=4, drafts_proposed=12, drafts_accepted=9)
    families = [zero.families(GAUGES, 2, stats, 1.5, True), one.families(GAUGES, 0)]
    text = exposition(families, router_families({"affinity": 7, "least_loaded": 2}))
    assert "_created" not in text
    samples = _parse(text)

    def value(name: str, engine: str, **labels: str) -> float:
        labels = {"model": "tiny", "engine": engine, **labels}
        return samples[(f"tileinfer_{name}", tuple(sorted(labels.items())))]

    for engine in ("0", "1"):
        assert value("requests_total", engine, finish_reason="stop") == 2
        assert value("requests_total", engine, finish_reason="length") == 1
        assert value("requests_rejected_total", engine) == 1
        assert value("num_requests_running", engine) == 3
        assert value("prompt_tokens_total", engine) == 0
    assert value("generation_tokens_total", "1") == 30
    assert value("preemptions_total", "0") == 2
    assert value("spec_drafts_accepted_total", "0") == 9 and value("spec_drafts_accepted_total", "1") == 0
    assert value("spec_step_cost", "0") == 1.5 and value("spec_hidden_rows_in_gpu_memory", "0") == 1

    ttft = "time_to_first_token_seconds"
    buckets = {
        labels["le"]: count
        for (name, key), count in samples.items()
        if name == f"tileinfer_{ttft}_bucket" and (labels := dict(key))["engine"] == "1"
    }
    assert list(buckets.values()) == sorted(buckets.values())  # cumulative
    assert [buckets[le] for le in ("0.001", "0.005", "0.25", "0.5", "30.0", "+Inf")] == [0, 1, 1, 2, 2, 3]
    assert value(f"{ttft}_count", "1") == 3 and abs(value(f"{ttft}_sum", "1") - 50.304) < 1e-9
    assert value(f"{ttft}_count", "0") == 2

    decisions = {key: count for key, count in samples.items() if key[0] == "tileinfer_router_decisions_total"}
    assert decisions == {
        ("tileinfer_router_decisions_total", (("decision", "affinity"),)): 7,
        ("tileinfer_router_decisions_total", (("decision", "least_loaded"),)): 2,
    }


def test_a_snapshot_pickles_and_no_engine_leaves_the_rest() -> None:
    metrics = _engine("3", [0.01])
    metrics.engine = "4"  # the replica learned its rank after construction
    snapshot = metrics.families(GAUGES, 1)
    again = pickle.loads(pickle.dumps(snapshot))
    assert exposition([again]) == exposition([snapshot])
    assert {sample.labels["engine"] for family in again for sample in family.samples} == {"4"}
    assert exposition([]) == ""
    assert _parse(exposition([], router_families({"retry": 1}))) == {
        ("tileinfer_router_decisions_total", (("decision", "retry"),)): 1
    }
