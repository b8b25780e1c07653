"""Qwen3's thinking: the text between `<think>` and `</think>` is the reasoning, the rest the answer.

As vLLM's Qwen3 reasoning parser returns them: `reasoning_content` is the text inside the block, the
content what follows `</think>`; an output that does not start with `<think>` is all content, and a block
cut off before `</think>` (max_tokens) is all reasoning. A chat template thinks when it writes `<think>`
and the request leaves `enable_thinking` on (Qwen3's switch, a chat_template_kwargs entry). Where the
prompt itself ends with `<think>` (QwQ's and DeepSeek-R1's distilled models' templates open the block in
the generation prompt), the output starts inside the block: its text up to `</think>` is the reasoning.

thinking_rules wraps a grammar (a response format's, or forced tool calls') so that it constrains only
the answer: any think block may come first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tileinfer.deployments.openai_api.tool_calls import TokenIdOf, held_back, lark_literal

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str | None, template_kwargs: dict[str, Any]) -> bool:
    """Whether the output may start with a think block: a template that writes one, and thinking on."""
    return template is not None and OPEN in template and template_kwargs.get("enable_thinking") is not False


def prompt_opens_thinking(prompt: str, template: str | None) -> bool:
    """Whether the rendered prompt ends inside a think block (`<think>` and whitespace at its end); only a
    template that writes `<think>` opens one, so others skip the check."""
    return template is not None and OPEN in template and prompt.rstrip().endswith(OPEN)


@dataclasses.dataclass
class ReasoningProgress:
    """Where the search for `</think>` resumes in an output that only grows (the text before holds none)."""

    searched: int = len(OPEN)


def find_reasoning(
    text: str, final: bool, progress: ReasoningProgress
) -> tuple[tuple[int, int] | None, int | None]:
    """The output so far, read by index: (the reasoning's span in text, or None: no think block; where
    the answer starts, or None: not yet, or never in a final text cut off in the block). While streaming
    (final false) what may still be `<think>` or `</think>` is held back. A stream calls it again as its
    text grows with the same progress, and only the new text is searched."""
    if not text.startswith(OPEN):
        if not final and OPEN.startswith(text):
            return (0, 0), None  # the output may yet start with <think>
        return None, 0
    end = text.find(CLOSE, progress.searched)
    if end >= 0:
        return (len(OPEN), end), end + len(CLOSE)
    progress.searched = max(progress.searched, len(text) - len(CLOSE) + 1)
    if final:
        return (len(OPEN), len(text)), None
    return (len(OPEN), held_back(text, CLOSE, len(OPEN))), None


def thinking_rules(answer_rule: str, token_id_of: TokenIdOf, opened: bool = False) -> str:
    """Lark rules for `start`: a think block or none, then `answer_rule`; opened (the prompt began the
    block): the rest of the block, then `answer_rule`."""
    optional, opening = ("", "") if opened else ("?", f"{lark_literal(OPEN, token_id_of)} ")
    return (
        f"start: think{optional} {answer_rule}\n"
        f"think: {opening}THOUGHT {lark_literal(CLOSE, token_id_of)} AFTER_THOUGHT\n"
        "THOUGHT: /(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/\n"
        "AFTER_THOUGHT: /\\n*/\n"
    )
