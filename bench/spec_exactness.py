"""Where speculative greedy output parts from plain decoding on the GPU, and which engine path it takes
to do so: n-gram speculation (up to 15 drafts) on bench_spec's prompts, with run-ahead, step graphs and
the adaptive draft count each switched off in turn, beside plain decoding under the same switches.

    python bench/spec_exactness.py [OUT_DIR] [--max-tokens 256]

Prints one line per configuration: for each prompt where it parts from plain decoding with every
default on, the first token where it does, the two tokens there, and plain decoding's top-2 logprob gap
in that context (near 0, a bf16 ulp or so: a near-tie that another kernel's rounding may flip).
Writes OUT_DIR/spec_exactness.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_spec import CODE_EDIT, OPEN_CHAT, run_set  # noqa: E402
from bench.divergence import differences  # noqa: E402
from engine.default_model import default_model_path  # noqa: E402
from engine.engine import Engine, EngineConfig  # noqa: E402
from engine.loader import load_model  # noqa: E402

NGRAM = {"proposer": "ngram", "num_draft": 15}
CONFIGURATIONS: list[tuple[str, dict]] = [
    ("plain, run-ahead off", {"run_ahead": False}),
    ("plain, step graphs off", {"step_graphs": False}),
    ("ngram", NGRAM),
    ("ngram, run-ahead off", {**NGRAM, "run_ahead": False}),
    ("ngram, step graphs off", {**NGRAM, "step_graphs": False}),
    ("ngram, fixed 15 drafts", {**NGRAM, "adapt_num_draft": False}),
    ("ngram, no graphs at all", {**NGRAM, "step_graphs": False, "cuda_graphs": False}),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    base = EngineConfig(device=args.device, dtype=dtype, max_model_len=4096, kv_cache_tokens=16384)
    model = load_model(str(default_model_path()), dtype=base.torch_dtype(), device=args.device)
    tokenizer = model.tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in OPEN_CHAT + CODE_EDIT]
    reference = Engine(model, base)
    expected = run_set(reference, prompts, args.max_tokens)["outputs"]
    rows = []
    for name, settings in CONFIGURATIONS:
        engine = Engine(model, EngineConfig(**{**vars(base), **settings}))
        outputs = run_set(engine, prompts, args.max_tokens)["outputs"]
        row: dict = {
            "configuration": name,
            "differences": list(differences(reference, prompts, outputs, expected)),
        }
        if engine.speculator is not None:
            row["stats"] = vars(engine.speculator.stats)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del engine
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec_exactness.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
