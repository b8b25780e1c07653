"""The application's arguments (serve_config.yaml `args`), validated once by pydantic."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from tileinfer.engine.config import (
    CPU_DEFAULTS,
    ENGINE_SETTINGS,
    GPU_DEFAULTS,
    Device,
    DeviceDefaults,
    Dtype,
    EngineConfig,
    KVCacheDtype,
    ProposerName,
    Quantization,
    device_defaults,
)
from tileinfer.engine.models.default_model import DEFAULT_MODEL_ALIAS

# num_ingress_replicas auto: one ingress replica per CPUS_PER_INGRESS of the cluster's CPUs, at most
# MAX_AUTO_INGRESS (each serves HTTP and detokenizes on one core; BENCHMARKS.md, Serve-load).
CPUS_PER_INGRESS = 4
MAX_AUTO_INGRESS = 4
# The API key from the environment of the ingress replicas (as vLLM's VLLM_API_KEY), when the args give
# neither api_key nor api_key_file.
API_KEY_ENV = "TILEINFER_API_KEY"

# The engine's settings whose default depends on the device: null in the args, for for_device to fill.
_DEVICE_DEFAULTED = frozenset(field.name for field in dataclasses.fields(DeviceDefaults))


def _on_each_device(name: str) -> str:
    """The device's defaults of one setting in words: "256 on a GPU, 64 on the CPU"."""

    def shown(value: float | None) -> str:
        if value is None:  # the engine sizes it from the free memory (the KV cache)
            return "from the free memory"
        return f"{value:g}" if isinstance(value, float) else str(value)

    return f"{shown(getattr(GPU_DEFAULTS, name))} on a GPU, {shown(getattr(CPU_DEFAULTS, name))} on the CPU"


def engine_arg(name: str, auto: str | None = None) -> Any:
    """The AppArgs field of EngineConfig's setting `name`: its default, bounds and help; null where the
    default depends on the device; "auto" where `auto` says what that takes."""
    setting = ENGINE_SETTINGS[name]
    default, description = setting.default, setting.help
    if name in _DEVICE_DEFAULTED:
        default, description = None, f"{description}; default: {_on_each_device(name)}"
    if auto is not None:
        default, description = "auto", f"{description}; auto: {auto}"
    return Field(default, ge=setting.ge, gt=setting.gt, le=setting.le, description=description)


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(DEFAULT_MODEL_ALIAS, description="a folder, a .gguf file, a hub id, or smollm2-135m")
    served_model_name: str | None = Field(None, description="the `model` clients name; default: model")
    chat_template: str | None = Field(
        None, min_length=1, description="a jinja chat template in place of the model's: a file (read where "
        "the ingress runs) or the template itself; rendered in a sandbox, as the model's own",
    )  # fmt: skip
    # The engine's settings (EngineConfig's fields): their defaults, bounds and help are engine/config.py's.
    dtype: Literal["auto", Dtype] = engine_arg("dtype", auto="bfloat16 on a GPU, else float32")
    device: Literal["auto", Device] = engine_arg("device", auto="the GPU when the Ray cluster has one")
    quantization: Quantization | None = engine_arg("quantization")
    kv_cache_dtype: KVCacheDtype = engine_arg("kv_cache_dtype")
    max_model_len: int | None = engine_arg("max_model_len")
    kv_cache_tokens: int | None = engine_arg("kv_cache_tokens")
    gpu_memory_utilization: float = engine_arg("gpu_memory_utilization")
    block_size: int = engine_arg("block_size")
    max_num_seqs: int | None = engine_arg("max_num_seqs")
    max_num_batched_tokens: int = engine_arg("max_num_batched_tokens")
    long_prefill_token_threshold: int | None = engine_arg("long_prefill_token_threshold")
    max_long_partial_prefills: int = engine_arg("max_long_partial_prefills")
    long_prefill_step_ms: float | None = engine_arg("long_prefill_step_ms")
    max_queue_len: int = Field(256, ge=0, description="requests that may wait beyond max_num_seqs; then 503")
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="larger bodies get 413")
    # Serve logs the args as given (its controller's "Importing application ... with arguments"), so a key
    # written here shows in its logs; api_key_file and TILEINFER_API_KEY are read by the ingress replicas.
    api_key: SecretStr | None = Field(
        None, min_length=1, description="when set, requests need this Bearer key (masked in reprs)"
    )
    api_key_file: str | None = Field(
        None, min_length=1, description="a file holding the key, read where the ingress replicas run"
    )
    metrics_require_key: bool = Field(False, description="/metrics needs the key too (by default not)")
    allow_open_cluster: bool = Field(
        False, description="serve on a Ray cluster that listens beyond loopback and takes callers without "
        "a token (refused by default: deployments/launch/cluster_security.py)",
    )  # fmt: skip
    engine_num_cpus: float = Field(1.0, ge=0)
    ingress_num_cpus: float = Field(0.0, ge=0)
    num_ingress_replicas: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description=f"auto: one per {CPUS_PER_INGRESS} of the cluster's CPUs, 1 to {MAX_AUTO_INGRESS}"
    )
    # Engine replicas (README, Scaling out): Serve places them over the cluster's GPUs and nodes, each with
    # engine_num_gpus of a GPU, and the ingress routes each request to one (deployments/replicas/routing.py).
    num_engine_replicas: int = Field(1, ge=1, description="engine replicas; each holds the whole model")
    engine_autoscaling_config: dict[str, Any] | None = Field(
        None, description="Serve's autoscaling_config for the engine deployment (min_replicas, max_replicas, "
        "...): then num_engine_replicas is not used",
    )  # fmt: skip
    engine_max_replicas_per_node: int | None = Field(
        None, ge=1, description="engine replicas on one node, at most (Serve's max_replicas_per_node)"
    )
    engine_router: Literal["prefix", "power_of_two"] = Field(
        "prefix", description="prefix: the replica most likely to hold the prompt's prefix, with a load "
        "guard; power_of_two: Serve's default, which knows nothing of caches",
    )  # fmt: skip
    # Serve's HTTP proxy (one process a node) forwards every SSE event on its own: at one event per step
    # per stream it was what capped the service at 64 clients and more (BENCHMARKS.md, Serve-load).
    max_stream_events_per_s: float = Field(
        2000.0, ge=0, description="SSE events a second that all streams together get, at most (0: one "
        "per step and stream); a stream's tokens between its events go together; its first never waits",
    )  # fmt: skip
    # Speculative decoding: the proposer runs as its own deployment beside the engine (or in the engine's
    # process with proposer_in_process) and hands its drafts over through shared memory.
    proposer: ProposerName | None = engine_arg("proposer")
    draft_model: str | None = engine_arg("draft_model")
    draft_layers: int | None = engine_arg("draft_layers")
    num_draft: int = engine_arg("num_draft")
    proposer_in_process: bool = False
    proposer_timeout_s: float = Field(0.5, gt=0, description="a step waits this long for drafts, at most")
    # BENCHMARKS.md: DFlash 1.5-2x faster with it (its steps then eager), a draft model within the noise
    draft_ring: bool = Field(
        True, description="draft and DFlash drafts cross in the draft ring (on a GPU: the engine's GPU "
        "waits for them) rather than in host memory, the engine's host waiting",
    )  # fmt: skip
    proposer_num_cpus: float = Field(1.0, ge=0)
    proposer_num_gpus: float | None = Field(
        None, ge=0, le=1, description="default: 1 when the cluster has 2+ GPUs (a GPU of its own), else 0.5"
    )
    engine_num_gpus: float | None = Field(
        None, ge=0, le=1, description="a GPU or a share of one for each engine replica (its KV cache is "
        "sized within that share of the GPU's memory); default: 1, or 0.5 when it shares its GPU with the "
        "proposer",
    )  # fmt: skip
    draft_ahead: bool | None = Field(
        None,
        description="the proposer drafts the next block while the engine verifies; default: on when "
        "the proposer has a GPU of its own (draft-model and DFlash proposers)",
    )

    @model_validator(mode="after")
    def _one_key_source(self) -> AppArgs:
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("give api_key or api_key_file, not both")
        return self

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self) -> AppArgs:
        if self.engine_autoscaling_config is not None and self.num_engine_replicas != 1:
            raise ValueError("give num_engine_replicas or engine_autoscaling_config, not both")
        return self

    def resolve_api_key(self) -> str | None:
        """The key requests need, or None: api_key, else api_key_file's content (stripped), else the
        TILEINFER_API_KEY environment variable. Call it where the ingress runs (the file and the variable
        are that machine's)."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_file is not None:
            try:
                key = Path(self.api_key_file).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as error:
                raise ValueError(f"args.api_key_file: cannot read {self.api_key_file}: {error}") from None
            if not key:
                raise ValueError(f"args.api_key_file: {self.api_key_file} is empty")
            return key
        return os.environ.get(API_KEY_ENV) or None

    def proposer_draft_ahead(self, device: str, num_gpus: float) -> bool:
        """Whether the proposer actor drafts ahead: as asked, else when it holds a whole GPU."""
        if self.draft_ahead is not None:
            return self.draft_ahead
        return device == "cuda" and num_gpus >= 1

    @property
    def proposer_actor(self) -> bool:
        """Whether each engine replica runs a proposer actor beside it."""
        return self.proposer is not None and not self.proposer_in_process

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def for_device(self, device: str, cluster_cpus: float = 1.0) -> AppArgs:
        """These args with the cluster's defaults in place of null and auto (build_app resolves them once,
        so every deployment sees numbers): max_num_seqs, long_prefill_step_ms, on the CPU kv_cache_tokens
        (on a GPU it stays null: the engine sizes its cache from the free memory), and
        num_ingress_replicas."""
        defaults = dataclasses.asdict(device_defaults(device))
        unset = {name: value for name, value in defaults.items() if getattr(self, name) is None}
        if self.num_ingress_replicas == "auto":
            unset["num_ingress_replicas"] = min(
                MAX_AUTO_INGRESS, max(1, int(cluster_cpus) // CPUS_PER_INGRESS)
            )
        return self.model_copy(update=unset) if unset else self

    def engine_config(self, device: str, dtype: str, gpu_memory_share: float = 1.0) -> EngineConfig:
        """The engine's settings, proposer included (the engine or its proposer actor builds it): the
        args' own, the device's defaults where they are null, and the resolved device and dtype."""
        args = self.for_device(device)
        given = {name: getattr(args, name) for name in _ENGINE_ARGS}
        return EngineConfig(**given, dtype=dtype, device=device, gpu_memory_share=gpu_memory_share)


# The args that go to EngineConfig as they are (dtype and device go resolved: engine_config's arguments).
_ENGINE_ARGS = tuple(
    name for name in AppArgs.model_fields if name in ENGINE_SETTINGS and name not in {"dtype", "device"}
)


def parse_app_args(args: dict | None) -> AppArgs:
    """Validate serve_config.yaml's args; a bad value gets one readable line per problem."""
    try:
        return AppArgs.model_validate(args or {})
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in item['loc']) or 'args'}: {item['msg']}"
            for item in error.errors()
        )
        raise ValueError(f"invalid TileInfer application args: {problems}") from None
