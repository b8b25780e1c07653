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

from typing import Any

from tileinfer.deployments.openai_api.tool_calls import TokenIdOf, lark_literal

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str | None, template_kwargs: dict[str, Any]) -> bool:
    """Whether the output may start with a think block: a template that writes one, and thinking on."""
    return template is not None and OPEN in template and template_kwargs.get("enable_thinking") is not False


def prompt_opens_thinking(prompt: str, template: str | None) -> bool:
    """Whether the rendered prompt ends inside a think block (`<think>` and whitespace at its end); only a
    template that writes `<think>` opens one, so others skip the check."""
    return template is not None and OPEN in template and prompt.rstrip().endswith(OPEN)


def split_reasoning(text: str, final: bool) -> tuple[str | None, str]:
    """(reasoning, answer) of the output so far; reasoning None: no think block. While streaming (final
    false) what may still be `<think>` or `</think>` is held back."""
    if not text.startswith(OPEN):
        if not final and OPEN.startswith(text):
            return "", ""  # the output may yet start with <think>
        return None, text
    block = text[len(OPEN) :]
    end = block.find(CLOSE)
    if end >= 0:
        return block[:end], block[end + len(CLOSE) :]
    if not final:
        for length in range(min(len(CLOSE) - 1, len(block)), 0, -1):
            if block.endswith(CLOSE[:length]):
                return block[:-length], ""
    return block, ""


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
