"""The engine's settings (engine/config.py): the command line, the app's args and the API's schema list the
values it allows, and EngineConfig.validate refuses the others with a message that names them; the command
line and the app's args take each setting's default, bounds and help from EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from ingress_harness import openapi_schema
from tileinfer.deployments.launch.app_args import AppArgs, parse_app_args
from tileinfer.deployments.launch.cli import build_parser
from tileinfer.engine.config import (
    DEVICES,
    DTYPES,
    ENGINE_SETTINGS,
    KV_CACHE_DTYPES,
    PROPOSERS,
    QUANTIZATIONS,
    EngineConfig,
    device_defaults,
)
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.models.loader import load_tokenizer


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return commands.choices[command]


def _cli_choices(command: str, option: str) -> tuple[str, ...]:
    subparser = _subparser(command)
    return tuple(next(action for action in subparser._actions if option in action.option_strings).choices)


def _engine_flags() -> dict[str, argparse.Action]:
    """The command line's flags for EngineConfig's settings, by setting."""
    return {
        action.dest: action for action in _subparser("generate")._actions if action.dest in ENGINE_SETTINGS
    }


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
        ({"long_prefill_step_ms": float("nan")}, "long_prefill_step_ms must be at least 0, got nan"),
        ({"num_draft": 17}, "num_draft must be at least 1 and at most 16, got 17"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization must be more than 0 and at most 1, got 0"),
    ],
)
def test_validate_names_the_setting_and_what_it_allows(setting: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        EngineConfig(**setting).validate()
    assert str(error.value) == message


@pytest.mark.parametrize(("device", "dtype"), [("cpu", "float32"), ("cuda", "bfloat16")])
def test_the_app_args_default_to_the_engines_settings(device: str, dtype: str) -> None:
    """Args left out give the engine EngineConfig's own defaults, but for the device's (DeviceDefaults)."""
    engine_defaults = EngineConfig(device=device, dtype=dtype)
    expected = dataclasses.replace(engine_defaults, **dataclasses.asdict(device_defaults(device)))
    assert parse_app_args({}).engine_config(device, dtype) == expected


def test_the_command_lines_flags_default_to_the_engines_settings() -> None:
    args = build_parser().parse_args(["generate", "smollm2-135m", "--prompt", "Hello"])
    flags = _engine_flags()
    assert set(flags) == {
        "dtype", "device", "quantization", "kv_cache_dtype", "max_model_len", "proposer", "draft_model",
        "draft_layers", "num_draft",
    }  # fmt: skip
    engine_defaults = EngineConfig()
    assert {name: getattr(args, name) for name in flags} == {
        name: getattr(engine_defaults, name) for name in flags
    }


def test_the_flags_and_the_args_show_the_engines_help() -> None:
    described = AppArgs.model_json_schema()["properties"]
    for name, action in _engine_flags().items():
        assert action.help.startswith(ENGINE_SETTINGS[name].help), name
    for name in ENGINE_SETTINGS.keys() & described.keys():
        assert described[name]["description"].startswith(ENGINE_SETTINGS[name].help), name


@pytest.mark.parametrize("name", [name for name, setting in ENGINE_SETTINGS.items() if setting.bounds()])
def test_each_bound_holds_alike_in_the_engine_the_args_and_the_command_line(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A value past a setting's bound is refused by EngineConfig.validate, by the app's args and by the
    command line, each naming the setting; one on the bound is taken by all three."""
    setting = ENGINE_SETTINGS[name]
    past = [
        *([] if setting.ge is None else [setting.ge - 1]),
        *([] if setting.gt is None else [setting.gt]),
        *([] if setting.le is None else [setting.le + 1]),
    ]
    on = [bound for bound in (setting.ge, setting.le) if bound is not None]
    flag = _engine_flags().get(name)
    command = ["generate", "smollm2-135m", "--prompt", "Hello"]
    for value in past:
        with pytest.raises(InvalidRequestError, match=f"^{name} must be"):
            EngineConfig(**{name: value}).validate()
        if name in AppArgs.model_fields:
            with pytest.raises(ValueError, match=f"invalid TileInfer application args: {name}:"):
                parse_app_args({name: value})
        if flag is not None:
            with pytest.raises(SystemExit) as exit_code:
                build_parser().parse_args([*command, flag.option_strings[0], str(value)])
            assert exit_code.value.code == 2
            assert flag.option_strings[0] in capsys.readouterr().err
    for value in on:
        EngineConfig(**{name: value}).validate()
        if name in AppArgs.model_fields:
            assert getattr(parse_app_args({name: value}), name) == value
        if flag is not None:
            parsed = build_parser().parse_args([*command, flag.option_strings[0], str(value)])
            assert getattr(parsed, name) == value
