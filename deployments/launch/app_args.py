"""The application's arguments (serve_config.yaml `args`), validated once by pydantic."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from tileinfer.engine.config import (
    CPU_DEFAULTS,
    GPU_DEFAULTS,
    Device,
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


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(DEFAULT_MODEL_ALIAS, description="a folder, a .gguf file, a hub id, or smollm2-135m")
    served_model_name: str | None = Field(None, description="the `model` clients name; default: model")
    chat_template: str | None = Field(
        None, min_length=1, description="a jinja chat template in place of the model's: a file (read where "
        "the ingress runs) or the template itself; rendered in a sandbox, as the model's own",
    )  # fmt: skip
    dtype: Literal["auto", Dtype] = "auto"  # auto: bfloat16 on a GPU, else float32
    device: Literal["auto", Device] = "auto"  # auto: the GPU when the Ray cluster has one
    quantization: Quantization | None = Field(
        None, description="int8: weight-only INT8 linears, quantized at load; default: the weights' dtype"
    )
    kv_cache_dtype: KVCacheDtype = Field(
        "auto", description="int8: keys and values in int8 with a scale per token and head; auto: the dtype"
    )
    max_model_len: int | None = Field(
        None, ge=2, description="context length; default: the model's; never more than the KV cache holds"
    )
    kv_cache_tokens: int | None = Field(
        None, ge=16, description="KV cache capacity; default: from the free memory on a GPU, "
        f"{CPU_DEFAULTS.kv_cache_tokens} on the CPU",
    )  # fmt: skip
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="on a GPU, the share of the memory free after loading the weights that "
        "the engine takes (for the KV cache, less a reserve for the steps)",
    )  # fmt: skip
    block_size: int = Field(16, ge=1, le=1024)
    max_num_seqs: int | None = Field(
        None, ge=1, description="sequences decoded together; default: "
        f"{GPU_DEFAULTS.max_num_seqs} on a GPU, {CPU_DEFAULTS.max_num_seqs} on the CPU",
    )  # fmt: skip
    max_num_batched_tokens: int = Field(2048, ge=1, description="tokens computed in one step")
    long_prefill_token_threshold: int | None = Field(
        None, ge=1, description="a prompt with more tokens to compute is long: it takes at most this many "
        "of a step until the prompts beside it have had theirs; default: a quarter of max_num_batched_tokens",
    )  # fmt: skip
    max_long_partial_prefills: int = Field(1, ge=1, description="long prompts prefilled at once, at most")
    long_prefill_step_ms: float | None = Field(
        None, ge=0, description="ms a step that carries a long prompt's chunk is planned to take (the "
        "engine cuts the chunk by its measured step costs), so a request sent during a long prefill gets "
        f"its first token within about two of these; default: {GPU_DEFAULTS.long_prefill_step_ms:g} on a "
        f"GPU, {CPU_DEFAULTS.long_prefill_step_ms:g} on the CPU; 0: steps limited by tokens only",
    )  # fmt: skip
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
    proposer: ProposerName | None = None
    draft_model: str | None = Field(None, description="draft: a smaller model; dflash: a DFlash checkpoint")
    draft_layers: int | None = Field(None, ge=1, description="self-draft: the target's first layers")
    num_draft: int = Field(4, ge=1, le=16, description="drafts verified per step, at most")
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
        """The engine's settings, proposer included (the engine or its proposer actor builds it)."""
        args = self.for_device(device)
        return EngineConfig(
            gpu_memory_share=gpu_memory_share,
            block_size=self.block_size,
            kv_cache_tokens=args.kv_cache_tokens,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_long_partial_prefills=self.max_long_partial_prefills,
            long_prefill_step_ms=args.long_prefill_step_ms,
            dtype=dtype,
            device=device,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            proposer=self.proposer,
            draft_model=self.draft_model,
            draft_layers=self.draft_layers,
            num_draft=self.num_draft,
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
