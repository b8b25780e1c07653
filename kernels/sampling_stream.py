"""The sampler's pass 1 (kernels/sampling_triton.py has the plan): each program streams a chunk of its row's
vocab once, applying penalties, temperature and noise, and keeps the race winner of the chunk (the
penalized argmax for greedy rows). Rows that filter also store their scaled logits for the search passes,
and the chunk's largest and smallest."""

from __future__ import annotations

import triton
import triton.language as tl
from tileinfer.kernels.sampling_triton import (
    race_lanes,
    race_score,
    race_step,
    race_uniform,
    race_winner,
    row_filters,
)


@triton.jit(do_not_specialize=["num_chunks"])
def sample_stream_kernel(
    logits_ptr,  # [B, V] fp32 (or bf16)
    logits_stride,
    counts_ptr,  # [B, V] int32
    counts_stride,
    seen_ptr,  # [B, V] uint8 (the prompt mask)
    seen_stride,
    noise_ptr,  # [B, V] fp32 uniform noise, when HAS_NOISE
    noise_stride,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    presence_ptr,
    frequency_ptr,
    repetition_ptr,
    seeds_ptr,
    positions_ptr,
    work_ptr,  # [B, V] fp32: penalized logits / temperature, written for rows that filter
    work_stride,
    part_score_ptr,  # [B, num_chunks] fp32: each chunk's best race score
    part_index_ptr,  # [B, num_chunks] int32: and its token
    part_max_ptr,  # [B, num_chunks] fp32: each chunk's largest scaled logit (rows that filter)
    part_min_ptr,  # [B, num_chunks] fp32: and its smallest finite one
    hist_count_ptr,  # [B, LEVELS, NUM_BINS] int32, zeroed here for rows that filter
    hist_mass_ptr,  # [B, LEVELS, NUM_BINS] int64, zeroed here
    final_ptr,  # [B, STATE_FIELDS] int64: its status set to FALLBACK here
    cand_count_ptr,  # [B] int32, zeroed here
    vocab_size,
    num_chunks,
    chunk_size,  # a multiple of BLOCK
    HAS_NOISE: tl.constexpr,
    LEVELS: tl.constexpr,
    NUM_BINS: tl.constexpr,
    STATE_FIELDS: tl.constexpr,
    FALLBACK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row64 = row.to(tl.int64)
    temperature, top_k, top_p, min_p, greedy, has_top_k, filtered = row_filters(
        temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab_size
    )
    presence = tl.load(presence_ptr + row)
    frequency = tl.load(frequency_ptr + row)
    repetition = tl.load(repetition_ptr + row)
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    penalized = (repetition != 1.0) | (frequency != 0.0) | (presence != 0.0)

    lanes = tl.arange(0, BLOCK)
    best, best_index = race_lanes(vocab_size, BLOCK)
    chunk_max = tl.full([BLOCK], float("-inf"), tl.float32)
    chunk_min = tl.full([BLOCK], float("inf"), tl.float32)
    chunk_start = chunk * chunk_size
    for block_start in range(0, chunk_size, BLOCK):
        offsets = chunk_start + block_start + lanes
        in_vocab = offsets < vocab_size
        logit = tl.load(logits_ptr + row64 * logits_stride + offsets, mask=in_vocab, other=float("-inf"))
        logit = logit.to(tl.float32)
        if penalized:  # the counts and the mask are only read by rows that use them
            count = tl.load(counts_ptr + row64 * counts_stride + offsets, mask=in_vocab, other=0)
            seen = tl.load(seen_ptr + row64 * seen_stride + offsets, mask=in_vocab, other=0)
            seen = (seen != 0) | (count > 0)
            repeated = tl.where(logit > 0, tl.math.div_rn(logit, repetition), logit * repetition)
            logit = tl.where(seen, repeated, logit)
            logit = logit - frequency * count.to(tl.float32)
            logit = logit - presence * (count > 0).to(tl.float32)
        if greedy:
            score = logit
        else:
            scaled = tl.math.div_rn(logit, temperature)
            if filtered:
                tl.store(work_ptr + row64 * work_stride + offsets, scaled, mask=in_vocab)
                chunk_max = tl.maximum(chunk_max, scaled)
                chunk_min = tl.minimum(chunk_min, tl.where(scaled > float("-inf"), scaled, float("inf")))
            noise_row_ptr = noise_ptr + row64 * noise_stride
            uniform = race_uniform(noise_row_ptr, offsets, in_vocab, seed, position, HAS_NOISE)
            score = race_score(scaled, uniform)
        best, best_index = race_step(score, offsets, in_vocab, best, best_index, vocab_size)

    top_score, top_index = race_winner(best, best_index, vocab_size)
    part = row64 * num_chunks + chunk
    tl.store(part_score_ptr + part, top_score)
    tl.store(part_index_ptr + part, top_index)
    tl.store(part_max_ptr + part, tl.max(chunk_max, axis=0))
    tl.store(part_min_ptr + part, tl.min(chunk_min, axis=0))
    if filtered & (chunk == 0):  # reset the row's search scratch for this step
        bins = tl.arange(0, NUM_BINS)
        for level in tl.static_range(LEVELS):
            hist = (row64 * LEVELS + level) * NUM_BINS + bins
            tl.store(hist_count_ptr + hist, tl.zeros([NUM_BINS], tl.int32))
            tl.store(hist_mass_ptr + hist, tl.zeros([NUM_BINS], tl.int64))
        tl.store(cand_count_ptr + row, 0)
        tl.store(final_ptr + row64 * STATE_FIELDS, (top_k * 0 + FALLBACK).to(tl.int64))
