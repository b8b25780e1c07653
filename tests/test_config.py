"""The engine's settings (engine/config.py): the command line, the app's args and the API's schema list the
values it allows, and EngineConfig.validate refuses the others with a message that names them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from ingress_harness import openapi_schema
from tileinfer.deployments.launch.app_args import AppArgs
from tileinfer.deployments.launch.cli import build_parser
from tileinfer.engine.config import DEVICES, DTYPES, KV_CACHE_DTYPES, PROPOSERS, QUANTIZATIONS, EngineConfig
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.models.loader import load_tokenizer


def _cli_choices(command: str, option: str) -> tuple[str, ...]:
    parser = build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    subparser = commands.choices[command]
    return tuple(next(action for action in subparser._actions if option in action.option_strings).choices)


def _schema_values(schema: dict[str, Any]) -> tuple[str, ...]:
    """The strings a JSON schema allows: its enum or const, or those of its anyOf (null left out)."""
    if "anyOf" in schema:
        return tuple(value for option in schema["anyOf"] for value in _schema_values(option))
    return tuple(schema.get("enum", [schema["const"]] if "const" in schema else []))


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_command_line_offers_the_allowed_values(command: str) -> None:
    assert _cli_choices(command, "--dtype") == DTYPES
    assert _cli_choices(command, "--device") == DEVICES
    assert _cli_choices(command, "--quantization") == QUANTIZATIONS
    assert _cli_choices(command, "--kv-cache-dtype") == KV_CACHE_DTYPES
    assert _cli_choices(command, "--proposer") == PROPOSERS


def test_the_app_args_schema_lists_the_allowed_values() -> None:
    properties = AppArgs.model_json_schema()["properties"]
    assert _schema_values(properties["dtype"]) == ("auto", *DTYPES)  # auto: the device's
    assert _schema_values(properties["device"]) == ("auto", *DEVICES)
    assert _schema_values(properties["quantization"]) == QUANTIZATIONS
    assert _schema_values(properties["kv_cache_dtype"]) == KV_CACHE_DTYPES
    assert _schema_values(properties["proposer"]) == PROPOSERS


def test_the_openapi_schema_lists_the_allowed_values(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    schema = openapi_schema(load_tokenizer("smollm2-135m"), monkeypatch)
    model = schema["components"]["schemas"]["Model"]["properties"]
    assert _schema_values(model["quantization"]) == QUANTIZATIONS
    assert _schema_values(model["kv_cache_dtype"]) == KV_CACHE_DTYPES


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"dtype": "float64"}, "dtype must be one of float32, bfloat16, float16, got 'float64'"),
        ({"device": "tpu"}, "device must be cpu or cuda, got 'tpu'"),
        ({"quantization": "int4"}, "quantization must be one of int8, got 'int4'"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of auto, int8, got 'fp8'"),
        ({"proposer": "medusa"}, "proposer must be one of ngram, draft, dflash, got 'medusa'"),
        ({"long_prefill_token_threshold": 0}, "long_prefill_token_threshold must be at least 1, got 0"),
        ({"max_long_partial_prefills": 0}, "max_long_partial_prefills must be at least 1, got 0"),
    ],
)
def test_validate_names_the_setting_and_what_it_allows(setting: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        EngineConfig(**setting).validate()
    assert str(error.value) == message
