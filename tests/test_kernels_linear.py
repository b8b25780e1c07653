"""Linear kernels (decode GEMV, prefill GEMM, gate/up fused with SwiGLU) against their torch references.

On the CPU the kernels run in Triton's interpreter (small shapes, odd sizes); on a GPU the same tests run
compiled, and the tests marked gpu check the real model shapes in bf16, under a CUDA graph too."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tileinfer.engine.graphs import capture_graph
from tileinfer.kernels import linear_gemm, linear_gemv, linear_skinny
from tileinfer.kernels.linear import (
    LinearWorkspace,
    gate_up_silu_reference,
    gate_up_silu_triton,
    linear_reference,
    linear_triton,
)
from tileinfer.kernels.linear_gemm import GemmConfig
from tileinfer.kernels.linear_gemv import GemvConfig
from tileinfer.kernels.linear_skinny import SkinnyConfig, SplitKScratch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def workspace() -> LinearWorkspace:
    """A decoder's split-K scratch, which the tests share as an engine's linears do."""
    return LinearWorkspace(SplitKScratch.allocate(torch.device(DEVICE)))


# (M, N, K): M = 1 takes the GEMV, 2 <= M <= 64 the skinny GEMM, M > 64 the tiled GEMM.
SHAPES = [
    (1, 1, 16),
    (1, 17, 40),
    (1, 96, 100),
    (3, 17, 64),
    (3, 64, 100),
    (8, 96, 40),
    (9, 17, 16),
    (64, 1, 40),
    (64, 96, 64),
    (64, 64, 100),
    (65, 33, 40),
]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.bfloat16:
        return {"rtol": 1.6e-2, "atol": 1.6e-2}
    # fp32: exact-ish in the interpreter; on the GPU the GEMM's fp32 tl.dot runs in TF32.
    return {"rtol": 2e-3, "atol": 2e-3} if DEVICE == "cuda" else {"rtol": 1e-5, "atol": 1e-5}


def _inputs(
    m: int, n_rows: int, k: int, dtype: torch.dtype, seed: int, x_pad: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k] (a view with row stride k + x_pad when x_pad > 0), weight [n_rows, k] scaled so that
    outputs are ~N(0, 1), bias [n_rows]."""
    gen = torch.Generator().manual_seed(seed)
    x_full = torch.randn(m, k + x_pad, generator=gen)
    weight = torch.randn(n_rows, k, generator=gen) / k**0.5
    bias = torch.randn(n_rows, generator=gen)
    x = x_full.to(DEVICE, dtype)[:, :k]
    return x, weight.to(DEVICE, dtype), bias.to(DEVICE, dtype)


def _poisoned_out(m: int, n: int, dtype: torch.dtype, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-filled [m, n + pad] buffer and its [m, n] view: the kernel must fill the view, not the pad."""
    buffer = torch.full((m, n + pad), float("nan"), dtype=dtype, device=DEVICE)
    return buffer, buffer[:, :n]


def _written(
    kernel: Callable[[torch.Tensor | None], torch.Tensor], m: int, n: int, dtype: torch.dtype, pad: int | None
) -> torch.Tensor:
    """kernel(out): into a NaN-poisoned [m, n] view of a wider buffer (pad columns past it), or allocating
    (pad None, out None); checks the result's shape and dtype, that every element was written and none
    past the view."""
    if pad is None:
        result = kernel(None)
    else:
        buffer, out = _poisoned_out(m, n, dtype, pad)
        result = kernel(out)
        assert result.data_ptr() == out.data_ptr()
        assert buffer[:, n:].isnan().all(), "wrote past the output columns"
    assert result.shape == (m, n) and result.dtype == dtype
    assert torch.isfinite(result).all(), "an output element was not written"
    return result


def _seed(*parts: object) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(repr(parts))) % (2**31)


def _linear64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


def _gate_up64(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    intermediate = weight.shape[0] // 2
    gate_up = F.linear(x.double(), weight.double())
    return F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
def test_linear_matches_reference(
    shape: tuple[int, int, int], dtype: torch.dtype, workspace: LinearWorkspace
) -> None:
    m, n, k = shape
    index = SHAPES.index(shape)
    with_bias, with_out, x_pad = index % 2 == 0, index % 3 != 1, 3 * (index % 2)
    x, weight, bias = _inputs(m, n, k, dtype, _seed("linear", shape, dtype), x_pad=x_pad)
    bias = bias if with_bias else None
    expected = _linear64(x, weight, bias)

    result = _written(
        lambda out: linear_triton(x, weight, bias, out=out, workspace=workspace),
        m, n, dtype, pad=5 if with_out else None,
    )  # fmt: skip
    torch.testing.assert_close(result.double(), expected, **tolerance(dtype))
    # The reference itself agrees (it is what the CPU engine runs).
    reference = linear_reference(x, weight, bias)
    torch.testing.assert_close(reference.double(), expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"M{m}-I{n}-K{k}" for m, n, k in SHAPES])
def test_gate_up_silu_matches_reference(
    shape: tuple[int, int, int], dtype: torch.dtype, workspace: LinearWorkspace
) -> None:
    m, intermediate, k = shape
    index = SHAPES.index(shape)
    with_out, x_pad = index % 2 == 1, 2 * (index % 3)
    x, weight, _ = _inputs(m, 2 * intermediate, k, dtype, _seed("gate_up", shape, dtype), x_pad=x_pad)
    expected = _gate_up64(x, weight)

    result = _written(
        lambda out: gate_up_silu_triton(x, weight, out=out, workspace=workspace),
        m, intermediate, dtype, pad=3 if with_out else None,
    )  # fmt: skip
    torch.testing.assert_close(result.double(), expected, **tolerance(dtype))
    reference = gate_up_silu_reference(x, weight)
    torch.testing.assert_close(reference.double(), expected, **tolerance(dtype))


# Tile shapes the heuristic would not pick for these small sizes: several programs, several K steps
# with a ragged last one, and (GEMM) several row and column tiles with wrap-around at both edges.
FORCED = [
    ("gemv", 1, 37, 100, GemvConfig(block_n=4, block_k=32, num_warps=4)),
    ("gemv", 1, 37, 100, GemvConfig(block_n=4, block_k=16, num_warps=4, num_stages=3)),  # loads pipelined
    ("skinny", 5, 37, 100, SkinnyConfig(block_n=16, block_k=16, split_k=1, num_warps=4, num_stages=2)),
    # K split 3 ways over 7 tiles (3, 3, 1), 3 column tiles: the last split of each tile adds them up
    ("skinny", 3, 37, 100, SkinnyConfig(block_n=16, block_k=16, split_k=3, num_warps=4, num_stages=2)),
    # more splits than tiles: trailing splits add zeros
    ("skinny", 17, 20, 40, SkinnyConfig(block_n=16, block_k=16, split_k=4, num_warps=4, num_stages=2)),
    ("gemm", 50, 40, 100, GemmConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2)),
    ("gemm", 33, 48, 64, GemmConfig(block_m=32, block_n=16, block_k=16, num_warps=4, num_stages=3)),
]


@pytest.mark.parametrize("gate_up", [False, True], ids=["linear", "gate_up"])
@pytest.mark.parametrize("case", FORCED, ids=[f"{c[0]}-M{c[1]}-N{c[2]}-K{c[3]}" for c in FORCED])
def test_forced_tiles(case: tuple, gate_up: bool, workspace: LinearWorkspace) -> None:
    kind, m, n, k, config = case
    dtype = torch.bfloat16
    x, weight, bias = _inputs(m, 2 * n if gate_up else n, k, dtype, _seed("forced", case, gate_up), x_pad=1)
    bias = None if gate_up else bias
    buffer, out = _poisoned_out(m, n, dtype, pad=2)
    if kind == "skinny":
        linear_skinny.launch_skinny(x, weight, bias, out, gate_up, config, scratch=workspace.split_k)
        assert not workspace.split_k.counters.any()  # every counter is left at zero for the next launch
    else:
        launch = {"gemv": linear_gemv.launch_gemv, "gemm": linear_gemm.launch_gemm}[kind]
        launch(x, weight, bias, out, gate_up, config)
    expected = _gate_up64(x, weight) if gate_up else _linear64(x, weight, bias)
    assert buffer[:, n:].isnan().all() and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, **tolerance(dtype))


@pytest.mark.parametrize("split_k", [1, 2])
def test_skinny_widens_into_float32_out(split_k: int, workspace: LinearWorkspace) -> None:
    """Logits: bf16 operands, an fp32 out holding the bf16-rounded result (as the reference chain)."""
    m, n, k = 4, 40, 64
    x, weight, _ = _inputs(m, n, k, torch.bfloat16, _seed("widen", split_k))
    out = torch.full((m, n), float("nan"), dtype=torch.float32, device=DEVICE)
    config = SkinnyConfig(block_n=16, block_k=16, split_k=split_k, num_warps=4, num_stages=2)
    linear_skinny.launch_skinny(x, weight, None, out, False, config, scratch=workspace.split_k)
    expected = _linear64(x, weight, None)
    torch.testing.assert_close(out.double(), expected, **tolerance(torch.bfloat16))
    assert torch.equal(out, out.bfloat16().float()), "not rounded to bf16 before widening"


def test_empty_inputs() -> None:
    weight = torch.randn(6, 0, device=DEVICE)
    bias = torch.randn(6, device=DEVICE)
    assert torch.equal(linear_triton(torch.empty(2, 0, device=DEVICE), weight, bias), bias.expand(2, 6))
    assert linear_triton(torch.empty(0, 4, device=DEVICE), torch.randn(6, 4, device=DEVICE)).shape == (0, 6)


# The real shapes: (name, N, K) per layer; gate_up gives the weight's rows (2 * intermediate).
MODELS = {
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                   "lm_head": (151936, 1024)},
    "qwen3-4b": {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728),
                 "lm_head": (151936, 2560)},
    "smollm2-135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                     "lm_head": (49152, 576)},
}  # fmt: skip
REAL_LAYERS = [(model, layer, *shape) for model, layers in MODELS.items() for layer, shape in layers.items()]


def test_heuristics_fill_an_h200(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the real shapes the tile choices fill 132 SMs and keep 16-byte loads along K."""
    for module in (linear_gemv, linear_gemm):
        monkeypatch.setattr(module, "num_sms", lambda: 132)
    for module in (linear_gemv, linear_skinny, linear_gemm):
        monkeypatch.setattr(module, "tuned_config", lambda *args: None)  # the heuristics, on the GPU too
    for _, layer, n_rows, k in REAL_LAYERS:
        gate_up = layer == "gate_up"
        n = n_rows // 2 if gate_up else n_rows
        config = linear_gemv.gemv_config(1, n, k, gate_up)
        assert -(-n // config.block_n) >= 4 * 132, (layer, config)
        assert config.block_k >= 256 and config.block_k % 8 == 0, (layer, config)
        for m in (32, 64):  # past the tuned table's 16-row tiles: the heuristic
            skinny = linear_skinny.skinny_config(m, n, k, gate_up)
            programs = -(-n // skinny.block_n) * skinny.split_k
            assert programs >= 96 or skinny.block_n == 16, (layer, skinny)
            assert skinny.split_k <= -(-k // skinny.block_k), (layer, skinny)
            assert skinny.block_k >= 64 and skinny.block_n >= 16, (layer, m, skinny)
        config = linear_gemm.gemm_config(512, n, k, gate_up)
        stage_bytes = 2 * config.block_k * (config.block_m + config.block_n * (2 if gate_up else 1))
        assert stage_bytes * config.num_stages <= 200 * 1024, (layer, config)
        assert config.block_m >= 64 and config.block_n >= (32 if gate_up else 64), (layer, config)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 8, 24, 64, 512])
@pytest.mark.parametrize("layer", REAL_LAYERS, ids=[f"{r[0]}-{r[1]}" for r in REAL_LAYERS])
def test_real_shapes_bf16_gpu(layer: tuple[str, str, int, int], m: int, workspace: LinearWorkspace) -> None:
    _, name, n_rows, k = layer
    gen = torch.Generator(device="cuda").manual_seed(_seed("real", layer, m))
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(n_rows, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    if name == "gate_up":
        intermediate = n_rows // 2
        out = torch.full((m, intermediate), float("nan"), dtype=torch.bfloat16, device="cuda")
        gate_up_silu_triton(x, weight, out=out, workspace=workspace)
        gate_up = F.linear(x.float(), weight.float())
        expected = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    else:
        bias = torch.randn(n_rows, device="cuda", generator=gen).bfloat16() if name == "qkv" else None
        out = torch.full((m, n_rows), float("nan"), dtype=torch.bfloat16, device="cuda")
        linear_triton(x, weight, bias, out=out, workspace=workspace)
        expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    result = out.float()
    assert torch.isfinite(result).all()
    relative = (result - expected).norm() / expected.norm()
    assert relative < 1e-2, relative
    torch.testing.assert_close(result, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 64, 128])
def test_cuda_graph_replay_gpu(m: int, workspace: LinearWorkspace) -> None:
    """Captured once with out= buffers, replayed on new inputs: no allocation, no sync, same bits."""
    k, n_rows, intermediate = 1024, 4096, 3072
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(n_rows, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    gate_up_weight = (torch.randn(2 * intermediate, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    out = torch.empty(m, n_rows, dtype=torch.bfloat16, device="cuda")
    mlp_out = torch.empty(m, intermediate, dtype=torch.bfloat16, device="cuda")

    def step() -> None:
        linear_triton(x, weight, out=out, workspace=workspace)
        gate_up_silu_triton(x, gate_up_weight, out=mlp_out, workspace=workspace)

    graph = capture_graph(step, None)
    x.copy_(torch.randn(m, k, device="cuda", generator=gen).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    first, first_mlp = out.clone(), mlp_out.clone()
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float()), rtol=1e-2, atol=2e-2)
    expected_mlp = gate_up_silu_reference(x.float(), gate_up_weight.float())
    torch.testing.assert_close(mlp_out.float(), expected_mlp, rtol=1e-2, atol=2e-2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first) and torch.equal(mlp_out, first_mlp), "not deterministic"
