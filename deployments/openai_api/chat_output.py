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
from tileinfer.deployments.openai_api.reasoning import (
    OPEN,
    ReasoningProgress,
    find_reasoning,
    thinking_rules,
    thinks,
)
from tileinfer.deployments.openai_api.tool_calls import (
    CallsProgress,
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
        reader = AnswerReader(self)
        reader.push(text, final, cut_short)
        return ParsedAnswer(reader.reasoning(), reader.content(), reader.calls)

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


class AnswerReader:
    """Reads an answer as it grows, each push scanning only what is new: the think block's end is searched
    for in the new text, and the calls are read on from the last whole one (CallsProgress). After a push,
    reasoning(), content() and calls hold the reading of everything pushed (what ChatOutputPlan.parse
    returns for that text)."""

    def __init__(self, plan: ChatOutputPlan) -> None:
        self.plan = plan
        self.text = OPEN if plan.opened else ""  # the output while its think block may be open
        self.answer: str | None = None if plan.thinking else ""  # the output after the think block
        self.reasoning_span: tuple[int, int] | None = None  # in text
        self.content_end = 0  # in answer
        self.calls: list[PartialCall] = []
        self._reasoning = ReasoningProgress()
        self._calls = CallsProgress()

    def push(self, new_text: str, final: bool, cut_short: bool = False) -> None:
        if self.answer is None:
            self.text += new_text
            self.reasoning_span, answer_start = find_reasoning(self.text, final, self._reasoning)
            if answer_start is not None:
                self.answer = self.text[answer_start:]
        else:
            self.answer += new_text
        answer = self.answer or ""
        if self.plan.tool_format is None:
            self.content_end = len(answer)
            return
        content_end, calls = self.plan.tool_format.scan(answer, final, self._calls)
        if cut_short and not calls:  # once, at the end: read again as if streaming
            streamed_end, calls = self.plan.tool_format.scan(answer, False, CallsProgress())
            content_end = streamed_end if calls else content_end
        if calls or not final:  # whitespace before a call is no content; while streaming, one may follow
            while content_end > 0 and answer[content_end - 1].isspace():
                content_end -= 1
        self.content_end, self.calls = content_end, calls

    def reasoning(self, start: int = 0) -> str | None:
        """The reasoning read so far from its start-th character (None: no think block)."""
        if self.reasoning_span is None:
            return None
        begin, end = self.reasoning_span
        return self.text[begin + start : end]

    def reasoning_length(self) -> int:
        return 0 if self.reasoning_span is None else self.reasoning_span[1] - self.reasoning_span[0]

    def content(self, start: int = 0) -> str:
        """The content read so far from its start-th character."""
        return (self.answer or "")[start : self.content_end]


class AnswerStream:
    """One choice's answer as it streams: push each new text, get the delta's fields to send."""

    def __init__(self, plan: ChatOutputPlan) -> None:
        self.plan = plan
        self.reader = AnswerReader(plan)
        self._sent_reasoning = 0
        self._sent_content = 0
        self._sent_calls: list[int] = []  # per call announced: the characters of its arguments sent

    def push(self, new_text: str, final: bool, finish_reason: str | None = None) -> dict[str, Any]:
        """The delta's fields for what `new_text` (and, final, the end) adds: reasoning_content, content,
        tool_calls (a call's first names it, with its id; then its arguments come in pieces)."""
        if self.plan.tool_format is None and not self.plan.thinking:  # plain text, as it comes
            return {"content": new_text} if new_text else {}
        reader = self.reader
        reader.push(new_text, final, cut_short=final and finish_reason == "length")
        delta: dict[str, Any] = {}
        if reader.reasoning_span is not None and reader.reasoning_length() > self._sent_reasoning:
            delta["reasoning_content"] = reader.reasoning(self._sent_reasoning)
            self._sent_reasoning = reader.reasoning_length()
        if reader.content_end > self._sent_content:
            delta["content"] = reader.content(self._sent_content)
            self._sent_content = reader.content_end
        tool_calls = []
        for index, call in enumerate(reader.calls):
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
