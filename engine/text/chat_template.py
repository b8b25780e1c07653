"""Chat templates rendered with jinja2 exactly as transformers renders them (apply_chat_template).

Same sandboxed environment and options (trim_blocks, lstrip_blocks, loop controls), the same
globals (raise_exception, strftime_now) and the same `tojson` filter, so a prompt is byte-identical
to what the model's authors produce. Template errors become InvalidRequestError.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tileinfer.engine.errors import InvalidRequestError

# Names a message's reasoning may come under; templates read `reasoning_content` (gpt-oss: `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def load_chat_template(file_or_text: str) -> str:
    """A user's chat template (the chat_template app arg, --chat-template): a file's text, or the template
    itself; it renders in the same sandbox as a model's own. InvalidRequestError when it is neither, or does
    not compile."""
    path = Path(file_or_text)
    try:
        is_file = "\n" not in file_or_text and len(file_or_text) < 4096 and path.is_file()
    except OSError:  # a name the file system refuses (too long, ...): text
        is_file = False
    if is_file:
        template = path.read_text(encoding="utf-8")
    elif "{{" in file_or_text or "{%" in file_or_text:
        template = file_or_text
    else:
        raise InvalidRequestError(
            f"chat template {file_or_text[:200]!r} is neither a file nor a jinja template"
        )
    try:
        _compile(template)
    except jinja2.TemplateError as error:
        raise InvalidRequestError(f"chat template does not compile: {error.message or error}") from error
    return template


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """Render one conversation; `template_kwargs` carries bos_token, eos_token, enable_thinking, ..."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("a chat needs at least one message")
    if not all(isinstance(message, dict) for message in messages):
        raise InvalidRequestError("every chat message must be an object with a role and content")
    try:
        compiled = _compile(template)
        return compiled.render(
            messages=_prepare_messages(messages),
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
    except jinja2.TemplateError as error:
        raise InvalidRequestError(f"chat template error: {error.message or error}") from error
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as error:
        # template code that trips over the messages it was given (a missing key, content of the wrong type)
        raise InvalidRequestError(f"chat template failed on these messages: {error}") from error


def _prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    prepared = []
    for message in messages:
        # as transformers does: drop None values (OpenAI clients send content=None), and expose the
        # reasoning under every name templates read it from
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: unlike jinja's own, it does not HTML-escape
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; renders as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(template)
