"""Residual add + RMSNorm fused into the following linear (kernels/norm_linear.py) against the unfused
reference chain (add_rms_norm_reference, then linear_reference / gate_up_silu_reference).

On the CPU the kernel runs in Triton's interpreter (small shapes, odd sizes); on a GPU the same tests run
compiled, and the tests marked gpu check the real model shapes in bf16, under a CUDA graph too."""

from __future__ import annotations

import pytest
import torch
from tileinfer.engine.graphs import capture_graph
from tileinfer.kernels import norm_linear
from tileinfer.kernels.linear import LinearWorkspace
from tileinfer.kernels.linear_gemv import GemvConfig
from tileinfer.kernels.linear_skinny import SplitKScratch
from tileinfer.kernels.norm_linear import (
    _launch_gemv,
    add_rms_norm_linear_reference,
    add_rms_norm_linear_triton,
)
from tileinfer.kernels.rmsnorm import add_rms_norm_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6

# (M, N, K, with residual, with bias, gate_up): M = 1 takes the fused GEMV, more rows a norm launch and
# the skinny GEMM (past SKINNY_MAX_M the tiled GEMM).
CASES = [
    (1, 37, 100, True, True, False),
    (1, 16, 33, True, False, True),
    (1, 50, 64, False, False, False),
    (3, 17, 64, False, False, True),
    (3, 45, 72, True, True, False),
    (5, 21, 130, True, False, True),
    (8, 40, 90, True, True, True),
    (8, 24, 16, False, True, False),  # more programs than columns of K: some own no residual_out slice
    (12, 20, 48, True, True, False),
    (17, 19, 40, False, False, True),
]


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.bfloat16:
        # A few bf16 ulps: the two paths sum the squares and the products in different orders (and the
        # interpreter truncates where the GPU rounds to nearest).
        return {"rtol": 3e-2, "atol": 3e-2}
    return {"rtol": 1e-4, "atol": 1e-4} if DEVICE == "cuda" else {"rtol": 1e-5, "atol": 1e-5}


def _assert_sum_equal(result: torch.Tensor, expected: torch.Tensor) -> None:
    """The residual sum is one rounding of an exact fp32 sum: bit-equal, except that the interpreter
    rounds fp32 -> bf16 towards zero (within one ulp, 2^-8 relative) where torch rounds to nearest."""
    if result.dtype == torch.bfloat16 and DEVICE == "cpu":
        torch.testing.assert_close(result, expected, rtol=2**-7, atol=0)
    else:
        assert torch.equal(result, expected)


def _seed(*parts: object) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(repr(parts))) % (2**31)


def _inputs(
    m: int, n_rows: int, k: int, dtype: torch.dtype, seed: int, with_residual: bool, with_bias: bool, pad: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """hidden and residual [m, k] (views with row stride k + pad), norm weight [k], weight [n_rows, k]
    scaled so that outputs are ~N(0, 1), bias [n_rows]. The residual is larger, as in a real stream."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, k + pad, generator=gen)
    residual = 4 * torch.randn(m, k + pad, generator=gen)
    norm_weight = 1 + 0.5 * torch.randn(k, generator=gen)
    weight = torch.randn(n_rows, k, generator=gen) / k**0.5
    bias = torch.randn(n_rows, generator=gen)

    def device(t: torch.Tensor) -> torch.Tensor:
        return t.to(DEVICE, dtype)

    return (
        device(hidden)[:, :k],
        device(residual)[:, :k] if with_residual else None,
        device(norm_weight),
        device(weight),
        device(bias) if with_bias else None,
    )


def _poisoned(m: int, n: int, dtype: torch.dtype, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-filled [m, n + pad] buffer and its [m, n] view: the kernel must fill the view, not the pad."""
    buffer = torch.full((m, n + pad), float("nan"), dtype=dtype, device=DEVICE)
    return buffer, buffer[:, :n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "case",
    CASES,
    ids=[f"M{c[0]}-N{c[1]}-K{c[2]}{'-res' * c[3]}{'-bias' * c[4]}{'-gu' * c[5]}" for c in CASES],
)
def test_matches_unfused_chain(case: tuple[int, int, int, bool, bool, bool], dtype: torch.dtype) -> None:
    m, n, k, with_residual, with_bias, gate_up = case
    n_rows = 2 * n if gate_up else n
    index = CASES.index(case)
    with_out = index % 3 != 2
    hidden, residual, norm_weight, weight, bias = _inputs(
        m, n_rows, k, dtype, _seed(case, dtype), with_residual, with_bias, pad=3 * (index % 2)
    )
    hidden_before = hidden.clone()
    residual_before = residual.clone() if residual is not None else None
    expected, expected_sum = add_rms_norm_linear_reference(
        hidden, residual, norm_weight, EPS, weight, bias, gate_up
    )
    # The reference is the unfused chain the decoder runs today.
    if residual is not None:
        chain_normed, chain_sum = add_rms_norm_reference(hidden, residual, norm_weight, EPS)
        assert torch.equal(expected_sum, chain_sum)
        chain_bias = bias if bias is not None else torch.zeros(n_rows, dtype=dtype, device=DEVICE)
        chain_out = torch.nn.functional.linear(chain_normed, weight, chain_bias)
        if gate_up:
            chain_out = torch.nn.functional.silu(chain_out[:, :n]) * chain_out[:, n:]
        torch.testing.assert_close(expected, chain_out, **_tolerance(dtype))
    else:
        assert expected_sum is hidden

    if with_out:
        out_buffer, out = _poisoned(m, n, dtype, pad=5)
        sum_buffer, residual_out = _poisoned(m, k, dtype, pad=2)
        result, result_sum = add_rms_norm_linear_triton(
            hidden, residual, norm_weight, EPS, weight, bias, gate_up, out=out, residual_out=residual_out
        )
        assert result.data_ptr() == out.data_ptr() and result_sum.data_ptr() == residual_out.data_ptr()
        assert out_buffer[:, n:].isnan().all(), "wrote past the output columns"
        assert sum_buffer[:, k:].isnan().all(), "wrote past the residual columns"
    else:
        result, result_sum = add_rms_norm_linear_triton(
            hidden, residual, norm_weight, EPS, weight, bias, gate_up
        )
        if residual is None:
            assert result_sum is hidden  # the first layer: the residual stream is the embedding itself
    assert result.shape == (m, n) and result.dtype == dtype
    assert torch.isfinite(result).all(), "an output element was not written"
    assert torch.isfinite(result_sum).all(), "a residual element was not written"
    torch.testing.assert_close(result, expected, **_tolerance(dtype))
    _assert_sum_equal(result_sum, expected_sum)
    assert torch.equal(hidden, hidden_before), "hidden was modified"
    if residual is not None:
        assert torch.equal(residual, residual_before), "residual was modified (the sum is not in place)"


@pytest.mark.parametrize("case", CASES[:3], ids=["res-bias", "res-gu", "no-res"])
def test_one_row_past_the_fused_weight_cap(
    case: tuple[int, int, int, bool, bool, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight past FUSED_GEMV_MAX_WEIGHTS: one row takes a norm launch, then the plain GEMV; the
    same checks as the fused GEMV passes."""
    monkeypatch.setattr(norm_linear, "FUSED_GEMV_MAX_WEIGHTS", 0)
    test_matches_unfused_chain(case, torch.bfloat16)
    if case == CASES[0]:
        test_fp32_logits_from_bf16(1)  # the LM head's fp32 logits


# Tiles the heuristic would not pick for these small sizes: BLOCK_N > 1 with a ragged last program,
# several K steps with a ragged last one, one tile wider than the row, and a pipelined K loop.
FORCED = [
    (1, 37, 100, GemvConfig(block_n=4, block_k=32, num_warps=4)),
    (1, 37, 100, GemvConfig(block_n=8, block_k=16, num_warps=4)),
    (1, 30, 50, GemvConfig(block_n=16, block_k=64, num_warps=4)),
    (1, 37, 100, GemvConfig(block_n=4, block_k=16, num_warps=4, num_stages=3)),
]


@pytest.mark.parametrize("gate_up", [False, True], ids=["linear", "gate_up"])
@pytest.mark.parametrize(
    "case",
    FORCED,
    ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-BN{c[3].block_n}-BK{c[3].block_k}-S{c[3].num_stages}" for c in FORCED],
)
def test_forced_tiles(case: tuple[int, int, int, GemvConfig], gate_up: bool) -> None:
    m, n, k, config = case
    dtype = torch.bfloat16
    n_rows = 2 * n if gate_up else n
    hidden, residual, norm_weight, weight, bias = _inputs(
        m, n_rows, k, dtype, _seed("forced", case, gate_up), with_residual=True, with_bias=True, pad=1
    )
    expected, expected_sum = add_rms_norm_linear_reference(
        hidden, residual, norm_weight, EPS, weight, bias, gate_up
    )
    out_buffer, out = _poisoned(m, n, dtype, pad=2)
    sum_buffer, residual_out = _poisoned(m, k, dtype, pad=2)
    _launch_gemv(hidden, residual, norm_weight, EPS, weight, bias, gate_up, out, residual_out, config)
    assert out_buffer[:, n:].isnan().all() and sum_buffer[:, k:].isnan().all()
    assert torch.isfinite(out).all() and torch.isfinite(residual_out).all()
    torch.testing.assert_close(out, expected, **_tolerance(dtype))
    _assert_sum_equal(residual_out, expected_sum)


@pytest.mark.parametrize("m", [1, 3, 9])
def test_fp32_logits_from_bf16(m: int) -> None:
    """The final norm + LM head writes float32 logits: the bf16 result widened, as reference(...).float()."""
    vocab, k = 300, 64
    hidden, residual, norm_weight, weight, _ = _inputs(
        m, vocab, k, torch.bfloat16, _seed("logits", m), with_residual=True, with_bias=False, pad=0
    )
    expected, _ = add_rms_norm_linear_reference(hidden, residual, norm_weight, EPS, weight)
    out = torch.full((m, vocab), float("nan"), dtype=torch.float32, device=DEVICE)
    reference_out = torch.empty_like(out)
    add_rms_norm_linear_reference(hidden, residual, norm_weight, EPS, weight, out=reference_out)
    assert torch.equal(reference_out, expected.float())
    logits, _ = add_rms_norm_linear_triton(hidden, residual, norm_weight, EPS, weight, out=out)
    assert logits is out and torch.isfinite(out).all()
    assert torch.equal(out, out.bfloat16().float()), "logits are not bf16 values widened"
    torch.testing.assert_close(out, expected.float(), **_tolerance(torch.bfloat16))


def test_residual_out_must_not_alias_an_input() -> None:
    hidden, residual, norm_weight, weight, _ = _inputs(
        2, 8, 16, torch.float32, 0, with_residual=True, with_bias=False, pad=0
    )
    with pytest.raises(AssertionError, match="aliases"):
        add_rms_norm_linear_triton(hidden, residual, norm_weight, EPS, weight, residual_out=residual)


# The real shapes: (model, layer, weight rows, K); gate_up gives 2 * intermediate rows; qkv carries a bias
# (as Qwen2's does) to cover that path at size.
MODELS = {
    "qwen3-0.6b": {"qkv": (4096, 1024), "gate_up": (6144, 1024), "lm_head": (151936, 1024)},
    "qwen3-4b": {"qkv": (6144, 2560), "gate_up": (19456, 2560), "lm_head": (151936, 2560)},
    "smollm2-135m": {"qkv": (960, 576), "gate_up": (3072, 576), "lm_head": (49152, 576)},
}
REAL_LAYERS = [(model, layer, *shape) for model, layers in MODELS.items() for layer, shape in layers.items()]


@pytest.fixture(scope="module")
def workspace() -> LinearWorkspace:
    """A decoder's split-K scratch, as the engine's several-row steps have it."""
    return LinearWorkspace(SplitKScratch.allocate(torch.device("cuda")))


def _real_inputs(
    n_rows: int, k: int, m: int, seed: int, with_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen)

    hidden = randn(m, k).bfloat16()
    residual = (4 * randn(m, k)).bfloat16()
    norm_weight = (1 + 0.5 * randn(k)).bfloat16()
    weight = (randn(n_rows, k) / k**0.5).bfloat16()
    bias = randn(n_rows).bfloat16() if with_bias else None
    return hidden, residual, norm_weight, weight, bias


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("layer", REAL_LAYERS, ids=[f"{r[0]}-{r[1]}" for r in REAL_LAYERS])
def test_real_shapes_bf16_gpu(layer: tuple[str, str, int, int], m: int, workspace: LinearWorkspace) -> None:
    _, name, n_rows, k = layer
    gate_up = name == "gate_up"
    n = n_rows // 2 if gate_up else n_rows
    hidden, residual, norm_weight, weight, bias = _real_inputs(
        n_rows, k, m, _seed("real", layer, m), with_bias=name == "qkv"
    )
    # The first layer (no residual yet) on the qkv shape; the other layers' residual add elsewhere.
    residual = None if name == "qkv" and m == 4 else residual
    out_dtype = torch.float32 if name == "lm_head" else torch.bfloat16
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
    residual_out = torch.full((m, k), float("nan"), dtype=torch.bfloat16, device="cuda")
    add_rms_norm_linear_triton(
        hidden, residual, norm_weight, EPS, weight, bias, gate_up, out=out, residual_out=residual_out,
        workspace=workspace,
    )  # fmt: skip
    expected, expected_sum = add_rms_norm_linear_reference(
        hidden, residual, norm_weight, EPS, weight, bias, gate_up
    )
    assert torch.equal(residual_out, expected_sum)
    result, expected = out.float(), expected.float()
    assert torch.isfinite(result).all()
    relative = (result - expected).norm() / expected.norm()
    assert relative < 1e-2, relative
    torch.testing.assert_close(result, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
def test_cuda_graph_replay_gpu(m: int, workspace: LinearWorkspace) -> None:
    """A decode layer's two fused ops (Qwen3-0.6B shapes) and the final norm + LM head, captured once with
    out= buffers and replayed on new inputs: no allocation, no sync, same bits on every replay."""
    k, qkv_rows, gate_up_rows, vocab = 1024, 4096, 6144, 151936
    hidden, residual, norm_weight, qkv_weight, _ = _real_inputs(qkv_rows, k, m, m, with_bias=False)
    gen = torch.Generator(device="cuda").manual_seed(100 + m)
    gate_up_weight = (torch.randn(gate_up_rows, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    lm_head = (torch.randn(vocab, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    qkv = torch.empty(m, qkv_rows, dtype=torch.bfloat16, device="cuda")
    mlp = torch.empty(m, gate_up_rows // 2, dtype=torch.bfloat16, device="cuda")
    logits = torch.empty(m, vocab, dtype=torch.float32, device="cuda")
    sums = [torch.empty(m, k, dtype=torch.bfloat16, device="cuda") for _ in range(3)]

    def step() -> None:
        add_rms_norm_linear_triton(
            hidden, residual, norm_weight, EPS, qkv_weight, out=qkv, residual_out=sums[0], workspace=workspace
        )
        add_rms_norm_linear_triton(
            hidden, sums[0], norm_weight, EPS, gate_up_weight, gate_up=True, out=mlp, residual_out=sums[1],
            workspace=workspace,
        )  # fmt: skip
        add_rms_norm_linear_triton(
            hidden, sums[1], norm_weight, EPS, lm_head, out=logits, residual_out=sums[2], workspace=workspace
        )

    graph = capture_graph(step, None)
    hidden.copy_(torch.randn(m, k, device="cuda", generator=gen).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    first = [t.clone() for t in (qkv, mlp, logits, *sums)]

    expected_qkv, expected_sum = add_rms_norm_linear_reference(hidden, residual, norm_weight, EPS, qkv_weight)
    assert torch.equal(sums[0], expected_sum)
    torch.testing.assert_close(qkv.float(), expected_qkv.float(), rtol=1e-2, atol=2e-2)
    expected_mlp, expected_sum = add_rms_norm_linear_reference(
        hidden, sums[0], norm_weight, EPS, gate_up_weight, gate_up=True
    )
    assert torch.equal(sums[1], expected_sum)
    torch.testing.assert_close(mlp.float(), expected_mlp.float(), rtol=1e-2, atol=2e-2)
    expected_logits, _ = add_rms_norm_linear_reference(hidden, sums[1], norm_weight, EPS, lm_head)
    torch.testing.assert_close(logits, expected_logits.float(), rtol=1e-2, atol=2e-2)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(first, (qkv, mlp, logits, *sums), strict=True))
