"""A chat answer beyond its text: the reasoning (deployments/openai_api/reasoning.py) and the tool calls
(deployments/openai_api/tool_calls.py) in it, the grammar that forces them, and the message or stream deltas
that carry them (OpenAI's `message.tool_calls`, `delta.tool_calls`; vLLM's `reasoning_content`).

ChatOutputPlan.for_request decides, per request, what the answer may hold; constrain() gives a choice's
SamplingParams the grammar it needs; message() reads a whole answer, AnswerStream one as it streams.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from tileinfer.deployments.openai_api.chat_request import ChatCompletionRequest, NamedToolChoice
from tileinfer.deployments.openai_api.errors import OpenAIError
from tileinfer.deployments.openai_api.reasoning import OPEN, split_reasoning, thinking_rules, thinks
from tileinfer.deployments.openai_api.tool_calls import (
    Function,
    PartialCall,
    TokenIdOf,
    ToolCallFormat,
    format_for_template,
    new_call_id,
)
from tileinfer.engine.sampling.grammar import lark_json
from tileinfer.engine.sampling.params import GrammarSpec, SamplingParams


@dataclasses.dataclass
class ParsedAnswer:
    reasoning: str | None  # None: no think block (or none parsed)
    content: str
    calls: list[PartialCall]


@dataclasses.dataclass
class ChatOutputPlan:
    tool_format: ToolCallFormat | None  # None: calls are not read (no tools, or tool_choice none)
    thinking: bool
    forced: list[Function]  # a forced call is one of these (required: every tool; a named one)
    functions: list[Function]  # every tool's
    parallel: bool
    token_id_of: TokenIdOf
    opened: bool = False  # the prompt began the think block: the answer starts inside it

    @classmethod
    def for_request(
        cls,
        request: ChatCompletionRequest,
        template: str | None,
        token_id_of: TokenIdOf,
        prompt_opens_thinking: bool = False,
    ) -> ChatOutputPlan:
        functions = [
            Function(tool.function.name, tool.function.description, tool.function.parameters)
            for tool in request.tools
        ]
        choice = request.effective_tool_choice
        if isinstance(choice, NamedToolChoice):
            forced = [function for function in functions if function.name == choice.function.name]
        else:
            forced = functions if choice == "required" else []
        tool_format = format_for_template(template)[0] if functions and choice != "none" else None
        thinking = prompt_opens_thinking or thinks(template, request.chat_template_kwargs)
        return cls(
            tool_format, thinking, forced, functions, request.parallel_tool_calls, token_id_of,
            prompt_opens_thinking,
        )  # fmt: skip

    # ---- the grammar ----------------------------------------------------------------------------

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """`params` with the grammar this answer needs: a forced call; or the response format's grammar
        (params.grammar) or a call (tool_choice auto); either after a think block where the model thinks.
        Keeps special tokens in the text where the call format's markers are special tokens."""
        if self.tool_format is not None and self.tool_format.needs_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        rules: list[str] = []
        alternatives: list[str] = []
        if self.forced:
            alternatives.append("tool_calls")
        elif params.grammar is not None and params.grammar.kind == "lark" and not self.thinking:
            return params  # a Lark grammar cannot sit beside a call: the answer follows it (no call)
        elif params.grammar is not None and (self.tool_format is not None or self.thinking):
            rules.append(_answer_rule(params.grammar))
            alternatives.append("formatted")
            if self.tool_format is not None:
                alternatives.append("tool_calls")
        if not alternatives:
            return params
        if "tool_calls" in alternatives:
            functions = self.forced or self.functions
            assert self.tool_format is not None
            rules.append(self.tool_format.calls_rules(functions, self.parallel, self.token_id_of))
        start = "start: answer\n"
        if self.thinking:
            start = thinking_rules("answer", self.token_id_of, self.opened)
        lark = start + f"answer: {' | '.join(alternatives)}\n" + "".join(rules)
        return dataclasses.replace(params, grammar=GrammarSpec("lark", lark))

    # ---- reading the answer ---------------------------------------------------------------------

    def parse(self, text: str, final: bool, cut_short: bool = False) -> ParsedAnswer:
        """The answer so far (final: all of it). cut_short (max_tokens ended it): a last call cut off is
        kept as far as it goes, as the stream sent it, rather than the whole answer read as content."""
        if self.opened:
            text = OPEN + text
        reasoning, answer = split_reasoning(text, final) if self.thinking else (None, text)
        if self.tool_format is None:
            return ParsedAnswer(reasoning, answer, [])
        content, calls = self.tool_format.parse(answer, final)
        if cut_short and not calls:
            content_so_far, calls = self.tool_format.parse(answer, final=False)
            content = content_so_far if calls else content
        if calls or not final:  # whitespace before a call is no content; while streaming, one may follow
            content = content.rstrip()
        return ParsedAnswer(reasoning, content, calls)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole answer's message, and its finish_reason ("tool_calls" for one that ends in calls)."""
        parsed = self.parse(text, final=True, cut_short=finish_reason == "length")
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.calls or (parsed.reasoning is not None and not parsed.content):
            message["content"] = parsed.content or None
        if self.thinking:
            message["reasoning_content"] = parsed.reasoning
        if parsed.calls:
            message["tool_calls"] = [
                {"id": new_call_id(), "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
                for call in parsed.calls
            ]  # fmt: skip
        return message, _finish_reason(bool(parsed.calls), finish_reason)

    def stream(self) -> AnswerStream:
        return AnswerStream(self)


class AnswerStream:
    """One choice's answer as it streams: push each new text, get the delta's fields to send."""

    def __init__(self, plan: ChatOutputPlan) -> None:
        self.plan = plan
        self.text = ""
        self._sent_reasoning = 0
        self._sent_content = 0
        self._sent_calls: list[int] = []  # per call announced: the characters of its arguments sent

    def push(self, new_text: str, final: bool, finish_reason: str | None = None) -> dict[str, Any]:
        """The delta's fields for what `new_text` (and, final, the end) adds: reasoning_content, content,
        tool_calls (a call's first names it, with its id; then its arguments come in pieces)."""
        if self.plan.tool_format is None and not self.plan.thinking:  # plain text, as it comes
            return {"content": new_text} if new_text else {}
        self.text += new_text
        parsed = self.plan.parse(self.text, final, cut_short=final and finish_reason == "length")
        delta: dict[str, Any] = {}
        if parsed.reasoning is not None and len(parsed.reasoning) > self._sent_reasoning:
            delta["reasoning_content"] = parsed.reasoning[self._sent_reasoning :]
            self._sent_reasoning = len(parsed.reasoning)
        if len(parsed.content) > self._sent_content:
            delta["content"] = parsed.content[self._sent_content :]
            self._sent_content = len(parsed.content)
        tool_calls = []
        for index, call in enumerate(parsed.calls):
            if index == len(self._sent_calls):
                function = {"name": call.name, "arguments": call.arguments}
                announced = {"index": index, "id": new_call_id(), "type": "function", "function": function}
                tool_calls.append(announced)
                self._sent_calls.append(len(call.arguments))
            elif len(call.arguments) > self._sent_calls[index]:
                piece = call.arguments[self._sent_calls[index] :]
                tool_calls.append({"index": index, "function": {"arguments": piece}})
                self._sent_calls[index] = len(call.arguments)
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return delta

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return _finish_reason(bool(self._sent_calls), finish_reason)


def _finish_reason(called: bool, finish_reason: str | None) -> str | None:
    """ "tool_calls" for an answer that made calls and ended by itself; "length" stays."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def _answer_rule(grammar: GrammarSpec) -> str:
    """A response format's grammar as the Lark rule `formatted`, to sit after a think block or beside a
    call; 400 for a Lark grammar after a think block (it cannot be embedded)."""
    if grammar.kind == "json":
        try:
            schema = json.loads(grammar.source)
        except ValueError as error:
            message = f"the JSON Schema is not JSON: {error}"
            raise OpenAIError.invalid_request(message, param="structured_outputs") from None
        return f"formatted: {lark_json(schema)}\n"
    if grammar.kind == "regex":
        return "formatted: /" + re.sub(r"(?<!\\)/", r"\\/", grammar.source) + "/\n"
    if grammar.kind == "choice":
        return "formatted: " + " | ".join(json.dumps(text) for text in json.loads(grammar.source)) + "\n"
    raise OpenAIError.invalid_request(
        "a grammar cannot follow a think block (it is not embedded in another grammar); set "
        'chat_template_kwargs {"enable_thinking": false} to constrain the whole answer',
        param="structured_outputs",
    )
