"""The `tileinfer` console script, run as a user runs it: a subprocess on the embedded default model
(the bad-input cases call its main() in process).

Each model load costs seconds, so the successful runs are module fixtures shared by the assertions.
transformers' tokenizer, built from the same GGUF, is the reference for token ids and text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tileinfer.deployments.launch import cli

TILEINFER = str(Path(sys.executable).parent / "tileinfer")
MODEL = "smollm2-135m"
MAX_TOKENS = 8
SYSTEM = "You are a helpful assistant."
QUESTION = "What is the capital of France?"


def run_cli(
    *args: str, stdin: str = "", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TILEINFER, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def last_json_line(result: subprocess.CompletedProcess[str]) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def reference_tokenizer(smollm2_gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def raw_result(smollm2_gguf: Path) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "generate", MODEL, "--prompt", "The capital of France is", "--max-tokens", str(MAX_TOKENS), "--json"
    )


@pytest.fixture(scope="module")
def chat_result(smollm2_gguf: Path) -> subprocess.CompletedProcess[str]:
    args = ["--system", SYSTEM, "--prompt", QUESTION, "--max-tokens", str(MAX_TOKENS), "--json"]
    return run_cli("generate", MODEL, *args)


def check_generation(output: dict, tokenizer) -> None:
    token_ids = output["token_ids"]
    eos_ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    if output["finish_reason"] == "stop":
        assert token_ids[-1] in eos_ids
    else:
        assert output["finish_reason"] == "length"
        assert len(token_ids) == MAX_TOKENS
    assert output["text"] == tokenizer.decode(token_ids, skip_special_tokens=True)


def test_generate_json_is_the_only_stdout_line(raw_result, reference_tokenizer) -> None:
    assert len(raw_result.stdout.splitlines()) == 1
    output = last_json_line(raw_result)
    assert output["prompt_token_ids"] == reference_tokenizer("The capital of France is").input_ids
    check_generation(output, reference_tokenizer)
    assert "Traceback" not in raw_result.stderr


def test_generate_chat_renders_the_template(chat_result, reference_tokenizer) -> None:
    output = last_json_line(chat_result)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    expected = reference_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert output["prompt_token_ids"] == expected
    assert output["prompt_token_ids"][0] == reference_tokenizer.convert_tokens_to_ids("<|im_start|>")
    check_generation(output, reference_tokenizer)


def test_chat_answers_each_turn_from_piped_stdin(smollm2_gguf: Path, chat_result) -> None:
    too_long = "word " * 200  # past --max-model-len: that turn fails, the chat goes on
    turns = f"{QUESTION}\nAnd of Italy?\n{too_long}\n/exit\nnever read\n"
    args = ["--system", SYSTEM, "--max-tokens", str(MAX_TOKENS), "--max-model-len", "128"]
    result = run_cli("chat", MODEL, *args, stdin=turns)
    assert result.returncode == 0, result.stderr
    # stdout: "> answer1\n> answer2\n> > " -- a prompt per turn, the too-long turn answering nothing.
    assert result.stdout.startswith("> ") and result.stdout.endswith("\n> > "), result.stdout
    answers = result.stdout[len("> ") : -len("\n> > ")].split("\n> ")
    assert len(answers) == 2, result.stdout
    # Greedy: the first turn is the same request as `generate --system ... --prompt ... --json`,
    # and what streamed to stdout is exactly its text.
    assert answers[0] == last_json_line(chat_result)["text"]
    assert answers[1].strip()
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "context" in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def write_gpt2_folder(folder: Path) -> Path:
    """A folder as an unsupported model ships it: a GPT-2 config beside a (tiny) tokenizer.json."""
    from tokenizers import Tokenizer, models

    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2}
    (folder / "config.json").write_text(json.dumps(config))
    Tokenizer(models.WordLevel({"hello": 0, "<unk>": 1}, unk_token="<unk>")).save(
        str(folder / "tokenizer.json")
    )
    return folder


@pytest.mark.parametrize(
    ("case", "expected_in_message"),
    [
        ("missing path", "missing.gguf"),
        ("negative temperature", "temperature"),
        ("zero top-p", "top_p"),
        ("unsupported architecture", "LlamaForCausalLM"),
        ("prompt longer than the context", "context"),
        ("cuda without a GPU", "cuda"),
        ("dflash without a checkpoint", "--draft-model"),
        ("more draft layers than the model has", "layers"),
        ("a chat template that is no file nor template", "neither a file nor"),
    ],
)
def test_bad_input_is_one_error_line(
    smollm2_gguf: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    expected_in_message: str,
) -> None:
    prompt = ["--prompt", "Hello"]
    args = {
        "missing path": [str(tmp_path / "missing.gguf"), *prompt],
        "negative temperature": [MODEL, *prompt, "--temperature", "-1"],
        "zero top-p": [MODEL, *prompt, "--top-p", "0"],
        "unsupported architecture": [str(write_gpt2_folder(tmp_path)), *prompt],
        "prompt longer than the context": [MODEL, "--prompt", "one two three " * 20, "--max-model-len", "16"],
        "cuda without a GPU": [MODEL, *prompt, "--device", "cuda"],
        "dflash without a checkpoint": [MODEL, *prompt, "--proposer", "dflash"],
        "a chat template that is no file nor template": [MODEL, *prompt, "--chat-template", "chat.jinja"],
        "more draft layers than the model has": [
            MODEL,
            *prompt,
            "--proposer",
            "draft",
            "--draft-layers",
            "99",
        ],
    }[case]
    if case == "cuda without a GPU" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    # The script's main() in this process (each subprocess would spend seconds importing torch): what the
    # console script runs once its interpreter is up. An uncaught exception would fail the test here.
    code = cli.main(["generate", *args, "--max-tokens", "4"])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert err.splitlines()[-1].startswith("error: ")
    assert expected_in_message in err.splitlines()[-1]
    assert out == ""


def test_pull_of_an_uncached_repo_offline_is_an_error(tmp_path: Path) -> None:
    offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    result = run_cli("pull", "tileinfer-tests/no-such-model", env=offline)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") or "\nerror: " in result.stderr
    assert "Traceback" not in result.stderr


def test_usage_error_exits_2() -> None:
    result = run_cli("generate", MODEL)
    assert result.returncode == 2
    assert "--prompt" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_cli("generate", MODEL, "--prompt", "Hi", "--proposer", "ngram", "--num-draft", "0")
    assert result.returncode == 2
    assert "--num-draft" in result.stderr and "Traceback" not in result.stderr


def test_generate_with_the_ngram_proposer_gives_the_plain_answer(raw_result) -> None:
    speculative = run_cli(
        "generate", MODEL, "--prompt", "The capital of France is", "--max-tokens", str(MAX_TOKENS), "--json",
        "--proposer", "ngram", "--num-draft", "3",
    )  # fmt: skip
    assert last_json_line(speculative)["token_ids"] == last_json_line(raw_result)["token_ids"]


def test_generate_on_an_int8_kv_cache(raw_result, reference_tokenizer) -> None:
    """--kv-cache-dtype int8: a valid answer, here the float cache's own tokens."""
    result = run_cli(
        "generate", MODEL, "--prompt", "The capital of France is", "--max-tokens", str(MAX_TOKENS), "--json",
        "--kv-cache-dtype", "int8",
    )  # fmt: skip
    output = last_json_line(result)
    check_generation(output, reference_tokenizer)
    assert output["token_ids"] == last_json_line(raw_result)["token_ids"]
