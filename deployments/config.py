"""The application's arguments (serve_config.yaml `args`), validated once by pydantic."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.default_model import DEFAULT_MODEL_ALIAS
from engine.engine import EngineConfig


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(DEFAULT_MODEL_ALIAS, description="a folder, a .gguf file, a hub id, or smollm2-135m")
    served_model_name: str | None = Field(None, description="the `model` clients name; default: model")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bfloat16 on a GPU, else float32
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: the GPU when the Ray cluster has one
    max_model_len: int | None = Field(None, ge=2, description="context length; default: the model's")
    kv_cache_tokens: int | None = Field(None, ge=16, description="KV cache capacity; default: max_model_len")
    block_size: int = Field(16, ge=1, le=1024)
    max_num_seqs: int = Field(64, ge=1, description="sequences decoded together")
    max_num_batched_tokens: int = Field(2048, ge=1, description="tokens computed in one step")
    max_queue_len: int = Field(256, ge=0, description="requests that may wait beyond max_num_seqs; then 503")
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="larger bodies get 413")
    api_key: str | None = Field(None, min_length=1, description="when set, requests need this Bearer key")
    engine_num_cpus: float = Field(1.0, ge=0)
    ingress_num_cpus: float = Field(0.0, ge=0)
    num_ingress_replicas: int = Field(1, ge=1)
    # Speculative decoding: the proposer runs as its own deployment beside the engine (or in the engine's
    # process with proposer_in_process) and hands its drafts over through shared memory.
    proposer: Literal["ngram", "draft", "dflash"] | None = None
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
        None, ge=0, le=1, description="default: 1; 0.5 when it shares its GPU with the proposer"
    )
    draft_ahead: bool | None = Field(
        None,
        description="the proposer drafts the next block while the engine verifies; default: on when "
        "the proposer has a GPU of its own (draft-model and DFlash proposers)",
    )

    def proposer_draft_ahead(self, device: str, num_gpus: float) -> bool:
        """Whether the proposer actor drafts ahead: as asked, else when it holds a whole GPU."""
        if self.draft_ahead is not None:
            return self.draft_ahead
        return device == "cuda" and num_gpus >= 1

    @property
    def proposer_actor(self) -> bool:
        """Whether a proposer deployment runs beside the engine."""
        return self.proposer is not None and not self.proposer_in_process

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def engine_config(self, device: str, dtype: str) -> EngineConfig:
        """The engine's settings, proposer included (the engine or the proposer deployment builds it)."""
        return EngineConfig(
            block_size=self.block_size,
            kv_cache_tokens=self.kv_cache_tokens,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            dtype=dtype,
            device=device,
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
