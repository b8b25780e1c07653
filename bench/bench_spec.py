"""Speculative decoding (BENCH.md `spec`): accepted tokens per verify step (tau) and the speedup over
plain decoding, same prompts, same run, on SmolLM2-135M (real weights).

    python bench/bench_spec.py [OUT_DIR] [--device cuda] [--max-tokens 256]
    python bench/bench_spec.py OUT_DIR --device cpu --step-cost 2.7 --sets "code edit" --proposers ngram-15

On the CPU only tau and the steps with drafts mean anything; --step-cost then prices a step with drafts
as a GPU measured it, so that the draft-count controller chooses as it would there.

Prompt sets: open chat questions, and a code edit (return a given 40-line function with one identifier
renamed). For each proposer (n-gram, self-draft with the first layers) every prompt is decoded greedily
with and without speculation; the outputs must be equal (exact verification). tau = generated tokens /
engine steps that emitted them; speedup = plain wall time / speculative wall time, summed over the set.
Writes OUT_DIR/bench_spec.json and prints one table.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tileinfer.deployments.replicas.proposer_build import build_engine  # noqa: E402
from tileinfer.engine.config import EngineConfig  # noqa: E402
from tileinfer.engine.engine import Engine  # noqa: E402
from tileinfer.engine.models.default_model import default_model_path  # noqa: E402
from tileinfer.engine.models.loader import LoadedModel, load_model  # noqa: E402
from tileinfer.engine.sampling.params import SamplingParams  # noqa: E402
from tileinfer.engine.step import ScheduledRow  # noqa: E402

from tests.divergence import differences  # noqa: E402

OPEN_CHAT = [
    "What is the capital of France, and why is it famous?",
    "Explain in a few sentences how a rainbow forms.",
    "Give me three tips for writing clear emails.",
    "What are the main differences between a cat and a dog as pets?",
    "Write a short poem about autumn leaves.",
]

FUNCTION = '''def summarize_orders(orders, tax_rate, discount_threshold):
    """Totals, taxes and discounts for a list of orders."""
    subtotal = 0.0
    item_count = 0
    largest_order = None
    discounted_orders = []
    for order in orders:
        order_total = 0.0
        for item in order["items"]:
            price = item["price"]
            quantity = item["quantity"]
            order_total += price * quantity
            item_count += quantity
        if order_total > discount_threshold:
            discount = order_total * 0.1
            order_total -= discount
            discounted_orders.append(order["id"])
        subtotal += order_total
        if largest_order is None or order_total > largest_order["total"]:
            largest_order = {"id": order["id"], "total": order_total}
    tax = subtotal * tax_rate
    total = subtotal + tax
    average = subtotal / len(orders) if orders else 0.0
    report = {
        "subtotal": round(subtotal, 2),
        "tax": round(tax, 2),
        "total": round(total, 2),
        "items": item_count,
        "average_order": round(average, 2),
        "largest_order": largest_order,
        "discounted_orders": discounted_orders,
    }
    if total > 10000:
        report["flag"] = "review"
    elif total > 1000:
        report["flag"] = "normal"
    else:
        report["flag"] = "small"
    return report
'''
CODE_EDIT = [
    "Rename the variable `subtotal` to `running_subtotal` in this function. Return the whole function and "
    "nothing else.\n\n" + FUNCTION
]

PROMPT_SETS = {"open chat": OPEN_CHAT, "code edit": CODE_EDIT}
PROPOSERS = {  # key: (name, settings); at most --num-draft drafts a step unless the settings say
    "ngram": ("ngram", {"proposer": "ngram"}),
    "ngram-15": ("ngram, up to 15 drafts", {"proposer": "ngram", "num_draft": 15}),  # a 16-token bucket
    "self-draft-15": ("self-draft (15 of 30 layers)", {"proposer": "draft", "draft_layers": 15}),
    "self-draft-24": ("self-draft (24 of 30 layers)", {"proposer": "draft", "draft_layers": 24}),
}


def _verify_or_execute(scheduled: list[ScheduledRow], ring: object = None) -> str:
    """ModelRunner.execute's calls: a verify step (some row has drafts) or a plain one."""
    return "verify" if any(row.num_drafts for row in scheduled) else "execute"


class CallTimer:
    """Wall time spent in chosen methods of an engine's parts (host work plus any wait for the GPU
    inside them), to split a speculative step into drafting, verifying and the rest."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)

    def wrap(self, owner: object, name: str, key: Callable[..., str] | None = None) -> None:
        """Time owner.name's calls, under `name` or under key(*args, **kwargs)."""
        method = getattr(owner, name)

        def timed(*args: object, **kwargs: object) -> object:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                label = key(*args, **kwargs) if key is not None else name
                self.seconds[label] += time.perf_counter() - started
                self.calls[label] += 1

        setattr(owner, name, timed)

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            name: {"calls": self.calls[name], "ms_per_call": 1e3 * seconds / self.calls[name]}
            for name, seconds in self.seconds.items()
        }


def divergence(
    reference: Engine, prompts: list[list[int]], got: list[list[int]], expected: list[list[int]]
) -> dict[str, object]:
    """The first prompt and token where the speculative outputs part from plain decoding, with plain
    decoding's top-2 logprob gap there (near 0: a near-tie that other kernels' rounding may flip)."""
    found = next(differences(reference, prompts, got, expected), None)
    if found is None:
        return {"first_difference": None, "top2_gap_there": None}
    return {"first_difference": [found["prompt"], found["token"]], "top2_gap_there": found.get("top2_gap")}


def same_cell(row: dict) -> str:
    if row["same_output"]:
        return "yes"
    gap = row["top2_gap_there"]
    return f"no: at {row['first_difference']}" + (f", top-2 gap {gap:.2e}" if gap is not None else "")


def run_set(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outputs, tokens, steps = [], 0, 0
    started = time.perf_counter()
    for prompt in prompts:
        generated: list[int] = []
        for output in engine.stream(prompt, params):
            generated += output.new_token_ids
            steps += 1
        outputs.append(generated)
        tokens += len(generated)
    return {"seconds": time.perf_counter() - started, "tokens": tokens, "steps": steps, "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-draft", type=int, default=6)
    parser.add_argument(
        "--no-step-graphs", action="store_true", help="run verify steps eagerly, not from CUDA graphs"
    )
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument(
        "--step-cost",
        type=float,
        default=None,
        help="a step with drafts costs this many plain steps (default: measured)",
    )
    parser.add_argument("--sets", nargs="*", choices=list(PROMPT_SETS), default=list(PROMPT_SETS))
    parser.add_argument("--proposers", nargs="*", choices=list(PROPOSERS), default=list(PROPOSERS))
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    base = EngineConfig(device=args.device, dtype=dtype, max_model_len=4096, kv_cache_tokens=16384)
    base.step_graphs = not args.no_step_graphs
    model: LoadedModel = load_model(str(default_model_path()), dtype=base.torch_dtype(), device=args.device)
    tokenizer = model.tokenizer
    sets = {
        name: [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in PROMPT_SETS[name]]
        for name in args.sets
    }
    plain_engine = Engine(model, base)
    proposers = {PROPOSERS[key][0]: PROPOSERS[key][1] for key in args.proposers}
    rows = []
    for set_name, prompts in sets.items():
        run_set(plain_engine, prompts[:1], 16)  # warm-up (compiles, captures)
        plain = run_set(plain_engine, prompts, args.max_tokens)
        for proposer_name, settings in proposers.items():
            config = EngineConfig(**{**base.__dict__, "num_draft": args.num_draft, **settings})
            engine = build_engine(model, config)
            engine.speculator.fixed_step_cost = args.step_cost
            run_set(engine, prompts[:1], 16)
            timer = CallTimer()
            for method in ("draft_lengths", "request_drafts"):
                timer.wrap(engine.speculator, method)
            timer.wrap(engine.speculator.proposer, "propose")  # each ask ends a step's run-ahead
            timer.wrap(engine.runner, "launch")
            timer.wrap(engine.runner, "execute", key=_verify_or_execute)
            spec = run_set(engine, prompts, args.max_tokens)
            stats = engine.speculator.stats
            row = {
                "prompts": set_name,
                "proposer": proposer_name,
                "tau": spec["tokens"] / spec["steps"],
                "speedup": plain["seconds"] / spec["seconds"],
                "plain_tok_s": plain["tokens"] / plain["seconds"],
                "spec_tok_s": spec["tokens"] / spec["seconds"],
                "acceptance": stats.drafts_accepted / max(stats.drafts_proposed, 1),
                "same_output": spec["outputs"] == plain["outputs"],
                **divergence(plain_engine, prompts, spec["outputs"], plain["outputs"]),
                "engine_steps": spec["steps"],
                "verify_steps": stats.steps,  # one request at a time: steps that verified drafts
                "time_in": timer.summary(),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            del engine
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_spec.json").write_text(json.dumps({"device": args.device, "rows": rows}, indent=2))
    setting = f"{args.device}, {dtype}, greedy, {args.max_tokens} tokens each"
    if args.step_cost is not None:
        setting += f", a step with drafts priced at {args.step_cost} plain steps"
    print(f"\nspeculative decoding, SmolLM2-135M, {setting}")
    columns = ["prompts", "proposer", "tau", "acceptance", "steps with drafts", "asks", "verify step",
               "plain tok/s", "spec tok/s", "speedup", "same"]  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        verify = row["time_in"].get("verify", {}).get("ms_per_call")
        cells = [
            row["prompts"], row["proposer"], f"{row['tau']:.2f}", f"{100 * row['acceptance']:.0f} %",
            f"{row['verify_steps']} of {row['engine_steps']}",
            str(row["time_in"].get("propose", {}).get("calls", 0)), f"{verify:.2f} ms" if verify else "-",
            f"{row['plain_tok_s']:.0f}", f"{row['spec_tok_s']:.0f}", f"{row['speedup']:.2f}x", same_cell(row),
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
