"""INT8 and FP8 accuracy against the model's own dtype, on a real model and a real English text: INT8
weights, the INT8 KV cache, both, and FP8 weights (e4m3 with a scale per 128 x 128 block, as an FP8
checkpoint of the model would hold them and the loader reads them back).

- Perplexity of the first TOKENS tokens of the Python standard library's `pydoc_data/topics.py` (a large
  English text present everywhere), teacher-forced in one sequence through the engine's paged cache.
- At the same positions: the largest logit error relative to the largest logit, and how often the
  top-1 token agrees.
- Greedy agreement over a set of chat prompts: identical outputs, and the mean length of the common
  prefix.

    python bench/int8_accuracy.py [--model smollm2-135m] [--device cpu] [--dtype float32] [--tokens 1024]
        [--modes weights,kv,both,fp8]

The default model is SmolLM2-135M (its Q4_1 GGUF, dequantized at load: the baseline's weights and the
INT8 quantizer's input). The table comes last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tileinfer.engine.config import EngineConfig  # noqa: E402
from tileinfer.engine.engine import Engine  # noqa: E402
from tileinfer.engine.models.decoder import is_layer_linear  # noqa: E402
from tileinfer.engine.models.fp8_checkpoint import dequantize_fp8, quantize_fp8  # noqa: E402
from tileinfer.engine.models.loader import LoadedModel, load_model  # noqa: E402
from tileinfer.engine.sampling.params import SamplingParams  # noqa: E402
from tileinfer.engine.sequence import Sequence  # noqa: E402
from tileinfer.engine.step import ScheduledRow  # noqa: E402

CHUNK = 256  # prompt tokens per teacher-forced prefill step
MODES = {  # what each INT8 mode changes in the engine's config
    "weights": {"quantization": "int8"},
    "kv": {"kv_cache_dtype": "int8"},
    "both": {"quantization": "int8", "kv_cache_dtype": "int8"},
    "fp8": {},  # the weights change instead (fp8_weights)
}
MODE_NAMES = {
    "weights": "INT8 weights", "kv": "INT8 KV cache", "both": "INT8 weights and KV",
    "fp8": "FP8 weights (128 x 128 blocks)",
}  # fmt: skip
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
)


def english_text() -> str:
    """pydoc_data's help topics, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


@dataclasses.dataclass(frozen=True)
class TextScores:
    perplexity: float
    logits: torch.Tensor  # float32 [positions, vocab]: each position's next-token logits


def score_text(engine: Engine, token_ids: list[int]) -> TextScores:
    """Teacher-forced next-token logits of token_ids[1:] (prefill chunks of CHUNK tokens, every row's
    logits), and their perplexity."""
    seq = Sequence("text", list(token_ids), SamplingParams())
    engine.block_manager.allocate(seq)
    rows: list[torch.Tensor] = []
    try:
        while seq.num_computed_tokens < len(token_ids):
            count = min(CHUNK, len(token_ids) - seq.num_computed_tokens)
            end = seq.num_computed_tokens + count
            # every row of the chunk: forward_eager returns a sequence's rows only once all are computed,
            # so the sequence is cut to this chunk's end while it runs
            seq.token_ids = list(token_ids[:end])
            logits = engine.runner.forward_eager([ScheduledRow(seq, count)], num_logits={seq: count})
            rows.append(logits.float().cpu())
            seq.num_computed_tokens = end
    finally:
        engine.block_manager.free(seq)
    logits = torch.cat(rows)[:-1]  # the last row predicts past the text
    targets = torch.tensor(token_ids[1:])
    nll = torch.nn.functional.cross_entropy(logits.double(), targets, reduction="mean")
    return TextScores(math.exp(nll.item()), logits)


def greedy_outputs(engine: Engine, prompts: tuple[str, ...], max_tokens: int) -> list[list[int]]:
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = []
    for prompt in prompts:
        token_ids, _, _ = engine.generate(
            tokenizer.encode_chat([{"role": "user", "content": prompt}]), params
        )
        outputs.append(token_ids)
    return outputs


def _common_prefix(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def evaluate(
    model: LoadedModel, config: EngineConfig, token_ids: list[int], prompts: tuple[str, ...], max_tokens: int
) -> tuple[TextScores, list[list[int]]]:
    engine = Engine(model, config)
    return score_text(engine, token_ids), greedy_outputs(engine, prompts, max_tokens)


def figures_against(
    base: tuple[TextScores, list[list[int]]], other: tuple[TextScores, list[list[int]]]
) -> dict[str, float]:
    """Perplexities, the largest logit error, top-1 and greedy agreement of `other` against `base`."""
    (base_text, base_greedy), (text, greedy) = base, other
    error = (text.logits - base_text.logits).abs().max() / base_text.logits.abs().max()
    prefixes = [_common_prefix(a, b) for a, b in zip(base_greedy, greedy, strict=True)]
    return {
        "tokens": base_text.logits.shape[0] + 1,
        "perplexity": base_text.perplexity,
        "perplexity_int8": text.perplexity,
        "perplexity_increase": text.perplexity / base_text.perplexity - 1,
        "max_logit_error": error.item(),
        "top1_agreement": (text.logits.argmax(-1) == base_text.logits.argmax(-1)).double().mean().item(),
        "greedy_identical": sum(a == b for a, b in zip(base_greedy, greedy, strict=True)) / len(prefixes),
        "greedy_common_prefix": sum(prefixes) / len(prefixes),
        "greedy_tokens": max(len(tokens) for tokens in base_greedy),
    }


def fp8_weights(model: LoadedModel) -> LoadedModel:
    """The model with each layer linear as an FP8 checkpoint holds it and the loader reads it back."""
    weights = {
        name: dequantize_fp8(*quantize_fp8(weight)).to(weight.dtype) if is_layer_linear(name) else weight
        for name, weight in model.weights.items()
    }
    return dataclasses.replace(model, weights=weights)


def compare(
    model: LoadedModel,
    config: EngineConfig,
    tokens: int,
    max_tokens: int,
    prompts: tuple[str, ...] = CHAT_PROMPTS,
    modes: tuple[str, ...] = tuple(MODES),
) -> dict[str, dict[str, float]]:
    """The baseline (config as given), run once, against each INT8 mode (MODES): figures by mode."""
    assert model.tokenizer is not None
    token_ids = model.tokenizer.encode(english_text())[:tokens]
    base = evaluate(model, config, token_ids, prompts, max_tokens)
    figures = {}
    for mode in modes:
        mode_model = fp8_weights(model) if mode == "fp8" else model
        mode_config = dataclasses.replace(config, **MODES[mode])
        measured = evaluate(mode_model, mode_config, token_ids, prompts, max_tokens)
        figures[mode] = figures_against(base, measured)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per chat prompt")
    parser.add_argument("--modes", default="weights,kv,both", help="comma-separated: " + ",".join(MODES))
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    config = EngineConfig(
        dtype=args.dtype, device=args.device, max_model_len=args.tokens + args.max_tokens + 64, max_num_seqs=1
    )
    model = load_model(args.model, dtype=config.torch_dtype(), device=config.torch_device())
    figures = compare(model, config, args.tokens, args.max_tokens, CHAT_PROMPTS, tuple(args.modes.split(",")))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
    print_table(args, figures)


def print_table(args: argparse.Namespace, figures: dict[str, dict[str, float]]) -> None:
    modes = list(figures)
    first = figures[modes[0]]

    def row(label: str, base: str, cell: Callable[[dict[str, float]], str]) -> None:
        print(f"| {label} | {base} | " + " | ".join(cell(figures[mode]) for mode in modes) + " |")

    names = " | ".join(MODE_NAMES[mode] for mode in modes)
    print(f"| {args.model}, {args.dtype} on {args.device} | {args.dtype} | {names} |")
    print("| --- | ---: |" + " ---: |" * len(modes))
    row(
        f"perplexity, {first['tokens']} tokens of pydoc_data/topics.py", f"{first['perplexity']:.4f}",
        lambda f: f"{f['perplexity_int8']:.4f} ({100 * f['perplexity_increase']:+.2f} %)",
    )  # fmt: skip
    row("top-1 agreement at those positions", "", lambda f: f"{100 * f['top1_agreement']:.2f} %")
    row("largest logit error / largest logit", "", lambda f: f"{f['max_logit_error']:.4f}")
    row(
        f"greedy outputs identical ({len(CHAT_PROMPTS)} chat prompts, {args.max_tokens} tokens)", "",
        lambda f: f"{100 * f['greedy_identical']:.0f} % (common prefix {f['greedy_common_prefix']:.1f})",
    )  # fmt: skip


if __name__ == "__main__":
    main()
