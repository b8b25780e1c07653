"""serve-structured: structured output under load, beside the same load unconstrained,
through one served app (serve_app.py starts it, load_client.py sends the requests and times them).

    python bench/serve_structured.py --model qwen3-0.6b --dtype bfloat16 [--concurrency 1,8,64,256]
        [--mixed-clients 64 --mixed-runs 3] [--client-processes 4] [--budget-s 420] [--out DIR]

The app: serve_config.yaml (--serve-config) under `serve run` as serve_app.py starts it; --model as there
(a named shape such as qwen3-0.6b: random weights of that shape with the real Qwen3 tokenizer, so
only the grammar keeps the output valid; default the config's smollm2-135m, real weights and tokenizer).

The requests: streamed `/v1/completions` with --prompt-tokens random token ids (load_client's prompts; no
chat template, so no think block: Qwen3's thinking is off), temperature 0, no ignore_eos, and max_tokens
the longest output the schema allows plus the end-of-sequence token. A constrained request adds
`response_format: {"type": "json_schema", ...}` with SCHEMA: 20 fields, nested, every string bounded by
maxLength and a pattern of ASCII characters that JSON writes unescaped, arrays by maxItems, integers by
minimum and maximum, enums. Its output is then ASCII on one line (the engine's JSON layout: ", " and
": " between items), so no token holds less than one character and the longest output's characters
bound its tokens (longest_output). An unconstrained request is the same request without response_format:
same max_tokens, no ignore_eos, as a user's; with random weights it rarely samples an end-of-sequence
token and runs to max_tokens, longer than the constrained ones (each kind's mean output tokens are
reported: shorter requests also mean more prefills a step). Each phase has prompts of its own, drawn the
same way (the same prompts twice would find their KV in the prefix cache the second time).

Every constrained request's text is parsed and validated against the schema with `jsonschema`; the
valid share counts failed requests as invalid (target 100 %).

In one served app, in this order:
1. warm-up: one request per client at --mixed-clients, a quarter of them constrained;
2. schema compile: --schema-probes times, a request with a schema the app has not seen (SCHEMA with a new
   title), then the same schema again, one at a time: TTFT of the first against the second. Beside it,
   before the app starts, the same compile in this process with tileinfer.engine.sampling.grammar's Grammars
   on the model's tokenizer, as the engine builds it: llguidance's tokenizer set-up (once per model), a new
   schema cold, the same again (cached), and a fresh matcher's first mask;
3. mixed load, --mixed-runs times: --mixed-clients clients all unconstrained, then the same clients with
   a quarter of them constrained; the medians of the runs' unconstrained TPOT p50s give the ratio
   mixed / all-unconstrained;
4. each --concurrency level all unconstrained, then all constrained: TPOT p50 and p99 of each, the ratio
   constrained / unconstrained.
Levels are closed loops of max(R C, --min-requests) requests (R = --requests-per-client); a mixed run
R x --mixed-clients. --budget-s: phases not begun within it (from the start) are skipped and listed.
Results as JSON in --out (serve_structured.json, written after each phase), tables printed last.

--engine-direct: no app; the same phases but the schema probes through an Engine built in this process
with the serve config's engine settings (engine_direct.py, as serve_load's engine-direct), its requests
added with Engine.add_request (a constrained one with the schema as its grammar) and stepped in the same
closed loop; TTFT from add_request to the step that returned the first token. What the engine costs,
without HTTP.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import engine_direct, load_client, serve_app, serve_load  # noqa: E402

TEXT = "^[A-Za-z0-9 .,-]*$"  # ASCII that JSON writes as is: no quote, backslash or control character


def _text(max_length: int, pattern: str = TEXT) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, "pattern": pattern}


def _integer(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def _record(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}  # fmt: skip


SCHEMA = _record({
    "order_id": _integer(1, 999999),
    "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
    "currency": {"enum": ["EUR", "USD", "JPY"]},
    "priority": _integer(1, 5),
    "gift": {"type": "boolean"},
    "customer": _record({
        "name": _text(20),
        "email": _text(24, "^[a-z0-9.@-]*$"),
        "tier": {"enum": ["free", "pro", "enterprise"]},
        "address": _record({
            "street": _text(24), "city": _text(16), "country": {"enum": ["FR", "DE", "US", "JP", "BR"]},
            "postal_code": _text(8, "^[0-9]*$"),
        }),
    }),
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": _record({
        "sku": _text(10, "^[A-Z0-9-]*$"), "quantity": _integer(1, 99),
        "unit_price_cents": _integer(0, 999999),
    })},
    "tags": {"type": "array", "maxItems": 3, "items": _text(10)},
    "notes": _text(32),
})  # fmt: skip


def count_fields(schema: dict[str, Any]) -> int:
    """Properties at every depth (an array's item object's too)."""
    own = schema.get("properties", {})
    inner = [*own.values(), *([schema["items"]] if "items" in schema else [])]
    return len(own) + sum(count_fields(part) for part in inner)


def longest_output(schema: dict[str, Any]) -> int:
    """The most characters of a value the schema allows, as the engine writes JSON (one line, ", " and
    ": " between items): every property present, arrays at maxItems, strings at maxLength with each
    character one (TEXT-like patterns leave nothing to escape), integers at their longest bound."""
    if "enum" in schema:
        return max(len(json.dumps(value)) for value in schema["enum"])
    kind = schema["type"]
    if kind == "object":
        parts = [
            len(json.dumps(key)) + 2 + longest_output(value) for key, value in schema["properties"].items()
        ]
        return 2 + sum(parts) + 2 * max(len(parts) - 1, 0)
    if kind == "array":
        items = schema["maxItems"]
        return 2 + items * longest_output(schema["items"]) + 2 * max(items - 1, 0)
    if kind == "string":
        return 2 + schema["maxLength"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "boolean":
        return len("false")
    raise ValueError(f"no bound for {schema}")


def titled(schema: dict[str, Any], title: str) -> dict[str, Any]:
    """The schema under another title: the same grammar, but new to a grammar cache (keyed by its text)."""
    return {"title": title, **schema}


def request_body(
    model: str, prompt: list[int], max_tokens: int, client: int, schema: dict[str, Any], constrained: int
) -> dict[str, Any]:
    """serve_load's completion without ignore_eos; clients below `constrained` ask for the schema."""
    body = load_client.completion_body(model, prompt, max_tokens, ignore_eos=False)
    if client < constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "order", "schema": schema}}
    return body


# --- validity and summaries -----------------------------------------------------------------------


def invalid_reason(record: dict[str, Any], validator: Any) -> str | None:
    """Why a constrained request's output is not a valid instance of the schema; None when it is."""
    import jsonschema

    if record["error"] is not None:
        return f"request failed: {record['error']}"
    try:
        value = json.loads(record["text"])
    except ValueError as error:
        return f"not JSON ({error}), finish_reason {record['finish_reason']}"
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    return None if error is None else f"not valid: {error.message}"


def kind_summary(records: list[dict[str, Any]], wall_s: float, validator: Any | None) -> dict[str, Any]:
    """serve_load's summary of one kind's requests (tok/s over the phase's wall time), their mean output
    tokens and how many ran to max_tokens; with a validator, how many outputs validate and the first
    invalid ones."""
    summary = load_client.summarize(records, wall_s)
    good = [record for record in records if record["error"] is None]
    summary["mean_output_tokens"] = statistics.fmean(r["tokens"] for r in good) if good else None
    summary["finish_length"] = sum(record["finish_reason"] == "length" for record in good)
    if validator is not None:
        reasons = [(record, invalid_reason(record, validator)) for record in records]
        invalid = [(record, reason) for record, reason in reasons if reason is not None]
        summary["valid"] = len(records) - len(invalid)
        summary["valid_share"] = summary["valid"] / len(records) if records else None
        summary["first_invalid"] = [{"reason": reason, "text": record.get("text", "")[:400]}
                                    for record, reason in invalid[:3]]  # fmt: skip
    return summary


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


# --- the phases ------------------------------------------------------------------------------------


class Load:
    """The phases against one served app; `results` (the JSON) grows and is saved after each phase."""

    def __init__(
        self,
        args: argparse.Namespace,
        vocab: tuple[int, int],
        max_tokens: int,
        started: float,
        results: dict[str, Any],
        save: Callable[[], None],
    ) -> None:
        import jsonschema

        self.args, self.vocab, self.max_tokens, self.started = args, vocab, max_tokens, started
        self.results, self.save = results, save
        self.validator = jsonschema.Draft202012Validator(SCHEMA)
        self.base_url = self.model = ""

    def _due(self, name: str) -> bool:
        """Whether phase `name` may begin: within --budget-s of the start, else it is listed as skipped."""
        budget = self.args.budget_s
        if budget is None or time.monotonic() - self.started < budget:
            return True
        self.results["skipped"].append(name)
        load_client.log(f"{name}: skipped, past --budget-s {budget:g}")
        return False

    def phase(
        self, name: str, clients: int, constrained: int, requests: int, schema: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """`requests` requests from `clients` closed-loop clients, the first `constrained` of them with the
        schema (default SCHEMA): per kind its summary (the constrained outputs validated against SCHEMA),
        and all together."""
        schema = SCHEMA if schema is None else schema
        seed = f"{self.args.seed}:{name}"
        prompts = load_client.make_prompts(requests, self.args.prompt_tokens, self.vocab, seed)
        records, wall_s = self.records(prompts, clients, constrained, schema)
        result = {"clients": clients, "constrained_clients": constrained}
        result["all"] = load_client.summarize(records, wall_s)
        for kind, validator in (("unconstrained", None), ("constrained", self.validator)):
            mine = [
                record for record in records if (record["client"] < constrained) == (validator is not None)
            ]
            if mine:
                result[kind] = kind_summary(mine, wall_s, validator)
        self.results["phases"][name] = result
        self.save()
        for kind in ("unconstrained", "constrained"):
            if kind in result:
                row = result[kind]
                valid = f", valid {row['valid']}/{row['requests']}" if "valid" in row else ""
                load_client.log(f"{name}, {kind}: {load_client.brief(row)}{valid}")
        return result

    def records(
        self, prompts: list[list[int]], clients: int, constrained: int, schema: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], float]:
        """The prompts' records from `clients` closed-loop clients over HTTP, and the wall time."""
        body_for = functools.partial(request_body, schema=schema, constrained=constrained)
        return load_client.http_level_records(
            self.base_url, self.model, prompts, clients, self.max_tokens, self.args.client_processes, body_for
        )

    def requests(self, clients: int) -> int:
        return max(self.args.requests_per_client * clients, self.args.min_requests)

    def run(self, base_url: str) -> None:
        self.base_url, self.model = base_url, serve_app.served_model(base_url)
        self.phases(schema_probes=True)

    def phases(self, schema_probes: bool) -> None:
        args = self.args
        mixed_clients, constrained = args.mixed_clients, max(1, args.mixed_clients // 4)
        self.phase("warm-up", mixed_clients, constrained, mixed_clients)
        if schema_probes:
            self.schema_probes()
        for run in range(args.mixed_runs):
            label = f"run {run + 1}/{args.mixed_runs}"
            for name, share in ((f"mixed {label}: all unconstrained", 0), (f"mixed {label}", constrained)):
                if self._due(name):
                    self.phase(name, mixed_clients, share, args.requests_per_client * mixed_clients)
        for clients in args.concurrency:
            for kind, share in (("unconstrained", 0), ("constrained", clients)):
                name = f"C={clients} {kind}"
                if self._due(name):
                    self.phase(name, clients, share, self.requests(clients))

    def schema_probes(self) -> None:
        """A request with a schema new to the app, then the same again, one at a time, --schema-probes
        times: their TTFTs."""
        new, again = [], []
        for probe in range(self.args.schema_probes):
            schema = titled(SCHEMA, f"order, probe {probe}")
            for name, ttfts in ((f"schema probe {probe}: new", new), (f"schema probe {probe}: again", again)):
                if not self._due(name):
                    return
                row = self.phase(name, 1, 1, 1, schema)["constrained"]
                ttfts.append(row["ttft_p50_ms"])
        first, second = (statistics.median(v) if v and None not in v else None for v in (new, again))
        self.results["compile"]["http"] = {
            "probes": len(new), "ttft_new_schema_ms": new, "ttft_same_again_ms": again,
            "ttft_new_p50_ms": first, "ttft_again_p50_ms": second,
            "difference_ms": first - second if first is not None and second is not None else None,
        }  # fmt: skip
        self.save()


class EngineLoad(Load):
    """The phases against an Engine in this process (--engine-direct): no schema probes."""

    def run_engine(self, engine: Any) -> None:
        self.engine = engine
        self.phases(schema_probes=False)

    def records(
        self, prompts: list[list[int]], clients: int, constrained: int, schema: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], float]:
        """The prompts' records from `clients` closed-loop clients of the engine (a client sends its next
        prompt when its request ends; those below `constrained` ask for the schema), and the wall time."""
        from tileinfer.engine.sampling.params import GrammarSpec, SamplingParams

        free = SamplingParams(max_tokens=self.max_tokens, temperature=0.0)
        bound = dataclasses.replace(free, grammar=GrammarSpec("json", json.dumps(schema)))
        return engine_direct.engine_records(
            self.engine, prompts, clients, lambda client: bound if client < constrained else free
        )


def compile_in_process(model: str, probes: int) -> dict[str, Any]:
    """tileinfer.engine.sampling.grammar's work for a new schema, in this process: Grammars on the model's
    tokenizer and vocabulary as Engine builds it, llguidance's tokenizer set-up (once per model, before the
    engine serves), then per probe SCHEMA under a new title compiled cold, the same again (the cache's), and a
    fresh matcher's first mask. Milliseconds."""
    import torch
    from tileinfer.engine.models.loader import load_tokenizer
    from tileinfer.engine.sampling.grammar import Grammars, MaskFiller
    from tileinfer.engine.sampling.params import GrammarSpec
    from tileinfer.kernels.token_mask import bitmask_words

    tokenizer, spec = load_tokenizer(model), serve_app.model_spec(model)
    vocab = min(tokenizer.vocab_size, spec.vocab_size)
    grammars = Grammars(tokenizer, vocab, tokenizer.eos_token_ids | frozenset(spec.eos_token_ids))

    def timed_ms(action: Any, *args: Any) -> float:
        start = time.perf_counter()
        action(*args)
        return 1e3 * (time.perf_counter() - start)

    masks_filler = MaskFiller()
    bitmask = torch.empty(1, bitmask_words(vocab), dtype=torch.int32)

    def first_mask(grammar: GrammarSpec) -> None:
        masks_filler.fill([(grammars.matcher(grammar), 0, [])], bitmask)

    setup_ms = timed_ms(lambda: grammars.start().result())
    cold, cached, masks = [], [], []
    for probe in range(probes):
        grammar = GrammarSpec("json", json.dumps(titled(SCHEMA, f"order, in process {probe}")))
        cold.append(timed_ms(grammars.check, grammar))
        cached.append(timed_ms(grammars.check, grammar))
        masks.append(timed_ms(first_mask, grammar))
    return {
        "tokenizer_setup_ms": setup_ms, "compile_cold_ms": cold, "compile_cached_ms": cached,
        "first_mask_ms": masks, "compile_cold_p50_ms": statistics.median(cold),
        "compile_cached_p50_ms": statistics.median(cached), "first_mask_p50_ms": statistics.median(masks),
    }  # fmt: skip


# --- what the phases add up to ---------------------------------------------------------------------


def levels(phases: dict[str, Any], concurrency: list[int]) -> dict[int, dict[str, Any]]:
    """Per level its two kinds and the ratios constrained / unconstrained (TPOT p50, p99, tok/s)."""
    rows = {}
    for clients in concurrency:
        free = phases.get(f"C={clients} unconstrained", {}).get("unconstrained")
        constrained = phases.get(f"C={clients} constrained", {}).get("constrained")
        if free is None and constrained is None:
            continue
        rows[clients] = {"unconstrained": free, "constrained": constrained}
        if free is not None and constrained is not None:
            for key in ("tpot_p50_ms", "tpot_p99_ms", "output_tok_s"):
                rows[clients][key.removesuffix("_ms") + "_ratio"] = _ratio(constrained[key], free[key])
    return rows


def mixed(phases: dict[str, Any], runs: int) -> dict[str, Any]:
    """The mixed runs: per run the all-unconstrained TPOT p50 beside the mixed load's per kind; the
    medians over the runs, and the ratio of the unconstrained medians (mixed / all-unconstrained)."""
    rows = []
    for run in range(runs):
        label = f"run {run + 1}/{runs}"
        alone, beside = phases.get(f"mixed {label}: all unconstrained"), phases.get(f"mixed {label}")
        if alone is None or beside is None:
            continue
        rows.append({
            "all_unconstrained_tpot_p50_ms": alone["unconstrained"]["tpot_p50_ms"],
            "unconstrained_tpot_p50_ms": beside["unconstrained"]["tpot_p50_ms"],
            "constrained_tpot_p50_ms": beside["constrained"]["tpot_p50_ms"],
            "all_unconstrained_tok_s": alone["all"]["output_tok_s"],
            "mixed_tok_s": beside["all"]["output_tok_s"],
        })  # fmt: skip

    def median(key: str) -> float | None:
        values = [row[key] for row in rows if row[key] is not None]
        return statistics.median(values) if values else None

    medians = {key: median(key) for key in (rows[0] if rows else {})}
    ratio = _ratio(medians.get("unconstrained_tpot_p50_ms"), medians.get("all_unconstrained_tpot_p50_ms"))
    return {"runs": rows, "medians": medians, "unconstrained_tpot_p50_ratio": ratio}


def validity(phases: dict[str, Any]) -> dict[str, Any]:
    """Every constrained request of every phase (warm-up and probes too): how many validate."""
    rows = [phase["constrained"] for phase in phases.values() if "constrained" in phase]
    requests, valid = sum(row["requests"] for row in rows), sum(row["valid"] for row in rows)
    first_invalid = [example for row in rows for example in row["first_invalid"]][:5]
    return {"constrained_requests": requests, "valid": valid, "valid_share": _ratio(valid, requests),
            "first_invalid": first_invalid}  # fmt: skip


# --- output ------------------------------------------------------------------------------------------


def _x(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def _header(cells: list[str]) -> str:
    return _row(cells) + "\n" + _row(["---"] * len(cells))


def print_tables(results: dict[str, Any]) -> None:
    ms, schema, args = load_client.ms, results["schema"], results["args"]
    if results["serve"] is None:
        print(f"engine-direct: {results['model']} (an Engine in the bench's process, no HTTP)")
    else:
        serve = serve_app.describe_serve(results["serve"])
        print(f"served: {results['model']}; {serve}; ready in {results.get('ready_s', 0):.1f} s")
    print(
        f"schema: {schema['fields']} fields, longest output {schema['longest_output_chars']} characters, "
        f"max_tokens {schema['max_tokens']}; prompts {args['prompt_tokens']} tokens"
    )
    print()
    print(_header(["clients", "kind", "requests", "output tok/s", "TTFT p50", "TPOT p50", "TPOT p99",
                   "mean output tokens", "ran to max_tokens", "valid", "errors"]))  # fmt: skip
    for clients, level in results["levels"].items():
        for kind in ("unconstrained", "constrained"):
            row = level[kind]
            if row is not None:
                valid = f"{row['valid']}/{row['requests']}" if "valid" in row else "-"
                mean = f"{row['mean_output_tokens']:.0f}" if row["mean_output_tokens"] is not None else "-"
                print(_row([clients, kind, row["requests"], f"{row['output_tok_s']:,.1f}",
                            ms(row["ttft_p50_ms"]), ms(row["tpot_p50_ms"]), ms(row["tpot_p99_ms"]), mean,
                            row["finish_length"], valid, row["errors"]]))  # fmt: skip
    print()
    print(
        _header(["clients", "TPOT p50 constrained / unconstrained", "TPOT p99 ratio", "output tok/s ratio"])
    )
    for clients, level in results["levels"].items():
        if "tpot_p50_ratio" in level:
            ratios = (level["tpot_p50_ratio"], level["tpot_p99_ratio"], level["output_tok_s_ratio"])
            print(_row([clients, *(_x(ratio) for ratio in ratios)]))
    mix = results["mixed"]
    print(f"\nmixed load: {args['mixed_clients']} clients, {max(1, args['mixed_clients'] // 4)} constrained")
    print(_header(["run", "all unconstrained: TPOT p50", "mixed: unconstrained TPOT p50",
                   "mixed: constrained TPOT p50", "all unconstrained tok/s", "mixed tok/s"]))  # fmt: skip
    for run, row in [*((str(i + 1), row) for i, row in enumerate(mix["runs"])), ("median", mix["medians"])]:
        if row:
            print(_row([run, ms(row["all_unconstrained_tpot_p50_ms"]), ms(row["unconstrained_tpot_p50_ms"]),
                        ms(row["constrained_tpot_p50_ms"]), f"{row['all_unconstrained_tok_s']:,.1f}",
                        f"{row['mixed_tok_s']:,.1f}"]))  # fmt: skip
    ratio = _x(mix["unconstrained_tpot_p50_ratio"])
    print(f"unconstrained TPOT p50, mixed / all unconstrained (medians): {ratio}")
    local, http = results["compile"].get("in_process", {}), results["compile"].get("http")
    print(
        f"\nschema compile ({schema['fields']} fields), in this process on the same tokenizer: llguidance's "
        f"tokenizer set-up {ms(local.get('tokenizer_setup_ms'))} (once per model), new schema "
        f"{ms(local.get('compile_cold_p50_ms'))}, same again {ms(local.get('compile_cached_p50_ms'))}, "
        f"a fresh matcher's first mask {ms(local.get('first_mask_p50_ms'))} (p50 of {args['schema_probes']})"
    )
    if http:
        print(
            f"through the app, one request at a time: TTFT with a new schema {ms(http['ttft_new_p50_ms'])}, "
            f"the same again {ms(http['ttft_again_p50_ms'])}, difference {ms(http['difference_ms'])} "
            f"(p50 of {http['probes']})"
        )
    valid = results["validity"]
    share = load_client.percent(valid["valid_share"])
    print(f"\nvalid: {valid['valid']}/{valid['constrained_requests']} constrained requests ({share})")
    for example in valid["first_invalid"]:
        print(f"  invalid: {example['reason']}: {example['text'][:200]!r}")
    if results["skipped"]:
        print(f"skipped (past --budget-s): {', '.join(results['skipped'])}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--serve-config", default=str(ROOT / "serve_config.yaml"))
    parser.add_argument("--model", default=None, help="default: the serve config's (smollm2-135m)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--concurrency", default=[1, 8, 64, 256], type=lambda text: [int(v) for v in text.split(",")]
    )
    parser.add_argument("--mixed-clients", type=int, default=64, help="a quarter of them constrained")
    parser.add_argument("--mixed-runs", type=int, default=3, help="the medians of the runs count")
    parser.add_argument("--requests-per-client", type=int, default=4, help="R: a level's length")
    parser.add_argument("--min-requests", type=int, default=16, help="a level's requests: max(R C, this)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--schema-probes", type=int, default=3, help="new-schema requests (and compiles)")
    parser.add_argument("--client-processes", type=int, default=1, help="client processes per phase")
    parser.add_argument("--budget-s", type=float, default=None, help="skip phases not begun by then")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ray-port", type=int, default=6390)
    parser.add_argument("--engine-direct", action="store_true", help="an Engine in process, no app")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args(argv)
    if args.mixed_clients < 2 or args.mixed_runs < 1 or args.schema_probes < 1:
        parser.error(
            "--mixed-clients 2 or more (a quarter constrained), --mixed-runs and --schema-probes 1 or more"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    started = time.monotonic()
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    longest = longest_output(SCHEMA)
    max_tokens = longest + 1  # and the end-of-sequence token
    load_args = serve_load.parse_args([
        "--serve-config", args.serve_config, *(["--model", args.model] if args.model else []),
        "--dtype", args.dtype, "--device", args.device,
        "--concurrency", ",".join(str(clients) for clients in [*args.concurrency, args.mixed_clients]),
        "--prompt-tokens", str(args.prompt_tokens), "--output-tokens", str(max_tokens),
        "--ray-port", str(args.ray_port),
    ])  # fmt: skip
    config, app_args = serve_load.app_args_for(load_args)
    vocab = serve_load.vocab_for(load_args, app_args)
    env = serve_app.make_run_env()
    device = "cuda" if serve_app.num_gpus(app_args.device) else "cpu"
    results: dict[str, Any] = {
        "args": vars(args), "model": app_args.model_name, "app_args": app_args.model_dump(),
        "serve": None
        if args.engine_direct
        else serve_app.serve_setup(app_args.for_device(device, os.cpu_count() or 1), env),
        "vocab": vocab,
        "schema": {"fields": count_fields(SCHEMA), "longest_output_chars": longest, "max_tokens": max_tokens,
                   "schema": SCHEMA},
        "compile": {}, "phases": {}, "skipped": [],
    }  # fmt: skip

    def save() -> None:
        """The JSON so far, with what the phases so far add up to (a run cut short keeps them)."""
        results["levels"] = levels(results["phases"], args.concurrency)
        results["mixed"] = mixed(results["phases"], args.mixed_runs)
        results["validity"] = validity(results["phases"])
        (out / "serve_structured.json").write_text(json.dumps(results, indent=2, default=str))

    results["compile"]["in_process"] = compile_in_process(app_args.model, args.schema_probes)
    save()
    if args.engine_direct:
        EngineLoad(args, vocab, max_tokens, started, results, save).run_engine(
            engine_direct.build_engine(app_args, device)
        )
    else:
        load = Load(args, vocab, max_tokens, started, results, save)
        config_path, log_path = out / "serve_structured_config.yaml", out / "serve_structured_serve.log"
        _, results["ready_s"] = serve_app.serve_and_load(
            config, config_path, log_path, env, load.run, args.ray_port
        )
    save()
    print_tables(results)
    return results


if __name__ == "__main__":
    serve_app.exit_on_sigterm()
    main()
