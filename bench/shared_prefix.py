"""serve_load.py's shared-prefix workload: multi-turn conversations whose turns share their history, for
the prefix cache and the engine router.

Each conversation has its own context (seeded random ids), and each turn sends the conversation so far
plus new random user ids; the conversation so far holds the earlier turns' prompts and the ids the server
generated. The completions API returns text, so the turns ask for logprobs (0 alternatives) and map each
token's spelling back to its id with the model's tokenizer. Turn 1 of every conversation runs first, then
the later turns; /metrics is read before, between and after, so that the prefix-hit share counted over
the later turns is theirs alone.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

from bench.load_client import (
    brief,
    completion_body,
    latencies,
    log,
    make_prompts,
    mark,
    ms,
    percent,
    request_record,
    stream_one,
    summarize,
)
from bench.server_metrics import metrics_text, prefix_hits


@dataclasses.dataclass
class Conversation:
    """One conversation of the shared-prefix workload: what it holds so far (its context, then each
    answered turn's user tokens and the ids the server generated) and every turn's user tokens."""

    history: list[int]
    user_turns: list[list[int]]

    def prompt(self, turn: int) -> list[int]:
        return self.history + self.user_turns[turn]

    def answered(self, turn: int, output_token_ids: list[int]) -> None:
        self.history = self.prompt(turn) + output_token_ids


def make_conversations(args: argparse.Namespace, vocab: tuple[int, int]) -> list[Conversation]:
    """Each conversation its own context and its turns' user tokens: random ids from seeded RNGs, as
    make_prompts draws them."""
    contexts = make_prompts(args.conversations, args.context_tokens, vocab, seed=f"{args.seed}:contexts")
    user_tokens = make_prompts(args.conversations * args.turns, args.turn_tokens, vocab, f"{args.seed}:turns")
    return [
        Conversation(context, user_tokens[index * args.turns : (index + 1) * args.turns])
        for index, context in enumerate(contexts)
    ]


def token_id_table(tokenizer: Any) -> dict[str, int]:
    """Each token's spelling in the completions API's logprobs
    (tileinfer.deployments.openai_api.logprobs.token_text) -> its id. The API returns a completion as text,
    and a conversation's next turn must hold the very ids the server generated (the prefix cache matches ids),
    so the turns ask for logprobs and read the ids back. A spelling that several ids share is left out (the
    Qwen3 and SmolLM2 tokenizers have none)."""
    from tileinfer.deployments.openai_api.logprobs import token_text

    table: dict[str, int] = {}
    shared = set()
    for token_id in range(tokenizer.vocab_size):
        spelling = token_text(tokenizer.token_bytes(token_id))
        if spelling in table:
            shared.add(spelling)
        table[spelling] = token_id
    for spelling in shared:
        del table[spelling]
    return table


def output_token_ids(spellings: list[str], table: dict[str, int], num_tokens: int) -> list[int]:
    """A completion's token ids from their spellings in its logprobs; ValueError when a spelling is not
    one token's, or when their count is not the usage's."""
    if len(spellings) != num_tokens:
        raise ValueError(f"{len(spellings)} tokens in the logprobs, {num_tokens} in the usage")
    unknown = [spelling for spelling in spellings if spelling not in table]
    if unknown:
        raise ValueError(f"no one token is spelled {unknown[0]!r}")
    return [table[spelling] for spelling in spellings]


async def conversation_records(
    base_url: str,
    model: str,
    conversations: list[Conversation],
    turns: range,
    concurrency: int,
    output_tokens: int,
    token_ids: dict[str, int],
) -> tuple[dict[int, list[dict[str, Any]]], float]:
    """These turns (0-based) of every conversation, `concurrency` conversations at a time, each one's
    turns in order; per turn its records (with prompt_tokens), and the wall time. A turn that failed ends
    its conversation: its later turns count as errors."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    pending = iter(conversations)
    records: dict[int, list[dict[str, Any]]] = {turn: [] for turn in turns}

    async def client_loop(client: httpx.AsyncClient) -> None:
        for conversation in pending:  # a shared iterator: each client takes the next one when it is free
            failed: int | None = None
            for turn in turns:
                prompt = conversation.prompt(turn)
                if failed is not None:
                    failure = f"turn {failed + 1} of its conversation failed"
                    record = request_record(0.0, None, None, 0, failure)
                else:
                    body = {**completion_body(model, prompt, output_tokens), "logprobs": 0}
                    record = await stream_one(client, url, body)
                    if record["error"] is None:
                        try:
                            ids = output_token_ids(record["token_spellings"], token_ids, record["tokens"])
                            conversation.answered(turn, ids)
                        except ValueError as error:
                            record["error"] = str(error)
                    failed = turn if record["error"] is not None else None
                records[turn].append({**record, "prompt_tokens": len(prompt)})

    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=60), limits=limits) as client:
        start = time.monotonic()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall_s = time.monotonic() - start
    return records, wall_s


def run_shared_prefix(
    base_url: str, model: str, args: argparse.Namespace, vocab: tuple[int, int], token_ids: dict[str, int]
) -> dict[str, Any]:
    """Turn 1 of every conversation, then the later turns, with /metrics read before, between and after:
    turn 1's prompts are all new, so the prefix hits counted over the later turns are theirs alone. Per
    turn its latencies and prompt tokens; per phase its latencies, throughput and prefix hits."""
    from tileinfer.deployments.replicas.engine_replica import HEARTBEAT_S

    conversations = make_conversations(args, vocab)
    phases = {"turn 1": range(1), f"turns 2-{args.turns}": range(1, args.turns)}
    texts = [metrics_text(base_url)]
    result: dict[str, Any] = {"turns": {}, "phases": {}}
    for name, turns in phases.items():
        mark(args.marks, "shared-prefix-" + name.replace(" ", "-"))
        records, wall_s = asyncio.run(
            conversation_records(
                base_url, model, conversations, turns, args.concurrency[0], args.output_tokens, token_ids
            )
        )
        # the other ingress replicas' router decisions reach /metrics with their next heartbeat
        time.sleep(1.5 * HEARTBEAT_S)
        texts.append(metrics_text(base_url))
        for turn in turns:
            prompt_tokens = sum(record["prompt_tokens"] for record in records[turn])
            result["turns"][turn + 1] = {**latencies(records[turn]), "prompt_tokens": prompt_tokens}
        phase = summarize([record for turn in turns for record in records[turn]], wall_s)
        result["phases"][name] = {**phase, **prefix_hits(texts[-2], texts[-1])}
        log(f"shared-prefix {name}: {brief(phase)}; prefix-hit share "
            f"{percent(result['phases'][name]['hit_share'])}")  # fmt: skip
    return result


def shared_prefix_workload(model: str) -> Callable[..., dict[str, Any]]:
    """run_shared_prefix, reading the generated ids back with this model's tokenizer."""
    from tileinfer.engine.models.loader import load_tokenizer

    return functools.partial(run_shared_prefix, token_ids=token_id_table(load_tokenizer(model)))


def print_shared_prefix(by_router: dict[str, dict[str, Any]]) -> None:
    """Per turn its latencies, per phase (turn 1, the later turns) the prefix hits; a row per router."""
    print("| turn | router | requests | prompt tokens | TTFT p50 | TTFT p99 | TPOT p50 | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    turns = sorted({turn for result in by_router.values() for turn in result["turns"]})
    for turn in turns:
        for router, result in by_router.items():
            row = result["turns"][turn]
            print(
                f"| {turn} | {router} | {row['requests']} | {row['prompt_tokens']:,} | "
                f"{ms(row['ttft_p50_ms'])} | {ms(row['ttft_p99_ms'])} | {ms(row['tpot_p50_ms'])} | "
                f"{row['errors']} |"
            )
    print("\n| phase | router | prompt tokens | prefix-hit tokens | hit share | per engine: hit share of "
          "its prompt tokens | router decisions |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for router, result in by_router.items():
        for phase, row in result["phases"].items():
            engines = ", ".join(
                f"{engine or '-'}: {percent(counts['hit_share'])} of {counts['prompt_tokens']:,.0f}"
                for engine, counts in row["per_engine"].items()
            )
            decisions = ", ".join(f"{name} {count:,.0f}" for name, count in row["router_decisions"].items())
            print(
                f"| {phase} | {router} | {row['prompt_tokens']:,.0f} | {row['hit_tokens']:,.0f} | "
                f"{percent(row['hit_share'])} | {engines or '-'} | {decisions or '-'} |"
            )
