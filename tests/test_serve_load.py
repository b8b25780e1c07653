"""bench/serve_load.py and its clients (load_client.py, shared_prefix.py, server_metrics.py), briefly: the
engine-direct closed loop on a tiny random model (fast, no timing assertions), and the pure parts of the
HTTP side (prompts, conversations, token ids read back, /metrics sums, the median of runs); its HTTP mode
runs against the served app in tests/test_serve_stream.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import load_client, serve_load, server_metrics, shared_prefix


def test_engine_direct_smoke(tmp_path: Path) -> None:
    payload = serve_load.main(
        ["--engine-direct", "--model", "tiny", "--device", "cpu", "--dtype", "float32",
         "--concurrency", "1,4", "--prompt-tokens", "32", "--output-tokens", "8", "--requests", "8",
         "--out", str(tmp_path)]
    )  # fmt: skip
    rows = payload["results"]["engine-direct"]
    assert set(rows) == {"1", "4"}
    for row in rows.values():
        assert row["errors"] == 0 and row["requests"] == 8 and row["output_tokens"] == 8 * 8
        assert row["tpot_p50_ms"] > 0 and row["ttft_p50_ms"] > 0
    assert json.loads((tmp_path / "serve_load.json").read_text())["results"] == payload["results"]


def test_levels_have_prompts_of_their_own() -> None:
    """A level that replayed an earlier level's prompts would find their KV in the prefix cache."""
    args = serve_load.parse_args(["--engine-direct", "--concurrency", "8,64", "--prompt-tokens", "16"])
    eight, sixty_four = (serve_load.level_prompts(args, level, (0, 1000)) for level in (8, 64))
    assert len(eight) == 32 and len(sixty_four) == 256
    assert not {tuple(prompt) for prompt in eight} & {tuple(prompt) for prompt in sixty_four}
    assert serve_load.level_prompts(args, 8, (0, 1000)) == eight  # the same run again: the same prompts


def test_runs_of_a_level_have_prompts_of_their_own() -> None:
    """A second run that replayed the first's prompts would find their KV cached; run 0 keeps the prompts
    engine-direct runs."""
    args = serve_load.parse_args(["--engine-direct", "--concurrency", "8", "--prompt-tokens", "16"])
    runs = [serve_load.level_prompts(args, 8, (0, 1000), run) for run in range(3)]
    assert runs[0] == serve_load.level_prompts(args, 8, (0, 1000))
    assert len({tuple(prompt) for prompts in runs for prompt in prompts}) == 3 * 32


def test_the_median_run_counts() -> None:
    runs = [{"output_tok_s": value, "run": index} for index, value in enumerate([300.0, 100.0, 200.0])]
    median = load_client.median_run(runs)
    assert median["run"] == 2 and median["output_tok_s"] == 200.0
    assert median["runs"] == 3 and median["output_tok_s_runs"] == [300.0, 100.0, 200.0]
    assert load_client.median_run(runs[:2])["run"] == 1  # even: the lower middle one


def test_summary_table_takes_the_median_run(capsys) -> None:  # noqa: ANN001
    http = load_client.median_run([{"output_tok_s": value} for value in (900.0, 600.0, 800.0)])
    results = {"http": {64: http}, "engine-direct": {64: {"output_tok_s": 1000.0}}}
    serve = {"engine_replicas": 2, "engine_num_gpus": 0.5, "ingress_replicas": 4, "engine_router": "prefix",
             "serve_mode": "throughput-optimized"}  # fmt: skip
    serve_load.print_summary(results, {"model": "qwen3-0.6b", "serve": serve})
    header, _, row = capsys.readouterr().out.splitlines()
    assert header == "| workload | model | TileInfer | peer | TileInfer / peer | % of limit |"
    assert row == (
        "| serve-load, 64 client(s); 2 engine replica(s) at 0.5 GPU each, 4 ingress replica(s), Serve "
        "throughput-optimized | qwen3-0.6b | HTTP 800 tok/s (median of 3) | engine-direct 1,000 tok/s (one "
        "engine, whole device) | 0.800 | - |"
    )


def test_engine_replicas_share_the_gpu() -> None:
    def placed(*flags: str, num_gpus: int = 1, router: str | None = None) -> dict:
        args = serve_load.parse_args(["--serve-config", "serve_config.yaml", *flags])
        return serve_load.engine_replica_args(args, num_gpus, router)

    assert placed() == {"num_engine_replicas": 1}  # one engine: the app's default share
    assert placed("--engine-replicas", "2") == {"num_engine_replicas": 2, "engine_num_gpus": 0.5}
    assert placed("--engine-replicas", "2", num_gpus=0) == {"num_engine_replicas": 2}  # on the CPU
    assert placed("--engine-replicas", "4", num_gpus=2)["engine_num_gpus"] == 0.5
    assert placed("--engine-replicas", "2", "--engine-num-gpus", "0.4")["engine_num_gpus"] == 0.4
    assert placed(router="power_of_two")["engine_router"] == "power_of_two"


def test_shared_prefix_defaults() -> None:
    args = serve_load.parse_args(["--serve-config", "serve_config.yaml", "--workload", "shared-prefix"])
    assert args.concurrency == [64] and args.output_tokens == 64
    assert args.max_model_len == 1000 + 4 * (50 + 64) + 16  # the last turn's prompt and output fit
    assert args.kv_cache_tokens == 64 * args.max_model_len  # every conversation stays cached between turns
    random = serve_load.parse_args(["--engine-direct"])
    assert random.concurrency == [1, 8, 64, 256] and random.output_tokens == 128


def test_a_turn_holds_the_conversation_so_far() -> None:
    args = serve_load.parse_args(
        ["--url", "http://x", "--model", "m", "--workload", "shared-prefix", "--conversations", "3",
         "--context-tokens", "20", "--turn-tokens", "5"]
    )  # fmt: skip
    conversations = shared_prefix.make_conversations(args, (0, 1000))
    assert len({tuple(conversation.history) for conversation in conversations}) == 3  # contexts of their own
    first = conversations[0]
    context, user = list(first.history), first.user_turns
    assert len(context) == 20 and [len(tokens) for tokens in user] == [5] * 4
    assert first.prompt(0) == context + user[0]
    first.answered(0, [7, 8, 9])
    assert first.prompt(1) == context + user[0] + [7, 8, 9] + user[1]  # turn 1's prompt is its prefix
    assert shared_prefix.make_conversations(args, (0, 1000))[1] == conversations[1]  # seeded


class _ByteTokenizer:
    """Ids 0-255 are the bytes; 256 spells "ab" (as 97 + 98 do not: they are two tokens); 257 and 258
    share a spelling."""

    vocab_size = 259

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else {256: b"ab", 257: b"<x>", 258: b"<x>"}[token_id]


def test_output_ids_read_back_from_their_logprobs_spellings() -> None:
    from tileinfer.deployments.openai_api.logprobs import token_text

    table = shared_prefix.token_id_table(_ByteTokenizer())
    ids = [104, 256, 0xE2, 0x82, 0xAC, 10]  # "h", "ab", the three bytes of "€" as tokens of their own, "\n"
    spellings = [token_text(_ByteTokenizer().token_bytes(token_id)) for token_id in ids]  # as the server's
    assert spellings[2] == "bytes:\\xe2"
    assert shared_prefix.output_token_ids(spellings, table, len(ids)) == ids
    with pytest.raises(ValueError, match="usage"):
        shared_prefix.output_token_ids(spellings, table, len(ids) + 1)
    with pytest.raises(ValueError, match="<x>"):  # two ids share it: which one is unknown
        shared_prefix.output_token_ids(["<x>"], table, 1)


def _metrics(hits: dict[str, int], prompts: dict[str, int], decisions: dict[str, int]) -> str:
    lines = ["# TYPE tileinfer_prefix_cache_hit_tokens_total counter"]
    lines += [f'tileinfer_prefix_cache_hit_tokens_total{{engine="{engine}",model="m"}} {count}.0'
              for engine, count in hits.items()]  # fmt: skip
    lines += ["# TYPE tileinfer_prompt_tokens_total counter"]
    lines += [f'tileinfer_prompt_tokens_total{{engine="{engine}",model="m"}} {count}.0'
              for engine, count in prompts.items()]  # fmt: skip
    lines += ["# TYPE tileinfer_router_decisions_total counter"]
    for key, count in decisions.items():  # "decision/ingress": label sets that differ beyond the decision
        decision, ingress = key.split("/")
        lines.append(f'tileinfer_router_decisions_total{{decision="{decision}",ingress="{ingress}"}} {count}')
    return "\n".join(lines) + "\n"


def test_prefix_hits_between_two_reads_of_metrics() -> None:
    before = _metrics({"0": 100, "1": 0}, {"0": 1000, "1": 500}, {"affinity/a": 3, "affinity/b": 1})
    after = _metrics(
        {"0": 1000, "1": 300, "10": 0}, {"0": 2000, "1": 1500, "10": 100},
        {"affinity/a": 10, "affinity/b": 4, "least_loaded/a": 2},
    )  # fmt: skip
    hits = server_metrics.prefix_hits(before, after)
    assert (hits["prompt_tokens"], hits["hit_tokens"]) == (2100, 1200)
    assert hits["hit_share"] == 1200 / 2100
    assert list(hits["per_engine"]) == ["0", "1", "10"]  # a replica that came up in between counts too
    assert hits["per_engine"]["0"] == {"prompt_tokens": 1000, "hit_tokens": 900, "hit_share": 0.9}
    assert hits["per_engine"]["10"]["hit_share"] == 0.0
    assert hits["router_decisions"] == {"affinity": 10, "least_loaded": 2}  # summed over the label sets
    # a server of one engine without the label, and one without /metrics
    plain = server_metrics.prefix_hits(
        "tileinfer_prefix_cache_hit_tokens_total 5\ntileinfer_prompt_tokens_total 10\n",
        "tileinfer_prefix_cache_hit_tokens_total 15\ntileinfer_prompt_tokens_total 30\n",
    )
    assert plain["hit_share"] == 0.5 and list(plain["per_engine"]) == [""]
    assert server_metrics.prefix_hits("", "")["hit_share"] is None


def test_a_refused_request_is_a_record_with_its_error() -> None:
    """A 4xx answer (here from a stand-in transport) is a record with the error and every field a
    successful one has, as serve_structured's validity count reads them."""
    import asyncio

    import httpx

    async def one() -> dict:
        refuse = httpx.MockTransport(lambda request: httpx.Response(400, json={"error": {"message": "no"}}))
        async with httpx.AsyncClient(transport=refuse) as client:
            return await load_client.stream_one(client, "http://test/v1/completions", {})

    record = asyncio.run(one())
    assert record["error"].startswith("HTTP 400") and record["tokens"] == 0
    assert record["text"] == "" and record["finish_reason"] is None and record["token_spellings"] == []
