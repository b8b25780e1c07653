"""What the serving benches read from the server's /metrics: the engines' own time to first token, and the
prefix cache's hits and the router's decisions between two reads."""

from __future__ import annotations

from typing import Any

ENGINE_TTFT = "tileinfer_time_to_first_token_seconds"
HIT_TOKENS = "tileinfer_prefix_cache_hit_tokens_total"
PROMPT_TOKENS = "tileinfer_prompt_tokens_total"
ROUTER_DECISIONS = "tileinfer_router_decisions_total"


def metrics_text(base_url: str) -> str:
    """The server's /metrics; empty from a server that has none."""
    import httpx

    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", timeout=30)
    except httpx.HTTPError:
        return ""
    return response.text if response.status_code == 200 else ""


def metric_sums(text: str, name: str, label: str | None = None) -> dict[str, float]:
    """The samples called `name` in a /metrics text, summed over their label sets per value of `label`
    (samples without that label under ""; all of them under "" when label is None)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                key = sample.labels.get(label, "") if label is not None else ""
                sums[key] = sums.get(key, 0.0) + sample.value
    return sums


def engine_ttft_totals(base_url: str) -> tuple[float, float] | None:
    """(sum, count) of the engines' own time-to-first-token histograms (from the request's arrival at an
    engine loop), from the server's /metrics; None from a server that has none."""
    text = metrics_text(base_url)
    total, count = (metric_sums(text, ENGINE_TTFT + suffix) for suffix in ("_sum", "_count"))
    if not total or not count:
        return None
    return total[""], count[""]


def with_engine_ttft(summary: dict[str, Any], before: tuple | None, after: tuple | None) -> dict[str, Any]:
    """The level's mean TTFT inside the engine (its /metrics, after less before) beside the clients':
    what the HTTP path adds is the difference."""
    if before is not None and after is not None and after[1] > before[1]:
        summary["engine_ttft_mean_ms"] = 1e3 * (after[0] - before[0]) / (after[1] - before[1])
    return summary


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _engine_order(label: str) -> tuple[int, str]:
    return len(label), label  # "2" before "10"


def prefix_hits(before: str, after: str) -> dict[str, Any]:
    """What the engines counted between two /metrics texts: prompt tokens and the prefix cache's hits
    among them, in all and per engine replica (label `engine`), and the router's decisions (label
    `decision`)."""

    def grown(name: str, label: str) -> dict[str, float]:
        old = metric_sums(before, name, label)
        return {key: value - old.get(key, 0.0) for key, value in metric_sums(after, name, label).items()}

    hits, prompts = grown(HIT_TOKENS, "engine"), grown(PROMPT_TOKENS, "engine")
    per_engine = {
        engine: {
            "prompt_tokens": prompts.get(engine, 0.0),
            "hit_tokens": hits.get(engine, 0.0),
            "hit_share": _share(hits.get(engine, 0.0), prompts.get(engine, 0.0)),
        }
        for engine in sorted(hits.keys() | prompts.keys(), key=_engine_order)
    }
    return {
        "prompt_tokens": sum(prompts.values()),
        "hit_tokens": sum(hits.values()),
        "hit_share": _share(sum(hits.values()), sum(prompts.values())),
        "per_engine": per_engine,
        "router_decisions": grown(ROUTER_DECISIONS, "decision"),
    }
