"""Compile every Triton kernel launch the GPU engine makes for the H200 (sm_90), on a machine without a
GPU: the compiler runs its whole pipeline (Python AST to cubin with ptxas), and nothing is launched.

    TRITON_INTERPRET=0 python tests/sm90_compile.py

The engine's Triton ops run on CPU tensors with JITFunction.run replaced by a recorder: a decoder of
each kind (SmolLM2's head size and GQA 3; Qwen3's q/k norm at head size 128; Qwen2's qkv bias; a
sliding window) runs a prefill, a decode step and a verify-shaped step, plus the sampler (and its
Philox noise kernel) and split decode and verify attention. Each distinct launch (kernel, constexprs,
warps, stages) is then compiled, in a process a core (up to 4); a kernel past the H200's shared memory
fails too.
Prints one JSON line: {"compiled": {kernel: variants}, "failed": [...]}; exits 1 if any failed.
The CPU tests run the same kernels in Triton's interpreter, which checks their arithmetic but not
that the compiler accepts them; this does the latter. Triton's version here may differ from the GPU
machine's.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import json
import multiprocessing
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("run with TRITON_INTERPRET=0: the kernels must be real JIT functions to compile")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from tileinfer.engine.kv.block_manager import BlockManager  # noqa: E402
from tileinfer.engine.models.decoder import Decoder  # noqa: E402
from tileinfer.engine.models.random_model import QWEN3_0_6B, SMOLLM2_135M, random_weights  # noqa: E402
from tileinfer.engine.ops import TRITON_OPS  # noqa: E402
from tileinfer.engine.runner import ModelRunner  # noqa: E402
from tileinfer.engine.sampling.params import SamplingParams  # noqa: E402
from tileinfer.engine.sequence import Sequence  # noqa: E402
from tileinfer.engine.step import ScheduledRow  # noqa: E402
from tileinfer.kernels import linear, norm_linear, persistent_decode  # noqa: E402
from tileinfer.kernels.decode_attention import (  # noqa: E402
    DecodeWorkspace,
    paged_decode_attention_triton,
)
from tileinfer.kernels.int8 import quantize_int8  # noqa: E402
from tileinfer.kernels.linear_dequant import INT8_DEQUANT_MIN_M, DequantWorkspace  # noqa: E402
from tileinfer.kernels.linear_gemv import GemvConfig, launch_gemv  # noqa: E402
from tileinfer.kernels.linear_skinny import SplitKScratch  # noqa: E402
from tileinfer.kernels.paged_attention import AttentionMetadata  # noqa: E402
from tileinfer.kernels.prefill_attention import allocate_prefill_workspace, paged_prefill_attention_triton  # noqa: E402
from tileinfer.kernels.sampling import ACCEPT_STREAM, SamplingTensors, philox_uniform_triton, sample_triton  # noqa: E402
from tileinfer.kernels.triton_common import H200_SHARED_MEMORY_PER_BLOCK  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H200
LAUNCH_OPTIONS = (
    "num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_pdl",
    "launch_cooperative_grid",
)  # fmt: skip
TYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
    torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
}  # fmt: skip


@dataclasses.dataclass
class Launch:
    kernel: JITFunction
    arguments: dict[str, object]  # every parameter, defaults applied
    options: dict[str, int]


def record_launches() -> list[Launch]:
    """Replace JITFunction.run so that `kernel[grid](...)` records its arguments instead of launching."""
    launches: list[Launch] = []

    def run(self: JITFunction, *args: object, grid: object = None, **kwargs: object) -> None:
        del grid
        kwargs.pop("warmup", None)
        options = {name: kwargs.pop(name) for name in LAUNCH_OPTIONS if name in kwargs}
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        launches.append(Launch(self, dict(bound.arguments), options))

    JITFunction.run = run
    return launches


def argument_type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def is_16_aligned(value: object) -> bool:
    """As the JIT specializes an argument at launch: a pointer or an integer divisible by 16. Without it
    the compiler neither vectorizes nor pipelines loads through shared memory, and under-counts it."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def compile_launch(launch: Launch) -> None:
    params = launch.kernel.params
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(params):
        value = launch.arguments[param.name]
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[(index,)] = value
            continue
        signature[param.name] = argument_type(value)
        if is_16_aligned(value) and not param.do_not_specialize and not param.do_not_specialize_on_alignment:
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(source, target=TARGET, options=launch.options)
    if kernel.metadata.shared > H200_SHARED_MEMORY_PER_BLOCK:  # the launch would fail with OutOfResources
        raise RuntimeError(
            f"{kernel.metadata.shared} bytes of shared memory, the H200 has {H200_SHARED_MEMORY_PER_BLOCK}"
        )


def variant_key(launch: Launch) -> tuple:
    """What makes a compiled variant: the kernel, its constexprs, its argument types, its options."""
    constexprs, types = [], []
    for param in launch.kernel.params:
        value = launch.arguments[param.name]
        if param.is_constexpr:
            constexprs.append((param.name, repr(value)))
        else:
            types.append("None" if value is None else argument_type(value))
    return (launch.kernel.fn.__name__, tuple(constexprs), tuple(types), tuple(sorted(launch.options.items())))


def run_decoder(
    spec: object,
    prompt_len: int,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
    stacked: bool = False,
) -> None:
    """A prefill, a decode step and a verify-shaped step (5 logit rows) of a 2-layer bf16 decoder;
    stacked: its layers stacked, so the decode step runs the persistent kernel."""
    spec = dataclasses.replace(spec, num_layers=2)
    weights = random_weights(spec, torch.bfloat16, "cpu")
    decoder = Decoder.from_weights(
        spec, weights, max_positions=1024, ops=TRITON_OPS, quantization=quantization
    )
    if stacked:
        decoder.stack_layers()
    runner = ModelRunner(
        decoder,
        64,
        16,
        torch.bfloat16,
        max_num_seqs=2,
        max_model_len=1024,
        graphs=False,
        kv_cache_dtype=kv_cache_dtype,
    )
    manager = BlockManager(num_blocks=64, block_size=16)
    seq = Sequence("s", list(range(1, prompt_len + 1)), SamplingParams())
    manager.allocate(seq)
    runner.forward_eager([ScheduledRow(seq, prompt_len)])
    seq.num_computed_tokens = prompt_len
    seq.token_ids.append(7)
    manager.append_slots(seq, 0)
    runner.forward_eager([ScheduledRow(seq, 1)])
    seq.num_computed_tokens += 1
    seq.token_ids += [8, 9, 10, 11, 12]
    manager.append_slots(seq, 0)
    runner.forward_eager([ScheduledRow(seq, 5)], num_logits={seq: 5})


def run_engine_kernels() -> None:
    run_decoder(SMOLLM2_135M, 40)  # head size 64, GQA 3, tied embeddings
    run_decoder(QWEN3_0_6B, 100)  # head size 128, q/k norm; a prefill past the skinny GEMM's rows
    run_decoder(dataclasses.replace(SMOLLM2_135M, family="qwen2", qkv_bias=True), 40)
    run_decoder(dataclasses.replace(SMOLLM2_135M, family="mistral", sliding_window=24), 40)
    run_decoder(QWEN3_0_6B, 100, kv_cache_dtype="int8")  # the INT8 KV cache's write and attention
    run_decoder(QWEN3_0_6B, 100, quantization="int8")  # INT8 weights in every linear kernel
    # the persistent decode kernel (its grid as on the H200: the compiler here loads no binary)
    persistent_decode.fitting_grid = lambda *args: 132
    run_decoder(QWEN3_0_6B, 100, stacked=True)
    # as a decoder's linears run: with split-K scratch (and dequantization buffers where given)
    workspace = linear.LinearWorkspace(SplitKScratch.allocate(torch.device("cpu")))
    # fp32 activations on INT8 weights in the skinny GEMM at 64 rows (SmolLM2's gate/up: shared memory)
    x = torch.empty(40, 576, dtype=torch.float32)
    out = torch.empty(40, 1536)
    linear.gate_up_silu_triton(x, quantize_int8(torch.zeros(3072, 576)), out=out, workspace=workspace)
    # a Q8_0 GGUF's group-32 scales in the GEMV, the skinny GEMM (16 and 64 rows) and the GEMM, at
    # Qwen3-4B's widths (64 gate/up rows in 4 stages passed the H200's shared memory); then a prefill
    # long enough to dequantize the weight first, with group and per-row scales
    for rows, gate_up, group_size in ((6144, False, 32), (19456, True, 32), (6144, False, None)):
        weight = quantize_int8(torch.zeros(rows, 2560), group_size=group_size)
        for m in (1, 5, 40, 100, INT8_DEQUANT_MIN_M) if group_size else (INT8_DEQUANT_MIN_M,):
            if m >= INT8_DEQUANT_MIN_M:
                workspace.dequant = DequantWorkspace(torch.device("cpu"), rows * 2560 * 2, num_buffers=1)
            x = torch.empty(m, 2560, dtype=torch.bfloat16)
            out = torch.empty(m, rows // 2 if gate_up else rows, dtype=torch.bfloat16)
            call = linear.gate_up_silu_triton if gate_up else linear.linear_triton
            call(x, weight, out=out, workspace=workspace)
            workspace.dequant = None
    # the norm-fused GEMV with one K tile wider than the row, as tuned tiles on the GPU pick it
    hidden = torch.empty(1, 1024, dtype=torch.bfloat16)
    for gate_up in (False, True):
        norm_linear._launch_gemv(
            hidden, torch.empty_like(hidden), torch.empty(1024, dtype=torch.bfloat16), 1e-6,
            torch.empty(4096, 1024, dtype=torch.bfloat16), None, gate_up,
            torch.empty(1, 2048 if gate_up else 4096, dtype=torch.bfloat16), torch.empty_like(hidden),
            GemvConfig(block_n=2, block_k=1024, num_warps=4),
        )  # fmt: skip
    # INT8 GEMVs with pipelined K loops (as tuned tiles on the GPU pick them), at Qwen3-4B's widths
    hidden = torch.empty(1, 2560, dtype=torch.bfloat16)
    values, scale = torch.empty(19456, 2560, dtype=torch.int8), torch.empty(19456)
    for gate_up in (False, True):
        norm_linear._launch_gemv(
            hidden, torch.empty_like(hidden), torch.empty(2560, dtype=torch.bfloat16), 1e-6, values, None,
            gate_up, torch.empty(1, 9728 if gate_up else 19456, dtype=torch.bfloat16),
            torch.empty_like(hidden),
            GemvConfig(block_n=4, block_k=512, num_warps=4, num_stages=4), scale=scale,
        )  # fmt: skip
    launch_gemv(
        torch.empty(1, 9728, dtype=torch.bfloat16), torch.empty(2560, 9728, dtype=torch.int8), None,
        torch.empty(1, 2560, dtype=torch.bfloat16), False,
        GemvConfig(block_n=4, block_k=2048, num_warps=8, num_stages=4), scale=torch.empty(2560),
    )  # fmt: skip
    # split decode attention, as a CUDA graph sized for a 32k block table runs it
    query = torch.empty(2, 32, 128, dtype=torch.bfloat16)
    cache = torch.empty(2, 2056, 16, 8, 128, dtype=torch.bfloat16)
    tables, lens = torch.zeros(2, 2056, dtype=torch.int32), torch.tensor([4096, 9], dtype=torch.int32)
    workspace = DecodeWorkspace(
        partials=torch.empty(DecodeWorkspace.partials_numel(2, 32, 128, 16)),
        counters=torch.zeros(2 * 8, dtype=torch.int32),
    )
    paged_decode_attention_triton(query, cache, tables, lens, 0.088, num_splits=16, workspace=workspace)
    # split verify attention: 2 sequences of 4 query tokens over long contexts
    query = torch.empty(8, 32, 128, dtype=torch.bfloat16)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(8, dtype=torch.int64),
        query_start_loc=torch.tensor([0, 4, 8], dtype=torch.int32),
        seq_lens=lens,
        block_tables=tables,
        max_query_len=4,
        prefill_num_splits=8,
        prefill_workspace=allocate_prefill_workspace(8, 2, 4, 32, 8, 128, 8, "cpu"),
    )
    paged_prefill_attention_triton(query, cache, metadata, 0.088)
    # the sampler: greedy and sampled rows with every filter and penalty
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                       frequency_penalty=0.5, presence_penalty=0.3, seed=3),
    ]  # fmt: skip
    tensors = SamplingTensors.from_params(params, [[1, 2], [3]], [[4], []], [1, 2], [0, 0], 1000)
    sample_triton(torch.empty(2, 1000, dtype=torch.float32), tensors)
    # sampled verification's noise: each position's race uniforms and the drafts' acceptance uniforms
    philox_uniform_triton(tensors.seeds, tensors.positions, 1000)
    philox_uniform_triton(tensors.seeds, tensors.positions, 1, ACCEPT_STREAM)


_VARIANTS: list[Launch] = []  # what the compiling processes (forked) read


def _compile_variant(index: int) -> str | None:
    """The error of compiling _VARIANTS[index], or None."""
    try:
        compile_launch(_VARIANTS[index])
    except Exception as error:  # noqa: BLE001 - report every failing variant, not just the first
        return str(error)[-2000:]
    return None


def main() -> None:
    launches = record_launches()
    run_engine_kernels()
    variants = {variant_key(launch): launch for launch in launches}
    _VARIANTS.extend(variants.values())
    # one compiling process a core (forked: they inherit the recorded launches)
    with multiprocessing.get_context("fork").Pool(max(1, min(4, os.cpu_count() or 1))) as pool:
        errors = pool.map(_compile_variant, range(len(_VARIANTS)), chunksize=1)
    compiled: dict[str, int] = collections.Counter()
    failed = []
    for key, error in zip(variants, errors, strict=True):
        if error is None:
            compiled[key[0]] += 1
        else:
            failed.append({"kernel": key[0], "constexprs": dict(key[1]), "error": error})
    split = {
        name: any(key[0] == name and ("NUM_SPLITS", "1") not in key[1] for key in variants)
        for name in ("_paged_decode_kernel", "_paged_prefill_kernel")
    }  # both attention kernels compiled with their split-and-merge path too
    int8_kv = {  # the INT8 KV cache's variants compiled too
        name: any(key[0] == name and (flag, "True") in key[1] for key in variants)
        for name, flag in (("_paged_decode_kernel", "KV_INT8"), ("_paged_prefill_kernel", "KV_INT8"),
                           ("_qkv_epilogue_kernel", "QUANTIZE"))
    }  # fmt: skip
    print(json.dumps({"compiled": compiled, "split_variants": split, "int8_kv": int8_kv, "failed": failed}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
