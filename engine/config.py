"""The engine's settings: the values each may take, the defaults that depend on the device, EngineConfig,
and one check of them all (EngineConfig.validate).

Each EngineConfig field carries its default, its help and its bounds (a Setting), written here once: the
command line's flags (deployments/launch/cli.py) and the app's args (deployments/launch/app_args.py) are
made from them, and they, with the API's schema (deployments/openai_api/openapi.py), read the allowed values
from here. This module imports no torch, so that `tileinfer --help` answers at once; the methods that make
torch objects import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

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


@dataclasses.dataclass(frozen=True)
class Setting:
    """One EngineConfig field as a user meets it: its default, the help the command line's flags and the
    app's args show (deployments/launch/), and the bounds of a number, which EngineConfig.validate, the
    flags and the args all check."""

    default: Any
    help: str
    ge: float | None = None  # at least
    gt: float | None = None  # more than
    le: float | None = None  # at most

    def holds(self, value: float) -> bool:
        # `not value >= ge` rather than `value < ge`, so that NaN is refused
        return not (
            (self.ge is not None and not value >= self.ge)
            or (self.gt is not None and not value > self.gt)
            or (self.le is not None and not value <= self.le)
        )

    def bounds(self) -> str:
        """The bounds in words ("at least 1 and at most 16"); empty for a setting without any."""
        parts = [
            f"{words} {bound}"
            for words, bound in (("at least", self.ge), ("more than", self.gt), ("at most", self.le))
            if bound is not None
        ]
        return " and ".join(parts)


def setting(
    default: Any, help: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None
) -> Any:
    """An EngineConfig field whose default, help and bounds are written here once."""
    return dataclasses.field(default=default, metadata={"setting": Setting(default, help, ge, gt, le)})


@dataclasses.dataclass
class EngineConfig:
    block_size: int = setting(16, "tokens per KV cache block", ge=1, le=1024)
    # default: on a GPU what gpu_memory_utilization of the free memory holds (engine/kv/budget.py), on the
    # CPU max_model_len; the app's args take the device's (DeviceDefaults)
    kv_cache_tokens: int | None = setting(None, "KV cache capacity in tokens", ge=16)
    # at least 2, a prompt's token and a generated one; 0 is refused rather than read as unset
    max_model_len: int | None = setting(
        None, "the context in tokens (prompt + generated); default: the model's own limit; never more than "
        "the KV cache holds", ge=2,
    )  # fmt: skip
    gpu_memory_utilization: float = setting(
        0.9, "on a GPU, the share of the memory free after loading the weights that the engine takes (for "
        "the KV cache, less a reserve for the steps)", gt=0, le=1,
    )  # fmt: skip
    # Ray's fractional num_gpus: engine replicas that share a GPU (kv_budget.engine_free_bytes)
    gpu_memory_share: float = setting(
        1.0, "the share of its GPU this engine owns; its KV cache is sized within that share of the memory"
    )
    # the CPU's, as the device is; the app's args and the command line take the device's (DeviceDefaults)
    max_num_seqs: int = setting(CPU_DEFAULTS.max_num_seqs, "sequences decoded together", ge=1)
    max_num_batched_tokens: int = setting(2048, "tokens computed in one step", ge=1)
    # A long prompt takes at most this many tokens of a step until the step's other prompts have had
    # theirs, so a prompt sent during a long prefill starts in the next step (engine/scheduler.py). What
    # they leave goes back to it, so steps are as full as without the cap. None: a quarter of the step
    # budget (512 of 2,048), which leaves three quarters of a step to the prompts beside a long one,
    # whatever the context. vLLM's default, 4 % of max_model_len, would tie it to the context instead:
    # 1,638 tokens of 2,048 for a 40k context, 82 for a 2k one.
    long_prefill_token_threshold: int | None = setting(
        None, "a prompt with more tokens to compute is long: it takes at most this many of a step until the "
        "prompts beside it have had theirs; default: a quarter of max_num_batched_tokens", ge=1,
    )  # fmt: skip
    # More long prompts wait, and short ones start past them. (vLLM's max_long_partial_prefills. Its
    # max_num_partial_prefills, which counts short prompts too, has no knob here: a short prompt is
    # prefilled in one step whenever the budget holds it.) 0 would keep every long prompt waiting.
    max_long_partial_prefills: int = setting(1, "long prompts prefilled at once, at most", ge=1)
    # The chunk is cut to what the engine's step-cost model (engine/step_cost.py, fitted to its own
    # measured steps) predicts fits, for a step's cost grows with its tokens' context as well as their
    # number. A request sent during a long prefill waits for the step in flight, then gets its first token
    # from its own step, so its TTFT stays near two of these. A cut chunk still costs at least what its step
    # costs anyway (half its best speed), so a long prompt's own TTFT pays about twice where the budget is
    # near a step's fixed cost (the CPU: 1.6-2.7x, BENCHMARKS.md), and a long prompt alone keeps
    # whole-budget chunks while they fit. None or 0: no time budget, steps by tokens only (one request at a
    # time, as the command line runs, gains nothing from it); the app's args take the device's default
    # (DeviceDefaults).
    long_prefill_step_ms: float | None = setting(
        None, "ms a step that carries a long prompt's chunk is planned to take (the engine cuts the chunk by "
        "its measured step costs), so a request sent during a long prefill gets its first token within "
        "about two of these; 0: steps limited by tokens only", ge=0,
    )  # fmt: skip
    dtype: Dtype = setting("float32", "the dtype the model computes in")
    device: str = setting("cpu", "where the engine runs")  # cpu, cuda or cuda:N
    quantization: Quantization | None = setting(
        None, "int8: weight-only INT8 linears, quantized at load; default: the weights' dtype"
    )
    kv_cache_dtype: KVCacheDtype = setting(
        "auto", "int8: keys and values in int8 with a scale per token and head; auto: the dtype"
    )
    cuda_graphs: bool = setting(True, "on a GPU, replay decode steps from CUDA graphs")
    # Not offered by the CLI or the app's args until a GPU run has measured it (bench_batch and
    # profile_step take --persistent-decode).
    persistent_decode: bool = setting(
        False, "on a GPU, one-sequence decode steps run every decoder layer in one persistent kernel "
        "(dense float weights, a float KV cache)",
    )  # fmt: skip
    step_graphs: bool = setting(
        True, "on a GPU, also replay prefill, mixed and verify steps from CUDA graphs (one per token-count "
        "bucket)",
    )  # fmt: skip
    # Decode steps, and mixed ones (prompt chunks beside decoding sequences) that step graphs run. On the
    # CPU it only delays each token by a step, but exercises the same path.
    run_ahead: bool | None = setting(
        None, "launch step n+1 before reading step n's tokens (the host works while the GPU runs); default: "
        "on a GPU only",
    )  # fmt: skip
    proposer: ProposerName | None = setting(
        None, "speculative decoding: ngram (prompt lookup), draft (a draft model, by default the target's "
        "own first layers) or dflash (a DFlash checkpoint)",
    )  # fmt: skip
    draft_model: str | None = setting(None, "draft: the draft model; dflash: the DFlash checkpoint folder")
    draft_layers: int | None = setting(
        None, "self-draft: the target's first N layers; default: a quarter of them", ge=1
    )
    num_draft: int = setting(4, "drafts verified per step, at most", ge=1, le=16)
    # The engine deployment turns it off: its ingress replicas detokenize. EOS, stop token ids and
    # max_tokens still end requests here.
    detokenize: bool = setting(
        True, "outputs carry their text; off: token ids only (new_text empty), and stop strings are the "
        "caller's to find",
    )  # fmt: skip

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
        for name, spec in ENGINE_SETTINGS.items():
            value = getattr(self, name)
            if value is not None and not spec.holds(value):
                raise InvalidRequestError(f"{name} must be {spec.bounds()}, got {value}")

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


# Each EngineConfig field's Setting, in the fields' order: what the command line's flags and the app's args
# are made from.
ENGINE_SETTINGS: dict[str, Setting] = {
    field.name: field.metadata["setting"] for field in dataclasses.fields(EngineConfig)
}
