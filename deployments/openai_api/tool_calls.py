"""Tool calls in a model's own format: found in its output (whole or as it streams), and forced by a grammar.

A format is chosen by the chat template (format_for_template): Qwen3 and Hermes write
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, Llama 3.x a bare `{"name": ..., "parameters": ...}`
(after `<|python_tag|>` or not, several joined by `;`), Mistral `[TOOL_CALLS]` then a JSON list of calls
(v3) or `name[ARGS]{...}` per call (v11). A template that ignores `tools` (SmolLM2's ChatML) gets the
Hermes format, its tools described in a system message (fallback_messages).

parse(text, final) reads the output so far: the content before the calls and each call as far as it goes.
While streaming (final false) it holds back what may still turn out to be a marker or the call object's
closing brace, so what it returns only grows; the stream sends the difference
(deployments/openai_api/chat_output.py), reading it with scan and a CallsProgress, which resumes after
the last whole call instead of reading the answer again. A final text whose calls do not parse is
content, as vLLM's parsers return it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from llguidance import LLMatcher
from tileinfer.engine.sampling.grammar import lark_json

# Looks a token up by its text: its id when the text is one token of the vocabulary, else None.
TokenIdOf = Callable[[str], int | None]


@dataclasses.dataclass
class PartialCall:
    """A call as far as the output goes: its name once whole, its arguments' JSON text so far."""

    name: str
    arguments: str
    complete: bool


@dataclasses.dataclass(frozen=True)
class Function:
    """A tool's function as the grammar and the fallback prompt need it."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None  # a JSON Schema of the arguments; None: no arguments


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def schema_problem(parameters: dict[str, Any] | None) -> str | None:
    """Why a tool's parameters are not a JSON Schema of an object (as llguidance compiles it), or None."""
    if parameters is None:
        return None
    if not isinstance(parameters, dict):
        return "it must be an object"
    kind = parameters.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        return f"it must describe an object (type 'object'), not {kind!r}"
    try:
        problem = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(json.dumps(parameters)))
    except (ValueError, TypeError) as error:
        problem = str(error)
    return problem or None


def lark_literal(text: str, token_id_of: TokenIdOf) -> str:
    """A Lark (llguidance) expression for `text`: its token, where it is one, or its characters (a model
    may spell a marker either way; llguidance takes added tokens only as tokens)."""
    literal = json.dumps(text, ensure_ascii=False)
    token_id = token_id_of(text)
    return literal if token_id is None else f"(<[{token_id}]> | {literal})"


# ---- reading a call object -----------------------------------------------------------------------

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\r\n"
# the start of a call object in the order grammars force: its name, then its arguments' key
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in _WHITESPACE:
        position += 1
    return position


def _json_value(text: str, position: int) -> tuple[Any, int] | None:
    """The JSON value at text[position:] (after whitespace) and the index after it; None if it is not
    (yet) whole."""
    try:
        return _DECODER.raw_decode(text, _skip_whitespace(text, position))
    except json.JSONDecodeError:
        return None


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _call_object(text: str, position: int, final: bool) -> tuple[PartialCall | None, int | None]:
    """The call object `{"name": ..., "arguments" or "parameters": ...}` at text[position:]: the call so
    far and, once the object is whole, the index after it. (None, None): no call (yet)."""
    head = _CALL_HEAD.match(text, position)
    # the arguments as the model wrote them (what streams), once whole
    written = _written_value(text, head.end()) if head is not None else None
    whole = _json_value(text, position)
    if whole is not None:
        value, end = whole
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None, None
        arguments = value.get("arguments", value.get("parameters", {}))
        as_written = written is not None and not isinstance(arguments, str) and written[0] == arguments
        return PartialCall(value["name"], written[1] if as_written else _arguments_text(arguments), True), end
    if final or head is None:
        return None, None
    if written is not None:
        streamed = written[1] if not isinstance(written[0], str) else ""
    else:  # as written so far, less what may close it; a string value waits until whole
        so_far = text[head.end() :]
        streamed = so_far.rstrip("}" + _WHITESPACE) if so_far.startswith("{") else ""
    return PartialCall(json.loads(head.group(1)), streamed, complete=False), None


def _written_value(text: str, position: int) -> tuple[Any, str] | None:
    """The JSON value at text[position:] and its text as written, once whole."""
    whole = _json_value(text, position)
    return None if whole is None else (whole[0], text[_skip_whitespace(text, position) : whole[1]])


def held_back(text: str, marker: str, start: int = 0) -> int:
    """Where text (read from start) ends less an end that may begin the marker, held back while streaming."""
    for length in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:length]):
            return len(text) - length
    return len(text)


@dataclasses.dataclass
class CallsProgress:
    """How far a format has read an answer that only grows, so that reading it again scans only what is
    new: where the search for the calls' marker resumes, where the calls begin (the content ends), and
    the calls read whole so far with the end of the last (reading resumes after it)."""

    searched: int = 0
    start: int | None = None
    whole: list[PartialCall] = dataclasses.field(default_factory=list)
    resume: int = 0  # the end of the last whole call; before one: where the first call begins


def _find_marker(text: str, marker: str, progress: CallsProgress) -> int | None:
    """Where the marker that starts the calls is (also progress.start), or None: not yet."""
    if progress.start is None:
        start = text.find(marker, progress.searched)
        if start < 0:
            progress.searched = max(progress.searched, len(text) - len(marker) + 1)
            return None
        progress.start = progress.resume = start
    return progress.start


# ---- the formats -------------------------------------------------------------------------------


class ToolCallFormat:
    """One family's way of writing calls."""

    name: str
    arguments_key = "arguments"
    needs_special_tokens = False  # its markers are special tokens, which the text must keep

    def parse(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        """(content, calls): the text before the calls, and the calls so far."""
        content_end, calls = self.scan(text, final, CallsProgress())
        return text[:content_end], calls

    def scan(self, text: str, final: bool, progress: CallsProgress) -> tuple[int, list[PartialCall]]:
        """parse's reading by index: (where the content ends, the calls so far). A stream calls it again
        as its text grows, with the same progress, so that only what follows the last whole call is read."""
        raise NotImplementedError

    def calls_rules(self, functions: Sequence[Function], parallel: bool, token_id_of: TokenIdOf) -> str:
        """Lark rules whose rule `tool_calls` matches one call (parallel: one or more) of these functions,
        each with arguments that validate against its parameters, on one line (lark_json)."""
        raise NotImplementedError

    def template_call_id(self, call_id: str) -> str:
        """The id a call has in a prompt this family's template renders."""
        return call_id

    def _call_schema(self, functions: Sequence[Function]) -> dict[str, Any]:
        """JSON Schema of a call object of any of `functions`: the name first, then the arguments."""
        definitions: dict[str, Any] = {}
        options = []
        for function in functions:
            parameters = dict(function.parameters or {"type": "object", "additionalProperties": False})
            for key in ("$defs", "definitions"):  # `#/$defs/...` refers to the root: move them there
                definitions.setdefault(key, {}).update(parameters.pop(key, {}))
            options.append({
                "type": "object",
                "properties": {"name": {"const": function.name}, self.arguments_key: parameters},
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            })  # fmt: skip
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return {**schema, **definitions}


class HermesFormat(ToolCallFormat):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call (Qwen2.5/3,
    Hermes, and the fallback)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool, progress: CallsProgress) -> tuple[int, list[PartialCall]]:
        start = _find_marker(text, self.OPEN, progress)
        if start is None:
            return len(text) if final else held_back(text, self.OPEN), []
        calls = list(progress.whole)
        position = self._next_open(text, progress.resume) if calls else start
        while position >= 0:
            call, end = _call_object(text, position + len(self.OPEN), final)
            if call is None:
                if final:
                    return len(text), []
                break
            calls.append(call)
            if end is None:
                break
            progress.whole.append(call)
            progress.resume = end
            position = self._next_open(text, end)
        return start, calls

    def _next_open(self, text: str, end: int) -> int:
        """The next call's marker after a whole call ending at `end` (and its closing marker), or -1."""
        position = _skip_whitespace(text, end)
        if text.startswith(self.CLOSE, position):
            position += len(self.CLOSE)
        return text.find(self.OPEN, position)

    def calls_rules(self, functions: Sequence[Function], parallel: bool, token_id_of: TokenIdOf) -> str:
        repeat = ' ("\\n" tool_call)*' if parallel else ""
        return (
            f"tool_calls: tool_call{repeat}\n"
            f'tool_call: {lark_literal(self.OPEN, token_id_of)} "\\n" call_object "\\n" '
            f"{lark_literal(self.CLOSE, token_id_of)}\n"
            f"call_object: {lark_json(self._call_schema(functions))}\n"
        )


class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.x's JSON calls: the whole answer is `{"name": ..., "parameters": {...}}` (after
    `<|python_tag|>` or not), several joined by `;`."""

    name = "llama3_json"
    arguments_key = "parameters"
    PYTHON_TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool, progress: CallsProgress) -> tuple[int, list[PartialCall]]:
        if progress.start is None:
            position = _skip_whitespace(text, 0)
            if text.startswith(self.PYTHON_TAG, position):
                position = _skip_whitespace(text, position + len(self.PYTHON_TAG))
            if not text.startswith("{", position):
                rest = len(text) - position
                may_begin_a_call = not final and rest <= len(self.PYTHON_TAG)
                may_begin_a_call = may_begin_a_call and self.PYTHON_TAG.startswith(text[position:])
                return (0 if may_begin_a_call else len(text)), []
            progress.start, progress.resume = 0, position
        calls = list(progress.whole)
        position = progress.resume
        if calls:  # after a whole call: `;` and the next, or the end
            position = _skip_whitespace(text, position)
            if not text.startswith(";", position):
                return 0, calls
            position += 1
        while True:
            call, end = _call_object(text, position, final)
            if call is None:
                # final: a JSON answer, not a call; streaming: it may still become one
                return (len(text) if final else 0), ([] if final else calls)
            calls.append(call)
            if end is None:
                return 0, calls
            progress.whole.append(call)
            progress.resume = end
            position = _skip_whitespace(text, end)
            if not text.startswith(";", position):
                return 0, calls
            position += 1

    def calls_rules(self, functions: Sequence[Function], parallel: bool, token_id_of: TokenIdOf) -> str:
        repeat = ' ("; " call_object)*' if parallel else ""
        return f"tool_calls: call_object{repeat}\ncall_object: {lark_json(self._call_schema(functions))}\n"


class MistralFormat(ToolCallFormat):
    """`[TOOL_CALLS]` then a JSON list of call objects (v3 templates: Mistral Nemo, 7B v0.3), or
    `[TOOL_CALLS]name[ARGS]{...}` per call (v11: Mistral Small 3.2, Devstral). Its markers are special
    tokens; its templates take only 9-character alphanumeric call ids."""

    name = "mistral"
    needs_special_tokens = True
    TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

    def __init__(self, name_then_arguments: bool) -> None:
        self.name_then_arguments = name_then_arguments  # v11

    def template_call_id(self, call_id: str) -> str:
        return "".join(character for character in call_id if character.isalnum())[-9:].rjust(9, "0")

    def scan(self, text: str, final: bool, progress: CallsProgress) -> tuple[int, list[PartialCall]]:
        start = _find_marker(text, self.TOOL_CALLS, progress)
        if start is None:
            return len(text) if final else held_back(text, self.TOOL_CALLS), []
        position = _skip_whitespace(text, start + len(self.TOOL_CALLS))
        if text.startswith("[", position):
            calls = self._listed_calls(text, position + 1, final, progress)
        else:
            calls = self._named_calls(text, start, final, progress)
        if calls is None:
            return (len(text), []) if final else (start, [])
        return start, calls

    def _listed_calls(
        self, text: str, position: int, final: bool, progress: CallsProgress
    ) -> list[PartialCall] | None:
        calls = list(progress.whole)
        if calls:  # after a whole call: `,` and the next, or the end
            position = _skip_whitespace(text, progress.resume)
            if not text.startswith(",", position):
                return calls
            position += 1
        while True:
            call, end = _call_object(text, position, final)
            if call is None:
                return None if final else calls
            calls.append(call)
            if end is None:
                return calls
            progress.whole.append(call)
            progress.resume = end
            position = _skip_whitespace(text, end)
            if not text.startswith(",", position):
                return calls
            position += 1

    def _named_calls(
        self, text: str, position: int, final: bool, progress: CallsProgress
    ) -> list[PartialCall] | None:
        calls = list(progress.whole)
        if calls:
            position = _skip_whitespace(text, progress.resume)
        while text.startswith(self.TOOL_CALLS, position):
            position += len(self.TOOL_CALLS)
            arguments_marker = text.find(self.ARGS, position)
            if arguments_marker < 0:
                return None if final else calls
            name = text[position:arguments_marker].split(self.CALL_ID)[0].strip()
            arguments_start = arguments_marker + len(self.ARGS)
            whole = _json_value(text, arguments_start)
            if whole is None:
                if final:
                    return None
                calls.append(PartialCall(name, text[arguments_start:].strip(_WHITESPACE), complete=False))
                return calls
            value, end = whole
            written = text[_skip_whitespace(text, arguments_start) : end]
            arguments = _arguments_text(value) if isinstance(value, str) else written
            calls.append(PartialCall(name, arguments, complete=True))
            progress.whole.append(calls[-1])
            progress.resume = end
            position = _skip_whitespace(text, end)
        return calls

    def calls_rules(self, functions: Sequence[Function], parallel: bool, token_id_of: TokenIdOf) -> str:
        marker = lark_literal(self.TOOL_CALLS, token_id_of)
        if not self.name_then_arguments:
            repeat = ' (", " call_object)*' if parallel else ""
            return (
                f'tool_calls: {marker} "[" call_object{repeat} "]"\n'
                f"call_object: {lark_json(self._call_schema(functions))}\n"
            )
        arguments = lark_literal(self.ARGS, token_id_of)
        rules = [f"tool_calls: tool_call{'+' if parallel else ''}"]
        rules.append("tool_call: " + " | ".join(f"call_{index}" for index in range(len(functions))))
        for index, function in enumerate(functions):
            parameters = function.parameters or {"type": "object", "additionalProperties": False}
            rules.append(f"call_{index}: {marker} {json.dumps(function.name)} {arguments} arguments_{index}")
            rules.append(f"arguments_{index}: {lark_json(parameters)}")
        return "\n".join(rules) + "\n"


@functools.lru_cache(maxsize=8)  # one template per server, asked per request; formats hold no state
def format_for_template(template: str | None) -> tuple[ToolCallFormat, bool]:
    """The call format a chat template teaches its model, and whether the template renders `tools`
    itself (else: fallback_messages)."""
    template = template or ""
    renders_tools = re.search(r"\btools\b", template) is not None
    if MistralFormat.TOOL_CALLS in template:
        return MistralFormat(name_then_arguments=MistralFormat.ARGS in template), renders_tools
    if HermesFormat.OPEN in template or not renders_tools:
        return HermesFormat(), renders_tools
    if Llama3JsonFormat.PYTHON_TAG in template or '"parameters"' in template:
        return Llama3JsonFormat(), renders_tools
    return HermesFormat(), renders_tools


# ---- the fallback: tools for a template that ignores them -------------------------------------------

_FALLBACK_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation with tools for a template that knows only roles and text (Hermes' conventions, as
    Qwen's templates write them): the tools in the system message, an assistant's calls as
    `<tool_call>` blocks in its text, and a tool's result as a user message in `<tool_response>`."""
    described = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    instructions = _FALLBACK_INSTRUCTIONS.format(tools=described) if tools else None
    rewritten: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            blocks = [
                f"<tool_call>\n{json.dumps(_call_in_prompt(call), ensure_ascii=False)}\n</tool_call>"
                for call in message["tool_calls"]
            ]
            text = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
            message = {"role": "assistant", "content": text}
        elif message["role"] == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        rewritten.append(message)
    if instructions is None:
        return rewritten
    if rewritten and rewritten[0]["role"] == "system":
        first = rewritten[0]
        return [{**first, "content": f"{first['content']}\n\n{instructions}"}, *rewritten[1:]]
    return [{"role": "system", "content": instructions}, *rewritten]


def _call_in_prompt(call: dict[str, Any]) -> dict[str, Any]:
    return {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
