"""Embedding, fused residual-add + RMSNorm, and the q/k-norm + RoPE + paged-KV-write epilogue: each Triton
kernel against its torch reference. On a CPU the kernels run in Triton's interpreter (tests/conftest.py),
so the shapes stay small; the `gpu` tests use the real model shapes."""

from __future__ import annotations

import pytest
import torch
from tileinfer.engine.graphs import capture_graph
from tileinfer.kernels import qkv_epilogue as qkv_epilogue_module
from tileinfer.kernels import rmsnorm as rmsnorm_module
from tileinfer.kernels.embedding import embedding_reference, embedding_triton
from tileinfer.kernels.qkv_epilogue import qkv_epilogue_reference, qkv_epilogue_triton
from tileinfer.kernels.rmsnorm import (
    add_rms_norm_reference,
    add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
# bf16 keeps 8 bits of mantissa (the interpreter also truncates instead of rounding): a few ulps apart.
# bf16: the kernel rounds the normed q/k to bf16 before RoPE (as HF does), the fp32 reference does not;
# values of magnitude ~4-8 then differ by up to two bf16 ulps (1/16) after the rotation.
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=6e-2, rtol=2e-2)}


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _randn(*shape: int, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, device=DEVICE).to(dtype)


def _nan(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


# ---------------------------------------------------------------------------------------------- embedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "hidden_size"), [(1, 64), (5, 100), (3, 2500)])
def test_embedding_matches_reference(dtype: torch.dtype, num_tokens: int, hidden_size: int) -> None:
    generator = _generator(1)
    vocab_size = 37
    weight = _randn(vocab_size, hidden_size, generator=generator, dtype=dtype)
    token_ids = torch.randint(0, vocab_size, (num_tokens,), generator=generator, device=DEVICE)
    token_ids[-1] = vocab_size - 1  # the last row of the table
    expected = embedding_reference(token_ids, weight)
    out = _nan(num_tokens, hidden_size, dtype=dtype)
    result = embedding_triton(token_ids, weight, out=out)
    assert result is out
    torch.testing.assert_close(result, expected, atol=0, rtol=0)  # a copy: exact
    torch.testing.assert_close(embedding_triton(token_ids, weight), expected, atol=0, rtol=0)
    torch.testing.assert_close(embedding_reference(token_ids, weight, out=torch.empty_like(out)), expected)


def test_embedding_out_of_range_id_gives_zeros() -> None:
    generator = _generator(2)
    weight = _randn(10, 48, generator=generator)
    token_ids = torch.tensor([3, 10, -1, 9], device=DEVICE)
    result = embedding_triton(token_ids, weight)
    torch.testing.assert_close(result[0], weight[3], atol=0, rtol=0)
    torch.testing.assert_close(result[3], weight[9], atol=0, rtol=0)
    assert (result[1:3] == 0).all()


# ------------------------------------------------------------------------------------------------ rmsnorm

NORM_SHAPES = [(1, 64), (5, 576), (3, 1000), (7, 33)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "hidden_size"), NORM_SHAPES)
def test_rms_norm_matches_reference(dtype: torch.dtype, num_tokens: int, hidden_size: int) -> None:
    generator = _generator(3)
    x = _randn(num_tokens, hidden_size, generator=generator, dtype=dtype) * 3
    weight = (1 + 0.5 * _randn(hidden_size, generator=generator)).to(dtype)
    expected = rms_norm_reference(x.float(), weight.float(), EPS)
    out = _nan(num_tokens, hidden_size, dtype=dtype)
    result = rms_norm_triton(x, weight, EPS, out=out)
    assert result is out and result.dtype == dtype
    torch.testing.assert_close(result.float(), expected, **TOLERANCES[dtype])
    torch.testing.assert_close(rms_norm_triton(x, weight, EPS).float(), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "hidden_size"), NORM_SHAPES)
def test_add_rms_norm_matches_reference(dtype: torch.dtype, num_tokens: int, hidden_size: int) -> None:
    generator = _generator(4)
    x = _randn(num_tokens, hidden_size, generator=generator, dtype=dtype)
    residual = _randn(num_tokens, hidden_size, generator=generator, dtype=dtype) * 4
    weight = (1 + 0.5 * _randn(hidden_size, generator=generator)).to(dtype)
    expected_normed, expected_summed = add_rms_norm_reference(
        x.float(), residual.float(), weight.float(), EPS
    )
    out = _nan(num_tokens, hidden_size, dtype=dtype)
    normed, summed = add_rms_norm_triton(x, residual, weight, EPS, out=out)
    assert normed is out and summed is residual  # the sum is written in place
    torch.testing.assert_close(summed.float(), expected_summed, **TOLERANCES[dtype])
    torch.testing.assert_close(normed.float(), expected_normed, **TOLERANCES[dtype])


def test_add_rms_norm_into_x_itself() -> None:
    """out=x: the decoder can keep one hidden buffer; each row is read before it is overwritten."""
    generator = _generator(5)
    x = _randn(4, 300, generator=generator)
    residual = _randn(4, 300, generator=generator)
    weight = _randn(300, generator=generator)
    expected_normed, expected_summed = add_rms_norm_reference(x, residual, weight, EPS)
    normed, summed = add_rms_norm_triton(x, residual, weight, EPS, out=x)
    assert normed is x
    torch.testing.assert_close(normed, expected_normed, **TOLERANCES[torch.float32])
    torch.testing.assert_close(summed, expected_summed, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_loop_over_long_rows(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Rows longer than one block (past 8192 on the GPU) take the two-pass loop; a 64 cap forces it here."""
    monkeypatch.setattr(rmsnorm_module, "_MAX_BLOCK_H", 64)
    generator = _generator(6)
    x = _randn(3, 200, generator=generator, dtype=dtype)
    residual = _randn(3, 200, generator=generator, dtype=dtype)
    weight = _randn(200, generator=generator, dtype=dtype)
    torch.testing.assert_close(
        rms_norm_triton(x, weight, EPS).float(),
        rms_norm_reference(x.float(), weight.float(), EPS),
        **TOLERANCES[dtype],
    )
    expected_normed, expected_summed = add_rms_norm_reference(
        x.float(), residual.float(), weight.float(), EPS
    )
    normed, summed = add_rms_norm_triton(x, residual, weight, EPS, out=_nan(3, 200, dtype=dtype))
    torch.testing.assert_close(summed.float(), expected_summed, **TOLERANCES[dtype])
    torch.testing.assert_close(normed.float(), expected_normed, **TOLERANCES[dtype])


# ------------------------------------------------------------------------------------------- qkv epilogue


def _rope_table(max_positions: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """[max_positions, head_dim] fp32, cos in the first half of a row, sin in the second
    (engine/models/rope.py)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float().to(DEVICE)


def _epilogue_inputs(
    seed: int,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    norm: str,
    num_blocks: int = 6,
    block_size: int = 4,
    max_positions: int = 64,
) -> dict:
    generator = _generator(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    # A column slice of a wider buffer: the row stride is not the row width.
    qkv = _randn(num_tokens, width + 16, generator=generator, dtype=dtype)[:, :width]
    num_slots = num_blocks * block_size
    assert num_tokens < num_slots
    # Scattered over non-contiguous blocks; token 1 (when there is one) is padding and writes nothing.
    slot_mapping = torch.randperm(num_slots, generator=generator, device=DEVICE)[:num_tokens]
    if num_tokens > 1:
        slot_mapping[1] = -1
    positions = torch.randint(0, max_positions, (num_tokens,), generator=generator, device=DEVICE)

    def norm_weight() -> torch.Tensor:
        return (1 + 0.5 * _randn(head_dim, generator=generator)).to(dtype)

    return dict(
        qkv=qkv,
        positions=positions,
        cos_sin_cache=_rope_table(max_positions, head_dim),
        q_norm_weight=norm_weight() if norm in ("q", "both") else None,
        k_norm_weight=norm_weight() if norm in ("k", "both") else None,
        eps=EPS,
        kv_cache=_nan(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype),
        slot_mapping=slot_mapping,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )


def _check_epilogue(inputs: dict, tolerance: dict) -> None:
    """The Triton epilogue against the reference run in fp32: every written element, every untouched one."""
    dtype = inputs["qkv"].dtype
    upcast = dict(inputs)
    for name in ("qkv", "q_norm_weight", "k_norm_weight", "kv_cache"):
        if inputs[name] is not None:
            upcast[name] = inputs[name].to(torch.float32, copy=True)  # never the tensor the kernel writes
    expected_query = qkv_epilogue_reference(**upcast)

    kv_cache = inputs["kv_cache"]
    out = _nan(inputs["qkv"].shape[0], inputs["num_heads"], inputs["head_dim"], dtype=dtype)
    query = qkv_epilogue_triton(**inputs, out=out)
    assert query is out
    torch.testing.assert_close(query.float(), expected_query, **tolerance)

    written = inputs["slot_mapping"][inputs["slot_mapping"] >= 0]
    cache_slots = kv_cache.flatten(1, 2)  # [2, num_slots, num_kv_heads, head_dim]
    expected_slots = upcast["kv_cache"].flatten(1, 2)
    torch.testing.assert_close(cache_slots[:, written].float(), expected_slots[:, written], **tolerance)
    untouched = torch.ones(cache_slots.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert cache_slots[:, untouched].isnan().all(), "a slot that no token owns was written"
    assert not cache_slots[:, written].isnan().any()


EPILOGUE_CASES = [
    # (num_tokens, num_heads, num_kv_heads, head_dim): GQA 3 (SmolLM2-like), 1 and 4, odd token counts
    (5, 9, 3, 64),
    (3, 4, 4, 128),
    (7, 8, 2, 128),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["none", "both"])
@pytest.mark.parametrize("case", EPILOGUE_CASES)
def test_qkv_epilogue_matches_reference(
    dtype: torch.dtype, norm: str, case: tuple[int, int, int, int]
) -> None:
    num_tokens, num_heads, num_kv_heads, head_dim = case
    inputs = _epilogue_inputs(7, num_tokens, num_heads, num_kv_heads, head_dim, dtype, norm)
    _check_epilogue(inputs, TOLERANCES[dtype])


@pytest.mark.parametrize("norm", ["q", "k"])
def test_qkv_epilogue_one_norm_only(norm: str) -> None:
    inputs = _epilogue_inputs(8, 3, 4, 2, 64, torch.float32, norm)
    _check_epilogue(inputs, TOLERANCES[torch.float32])


@pytest.mark.parametrize("heads_per_program", [2, 4])
def test_qkv_epilogue_several_heads_per_program(
    monkeypatch: pytest.MonkeyPatch, heads_per_program: int
) -> None:
    """Groups of heads per program (the prefill path), with masked-off heads in the last groups."""
    monkeypatch.setattr(qkv_epilogue_module, "_heads_per_program", lambda *_: heads_per_program)
    inputs = _epilogue_inputs(9, 5, 9, 3, 64, torch.bfloat16, "both")
    _check_epilogue(inputs, TOLERANCES[torch.bfloat16])


def test_qkv_epilogue_head_dim_not_a_power_of_two() -> None:
    inputs = _epilogue_inputs(10, 3, 2, 1, 96, torch.float32, "both")
    _check_epilogue(inputs, TOLERANCES[torch.float32])


def test_qkv_epilogue_reference_skips_padding() -> None:
    """The reference itself honours slot -1 (the CPU path runs padded batches too)."""
    inputs = _epilogue_inputs(11, 4, 2, 2, 64, torch.float32, "none")
    qkv_epilogue_reference(**inputs)
    written = inputs["slot_mapping"][inputs["slot_mapping"] >= 0]
    assert written.numel() == 3
    assert inputs["kv_cache"].flatten(1, 2).isnan().sum() == 2 * (24 - 3) * 2 * 64


# -------------------------------------------------------------------------------------- GPU, real shapes

# (name, hidden_size, num_heads, num_kv_heads, head_dim, vocab_size, qk_norm)
MODEL_SHAPES = [
    ("qwen3-0.6b", 1024, 16, 8, 128, 151936, True),
    ("qwen3-4b", 2560, 32, 8, 128, 151936, True),
    ("smollm2-135m", 576, 9, 3, 64, 49152, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 37, 512])
@pytest.mark.parametrize("model", MODEL_SHAPES, ids=[shape[0] for shape in MODEL_SHAPES])
def test_real_shapes_bf16_on_gpu(model: tuple, num_tokens: int) -> None:
    _, hidden_size, num_heads, num_kv_heads, head_dim, vocab_size, qk_norm = model
    dtype = torch.bfloat16
    tolerance = TOLERANCES[dtype]
    generator = _generator(12)

    weight = _randn(vocab_size, hidden_size, generator=generator, dtype=dtype)
    token_ids = torch.randint(0, vocab_size, (num_tokens,), generator=generator, device=DEVICE)
    torch.testing.assert_close(embedding_triton(token_ids, weight), embedding_reference(token_ids, weight))

    x = _randn(num_tokens, hidden_size, generator=generator, dtype=dtype)
    residual = _randn(num_tokens, hidden_size, generator=generator, dtype=dtype) * 4
    norm_weight = (1 + 0.5 * _randn(hidden_size, generator=generator)).to(dtype)
    expected_normed, expected_summed = add_rms_norm_reference(
        x.float(), residual.float(), norm_weight.float(), EPS
    )
    torch.testing.assert_close(
        rms_norm_triton(x, norm_weight, EPS).float(),
        rms_norm_reference(x.float(), norm_weight.float(), EPS),
        **tolerance,
    )
    normed, summed = add_rms_norm_triton(x, residual, norm_weight, EPS)
    torch.testing.assert_close(summed.float(), expected_summed, **tolerance)
    torch.testing.assert_close(normed.float(), expected_normed, **tolerance)

    inputs = _epilogue_inputs(
        13,
        num_tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        dtype,
        "both" if qk_norm else "none",
        num_blocks=96,
        block_size=16,
        max_positions=4096,
    )
    _check_epilogue(inputs, tolerance)


@pytest.mark.gpu
def test_kernels_replay_in_a_cuda_graph() -> None:
    """Captured once, replayed with new token ids, positions and slots written into the same buffers."""
    hidden_size, num_heads, num_kv_heads, head_dim, vocab_size = 1024, 16, 8, 128, 151936
    num_tokens, num_blocks, block_size, max_positions = 4, 32, 16, 2048
    dtype = torch.bfloat16
    generator = _generator(14)
    embed_weight = _randn(vocab_size, hidden_size, generator=generator, dtype=dtype)
    norm_weight = (1 + 0.5 * _randn(hidden_size, generator=generator)).to(dtype)
    q_norm_weight = (1 + 0.5 * _randn(head_dim, generator=generator)).to(dtype)
    k_norm_weight = (1 + 0.5 * _randn(head_dim, generator=generator)).to(dtype)
    qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv_proj = _randn(hidden_size, qkv_width, generator=generator, dtype=dtype) * hidden_size**-0.5
    cos_sin_cache = _rope_table(max_positions, head_dim)

    token_ids = torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE)
    positions = torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE)
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=DEVICE)
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=DEVICE)
    residual = torch.empty_like(hidden)
    normed = torch.empty_like(hidden)
    query = torch.empty(num_tokens, num_heads, head_dim, dtype=dtype, device=DEVICE)

    def step() -> None:
        embedding_triton(token_ids, embed_weight, out=residual)
        hidden.fill_(0.5)
        add_rms_norm_triton(hidden, residual, norm_weight, EPS, out=normed)
        qkv = normed @ qkv_proj
        qkv_epilogue_triton(
            qkv,
            positions,
            cos_sin_cache,
            q_norm_weight,
            k_norm_weight,
            EPS,
            kv_cache,
            slot_mapping,
            num_heads,
            num_kv_heads,
            head_dim,
            out=query,
        )

    graph = capture_graph(step, None)

    for seed in range(3):
        step_generator = _generator(100 + seed)
        token_ids.copy_(torch.randint(0, vocab_size, (num_tokens,), generator=step_generator, device=DEVICE))
        positions.copy_(
            torch.randint(0, max_positions, (num_tokens,), generator=step_generator, device=DEVICE)
        )
        slots = torch.randperm(num_blocks * block_size, generator=step_generator, device=DEVICE)[:num_tokens]
        slots[-1] = -1
        slot_mapping.copy_(slots)
        kv_cache.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()

        expected_residual = embedding_reference(token_ids, embed_weight) + 0.5
        expected_normed = rms_norm_reference(expected_residual, norm_weight, EPS)
        expected_cache = torch.full_like(kv_cache, float("nan"))
        expected_query = qkv_epilogue_reference(
            normed @ qkv_proj,
            positions,
            cos_sin_cache,
            q_norm_weight,
            k_norm_weight,
            EPS,
            expected_cache,
            slot_mapping,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        torch.testing.assert_close(residual, expected_residual)
        torch.testing.assert_close(normed.float(), expected_normed.float(), **TOLERANCES[dtype])
        torch.testing.assert_close(query.float(), expected_query.float(), **TOLERANCES[dtype])
        torch.testing.assert_close(kv_cache, expected_cache, equal_nan=True, **TOLERANCES[dtype])
