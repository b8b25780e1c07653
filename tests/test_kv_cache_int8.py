"""The INT8 KV cache (kernels/kv_cache.py): quantizing, the QKV epilogue's quantized write, the decode and
prefill attention kernels reading int8 with its scales (in Triton's interpreter on the CPU, against the
torch references), key smoothing, and an engine that runs on it (copy-on-write, prefix reuse)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tileinfer.deployments.replicas.proposer_build import build_engine
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.models.random_model import SMOLLM2_135M, random_weights
from tileinfer.engine.models.rope import rope_cos_sin_cache
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.kernels.decode_attention import (
    paged_decode_attention_reference,
    paged_decode_attention_triton,
)
from tileinfer.kernels.kv_cache import (
    Int8KVCache,
    copy_kv_blocks,
    gather_kv_reference,
    kv_cache_bytes,
    quantize_kv_reference,
    smoothing_from_keys,
    write_kv_cache_reference,
)
from tileinfer.kernels.paged_attention import AttentionMetadata, paged_attention_reference
from tileinfer.kernels.prefill_attention import paged_prefill_attention_triton
from tileinfer.kernels.qkv_epilogue import qkv_epilogue_reference, qkv_epilogue_triton

from tests.test_spec_decode_engine import run_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 16


def random_int8_cache(
    num_blocks: int, num_kv_heads: int, head_dim: int, generator: torch.Generator
) -> Int8KVCache:
    """One layer's cache of random int8 values, scales of different sizes and a random smoothing."""
    cache = Int8KVCache.allocate(1, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, DEVICE)[0]
    cache.values.copy_(torch.randint(-127, 128, cache.values.shape, generator=generator, dtype=torch.int8))
    cache.scales.copy_(torch.rand(cache.scales.shape, generator=generator) * 0.05 + 0.001)
    cache.key_offset.copy_(torch.randn(cache.key_offset.shape, generator=generator))
    cache.key_smoothing.copy_(torch.rand(cache.key_smoothing.shape, generator=generator) + 0.5)
    return cache


def test_quantizing_rounds_each_head_row_to_within_half_a_step() -> None:
    x = (
        torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0))
        * torch.logspace(-2, 1, 5)[:, None, None]
    )
    x[2, 1] = 0.0  # an all-zero row: scale 1, zeros
    values, scale = quantize_kv_reference(x)
    assert values.dtype == torch.int8 and scale.shape == (5, 3)
    assert values.abs().amax(dim=-1)[scale != 1].eq(127).all()  # each row's largest maps to 127
    assert torch.all((values.float() * scale[..., None] - x).abs() <= scale[..., None] / 2 + 1e-7)
    assert values[2, 1].eq(0).all() and scale[2, 1] == 1


def test_smoothing_takes_out_each_channels_mean_and_evens_its_rope_pairs_spread() -> None:
    keys = torch.randn(64, 2, 8, generator=torch.Generator().manual_seed(1))
    keys[:, 0, 1] *= 40.0  # a wide channel: it and its RoPE partner (1 + 4) get the large smoothing
    keys[:, 1, 2] += 25.0  # a channel with a large constant part: the offset takes it out
    offset, smoothing = smoothing_from_keys(keys)
    assert torch.equal(smoothing[:, :4], smoothing[:, 4:])
    assert smoothing[0, 1] > 4 * smoothing[0, 0] and smoothing[0, 5] == smoothing[0, 1]  # sqrt(40)
    torch.testing.assert_close(offset, keys.mean(dim=0))
    assert smoothing[1, 2] < 2  # the spread around the mean, not the constant part


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "norms"), [(9, 3, 64, False), (8, 2, 128, True)]
)
def test_the_epilogue_writes_the_int8_cache_as_the_reference_does(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, norms: bool
) -> None:
    generator = torch.Generator().manual_seed(2)
    num_tokens = 7
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=generator).to(DEVICE, dtype)
    spec = dataclasses.replace(SMOLLM2_135M, head_dim=head_dim)
    slot_mapping = torch.randperm(4 * BLOCK_SIZE, generator=generator)[:num_tokens].to(DEVICE)
    slot_mapping[1] = -1  # padding: writes nothing
    norm = (1 + 0.3 * torch.randn(head_dim, generator=generator)).to(DEVICE, dtype) if norms else None
    inputs = dict(
        qkv=qkv, positions=torch.randint(0, 64, (num_tokens,), generator=generator).to(DEVICE),
        cos_sin_cache=rope_cos_sin_cache(spec, 64, DEVICE), q_norm_weight=norm, k_norm_weight=norm,
        eps=1e-6, slot_mapping=slot_mapping, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )  # fmt: skip
    caches = []
    for _ in range(2):
        cache = Int8KVCache.allocate(1, 4, BLOCK_SIZE, num_kv_heads, head_dim, DEVICE)[0]
        same = torch.Generator().manual_seed(3)
        cache.key_offset.copy_(0.5 * torch.randn(num_kv_heads, head_dim, generator=same))
        cache.key_smoothing.copy_(torch.rand(num_kv_heads, head_dim, generator=same) + 0.5)
        caches.append(cache)
    expected_query = qkv_epilogue_reference(**inputs, kv_cache=caches[0])
    query = qkv_epilogue_triton(**inputs, kv_cache=caches[1])
    # bf16: the float epilogue's tolerance (tests/test_kernels_norm_rope.py), times the smoothing
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=6e-2, atol=1.5e-1)
    torch.testing.assert_close(query.float(), expected_query.float(), **tolerance)
    written = slot_mapping[slot_mapping >= 0]
    expected_values, values = (cache.values.flatten(1, 2)[:, written].int() for cache in caches)
    # one step apart at most: in bf16 a key may round one ulp apart before it is quantized
    assert (expected_values - values).abs().max() <= 1
    assert (expected_values == values).float().mean() > (0.99 if dtype == torch.float32 else 0.9)
    expected_scales, scales = (cache.scales.flatten(1, 2)[:, written] for cache in caches)
    torch.testing.assert_close(
        scales, expected_scales, rtol=1e-5 if dtype == torch.float32 else 3e-2, atol=0.0
    )
    untouched = torch.ones(4 * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert caches[1].values.flatten(1, 2)[:, untouched].eq(0).all()
    assert caches[1].scales.flatten(1, 2)[:, untouched].eq(0).all()


@pytest.mark.parametrize("seq_lens", [[37, 1, 130], [300]])
def test_decode_attention_reads_the_int8_cache(seq_lens: list[int]) -> None:
    generator = torch.Generator().manual_seed(4)
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    blocks_per_seq = -(-max(seq_lens) // BLOCK_SIZE)
    cache = random_int8_cache(len(seq_lens) * blocks_per_seq + 1, num_kv_heads, head_dim, generator)
    order = torch.randperm(len(seq_lens) * blocks_per_seq, generator=generator) + 1
    block_tables = order.view(len(seq_lens), blocks_per_seq).int().to(DEVICE)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator).to(DEVICE)
    expected = paged_decode_attention_reference(query, cache, block_tables, seq_lens_t, 0.125)
    for num_splits in (1, 4):
        out = paged_decode_attention_triton(
            query, cache, block_tables, seq_lens_t, 0.125, num_splits=num_splits
        )
        torch.testing.assert_close(out, expected, rtol=2e-4, atol=2e-4)


def test_prefill_attention_reads_the_int8_cache() -> None:
    generator = torch.Generator().manual_seed(5)
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    seq_lens, q_lens = [70, 19, 40], [30, 19, 1]  # a prompt chunk after cached keys, a whole prompt, a decode
    blocks_per_seq = -(-max(seq_lens) // BLOCK_SIZE)
    cache = random_int8_cache(len(seq_lens) * blocks_per_seq, num_kv_heads, head_dim, generator)
    block_tables = torch.randperm(len(seq_lens) * blocks_per_seq, generator=generator).view(len(seq_lens), -1)
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.int().to(DEVICE),
    )
    query = torch.randn(starts[-1], num_heads, head_dim, generator=generator).to(DEVICE)
    expected = paged_attention_reference(query, cache, metadata, 0.125)
    torch.testing.assert_close(paged_prefill_attention_triton(query, cache, metadata, 0.125), expected,
                               rtol=2e-4, atol=2e-4)  # fmt: skip


def _attention_error(keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor, smoothed: bool) -> float:
    """Relative error of attention over an INT8 cache of these keys and values against float attention."""
    num_tokens, num_kv_heads, head_dim = keys.shape
    cache = Int8KVCache.allocate(1, -(-num_tokens // BLOCK_SIZE), BLOCK_SIZE, num_kv_heads, head_dim, "cpu")[
        0
    ]
    if smoothed:
        offset, smoothing = smoothing_from_keys(keys)
        cache.key_offset.copy_(offset)
        cache.key_smoothing.copy_(smoothing)
    slots = torch.arange(num_tokens)
    write_kv_cache_reference(keys, values, cache, slots)
    metadata = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.arange(cache.shape[1], dtype=torch.int32)[None],
    )  # fmt: skip
    group = query.shape[1] // num_kv_heads
    scaled_query = query * cache.key_smoothing.repeat_interleave(group, dim=0)  # as the epilogue does
    out = paged_attention_reference(scaled_query, cache, metadata, head_dim**-0.5)
    float_cache = torch.stack([keys, values]).view(2, -1, BLOCK_SIZE, num_kv_heads, head_dim)
    exact = paged_attention_reference(query, float_cache, metadata, head_dim**-0.5)
    return ((out - exact).norm() / exact.norm()).item()


def test_key_smoothing_cuts_the_error_an_outlier_channel_causes() -> None:
    generator = torch.Generator().manual_seed(6)
    keys = torch.randn(128, 2, 64, generator=generator)
    keys[:, :, 3] += 30.0  # a channel far larger than the rest, in every token (as trained models show)
    keys[:, :, 35] -= 20.0
    values = torch.randn(128, 2, 64, generator=generator)
    query = torch.randn(1, 4, 64, generator=generator)
    plain, smoothed = (
        _attention_error(keys, values, query, False),
        _attention_error(keys, values, query, True),
    )
    assert smoothed < plain / 4, (plain, smoothed)


def test_copying_a_block_copies_its_scales() -> None:
    cache = random_int8_cache(4, 2, 64, torch.Generator().manual_seed(7))
    layers = Int8KVCache(
        cache.values[None], cache.scales[None], cache.key_offset[None], cache.key_smoothing[None]
    )
    copy_kv_blocks(layers, src_block=1, dst_block=3, num_slots=5)
    assert torch.equal(gather_kv_reference(cache, 0, torch.tensor([3]))[0, :5],
                       gather_kv_reference(cache, 0, torch.tensor([1]))[0, :5])  # fmt: skip
    assert torch.equal(cache.scales[:, 3, :5], cache.scales[:, 1, :5])
    assert kv_cache_bytes(layers) == 2 * 4 * 16 * 2 * (64 + 4) + 2 * (2 * 64 * 4)


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    """A 2-layer SmolLM2-shaped model of random weights, no tokenizer."""
    spec = dataclasses.replace(SMOLLM2_135M, num_layers=2)
    weights = random_weights(spec, torch.float32, "cpu")
    return LoadedModel(name="random", source=Path("random"), spec=spec, weights=weights, tokenizer=None)


def _int8_engine(model: LoadedModel, **changes: object) -> Engine:
    config = EngineConfig(kv_cache_dtype="int8", max_model_len=256, kv_cache_tokens=1024, max_num_seqs=4)
    return build_engine(model, dataclasses.replace(config, **changes))


def test_an_engine_on_an_int8_cache_reuses_prefixes_and_copies_on_write(model: LoadedModel) -> None:
    """Two requests that share a prompt's full blocks: the second reuses them (prefix cache) and, where
    the shared block is partial, copies it. Its tokens are those it decodes alone on a fresh engine."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [(position * 37 + 11) % 1000 for position in range(40)]  # 2 full blocks and 8 tokens
    engine = _int8_engine(model)
    assert isinstance(engine.runner.kv_cache, Int8KVCache)

    def run(prompt: list[int]) -> tuple[list[int], int]:
        """The request's tokens, and how many prompt tokens came from the prefix cache."""
        request_id = engine.add_request(prompt, params)
        tokens, cached = [], None
        while engine.has_unfinished():
            for output in engine.step():
                if output.request_id == request_id:
                    tokens += output.new_token_ids
                    cached = output.num_cached_tokens if cached is None else cached
        return tokens, cached or 0

    first, first_cached = run(prompt)
    second, second_cached = run(prompt)
    assert first_cached == 0 and second_cached >= 32  # the two full blocks, reused
    alone = _int8_engine(model).generate(prompt, params)[0]
    assert first == alone and second == alone


def test_preempted_requests_on_an_int8_cache_lose_nothing(model: LoadedModel) -> None:
    """A cache too small for two requests at once preempts (their blocks are freed and recomputed): the
    tokens are those a roomy INT8 cache gives."""
    prompts = [[(seed * 101 + position * 7) % 900 + 5 for position in range(6)] for seed in range(2)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)  # 5 blocks each when done
    small = _int8_engine(model, block_size=4, kv_cache_tokens=24)  # 6 blocks: both start, one is preempted
    assert run_batch(small, prompts, params) == run_batch(_int8_engine(model), prompts, params)
    assert small.scheduler.num_preemptions > 0


def test_speculative_verification_on_an_int8_cache_gives_plain_decoding(model: LoadedModel) -> None:
    prompt = [11, 12, 13, 14, 15, 16] * 6  # repeats: the n-gram proposer drafts
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    speculative = _int8_engine(model, proposer="ngram", num_draft=3)
    assert speculative.generate(prompt, params)[0] == _int8_engine(model).generate(prompt, params)[0]
    assert speculative.speculator is not None and speculative.speculator.stats.drafts_accepted > 0


def test_an_int8_cache_calibrates_within_a_short_context(model: LoadedModel) -> None:
    """A max_model_len under the calibration passage and not a whole number of blocks (136: 9 blocks
    hold 144 positions) calibrates within the model's 136 positions, and the engine decodes."""
    engine = _int8_engine(model, max_model_len=136)
    token_ids, _, _ = engine.generate(list(range(1, 9)), SamplingParams(max_tokens=4, temperature=0.0))
    assert len(token_ids) == 4
