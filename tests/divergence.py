"""Where two greedy outputs part, and how close a call the reference's choice was there: its top-2
logprob gap. A gap near 0 is a numerical near-tie (kernels that sum in another order may flip it); a
large one is a bug."""

from __future__ import annotations

from collections.abc import Iterator

from tileinfer.engine.engine import Engine
from tileinfer.engine.sampling.params import SamplingParams


def first_difference(got: list[int], expected: list[int]) -> int | None:
    """The index of the first token where two outputs part (the shorter one's length if one is a
    prefix of the other), or None if they are equal."""
    index = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    if index is None and len(got) != len(expected):
        return min(len(got), len(expected))
    return index


def top2_gap(reference: Engine, prompt: list[int], expected: list[int], index: int) -> float:
    """The reference engine's top-2 logprob gap at token `index` of `expected`, in expected's own context:
    the prompt and expected[:index] are prefilled (teacher-forced), so the gap belongs to the context where
    the outputs parted (a fresh greedy run could itself part from `expected` earlier)."""
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=2, ignore_eos=True)
    (output,) = list(reference.stream(prompt + expected[:index], params))
    (top1, top2) = output.new_logprobs[0].top[:2]
    return top1[1] - top2[1]


def differences(
    reference: Engine, prompts: list[list[int]], got: list[list[int]], expected: list[list[int]]
) -> Iterator[dict]:
    """For each prompt whose outputs part, in order: the prompt's index, the first token where they do,
    the two tokens there and the reference's top-2 gap there; or `one_ends` where one output is a prefix
    of the other. Lazy: a gap (one reference run) is computed only when its entry is taken."""
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        position = first_difference(a, b)
        if position is None:
            continue
        if position >= min(len(a), len(b)):
            yield {"prompt": index, "token": position, "one_ends": True}
        else:
            gap = top2_gap(reference, prompts[index], b, position)
            yield {
                "prompt": index,
                "token": position,
                "got": a[position],
                "expected": b[position],
                "top2_gap": gap,
            }


def describe(reference: Engine, prompt: list[int], got: list[int], expected: list[int]) -> str:
    found = next(differences(reference, [prompt], [got], [expected]), None)
    if found is None:
        return "equal"
    if "one_ends" in found:
        return f"one is a prefix of the other: lengths {len(got)} and {len(expected)}"
    return (
        f"first difference at token {found['token']}: {found['got']} vs {found['expected']}; the "
        f"reference's top-2 logprob gap there is {found['top2_gap']:.3e}"
    )
