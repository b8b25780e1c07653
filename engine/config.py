"""The engine's settings: the values each may take, the defaults that depend on the device, EngineConfig,
and one check of them all (EngineConfig.validate).

The command line's choices (deployments/launch/cli.py), the app's args (deployments/launch/app_args.py) and
the API's schema (deployments/openai_api/openapi.py) read the allowed values from here. This module imports no
torch, so that `tileinfer --help` answers at once; the methods that make torch objects import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, get_args

from tileinfer.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

Dtype = Literal["float32", "bfloat16", "float16"]
Device = Literal["cpu", "cuda"]
Quantization = Literal["int8"]  # weight-only INT8 linears in every decoder layer (kernels/int8.py)
# int8: keys and values stored as int8 with scales (kernels/kv_cache.py's Int8KVCache); auto: the dtype's
KVCacheDtype = Literal["auto", "int8"]
# ngram: prompt lookup; draft: a draft model, or the target's first layers; dflash: a DFlash checkpoint
ProposerName = Literal["ngram", "draft", "dflash"]

DTYPES: tuple[str, ...] = get_args(Dtype)
DEVICES: tuple[str, ...] = get_args(Device)
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)
PROPOSERS: tuple[str, ...] = get_args(ProposerName)


@dataclasses.dataclass(frozen=True)
class DeviceDefaults:
    max_num_seqs: int
    kv_cache_tokens: int | None  # None: what the free memory holds (engine/kv/budget.py)
    long_prefill_step_ms: float  # EngineConfig.long_prefill_step_ms


# A GPU decodes many sequences at once, and its KV cache takes what the free memory holds; the CPU's stay
# small. The app's args (AppArgs.for_device) and the command line take these where nothing was given.
# A step that carries a long prompt's chunk (EngineConfig.long_prefill_step_ms): 100 ms on the CPU, one or
# two of SmolLM2-135M's short steps on two cores, where a step's fixed cost makes smaller chunks slow. Off
# on a GPU until it has been measured there (bench/long_prompts.py --long-prefill-step-ms 25: a short
# request beside long prompts would wait about 50 ms, twice its TTFT alone at 8 clients).
GPU_DEFAULTS = DeviceDefaults(max_num_seqs=256, kv_cache_tokens=None, long_prefill_step_ms=0.0)
CPU_DEFAULTS = DeviceDefaults(max_num_seqs=64, kv_cache_tokens=16384, long_prefill_step_ms=100.0)


def device_defaults(device: str) -> DeviceDefaults:
    return GPU_DEFAULTS if device.split(":")[0] == "cuda" else CPU_DEFAULTS


def check_one_of(name: str, value: object, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise InvalidRequestError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of one of DTYPES."""
    import torch

    check_one_of("dtype", name, DTYPES)
    return getattr(torch, name)


@dataclasses.dataclass
class EngineConfig:
    block_size: int = 16
    # KV cache capacity in tokens; default: on a GPU what gpu_memory_utilization of the free memory holds
    # (engine/kv/budget.py), on the CPU max_model_len
    kv_cache_tokens: int | None = None
    # default: the model's max_position_embeddings; never more than the KV cache holds
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9  # of the device memory free once the weights are loaded
    # The share of its GPU this engine owns (Ray's fractional num_gpus: engine replicas that share a GPU);
    # its KV cache is sized within that share of the memory (kv_budget.engine_free_bytes).
    gpu_memory_share: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # A prompt with more tokens than this left to compute is long: it takes at most this many of a step
    # until the step's other prompts have had theirs, so a prompt sent during a long prefill starts in the
    # next step (engine/scheduler.py). What they leave goes back to it, so steps are as full as without
    # the cap. None: a quarter of the step budget (512 of 2,048), which leaves three quarters of a step to
    # the prompts beside a long one, whatever the context. vLLM's default, 4 % of max_model_len, would
    # tie it to the context instead: 1,638 tokens of 2,048 for a 40k context, 82 for a 2k one.
    long_prefill_token_threshold: int | None = None
    # How many long prompts are prefilled at once; more wait, and short ones start past them. (vLLM's
    # max_long_partial_prefills. Its max_num_partial_prefills, which counts short prompts too, has no
    # knob here: a short prompt is prefilled in one step whenever the budget holds it.)
    max_long_partial_prefills: int = 1
    # The time a step that carries a long prompt's chunk is planned to take, in ms: the chunk is cut to
    # what the engine's step-cost model (engine/step_cost.py, fitted to its own measured steps) predicts
    # fits, for a step's cost grows with its tokens' context as well as their number. A request sent
    # during a long prefill waits for the step in flight, then gets its first token from its own step, so
    # its TTFT stays near two of these. A cut chunk still costs at least what its step costs anyway (half
    # its best speed), so a long prompt's own TTFT pays about twice where the budget is near a step's fixed
    # cost (the CPU: 1.6-2.7x, BENCHMARKS.md), and a long prompt alone keeps whole-budget chunks while they
    # fit. None or 0: no time budget, steps by tokens only (one request at a time, as the command line
    # runs, gains nothing from it); the app's args give the device's default (DeviceDefaults).
    long_prefill_step_ms: float | None = None
    dtype: Dtype = "float32"
    device: str = "cpu"  # cpu, cuda or cuda:N
    quantization: Quantization | None = None  # None: the weights' dtype
    kv_cache_dtype: KVCacheDtype = "auto"
    cuda_graphs: bool = True  # on a GPU, replay decode steps from CUDA graphs
    # On a GPU, also replay prefill, mixed and verify steps from CUDA graphs (one per token-count bucket).
    step_graphs: bool = True
    # Launch step n+1 before reading step n's tokens (the host works while the GPU runs): decode steps,
    # and mixed ones (prompt chunks beside decoding sequences) that step graphs run.
    # None: on a GPU only; on the CPU it only delays each token by a step, but exercises the same path.
    run_ahead: bool | None = None
    # Speculative decoding: the proposer (draft_model: the draft model, or DFlash's checkpoint folder); at
    # most num_draft drafts a step.
    proposer: ProposerName | None = None
    draft_model: str | None = None
    draft_layers: int | None = None
    num_draft: int = 4
    # False: outputs carry token ids only (new_text ""), and stop strings are the caller's to find: the
    # engine deployment, whose ingress replicas detokenize. EOS, stop token ids and max_tokens still end
    # requests here.
    detokenize: bool = True

    def validate(self) -> None:
        """Raise InvalidRequestError for a setting the engine cannot run with (a device cuda on a machine
        without a usable GPU included)."""
        check_one_of("dtype", self.dtype, DTYPES)
        self.torch_device()
        if self.quantization is not None:
            check_one_of("quantization", self.quantization, QUANTIZATIONS)
        check_one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.proposer is not None:
            check_one_of("proposer", self.proposer, PROPOSERS)
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise InvalidRequestError(
                f"long_prefill_token_threshold must be at least 1, got {self.long_prefill_token_threshold}"
            )
        if self.long_prefill_step_ms is not None and not self.long_prefill_step_ms >= 0:
            raise InvalidRequestError(
                f"long_prefill_step_ms must be at least 0, got {self.long_prefill_step_ms}"
            )
        if self.max_long_partial_prefills < 1:  # 0 would keep every long prompt waiting
            raise InvalidRequestError(
                f"max_long_partial_prefills must be at least 1, got {self.max_long_partial_prefills}"
            )

    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    def torch_device(self) -> torch.device:
        import torch

        unknown = InvalidRequestError(f"device must be {' or '.join(DEVICES)}, got {self.device!r}")
        try:
            device = torch.device(self.device)
        except RuntimeError as error:
            raise unknown from error
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidRequestError("device cuda was asked for, but this machine has no usable CUDA GPU")
        if device.type not in DEVICES:
            raise unknown
        return device
