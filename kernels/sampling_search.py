"""The sampler's search passes (kernels/sampling_triton.py has the plan), for rows that filter (top-k,
top-p, min-p): each histograms its row's buckets inside the bracket the pass before it narrowed, until the
bracket holds few enough tokens to compact into the finisher's candidates, with the race over the tokens
above them."""

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
def _bucket(scaled, row_max, scale, NUM_BUCKETS: tl.constexpr):
    """q = floor((row_max - x) * scale) clamped to [0, NUM_BUCKETS): non-increasing in x; -inf -> the last."""
    t = tl.minimum((row_max - scaled) * scale, NUM_BUCKETS - 1.0)
    return t.to(tl.int32)


@triton.jit
def _row_range(part_max_ptr, part_min_ptr, row64, num_chunks, CHUNKS_POW2: tl.constexpr):
    """(row_max, row_min over finite logits) from the chunks' partials."""
    chunks = tl.arange(0, CHUNKS_POW2)
    in_row = chunks < num_chunks
    part = row64 * num_chunks + chunks
    row_max = tl.max(tl.load(part_max_ptr + part, mask=in_row, other=float("-inf")), axis=0)
    row_min = tl.min(tl.load(part_min_ptr + part, mask=in_row, other=float("inf")), axis=0)
    return row_max, row_min


@triton.jit
def _select_bin(
    hist_count_ptr,  # this row's histogram of the previous level
    hist_mass_ptr,
    lo,
    count_above,
    mass_above,
    total_mass,
    top_k,
    top_p,
    upper,
    by_count,
    SHIFT: tl.constexpr,
    NUM_BINS: tl.constexpr,
    CANDIDATES: tl.constexpr,
    SEARCH: tl.constexpr,
    COMPACT: tl.constexpr,
    FALLBACK: tl.constexpr,
):
    """From the histogram of the bracket [lo, lo + (NUM_BINS << SHIFT)) of buckets, the next state:
    (status, lo, hi, count above, mass above). The threshold's bin is the first (from the top) where the
    count reaches k (top-k) or the mass reaches top_p * total (top-p). Upper rows (both) instead look for
    the lowest bin such that everything from the top down to it fits the candidates and holds the k-th."""
    bins = tl.arange(0, NUM_BINS)
    counts = tl.load(hist_count_ptr + bins).to(tl.int64)
    masses = tl.load(hist_mass_ptr + bins)
    count_through = count_above + tl.cumsum(counts, axis=0)  # tokens in this bin or above it
    mass_through = mass_above + tl.cumsum(masses, axis=0)
    target = top_p.to(tl.float64) * total_mass.to(tl.float64)
    kth_bin = tl.sum((count_through < top_k).to(tl.int32), axis=0)
    mass_bin = tl.sum((mass_through.to(tl.float64) < target).to(tl.int32), axis=0)
    chosen = tl.minimum(tl.where(by_count, kth_bin, mass_bin), NUM_BINS - 1)
    before = bins < chosen
    new_count_above = count_above + tl.sum(tl.where(before, counts, 0), axis=0)
    new_mass_above = mass_above + tl.sum(tl.where(before, masses, 0), axis=0)
    in_chosen = tl.sum(tl.where(bins == chosen, counts, 0), axis=0)
    new_lo = lo + (chosen.to(tl.int64) << SHIFT)
    new_hi = new_lo + ((1 << SHIFT) - 1)
    # Upper rows: the last bin whose prefix (from the top) fits the candidates.
    fitting = tl.sum((count_through <= CANDIDATES).to(tl.int32), axis=0) - 1
    upper_done = upper & (kth_bin <= fitting)
    stuck = upper & (new_count_above > CANDIDATES)
    if SHIFT == 0:  # no finer level: a crowded bin stays crowded
        stuck = stuck | (count_above == count_above)
    status = tl.where(stuck, FALLBACK, SEARCH)
    status = tl.where(upper_done | (~upper & (in_chosen <= CANDIDATES)), COMPACT, status)
    new_lo = tl.where(upper_done, 0, new_lo)
    new_hi = tl.where(upper_done, lo + ((fitting + 1).to(tl.int64) << SHIFT) - 1, new_hi)
    new_count_above = tl.where(upper_done, 0, new_count_above)
    new_mass_above = tl.where(upper_done, 0, new_mass_above)
    return status, new_lo, new_hi, new_count_above, new_mass_above


@triton.jit
def _bracket_histogram(
    work_row_ptr,
    hist_count_ptr,  # this row's histogram of this level
    hist_mass_ptr,
    chunk_start,
    chunk_size,
    vocab_size,
    row_max,
    scale,
    lo,
    hi,
    with_mass,
    SHIFT: tl.constexpr,
    NUM_BINS: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    MASS_ONE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Adds this chunk's tokens with buckets in [lo, hi] to the histogram of bins (q - lo) >> SHIFT."""
    bins = tl.arange(0, NUM_BINS)
    lanes = tl.arange(0, BLOCK)
    lo32 = lo.to(tl.int32)
    hi32 = hi.to(tl.int32)
    # [NUM_BINS, BLOCK] accumulators, reduced once at the end.
    counts = tl.zeros([NUM_BINS, BLOCK], tl.int32)
    masses = tl.zeros([NUM_BINS, BLOCK], tl.int64)
    for block_start in range(0, chunk_size, BLOCK):
        offsets = chunk_start + block_start + lanes
        in_vocab = offsets < vocab_size
        scaled = tl.load(work_row_ptr + offsets, mask=in_vocab, other=float("-inf"))
        bucket = _bucket(scaled, row_max, scale, NUM_BUCKETS)
        inside = in_vocab & (bucket >= lo32) & (bucket <= hi32)
        hit = inside[None, :] & (((bucket - lo32) >> SHIFT)[None, :] == bins[:, None])  # [NUM_BINS, BLOCK]
        counts += hit.to(tl.int32)
        if with_mass:
            mass = fixed_mass(scaled, row_max, MASS_ONE)
            masses += tl.where(hit, mass[None, :], 0)
    counts = tl.sum(counts, axis=1)
    masses = tl.sum(masses, axis=1)
    used = counts != 0
    tl.atomic_add(hist_count_ptr + bins, counts, mask=used, sem="relaxed")
    if with_mass:
        tl.atomic_add(hist_mass_ptr + bins, masses, mask=used, sem="relaxed")


@triton.jit
def _compact_and_race(
    work_row_ptr,
    noise_row_ptr,
    cand_row_ptr,
    cand_count_ptr,  # this row's
    part_score_ptr,  # this chunk's
    part_index_ptr,
    seed,
    position,
    min_p,
    chunk_start,
    chunk_size,
    vocab_size,
    row_max,
    scale,
    lo,
    hi,
    HAS_NOISE: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    CANDIDATES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Appends this chunk's tokens with buckets in [lo, hi] to the candidates as (key << 32 | index), and
    stores the race winner over its tokens above them (bucket < lo) that min-p keeps."""
    lanes = tl.arange(0, BLOCK)
    lo32 = lo.to(tl.int32)
    hi32 = hi.to(tl.int32)
    best, best_index = race_lanes(vocab_size, BLOCK)
    for block_start in range(0, chunk_size, BLOCK):
        offsets = chunk_start + block_start + lanes
        in_vocab = offsets < vocab_size
        scaled = tl.load(work_row_ptr + offsets, mask=in_vocab, other=float("-inf"))
        bucket = _bucket(scaled, row_max, scale, NUM_BUCKETS)
        keep = (bucket < lo32) & (tl.exp(scaled - row_max) >= min_p)
        uniform = race_uniform(noise_row_ptr, offsets, in_vocab, seed, position, HAS_NOISE)
        score = tl.where(keep, race_score(scaled, uniform), float("-inf"))
        best, best_index = race_step(score, offsets, in_vocab, best, best_index, vocab_size)
        chosen = in_vocab & (bucket >= lo32) & (bucket <= hi32)
        num_chosen = tl.sum(chosen.to(tl.int32), axis=0)
        if num_chosen > 0:
            base = tl.atomic_add(cand_count_ptr, num_chosen)
            slot = base + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
            packed = (ordered_key(scaled).to(tl.int64) << 32) | offsets.to(tl.int64)
            tl.store(cand_row_ptr + slot, packed, mask=chosen & (slot < CANDIDATES))
    top_score, top_index = race_winner(best, best_index, vocab_size)
    tl.store(part_score_ptr, top_score)
    tl.store(part_index_ptr, top_index)


@triton.jit(do_not_specialize=["num_chunks"])
def sample_bracket_kernel(
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
    part_min_ptr,
    hist_count_ptr,  # [B, LEVELS, NUM_BINS] int32
    hist_mass_ptr,  # [B, LEVELS, NUM_BINS] int64
    state_ptr,  # [B, LEVELS + 1, STATE_FIELDS] int64: the state each pass worked in
    final_ptr,  # [B, STATE_FIELDS] int64: the state of the compaction (or FALLBACK)
    cand_ptr,  # [B, CANDIDATES] int64
    cand_count_ptr,  # [B] int32
    vocab_size,
    num_chunks,
    chunk_size,
    LEVEL: tl.constexpr,  # 1 .. LEVELS + 1
    PREV_SHIFT: tl.constexpr,  # the previous level's shift (LEVEL > 1)
    SHIFT: tl.constexpr,  # this level's (LEVEL <= LEVELS)
    LEVELS: tl.constexpr,
    HAS_NOISE: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
    NUM_BINS: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    CANDIDATES: tl.constexpr,
    STATE_FIELDS: tl.constexpr,
    MASS_ONE: tl.constexpr,
    SEARCH: tl.constexpr,
    COMPACT: tl.constexpr,
    DONE: tl.constexpr,
    FALLBACK: tl.constexpr,
    HISTOGRAM_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row64 = row.to(tl.int64)
    temperature, top_k, top_p, min_p, greedy, has_top_k, filtered = row_filters(
        temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab_size
    )
    if filtered:
        row_max, row_min = _row_range(part_max_ptr, part_min_ptr, row64, num_chunks, CHUNKS_POW2)
        finite = (row_max > float("-inf")) & (row_max < float("inf"))
        spread = tl.minimum(tl.maximum(row_max - row_min, 1e-20), 64.0)  # e**-64: no mass below
        scale = NUM_BUCKETS / spread
        has_top_p = top_p < 1.0
        upper = has_top_k & has_top_p
        searching = has_top_k | has_top_p
        zero = row64 * 0
        if LEVEL == 1:
            status = tl.where(searching, SEARCH, COMPACT)  # min-p alone: no candidates, race over all
            status = tl.where(~finite | (upper & (top_k > CANDIDATES)), FALLBACK, status)
            lo = tl.where(searching, zero, zero + NUM_BUCKETS)
            hi = zero + (NUM_BUCKETS - 1)
            count_above = zero
            mass_above = zero
            total_mass = zero
        else:
            previous = state_ptr + (row64 * (LEVELS + 1) + LEVEL - 2) * STATE_FIELDS
            status = tl.load(previous)
            lo = tl.load(previous + 1)
            hi = tl.load(previous + 2)
            count_above = tl.load(previous + 3)
            mass_above = tl.load(previous + 4)
            total_mass = tl.load(previous + 5)
            hist = (row64 * LEVELS + LEVEL - 2) * NUM_BINS
            if LEVEL == 2:  # level 1 covered the whole row
                bins = tl.arange(0, NUM_BINS)
                total_mass = tl.sum(tl.load(hist_mass_ptr + hist + bins), axis=0)
            new_status, new_lo, new_hi, new_count_above, new_mass_above = _select_bin(
                hist_count_ptr + hist,
                hist_mass_ptr + hist,
                lo,
                count_above,
                mass_above,
                total_mass,
                top_k,
                top_p,
                upper,
                has_top_k,
                PREV_SHIFT,
                NUM_BINS,
                CANDIDATES,
                SEARCH,
                COMPACT,
                FALLBACK,
            )
            was_searching = status == SEARCH
            lo = tl.where(was_searching, new_lo, lo)
            hi = tl.where(was_searching, new_hi, hi)
            count_above = tl.where(was_searching, new_count_above, count_above)
            mass_above = tl.where(was_searching, new_mass_above, mass_above)
            status = tl.where(was_searching, new_status, tl.where(status == COMPACT, DONE, status))
        if chunk == 0:
            here = state_ptr + (row64 * (LEVELS + 1) + LEVEL - 1) * STATE_FIELDS
            fields = tl.arange(0, 8)
            record = tl.where(fields == 0, status.to(tl.int64), 0)
            record = tl.where(fields == 1, lo, record)
            record = tl.where(fields == 2, hi, record)
            record = tl.where(fields == 3, count_above, record)
            record = tl.where(fields == 4, mass_above, record)
            record = tl.where(fields == 5, total_mass, record)
            tl.store(here + fields, record, mask=fields < STATE_FIELDS)
            if (status == COMPACT) | (status == FALLBACK):
                tl.store(final_ptr + row64 * STATE_FIELDS + fields, record, mask=fields < STATE_FIELDS)
        work_row_ptr = work_ptr + row64 * work_stride
        chunk_start = chunk * chunk_size
        if LEVEL <= LEVELS:  # noqa: SIM102 (a constexpr branch)
            if status == SEARCH:
                hist = (row64 * LEVELS + LEVEL - 1) * NUM_BINS
                _bracket_histogram(
                    work_row_ptr,
                    hist_count_ptr + hist,
                    hist_mass_ptr + hist,
                    chunk_start,
                    chunk_size,
                    vocab_size,
                    row_max,
                    scale,
                    lo,
                    hi,
                    has_top_p & ~has_top_k,
                    SHIFT,
                    NUM_BINS,
                    NUM_BUCKETS,
                    MASS_ONE,
                    HISTOGRAM_BLOCK,
                )
        if status == COMPACT:
            _compact_and_race(
                work_row_ptr,
                noise_ptr + row64 * noise_stride,
                cand_ptr + row64 * CANDIDATES,
                cand_count_ptr + row,
                part_score_ptr + row64 * num_chunks + chunk,
                part_index_ptr + row64 * num_chunks + chunk,
                tl.load(seeds_ptr + row),
                tl.load(positions_ptr + row),
                min_p,
                chunk_start,
                chunk_size,
                vocab_size,
                row_max,
                scale,
                lo,
                hi,
                HAS_NOISE,
                NUM_BUCKETS,
                CANDIDATES,
                BLOCK,
            )
