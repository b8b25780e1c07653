"""The `tileinfer` command line: generate, chat and pull.

Generated text goes to stdout as it streams; everything else (loading notes, errors) goes to stderr,
so `--json` output stays one parseable line. A user's mistake ends as `error: <message>` and exit
code 1, never as a traceback; argparse's own usage errors exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from tileinfer.engine.config import (
    DEVICES,
    DTYPES,
    ENGINE_SETTINGS,
    KV_CACHE_DTYPES,
    PROPOSERS,
    QUANTIZATIONS,
    EngineConfig,
    Setting,
    device_defaults,
)
from tileinfer.engine.errors import InvalidRequestError, TileInferError
from tileinfer.engine.text.chat_template import load_chat_template

if TYPE_CHECKING:
    from tileinfer.engine.engine import Engine, RequestOutput
    from tileinfer.engine.sampling.params import SamplingParams

MODEL_HELP = (
    "a model folder (config.json + safetensors), a .gguf file, a hub id, "
    "or smollm2-135m (the embedded default model)"
)


def _bounded_count(setting: Setting) -> Callable[[str], int]:
    """The flag's type for a count within the setting's bounds (the command line's bounded settings are
    all counts). A bad one is argparse's usage error, before the model loads."""

    def parse(text: str) -> int:
        if not text.isdigit() or not setting.holds(int(text)):
            raise argparse.ArgumentTypeError(f"must be an integer of {setting.bounds()}, got {text!r}")
        return int(text)

    return parse


def _add_engine_argument(
    parser: argparse._ActionsContainer,  # the parser or one of its groups
    name: str,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
) -> None:
    """--name for EngineConfig's setting `name`, with its default, help and bounds."""
    setting = ENGINE_SETTINGS[name]
    shown = "" if setting.default is None else f" (default: {setting.default})"
    parser.add_argument(
        f"--{name.replace('_', '-')}",
        type=_bounded_count(setting) if setting.bounds() else None,
        choices=choices,
        default=setting.default,
        metavar=metavar,
        help=setting.help + shown,
    )


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    _add_engine_argument(parser, "dtype", DTYPES)
    _add_engine_argument(parser, "device", DEVICES)
    _add_engine_argument(parser, "quantization", QUANTIZATIONS)
    _add_engine_argument(parser, "kv_cache_dtype", KV_CACHE_DTYPES)
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEXT",
        help="a jinja chat template (a file, or the template itself) in place of the model's",
    )
    _add_engine_argument(parser, "max_model_len", metavar="N")
    group = parser.add_argument_group("speculative decoding (the output is what plain decoding gives)")
    _add_engine_argument(group, "proposer", PROPOSERS)
    _add_engine_argument(group, "draft_model", metavar="M")
    _add_engine_argument(group, "draft_layers", metavar="N")
    _add_engine_argument(group, "num_draft", metavar="K")


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256, metavar="N", help="(default: 256)")
    group.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0 decodes greedily, so the same prompt gives the same answer (default: 0)",
    )
    group.add_argument(
        "--top-p", type=float, default=1.0, metavar="P", help="nucleus mass, in (0, 1] (default: 1)"
    )
    group.add_argument(
        "--top-k", type=int, default=0, metavar="K", help="keep the K likeliest tokens; 0 = all"
    )
    group.add_argument("--seed", type=int, default=None, metavar="S", help="makes sampling reproducible")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tileinfer",
        description="TileInfer: run LLMs from a folder, a .gguf file or the Hugging Face hub.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser(
        "generate",
        help="complete one prompt, streaming the text",
        description="Complete one prompt. Without --chat the prompt is tokenized as raw text; with --chat or "
        "--system it becomes a chat turn rendered by the model's chat template.",
    )
    _add_model_arguments(generate)
    generate.add_argument("--prompt", required=True, metavar="TEXT")
    generate.add_argument("--chat", action="store_true", help="render the prompt as a user message")
    generate.add_argument("--system", metavar="TEXT", help="a system message (implies --chat)")
    generate.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object instead of streaming: prompt_token_ids, token_ids (including the "
        "end-of-sequence token that ended generation), text, finish_reason",
    )
    _add_sampling_arguments(generate)
    generate.set_defaults(run=_run_generate)

    chat = commands.add_parser(
        "chat",
        help="interactive multi-turn chat on stdin/stdout",
        description="Chat with the model. Type a message after '> '; /exit or end of input (Ctrl-D) quits; "
        "Ctrl-C stops the answer being written.",
    )
    _add_model_arguments(chat)
    chat.add_argument("--system", metavar="TEXT", help="a system message that opens the conversation")
    _add_sampling_arguments(chat)
    chat.set_defaults(run=_run_chat)

    pull = commands.add_parser("pull", help="download a model from the Hugging Face hub into its cache")
    pull.add_argument("repo_id", metavar="ID", help="a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct")
    pull.add_argument("--revision", metavar="R", help="a branch, tag or commit (default: main)")
    pull.set_defaults(run=_run_pull)
    return parser


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from tileinfer.engine.sampling.params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    params.validate()
    return params


def _load_engine(args: argparse.Namespace) -> Engine:
    # the engine (and torch) is imported only here, so usage errors and --help answer at once
    from tileinfer.deployments.replicas.proposer_build import build_engine
    from tileinfer.engine.models.loader import load_model

    # The flags' settings, and serving's device defaults for the sequences decoded together (256 on a GPU);
    # the KV cache holds the model's context (one request at a time), where a CPU server's holds 16384
    # tokens for all its users.
    flags = {name: value for name, value in vars(args).items() if name in ENGINE_SETTINGS}
    config = EngineConfig(**flags, max_num_seqs=device_defaults(args.device).max_num_seqs)
    chat_template = None if args.chat_template is None else load_chat_template(args.chat_template)
    print(f"loading {args.model} ({args.dtype}, {args.device})", file=sys.stderr, flush=True)
    model = load_model(args.model, config.torch_dtype(), config.torch_device(), config.quantization)
    if chat_template is not None:
        model.tokenizer.chat_template = chat_template
    return build_engine(model, config)  # with the proposer in this process


def _system_messages(system: str | None) -> list[dict[str, str]]:
    return [] if system is None else [{"role": "system", "content": system}]


def _generate(
    engine: Engine,
    prompt_token_ids: list[int],
    params: SamplingParams,
    on_output: Callable[[RequestOutput], None],
) -> tuple[list[int], str, str]:
    """Run one request to its end, handing each step's output to on_output.

    Returns (generated token ids, text, finish reason). Ctrl-C stops the request (closing the
    stream aborts it in the engine) and returns what was generated so far, finish reason "abort".
    """
    # --max-tokens is a ceiling: a long prompt (a chat's history) gets what is left of the context, as an
    # unset max_tokens does over HTTP; the engine refuses more than its KV cache holds
    room = engine.max_model_len - len(prompt_token_ids)
    if 0 < room < params.max_tokens:
        params = dataclasses.replace(params, max_tokens=room)
    token_ids: list[int] = []
    text_parts: list[str] = []
    finish_reason = "abort"
    with (
        contextlib.suppress(KeyboardInterrupt),
        contextlib.closing(engine.stream(prompt_token_ids, params)) as outputs,
    ):
        for output in outputs:
            token_ids += output.new_token_ids
            text_parts.append(output.new_text)
            on_output(output)
            finish_reason = output.finish_reason or finish_reason
    return token_ids, "".join(text_parts), finish_reason


def _print_text(output: RequestOutput) -> None:
    sys.stdout.write(output.new_text)
    sys.stdout.flush()


def _run_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    engine = _load_engine(args)
    if args.chat or args.system is not None:
        prompt_token_ids = engine.tokenizer.encode_chat(
            _system_messages(args.system) + [{"role": "user", "content": args.prompt}]
        )
    else:
        prompt_token_ids = engine.tokenizer.encode(args.prompt)
    on_output = (lambda output: None) if args.json else _print_text
    token_ids, text, finish_reason = _generate(engine, prompt_token_ids, params, on_output)
    if args.json:
        result = {
            "prompt_token_ids": prompt_token_ids,
            "token_ids": token_ids,
            "text": text,
            "finish_reason": finish_reason,
        }
        print(json.dumps(result, ensure_ascii=False))
    else:
        print()
    return 130 if finish_reason == "abort" else 0


def _run_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    engine = _load_engine(args)
    messages = _system_messages(args.system)
    print("type a message; /exit or Ctrl-D quits, Ctrl-C stops an answer", file=sys.stderr, flush=True)
    while True:
        try:
            user_text = input("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt clears the line, as in a shell
            print()
            continue
        if user_text.strip() == "/exit":
            return 0
        if not user_text.strip():
            continue
        messages.append({"role": "user", "content": user_text})
        try:
            # The whole history is rendered again each turn; the prefix cache makes the repeat cheap.
            prompt_token_ids = engine.tokenizer.encode_chat(messages)
            _, answer, _ = _generate(engine, prompt_token_ids, params, _print_text)
        except InvalidRequestError as error:  # e.g. the history outgrew the context: drop this turn only
            messages.pop()
            print(f"error: {error}", file=sys.stderr, flush=True)
            continue
        print()
        # A stopped answer stays in the history as the user saw it, so the next turn follows on from it.
        messages.append({"role": "assistant", "content": answer})


def _run_pull(args: argparse.Namespace) -> int:
    from tileinfer.engine.models.hub import pull

    print(pull(args.repo_id, revision=args.revision))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except TileInferError as error:
        print(f"error: {error}", file=sys.stderr)
    except BrokenPipeError:  # stdout closed early (`| head`): nothing left to tell anyone
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - stops the flush at exit from failing again
    except OSError as error:  # a missing or unreadable file that a loader did not turn into a ModelLoadError
        where = f": {error.filename}" if error.filename else ""
        print(f"error: {error.strerror or error}{where}", file=sys.stderr)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
