"""The sampler's last pass (kernels/sampling_triton.py has the plan), one program a row: a row that does not
filter takes the best of its chunks' race winners; a filtering row finds its exact thresholds among its
sorted candidates and races over those kept, or, where the search could not narrow its row, takes the slow
exact path (radix searches over the whole row)."""

from __future__ import annotations

import triton
import triton.language as tl
from tileinfer.kernels.sampling_triton import (
    fixed_mass,
    ordered_key,
    race_lanes,
    race_score,
    race_step,
    race_uniform,
    race_winner,
    row_filters,
)


@triton.jit
def _key_value(key):
    """The fp32 value of an ordered_key."""
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _threshold_key(
    work_row_ptr,
    vocab_size,
    floor_key,
    row_max,
    target_value,
    BY_MASS: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The largest key t with F(t) >= target, where F(t) counts (BY_MASS: sums exp(x - row_max) over) the
    entries with key >= t among those with key >= floor_key. The target is top_k, or top_p times the total
    mass. F only changes at entries' keys, so t is the key of an entry: the k-th largest, or the smallest
    logit that top-p keeps. Radix search from the top bit, RADIX_BITS per pass over the row."""
    NUM_PIVOTS: tl.constexpr = 1 << RADIX_BITS
    digits = tl.arange(0, NUM_PIVOTS).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    prefix = (floor_key * 0).to(tl.int64)  # the answer's bits so far, as an offset from INT32_MIN
    target = target_value
    for level in tl.static_range(32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (level + 1)
        pivots = (prefix + (digits << shift) - 2147483648).to(tl.int32)  # [NUM_PIVOTS] ascending
        totals = tl.zeros([NUM_PIVOTS], tl.float32)
        for start in range(0, vocab_size, BLOCK):
            offsets = start + lanes
            in_vocab = offsets < vocab_size
            x = tl.load(work_row_ptr + offsets, mask=in_vocab, other=float("-inf"))
            key = ordered_key(x)
            live = in_vocab & (key >= floor_key)
            if BY_MASS:  # noqa: SIM108 (a constexpr branch)
                weight = tl.where(live, tl.exp(x - row_max), 0.0)
            else:
                weight = live.to(tl.float32)
            above = key[None, :] >= pivots[:, None]  # [NUM_PIVOTS, BLOCK]
            totals += tl.sum(tl.where(above, weight[None, :], 0.0), axis=1)
        if BY_MASS and level == 0:
            target = target_value * tl.max(totals, axis=0)  # the first pivot is INT32_MIN: all the mass
        # F is non-increasing in the pivot and the first pivot always qualifies.
        chosen = tl.sum((totals >= target).to(tl.int64), axis=0) - 1
        prefix = prefix + (chosen << shift)
    return (prefix - 2147483648).to(tl.int32)


@triton.jit
def _finish_from_candidates(
    cand_row_ptr,
    num_candidates,
    noise_row_ptr,
    seed,
    position,
    top_k,
    top_p,
    min_p,
    has_top_k,
    row_max,
    count_above,
    mass_above,
    total_mass,
    above_score,
    above_token,
    vocab_size,
    HAS_NOISE: tl.constexpr,
    CANDIDATES: tl.constexpr,
    MASS_ONE: tl.constexpr,
):
    """The exact thresholds among the sorted candidates, the race over those kept, merged with the race
    winner above them (above_score, above_token). Returns the token (int32)."""
    positions = tl.arange(0, CANDIDATES)
    valid = positions < num_candidates
    packed = tl.load(cand_row_ptr + positions, mask=valid, other=-(2**63))
    packed = tl.sort(packed, descending=True)  # largest first; the padding last
    key = (packed >> 32).to(tl.int32)
    index = (packed & 0xFFFFFFFF).to(tl.int32)
    scaled = tl.where(valid, _key_value(key), float("-inf"))
    mass = fixed_mass(scaled, row_max, MASS_ONE)
    floor_key = top_k * 0 - 2147483647 - 1  # INT32_MIN: keep everything
    if has_top_k:  # the k-th largest: count_above tokens lie above the candidates
        floor_key = tl.sum(tl.where(positions == top_k - 1 - count_above, key, 0), axis=0)
        # Upper rows: the candidates hold the whole top-k set, and top-p's mass is over it.
        total_mass = tl.sum(tl.where(valid & (key >= floor_key), mass, 0), axis=0)
    in_top_k = valid & (key >= floor_key)
    if top_p < 1.0:
        # The first position whose mass strictly before it reaches top_p * total: its tie group is dropped
        # if it starts there, kept if it started before.
        mass_before = mass_above + tl.cumsum(mass, axis=0) - mass
        target = top_p.to(tl.float64) * total_mass.to(tl.float64)
        reached = in_top_k & (mass_before.to(tl.float64) >= target)
        first = tl.min(tl.where(reached, positions, CANDIDATES), axis=0)
        if first < CANDIDATES:
            first_key = tl.sum(tl.where(positions == first, key, 0), axis=0)
            previous_key = tl.sum(tl.where(positions == first - 1, key, 0), axis=0)
            cut = tl.where(first_key == previous_key, first_key, previous_key)
            cut = tl.where(first == 0, 2147483647, cut)
            floor_key = tl.maximum(floor_key, cut)
    keep = in_top_k & (key >= floor_key) & (tl.exp(scaled - row_max) >= min_p)
    uniform = race_uniform(noise_row_ptr, index, valid, seed, position, HAS_NOISE)
    score = tl.where(keep, race_score(scaled, uniform), float("-inf"))
    cand_score = tl.max(score, axis=0)
    cand_token = tl.min(tl.where(valid & (score == cand_score), index, vocab_size), axis=0)
    top_score = tl.maximum(cand_score, above_score)
    token = tl.minimum(
        tl.where(above_score == top_score, above_token, vocab_size),
        tl.where(cand_score == top_score, cand_token, vocab_size),
    )
    return tl.where(top_score == float("-inf"), 0, token)  # nothing can win: torch.argmax's first index


@triton.jit(do_not_specialize=["num_chunks"])
def sample_finish_kernel(
    work_ptr,
    work_stride,
    noise_ptr,
    noise_stride,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seeds_ptr,
    positions_ptr,
    part_score_ptr,
    part_index_ptr,
    part_max_ptr,
    final_ptr,
    cand_ptr,
    cand_count_ptr,
    out_ptr,  # [B] int64
    vocab_size,
    num_chunks,
    HAS_NOISE: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
    CANDIDATES: tl.constexpr,
    STATE_FIELDS: tl.constexpr,
    MASS_ONE: tl.constexpr,
    FALLBACK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    temperature, top_k, top_p, min_p, greedy, has_top_k, filtered = row_filters(
        temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab_size
    )

    chunks = tl.arange(0, CHUNKS_POW2)
    part = row64 * num_chunks + chunks
    in_row = chunks < num_chunks
    # The chunks' race winners: over every token (rows that do not filter), or over the tokens above the
    # candidates (rows that filter, written by the compaction pass).
    scores = tl.load(part_score_ptr + part, mask=in_row, other=float("-inf"))
    indices = tl.load(part_index_ptr + part, mask=in_row, other=vocab_size)
    top_score, token = race_winner(scores, indices, vocab_size)
    if filtered:
        row_max = tl.max(tl.load(part_max_ptr + part, mask=in_row, other=float("-inf")), axis=0)
        seed = tl.load(seeds_ptr + row)
        position = tl.load(positions_ptr + row)
        final = final_ptr + row64 * STATE_FIELDS
        if tl.load(final) != FALLBACK:
            token = _finish_from_candidates(
                cand_ptr + row64 * CANDIDATES,
                tl.minimum(tl.load(cand_count_ptr + row), CANDIDATES),
                noise_ptr + row64 * noise_stride,
                seed,
                position,
                top_k,
                top_p,
                min_p,
                has_top_k,
                row_max,
                tl.load(final + 3),
                tl.load(final + 4),
                tl.load(final + 5),
                top_score,
                token,
                vocab_size,
                HAS_NOISE,
                CANDIDATES,
                MASS_ONE,
            )
        else:
            # The slow exact path: radix searches over the row in this one program.
            work_row_ptr = work_ptr + row64 * work_stride
            floor_key = top_k * 0 - 2147483647 - 1  # INT32_MIN: keep everything
            if has_top_k:
                floor_key = _threshold_key(
                    work_row_ptr,
                    vocab_size,
                    floor_key,
                    row_max,
                    top_k.to(tl.float32),
                    False,
                    RADIX_BITS,
                    BLOCK,
                )
            if top_p < 1.0:
                floor_key = _threshold_key(
                    work_row_ptr, vocab_size, floor_key, row_max, top_p, True, RADIX_BITS, BLOCK
                )
            # The race over the tokens kept; min_p == 0 keeps all (exp >= 0).
            lanes = tl.arange(0, BLOCK)
            best, best_index = race_lanes(vocab_size, BLOCK)
            for start in range(0, vocab_size, BLOCK):
                offsets = start + lanes
                in_vocab = offsets < vocab_size
                scaled = tl.load(work_row_ptr + offsets, mask=in_vocab, other=float("-inf"))
                keep = (ordered_key(scaled) >= floor_key) & (tl.exp(scaled - row_max) >= min_p)
                noise_row_ptr = noise_ptr + row64 * noise_stride
                uniform = race_uniform(noise_row_ptr, offsets, in_vocab, seed, position, HAS_NOISE)
                score = tl.where(keep, race_score(scaled, uniform), float("-inf"))
                best, best_index = race_step(score, offsets, in_vocab, best, best_index, vocab_size)
            slow_score, token = race_winner(best, best_index, vocab_size)
    tl.store(out_ptr + row, token.to(tl.int64))
