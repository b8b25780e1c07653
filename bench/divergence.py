"""Where two greedy outputs part, and how close a call the reference's choice was there: its top-2
logprob gap. A gap near 0 is a numerical near-tie (kernels that sum in another order may flip it); a
large one is a bug."""

from __future__ import annotations

from engine.engine import Engine
from engine.sampling import SamplingParams


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


def describe(reference: Engine, prompt: list[int], got: list[int], expected: list[int]) -> str:
    index = first_difference(got, expected)
    if index is None:
        return "equal"
    if index >= min(len(got), len(expected)):
        return f"one is a prefix of the other: lengths {len(got)} and {len(expected)}"
    gap = top2_gap(reference, prompt, expected, index)
    return (
        f"first difference at token {index}: {got[index]} vs {expected[index]}; the reference's top-2 "
        f"logprob gap there is {gap:.3e}"
    )
