"""Tool calls and Qwen3's thinking on the request side (deployments/openai_api/tool_calls.py, reasoning.py,
chat_output.py), with the real chat templates of each family (llama.cpp's models/templates) and the real
Qwen3 and Llama 3 tokenizers: what a template writes for an assistant's call is what its parser reads, whole
and as it streams, and what the forced-call grammar (compiled by llguidance with the model's tokenizer)
accepts; a template that ignores tools gets them in a system message; the 400s of bad tool requests."""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import openai
import pytest
from assets import llama3_tokenizer_dir, llama_cpp_models_dir, qwen3_tokenizer_dir
from ingress_harness import MODEL as SERVED_MODEL
from ingress_harness import build
from tileinfer.deployments.openai_api.chat_output import ChatOutputPlan
from tileinfer.deployments.openai_api.chat_request import ChatCompletionRequest
from tileinfer.deployments.openai_api.errors import OpenAIError
from tileinfer.deployments.openai_api.reasoning import prompt_opens_thinking
from tileinfer.deployments.openai_api.request_parsing import parse_request
from tileinfer.deployments.openai_api.request_to_engine import chat_template_input
from tileinfer.deployments.openai_api.tool_calls import format_for_template
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.models.loader import load_tokenizer
from tileinfer.engine.sampling.params import GrammarSpec, SamplingParams
from tileinfer.engine.text.chat_template import load_chat_template, render_chat_template
from tileinfer.engine.text.tokenizer import Tokenizer

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city",
                                              "parameters": WEATHER_PARAMETERS}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ARGUMENTS = {"city": "Paris", "days": 3}
USER = {"role": "user", "content": "What is the weather in Paris for the next 3 days?"}
CALL_ID = "call_0123456789abcdef01234567"
# template file (llama.cpp's models/templates) -> the format it teaches, and the end of an assistant turn
TEMPLATES = {
    "Qwen-Qwen3-0.6B": ("hermes", "<|im_end|>\n"),
    "Qwen-Qwen2.5-7B-Instruct": ("hermes", "<|im_end|>\n"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("hermes", "<|im_end|>\n"),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3_json", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama3_json", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("mistral", "</s>"),
    "Mistral-Small-3.2-24B-Instruct-2506": ("mistral", "</s>"),
}
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


def template(name: str) -> str:
    return (llama_cpp_models_dir() / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


def request(**fields: Any) -> ChatCompletionRequest:
    return parse_request(
        ChatCompletionRequest, {"model": "m", "messages": [USER], "tools": [WEATHER], **fields}
    )


def written_call(name: str) -> str:
    """The assistant turn a template writes for a call of get_weather: the text its model generates."""
    source = template(name)
    tool_format, _ = format_for_template(source)
    call = {"id": tool_format.template_call_id(CALL_ID), "type": "function",
            "function": {"name": "get_weather", "arguments": ARGUMENTS}}  # fmt: skip
    tools = {"tools": [WEATHER], **SPECIALS}
    prompt = render_chat_template(source, [USER], add_generation_prompt=True, **tools)
    conversation = [USER, {"role": "assistant", "content": "", "tool_calls": [call]}]
    whole = render_chat_template(source, conversation, add_generation_prompt=False, **tools)
    assert whole.startswith(prompt)
    return whole[len(prompt) :].removesuffix(TEMPLATES[name][1])


@pytest.mark.parametrize("name", TEMPLATES)
def test_each_family_reads_the_calls_its_template_writes(name: str) -> None:
    source = template(name)
    assert format_for_template(source)[0].name == TEMPLATES[name][0]
    plan = ChatOutputPlan.for_request(request(), source, lambda text: None)
    message, finish_reason = plan.message(written_call(name), "stop")
    assert finish_reason == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == ARGUMENTS


@pytest.mark.parametrize("name", TEMPLATES)
def test_streamed_deltas_add_up_to_the_whole_answer(name: str) -> None:
    """Fed a few characters at a time: the call's id and name come first, then its arguments in pieces,
    which join to the arguments of the whole answer; text before the call streams as content."""
    source = template(name)
    text = written_call(name)
    if not text.startswith("<think>"):  # text before the call, where the format allows it
        text = "Let me look.\n" + text if TEMPLATES[name][0] == "hermes" else text
    plan = ChatOutputPlan.for_request(request(), source, lambda text: None)
    stream = plan.stream()
    deltas = [
        stream.push(text[start : start + 3], start + 3 >= len(text)) for start in range(0, len(text), 3)
    ]
    whole, _ = plan.message(text, "stop")
    assert "".join(delta.get("content", "") for delta in deltas) == (whole["content"] or "")
    pieces = [call for delta in deltas for call in delta.get("tool_calls", ())]
    assert pieces[0]["id"].startswith("call_") and pieces[0]["function"]["name"] == "get_weather"
    assert all(piece["index"] == 0 and "id" not in piece for piece in pieces[1:])
    arguments = "".join(piece["function"]["arguments"] for piece in pieces)
    assert arguments == whole["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments) == ARGUMENTS
    assert len(pieces) > 2  # the arguments came in pieces
    assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"


def test_several_calls_and_text_that_is_no_call() -> None:
    plan = ChatOutputPlan.for_request(
        request(tools=[WEATHER, TIME]), template("Qwen-Qwen2.5-7B-Instruct"), str
    )
    two = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    message, _ = plan.message(two, "stop")
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["get_weather", "get_time"]
    assert len({call["id"] for call in message["tool_calls"]}) == 2
    cut = two[: two.index('"arguments": {}') + len('"arguments": {')]  # max_tokens ended the second call
    message, finish_reason = plan.message(cut, "length")
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["get_weather", "get_time"]
    assert (message["tool_calls"][1]["function"]["arguments"], finish_reason) == ("{", "length")
    stream = plan.stream()
    sent = [
        stream.push(cut[start : start + 5], start + 5 >= len(cut), "length")
        for start in range(0, len(cut), 5)
    ]
    announced = [
        call["function"]["name"] for delta in sent for call in delta.get("tool_calls", ()) if "id" in call
    ]
    assert announced == ["get_weather", "get_time"]
    for broken in ("<tool_call>\n{not json}\n</tool_call>", "The answer is 42."):
        message, finish_reason = plan.message(broken, "stop")
        assert (message["content"], finish_reason) == (broken, "stop") and "tool_calls" not in message
    llama = ChatOutputPlan.for_request(request(), template("meta-llama-Llama-3.1-8B-Instruct"), str)
    assert llama.message('{"answer": 42}', "stop")[0] == {"role": "assistant", "content": '{"answer": 42}'}
    none = ChatOutputPlan.for_request(request(tool_choice="none"), template("Qwen-Qwen2.5-7B-Instruct"), str)
    assert none.message(two, "stop") == ({"role": "assistant", "content": two}, "stop")


def _reparsed_deltas(plan: ChatOutputPlan, chunks: list[str], finish_reason: str) -> list[dict[str, Any]]:
    """The deltas of reading the whole answer so far again at every event (ChatOutputPlan.parse), and
    sending what grew."""
    text, sent_reasoning, sent_content, sent_calls, deltas = "", 0, 0, [], []
    for index, chunk in enumerate(chunks):
        text += chunk
        final = index == len(chunks) - 1
        parsed = plan.parse(text, final, cut_short=final and finish_reason == "length")
        delta: dict[str, Any] = {}
        if parsed.reasoning is not None and len(parsed.reasoning) > sent_reasoning:
            delta["reasoning_content"], sent_reasoning = (
                parsed.reasoning[sent_reasoning:],
                len(parsed.reasoning),
            )
        if len(parsed.content) > sent_content:
            delta["content"], sent_content = parsed.content[sent_content:], len(parsed.content)
        calls = []
        for number, call in enumerate(parsed.calls):
            if number == len(sent_calls):
                calls.append({"index": number, "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})  # fmt: skip
                sent_calls.append(len(call.arguments))
            elif len(call.arguments) > sent_calls[number]:
                calls.append(
                    {"index": number, "function": {"arguments": call.arguments[sent_calls[number] :]}}
                )
                sent_calls[number] = len(call.arguments)
        if calls:
            delta["tool_calls"] = calls
        deltas.append(delta)
    return deltas


RECORDED = {  # template -> answers as models write them: calls, text around them, think blocks
    "Qwen-Qwen3-0.6B": [
        '<think>\nThe user wants <tool_call> weather.\n</think>\n\nLet me look.\n<tool_call>\n{"name": '
        '"get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>\n<tool_call>\n{"name": '
        '"get_time", "arguments": {}}\n</tool_call>',
        '<think>\nNo tool.\n</think>\n\nIt is <tool sunny, {"a": 1}.',
        '<think>\nCut.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os',
    ],
    "meta-llama-Llama-3.1-8B-Instruct": [
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}; '
        '{"name": "get_time", "parameters": {}}',
        '{"answer": 42, "note": "not a call"}',
        "Plain text, no call.",
    ],
    "mistralai-Mistral-Nemo-Instruct-2407": [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}, '
        '{"name": "get_time", "arguments": {}}]',
        "Some [TOOL text] first.",
    ],
    "Mistral-Small-3.2-24B-Instruct-2506": [
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 1}[TOOL_CALLS]get_time[ARGS]{}',
    ],
}


@pytest.mark.parametrize("name", RECORDED)
def test_streamed_answers_read_incrementally_give_the_deltas_of_reading_them_whole(name: str) -> None:
    """Each event reads only the new text (the think block's end, then the calls after the last whole
    one), and sends what reading the whole answer again would: in chunks of 1, 3 and 7 characters, to the
    end or cut short (max_tokens)."""
    plan = ChatOutputPlan.for_request(request(tools=[WEATHER, TIME]), template(name), str)
    for text in RECORDED[name]:
        for size, finish_reason in ((1, "stop"), (3, "length"), (7, "stop")):
            chunks = [text[start : start + size] for start in range(0, len(text), size)]
            stream = plan.stream()
            deltas = [
                stream.push(chunk, index == len(chunks) - 1, finish_reason)
                for index, chunk in enumerate(chunks)
            ]
            for delta in deltas:  # a call's id is new each time
                for call in delta.get("tool_calls", ()):
                    assert call.pop("id", "call_").startswith("call_")
            assert deltas == _reparsed_deltas(plan, chunks, finish_reason), (text, size)


# ---- the grammar of a forced call, compiled with the model's tokenizer --------------------------------


@functools.cache
def _tokenizers(tokenizer_dir: Path) -> tuple[Tokenizer, llguidance.LLTokenizer]:
    """Ours and llguidance's, of one tokenizer.json (built once: a 150k vocabulary takes seconds)."""
    return Tokenizer.from_folder(tokenizer_dir), llguidance.LLTokenizer(str(tokenizer_dir / "tokenizer.json"))


def _accepts(tokenizer_dir: Path, grammar: GrammarSpec | None, text: str) -> bool:
    """Whether llguidance, with the model's tokenizer, takes `text` (as the model's tokens) whole."""
    assert grammar is not None
    tokenizer, ll_tokenizer = _tokenizers(tokenizer_dir)
    kind = "json_schema" if grammar.kind == "json" else grammar.kind
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.grammar_from(kind, grammar.source))
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def _grammar(name: str, tokenizer_dir: Path, params: SamplingParams, **fields: Any) -> GrammarSpec | None:
    """The grammar that a chat request with these fields decodes under, for the model whose template and
    tokenizer these are."""
    tokenizer, _ = _tokenizers(tokenizer_dir)
    plan = ChatOutputPlan.for_request(request(**fields), template(name), tokenizer.single_token_id)
    return plan.constrain(params).grammar


@pytest.mark.parametrize(
    ("name", "tokenizer_dir", "tool_choice"),
    [("Qwen-Qwen3-0.6B", qwen3_tokenizer_dir, "required"),
     ("meta-llama-Llama-3.1-8B-Instruct", llama3_tokenizer_dir, {"type": "function",
                                                                 "function": {"name": "get_weather"}})],
    ids=["qwen3-required", "llama3-named"],
)  # fmt: skip
def test_the_forced_call_grammar_takes_the_written_call_and_refuses_bad_arguments(
    name: str, tokenizer_dir: Any, tool_choice: Any
) -> None:
    grammar = _grammar(
        name, tokenizer_dir(), SamplingParams(), tools=[WEATHER, TIME], tool_choice=tool_choice
    )
    assert grammar is not None and grammar.kind == "lark" and "%json" in grammar.source
    text = written_call(name)  # Qwen3's begins with its (empty) think block
    assert _accepts(tokenizer_dir(), grammar, text)
    assert not _accepts(tokenizer_dir(), grammar, text.replace('"days": 3', '"days": 30'))  # maximum 7
    assert not _accepts(tokenizer_dir(), grammar, text.replace('"days": 3', '"weeks": 3'))
    assert not _accepts(tokenizer_dir(), grammar, "It is sunny.")


def test_one_call_or_several_as_parallel_tool_calls_says() -> None:
    one = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    for parallel in (True, False):
        grammar = _grammar(
            "Qwen-Qwen3-0.6B", qwen3_tokenizer_dir(), SamplingParams(), tools=[WEATHER, TIME],
            tool_choice="required", parallel_tool_calls=parallel,
            chat_template_kwargs={"enable_thinking": False},
        )  # fmt: skip
        assert _accepts(qwen3_tokenizer_dir(), grammar, one)
        assert _accepts(qwen3_tokenizer_dir(), grammar, one + "\n" + one) == parallel


def test_a_forced_call_and_a_schema_beside_it_are_json_on_one_line() -> None:
    """A forced call's object, and a response format's schema after a think block or beside a call, are laid
    out as a json_schema answer is: ", " and ": " between items, no newline or indent (indented lines cost
    a forced call's arguments tokens, which a call cut off by max_tokens lost)."""
    compact = '{"city": "Paris", "days": 3}'
    indented = json.dumps(ARGUMENTS, indent=2)
    call = '<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>'
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    qwen3 = ("Qwen-Qwen3-0.6B", qwen3_tokenizer_dir())
    forced = _grammar(*qwen3, SamplingParams(), tool_choice="required", **no_thinking)
    schema = SamplingParams(grammar=GrammarSpec("json", json.dumps(WEATHER_PARAMETERS)))
    beside_a_call = _grammar(*qwen3, schema, **no_thinking)
    after_thinking = _grammar(*qwen3, schema, tools=[])
    for grammar, spelled in ((forced, call), (beside_a_call, call), (beside_a_call, "%s"),
                             (after_thinking, "<think>\nParis.\n</think>\n\n%s")):  # fmt: skip
        assert _accepts(qwen3_tokenizer_dir(), grammar, spelled % compact), spelled
        for other in (indented, compact.replace(", ", ","), compact.replace(": ", ":")):
            assert not _accepts(qwen3_tokenizer_dir(), grammar, spelled % other), (spelled, other)


def test_a_schema_constrains_only_the_answer_after_the_thinking() -> None:
    """Qwen3 thinking: a response format's grammar (as the structured-output side sets it) after any think
    block, and with tool_choice auto a call instead; with thinking off no think block."""
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    constrained = SamplingParams(grammar=GrammarSpec("json", json.dumps(schema)))
    answer = '<think>\nThe user wants x. Maybe {"x": "a"}? No.\n</think>\n\n{"x": 7}'
    for tools, thinking, text, accepted in (
        ([], True, answer, True),
        ([], True, '{"x": 7}', True),
        ([], True, answer.replace("7}", '"7"}'), False),
        ([], False, answer, False),
        ([], False, '{"x": 7}', True),
        ([WEATHER], True, written_call("Qwen-Qwen3-0.6B"), True),
        ([WEATHER], True, answer, True),
    ):
        grammar = _grammar(
            "Qwen-Qwen3-0.6B", qwen3_tokenizer_dir(), constrained, tools=tools,
            chat_template_kwargs={"enable_thinking": thinking},
        )  # fmt: skip
        assert _accepts(qwen3_tokenizer_dir(), grammar, text) == accepted, (tools, thinking, text)


@pytest.mark.parametrize(
    ("grammar", "answer", "refused"),
    [(GrammarSpec("regex", "[0-9]{3}/[a-z]+"), "123/abc", "12/abc"),
     (GrammarSpec("choice", '["yes", "no"]'), "no", "maybe")],
)  # fmt: skip
def test_a_regex_or_a_choice_follows_the_thinking_too(
    grammar: GrammarSpec, answer: str, refused: str
) -> None:
    wrapped = _grammar("Qwen-Qwen3-0.6B", qwen3_tokenizer_dir(), SamplingParams(grammar=grammar), tools=[])
    assert _accepts(qwen3_tokenizer_dir(), wrapped, f"<think>\nSo: {refused}?\n</think>\n\n{answer}")
    assert not _accepts(qwen3_tokenizer_dir(), wrapped, f"<think>\nSo.\n</think>\n\n{refused}")


# ---- Qwen3's thinking ------------------------------------------------------------------------------


def test_reasoning_is_the_think_block_as_vllm_returns_it() -> None:
    qwen3 = template("Qwen-Qwen3-0.6B")
    plan = ChatOutputPlan.for_request(request(tools=[]), qwen3, str)
    message, _ = plan.message("<think>\nParis is in France.\n</think>\n\nIt is sunny.", "stop")
    assert message == {
        "role": "assistant",
        "content": "\n\nIt is sunny.",
        "reasoning_content": "\nParis is in France.\n",
    }
    cut_off = plan.parse("<think>\ncut off", final=True)  # max_tokens in the block
    assert (cut_off.reasoning, cut_off.content) == ("\ncut off", "")
    no_block = plan.parse("No block.", final=True)
    assert (no_block.reasoning, no_block.content) == (None, "No block.")
    stream = plan.stream()
    text = "<think>\nHmm.\n</think>\n\nSunny."
    deltas = [stream.push(character, index == len(text) - 1) for index, character in enumerate(text)]
    assert "".join(delta.get("reasoning_content", "") for delta in deltas) == "\nHmm.\n"
    assert "".join(delta.get("content", "") for delta in deltas) == "\n\nSunny."
    off = ChatOutputPlan.for_request(
        request(tools=[], chat_template_kwargs={"enable_thinking": False}), qwen3, str
    )
    assert off.message("Sunny.", "stop")[0] == {"role": "assistant", "content": "Sunny."}
    prompt = render_chat_template(qwen3, [USER], enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("name", ["Qwen-QwQ-32B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"])
def test_a_prompt_that_opens_the_think_block_gives_reasoning_up_to_its_end(name: str) -> None:
    """QwQ's and DeepSeek-R1's distilled models' templates write `<think>` in the generation prompt (with
    thinking on): the output starts inside the block, so its text up to `</think>` is the reasoning, the
    stream's too, and a schema constrains only what follows the block's end."""
    tokenizer, _ = _tokenizers(qwen3_tokenizer_dir())  # the Qwen2/Qwen3 vocabulary both models use
    source = template(name)
    opened = render_chat_template(source, [USER], enable_thinking=True, **SPECIALS)
    closed = render_chat_template(source, [USER], enable_thinking=False, **SPECIALS)
    assert prompt_opens_thinking(opened, source) and not prompt_opens_thinking(closed, source)
    # only a template that writes the block opens it: a user's text ending so does not
    assert not prompt_opens_thinking(opened, template("Qwen-Qwen2.5-7B-Instruct"))
    thinking_on = request(tools=[], chat_template_kwargs={"enable_thinking": True})
    plan = ChatOutputPlan.for_request(thinking_on, source, tokenizer.single_token_id, True)
    message, _ = plan.message("Paris is in France.\n</think>\n\nIt is sunny.", "stop")
    assert message == {
        "role": "assistant", "content": "\n\nIt is sunny.", "reasoning_content": "Paris is in France.\n",
    }  # fmt: skip
    stream = plan.stream()
    text = "Hmm.\n</think>\n\nSunny."
    deltas = [stream.push(character, index == len(text) - 1) for index, character in enumerate(text)]
    assert "".join(delta.get("reasoning_content", "") for delta in deltas) == "Hmm.\n"
    assert "".join(delta.get("content", "") for delta in deltas) == "\n\nSunny."
    wrapped = plan.constrain(SamplingParams(grammar=GrammarSpec("regex", "[0-9]{3}"))).grammar
    assert _accepts(qwen3_tokenizer_dir(), wrapped, "So: 12?\n</think>\n\n123")
    # a second <think> (a special token: no text of the block) is refused, where a plain plan takes it
    assert not _accepts(qwen3_tokenizer_dir(), wrapped, "<think>\nSo.\n</think>\n\n123")
    assert not _accepts(qwen3_tokenizer_dir(), wrapped, "123")  # the block must end first


# ---- rendering: the model's template, the fallback, a user's template -------------------------------


def test_a_conversation_with_a_tool_result_renders_through_the_model_template() -> None:
    """An assistant message with content null and tool_calls, then the tool's result (Qwen3 and Llama 3.1
    render both; Mistral's template gets 9-character call ids)."""
    conversation = {
        "messages": [
            USER,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": CALL_ID, "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}}]},
            {"role": "tool", "tool_call_id": CALL_ID, "content": '{"forecast": "sunny"}'},
        ]
    }  # fmt: skip
    for name, expected in (
        ("Qwen-Qwen3-0.6B", '<tool_response>\n{"forecast": "sunny"}\n</tool_response>'),
        # (the template writes a text result with tojson: a string is iterable)
        ("meta-llama-Llama-3.1-8B-Instruct", '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"forecast'),
        ("mistralai-Mistral-Nemo-Instruct-2407", '"call_id": "f01234567"'),  # the id's last 9
    ):
        source = template(name)
        messages, tools = chat_template_input(request(**conversation), source)
        assert tools == [WEATHER]
        prompt = render_chat_template(source, messages, tools=tools, **SPECIALS)
        assert expected in prompt and "get_weather" in prompt


def test_a_template_that_ignores_tools_gets_them_in_a_system_message(smollm2_gguf: Path) -> None:
    smollm2 = load_tokenizer("smollm2-135m")
    assert format_for_template(smollm2.chat_template)[1] is False
    function = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    call = {"id": CALL_ID, "type": "function", "function": function}
    body = request(messages=[USER, {"role": "assistant", "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny"}])  # fmt: skip
    messages, tools = chat_template_input(body, smollm2.chat_template)
    assert tools is None
    prompt = smollm2.render_chat(messages)
    assert prompt.startswith("<|im_start|>system\n# Tools\n") and json.dumps(WEATHER) in prompt
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{written}<|im_end|>" in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in prompt


def test_a_user_template_from_a_file_or_text(tmp_path: Path) -> None:
    text = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (tmp_path / "chat.jinja").write_text(text)
    assert load_chat_template(str(tmp_path / "chat.jinja")) == text == load_chat_template(text)
    with pytest.raises(InvalidRequestError, match="neither a file nor"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(InvalidRequestError, match="does not compile"):
        load_chat_template("{% for m in messages %}")
    with pytest.raises(InvalidRequestError):  # the sandbox, as for a model's own template
        render_chat_template("{{ messages.__class__.__mro__ }}", [USER])


# ---- 400s ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "tools[0].function.parameters"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         "tool_choice.function.name"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"messages": [USER, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
         "messages[1].tool_call_id"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ],
)  # fmt: skip
def test_bad_tool_requests_get_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    body = {"model": "m", "messages": [USER], "tools": [WEATHER], **fields}
    if "response_format" in fields and "response_format" not in ChatCompletionRequest.model_fields:
        pytest.skip("response_format is the structured-output side's field")
    with pytest.raises(OpenAIError) as raised:
        parse_request(ChatCompletionRequest, body)
    assert (raised.value.status_code, raised.value.param) == (400, param)
    assert param in raised.value.message


# ---- through the ingress, with the official client (a stand-in engine replies the tokens of a call) -----


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> Tokenizer:
    return load_tokenizer("smollm2-135m")


CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'


def _client(smollm2: Tokenizer, monkeypatch: pytest.MonkeyPatch, reply: str) -> tuple[Any, Any, Any]:
    """The official client on an ingress whose engine replies `reply` a token at a time, then <|im_end|>."""
    http_client, engine = build(smollm2, monkeypatch)
    engine.reply = smollm2.encode(reply + "<|im_end|>", add_special_tokens=False)
    engine.finish_reason, engine.piecewise = "stop", True
    base_url = http_client.base_url.join("/v1")
    client = openai.AsyncOpenAI(api_key="k", base_url=base_url, http_client=http_client, max_retries=0)
    return client, http_client, engine


FORCED = {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}


def test_a_forced_call_comes_back_as_tool_calls(smollm2: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    async def run() -> None:
        client, http_client, engine = _client(smollm2, monkeypatch, CALL_TEXT)
        async with http_client:
            reply = await client.chat.completions.create(
                model=SERVED_MODEL, messages=[USER], max_tokens=64, **FORCED
            )
        choice = reply.choices[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
        prompt, params = engine.submitted[-1]
        assert "<tools>" in smollm2.decode(prompt)  # the fallback's system message
        assert params.grammar.kind == "lark" and '"const": "get_weather"' in params.grammar.source
        assert '"const": "get_time"' not in params.grammar.source  # the named function only

    asyncio.run(run())


def test_a_streamed_call_sends_its_arguments_in_pieces(
    smollm2: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def run() -> list[Any]:
        client, http_client, _ = _client(smollm2, monkeypatch, "Checking.\n" + CALL_TEXT)
        async with http_client:
            stream = await client.chat.completions.create(
                model=SERVED_MODEL, messages=[USER], max_tokens=64, stream=True, tools=[WEATHER]
            )
            return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert "".join(delta.content or "" for delta in deltas) == "Checking."
    pieces = [call for delta in deltas for call in delta.tool_calls or ()]
    assert (pieces[0].index, pieces[0].type, pieces[0].function.name) == (0, "function", "get_weather")
    assert pieces[0].id.startswith("call_") and all(piece.id is None for piece in pieces[1:])
    assert len(pieces) > 3  # the arguments came in pieces, as the tokens did
    arguments = "".join(piece.function.arguments or "" for piece in pieces)
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_result_goes_back_in_the_next_turn(
    smollm2: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def run() -> None:
        client, http_client, engine = _client(smollm2, monkeypatch, CALL_TEXT)
        async with http_client:
            first = await client.chat.completions.create(
                model=SERVED_MODEL, messages=[USER], max_tokens=64, **FORCED
            )
            called = first.choices[0].message
            engine.reply = smollm2.encode("Sunny.<|im_end|>", add_special_tokens=False)
            result = {"role": "tool", "tool_call_id": called.tool_calls[0].id, "content": '{"sky": "clear"}'}
            second = await client.chat.completions.create(
                model=SERVED_MODEL, messages=[USER, called.model_dump(exclude_none=True), result],
                tools=[WEATHER], max_tokens=8,
            )  # fmt: skip
        assert (second.choices[0].message.content, second.choices[0].finish_reason) == ("Sunny.", "stop")
        prompt = smollm2.decode(engine.submitted[-1][0])
        assert CALL_TEXT in prompt and '<tool_response>\n{"sky": "clear"}\n</tool_response>' in prompt

    asyncio.run(run())


def test_the_chat_template_arg_replaces_the_model_template(
    smollm2: Tokenizer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A user's template (the chat_template app arg, here a file) renders the prompt; with tools that it
    renders itself, no fallback system message is added."""
    own = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ tools | length }} tools\n"
    (tmp_path / "own.jinja").write_text(own)

    async def run() -> str:
        http_client, engine = build(smollm2, monkeypatch, chat_template=str(tmp_path / "own.jinja"))
        client = openai.AsyncOpenAI(
            api_key="k", base_url=http_client.base_url.join("/v1"), http_client=http_client, max_retries=0
        )
        async with http_client:
            await client.chat.completions.create(model=SERVED_MODEL, messages=[USER], tools=[WEATHER])
        return smollm2.decode(engine.submitted[-1][0])

    assert asyncio.run(run()) == f"[user] {USER['content']}\n1 tools"  # (jinja drops the last newline)
    assert smollm2.chat_template != own  # the model's own tokenizer is left as it was


def test_reasoning_content_through_the_ingress(smollm2: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3's template (the chat_template arg) on SmolLM2's tokenizer: the think block comes back as
    message.reasoning_content, and streamed as delta.reasoning_content; enable_thinking false renders
    Qwen3's empty think block into the prompt."""
    thought = "<think>\nParis is sunny in June.\n</think>\n\nSunny."

    async def run() -> tuple[Any, list[Any], str]:
        http_client, engine = build(smollm2, monkeypatch, chat_template=template("Qwen-Qwen3-0.6B"))
        engine.reply = smollm2.encode(thought + "<|im_end|>", add_special_tokens=False)
        engine.finish_reason, engine.piecewise = "stop", True
        base_url = http_client.base_url.join("/v1")
        client = openai.AsyncOpenAI(api_key="k", base_url=base_url, http_client=http_client, max_retries=0)
        async with http_client:
            whole = await client.chat.completions.create(model=SERVED_MODEL, messages=[USER])
            stream = await client.chat.completions.create(model=SERVED_MODEL, messages=[USER], stream=True)
            chunks = [chunk async for chunk in stream]
            off = {"chat_template_kwargs": {"enable_thinking": False}}
            await client.chat.completions.create(model=SERVED_MODEL, messages=[USER], extra_body=off)
        return whole.choices[0].message, chunks, smollm2.decode(engine.submitted[-1][0])

    message, chunks, prompt_without_thinking = asyncio.run(run())
    assert (message.reasoning_content, message.content) == ("\nParis is sunny in June.\n", "\n\nSunny.")
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert (
        "".join(getattr(delta, "reasoning_content", None) or "" for delta in deltas)
        == message.reasoning_content
    )
    assert "".join(delta.content or "" for delta in deltas) == message.content
    assert prompt_without_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_reasoning_content_of_a_prompt_that_opens_the_block_through_the_ingress(
    smollm2: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QwQ's template (thinking on) ends the prompt with `<think>`: the answer's text up to `</think>` comes
    back as reasoning_content."""

    async def run() -> Any:
        http_client, engine = build(smollm2, monkeypatch, chat_template=template("Qwen-QwQ-32B"))
        answer = "Sunny in June.\n</think>\n\nSunny.<|im_end|>"
        engine.reply = smollm2.encode(answer, add_special_tokens=False)
        engine.finish_reason = "stop"
        base_url = http_client.base_url.join("/v1")
        client = openai.AsyncOpenAI(api_key="k", base_url=base_url, http_client=http_client, max_retries=0)
        on = {"chat_template_kwargs": {"enable_thinking": True}}
        async with http_client:
            reply = await client.chat.completions.create(model=SERVED_MODEL, messages=[USER], extra_body=on)
        assert smollm2.decode(engine.submitted[-1][0]).endswith("<|im_start|>assistant\n<think>\n")
        return reply.choices[0].message

    message = asyncio.run(run())
    assert (message.reasoning_content, message.content) == ("Sunny in June.\n", "\n\nSunny.")


def test_a_lark_grammar_stands_alone() -> None:
    """A Lark grammar is not embedded: beside tool_choice auto it constrains the whole answer (no call), and
    after a think block it is a 400 naming the field."""
    lark = GrammarSpec("lark", 'start: "yes" | "no"')
    plan = ChatOutputPlan.for_request(request(), template("Qwen-Qwen2.5-7B-Instruct"), lambda text: None)
    assert plan.constrain(SamplingParams(grammar=lark)).grammar == lark
    thinking = ChatOutputPlan.for_request(request(tools=[]), template("Qwen-Qwen3-0.6B"), lambda text: None)
    with pytest.raises(OpenAIError) as raised:
        thinking.constrain(SamplingParams(grammar=lark))
    assert (raised.value.status_code, raised.value.param) == (400, "structured_outputs")
    with pytest.raises(OpenAIError, match="not JSON"):  # a schema given as text (structured_outputs.json)
        plan.constrain(SamplingParams(grammar=GrammarSpec("json", "{not json")))
