"""The sampler's Triton kernels (kernels/sampling.py launches them and holds their torch reference).

Pass 1 (stream), grid (B, num_chunks): each program streams a chunk of its row's vocab once: penalties,
temperature, noise, and the race winner of the chunk (the penalized argmax for greedy rows). Rows that
filter (top-k / top-p / min-p) also store their scaled logits in the workspace, the chunk's max and min.

Search passes, grid (B, num_chunks) again, for rows that filter (the others return at once). The
threshold that top-k or top-p needs is bracketed in parallel over the whole row. Every token gets a
bucket q = floor((row_max - x) * scale) in [0, 2**18), monotone in its scaled logit x (a larger logit never
has a larger bucket) with scale spreading [row_min, row_max] over the buckets. Level 1 histograms q's top
6 bits over the row (64 bins: counts, and for top-p the mass exp(x - row_max) in 2**-40 fixed point, so
that the sums are exact and independent of the order of the atomics: deterministic). The next pass picks
the bin that holds the threshold (every program of it does so redundantly: 64 bins) and, while that bin
holds more than CANDIDATES tokens, histograms the next 6 bits inside it; once it holds few enough, that
pass compacts the bin's tokens into a candidate list and runs the race over the tokens above the bin
(all kept but for min-p). Three histogram levels and one compaction pass at most: the launches are fixed.
Finish, grid (B,): a row that does not filter takes the best of its chunks' winners. A filtering row
sorts its candidates (at most CANDIDATES) and finds the exact k-th largest, top-p cut and min-p test
among them, knowing the count and mass above them, then runs the race over the kept candidates and
merges it with the winners above. A row whose bracket stays too crowded after the last level (more than
CANDIDATES tokens within 2**-18 of the row's range, in practice a tie group that large; or top-k above
CANDIDATES together with top-p) takes the slow exact path: a radix search over the row in one program.

Top-k with top-p ("upper" rows): top-p's mass is over the top-k set, so the candidates are every token
from the top down to a bucket below the k-th largest (at most CANDIDATES), and the finisher finds both.

Noise: Philox-4x32-10 keyed by the row's seed, counter (vocab index, position, stream), the bits of
kernels/sampling.py's philox_uniform_reference; the race draws stream 0 (TOKEN_STREAM there).
"""

from __future__ import annotations

import triton
import triton.language as tl
from tileinfer.kernels.triton_common import INTERPRET

# Pass 1: 1024 fp32 = 8 per thread with 4 warps (two 16-byte loads). Small blocks in the interpreter so
# that the tests' small vocabularies still span several blocks and chunks.
STREAM_BLOCK = 128 if INTERPRET else 1024
STREAM_WARPS = 4
# Search passes: [64 bins, 64] compare tiles (32 per thread) in the histograms, 1024 tokens per step in the
# compaction.
HISTOGRAM_BLOCK = 64
BRACKET_BLOCK = 128 if INTERPRET else 1024
BRACKET_WARPS = 4
BIN_BITS = 6
NUM_BINS = 1 << BIN_BITS
LEVEL_SHIFTS = (12, 6, 0)  # the bucket bits each histogram level looks at: q has 18 bits
NUM_BUCKETS = 1 << (BIN_BITS * len(LEVEL_SHIFTS))
# The most tokens the finisher sorts (a power of two). Small in the interpreter, so that the tests' small
# vocabularies go through several levels and the slow path too.
CANDIDATES = 16 if INTERPRET else 1024
FINISH_WARPS = 8
# The slow exact path: [16 pivots, BLOCK] tiles.
SEARCH_BLOCK = 256 if INTERPRET else 1024
# The interpreter pays per operation, not per element: fewer, wider passes there.
RADIX_BITS = 8 if INTERPRET else 4
# Search states: what a pass does for a row.
SEARCH = 0  # histogram the bracket
COMPACT = 1  # gather the bracket's tokens as candidates, race over the tokens above it
DONE = 2  # nothing left to do before the finisher
FALLBACK = 3  # the finisher takes the slow exact path
STATE_FIELDS = 8  # status, lo, hi, count above, mass above, total mass, (unused) x2
MASS_ONE = 2.0**40  # fixed point of the mass exp(x - row_max) <= 1; 2**17.3 tokens sum below 2**63


@triton.jit
def _philox_uniform(seed, position, stream, offsets):
    """U(0, 1) for vocab indices `offsets`: Philox-4x32-10, key = seed (int64, as two 32-bit halves),
    counter = (index, position low 32 bits, position high 32 bits, stream)."""
    c0 = offsets.to(tl.uint32)
    zero = c0 * 0
    c1 = zero + (position & 0xFFFFFFFF).to(tl.uint32)
    c2 = zero + ((position >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c3 = (zero + stream).to(tl.uint32)
    random, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
    # 23 random bits, centred in their cell: (2j + 1) / 2**24, never 0 or 1, exact in fp32.
    return ((random >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _uniform_noise(seed, position, offsets):
    """The token race's noise: stream 0."""
    return _philox_uniform(seed, position, 0, offsets)


@triton.jit(do_not_specialize=["stream", "width"])
def philox_uniform_kernel(seeds_ptr, positions_ptr, out_ptr, stream, width, BLOCK: tl.constexpr):
    """out[row, :width] = U(0, 1) at vocab indices 0 .. width - 1 for the row's seed and position."""
    row = tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    uniform = _philox_uniform(seed, position, stream, offsets)
    tl.store(out_ptr + row.to(tl.int64) * width + offsets, uniform, mask=offsets < width)


@triton.jit
def _race_score(scaled, uniform):
    """scaled - log(E) with E = -log(U); -inf stays -inf (a masked token never wins)."""
    score = scaled - tl.log(-tl.log(uniform))
    return tl.where(scaled == float("-inf"), float("-inf"), score)


@triton.jit
def _ordered_key(x):
    """int32 keys that order as the fp32 values do (-0 and +0 equal)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x == 0.0, 0, key)


@triton.jit
def _row_flags(temperature, top_k, top_p, min_p, vocab_size):
    """(greedy, has_top_k, filtered): what work a row needs."""
    greedy = temperature == 0.0
    has_top_k = (top_k > 0) & (top_k < vocab_size)
    filtered = (temperature != 0.0) & (has_top_k | (top_p < 1.0) | (min_p > 0.0))
    return greedy, has_top_k, filtered


@triton.jit
def _key_value(key):
    """The fp32 value of an _ordered_key."""
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _bucket(scaled, row_max, scale, NUM_BUCKETS: tl.constexpr):
    """q = floor((row_max - x) * scale) clamped to [0, NUM_BUCKETS): non-increasing in x; -inf -> the last."""
    t = tl.minimum((row_max - scaled) * scale, NUM_BUCKETS - 1.0)
    return t.to(tl.int32)


@triton.jit
def _fixed_mass(scaled, row_max, MASS_ONE: tl.constexpr):
    """exp(x - row_max) in [0, 1] as int64 fixed point: sums are exact whatever their order."""
    return (tl.exp(scaled - row_max) * MASS_ONE).to(tl.int64)


@triton.jit
def _row_range(part_max_ptr, part_min_ptr, row64, num_chunks, CHUNKS_POW2: tl.constexpr):
    """(row_max, row_min over finite logits) from the chunks' partials."""
    chunks = tl.arange(0, CHUNKS_POW2)
    in_row = chunks < num_chunks
    part = row64 * num_chunks + chunks
    row_max = tl.max(tl.load(part_max_ptr + part, mask=in_row, other=float("-inf")), axis=0)
    row_min = tl.min(tl.load(part_min_ptr + part, mask=in_row, other=float("inf")), axis=0)
    return row_max, row_min


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
    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    presence = tl.load(presence_ptr + row)
    frequency = tl.load(frequency_ptr + row)
    repetition = tl.load(repetition_ptr + row)
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    greedy, has_top_k, filtered = _row_flags(temperature, top_k, top_p, min_p, vocab_size)
    penalized = (repetition != 1.0) | (frequency != 0.0) | (presence != 0.0)

    lanes = tl.arange(0, BLOCK)
    # Per lane: the best score so far and the lowest index reaching it (vocab_size = none yet).
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32) + vocab_size
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
            if HAS_NOISE:
                uniform = tl.load(noise_ptr + row64 * noise_stride + offsets, mask=in_vocab, other=0.5)
            else:
                uniform = _uniform_noise(seed, position, offsets)
            score = _race_score(scaled, uniform)
        take = in_vocab & ((score > best) | (best_index == vocab_size))
        best = tl.where(take, score, best)
        best_index = tl.where(take, offsets, best_index)

    top_score = tl.max(best, axis=0)
    top_index = tl.min(tl.where(best == top_score, best_index, vocab_size), axis=0)
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
            mass = _fixed_mass(scaled, row_max, MASS_ONE)
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
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32) + vocab_size
    for block_start in range(0, chunk_size, BLOCK):
        offsets = chunk_start + block_start + lanes
        in_vocab = offsets < vocab_size
        scaled = tl.load(work_row_ptr + offsets, mask=in_vocab, other=float("-inf"))
        bucket = _bucket(scaled, row_max, scale, NUM_BUCKETS)
        keep = (bucket < lo32) & (tl.exp(scaled - row_max) >= min_p)
        if HAS_NOISE:
            uniform = tl.load(noise_row_ptr + offsets, mask=in_vocab, other=0.5)
        else:
            uniform = _uniform_noise(seed, position, offsets)
        score = tl.where(keep, _race_score(scaled, uniform), float("-inf"))
        take = in_vocab & ((score > best) | (best_index == vocab_size))
        best = tl.where(take, score, best)
        best_index = tl.where(take, offsets, best_index)
        chosen = in_vocab & (bucket >= lo32) & (bucket <= hi32)
        num_chosen = tl.sum(chosen.to(tl.int32), axis=0)
        if num_chosen > 0:
            base = tl.atomic_add(cand_count_ptr, num_chosen)
            slot = base + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
            packed = (_ordered_key(scaled).to(tl.int64) << 32) | offsets.to(tl.int64)
            tl.store(cand_row_ptr + slot, packed, mask=chosen & (slot < CANDIDATES))
    top_score = tl.max(best, axis=0)
    tl.store(part_score_ptr, top_score)
    tl.store(part_index_ptr, tl.min(tl.where(best == top_score, best_index, vocab_size), axis=0))


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
    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    greedy, has_top_k, filtered = _row_flags(temperature, top_k, top_p, min_p, vocab_size)
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
            key = _ordered_key(x)
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
    mass = _fixed_mass(scaled, row_max, MASS_ONE)
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
    if HAS_NOISE:
        uniform = tl.load(noise_row_ptr + index, mask=valid, other=0.5)
    else:
        uniform = _uniform_noise(seed, position, index)
    score = tl.where(keep, _race_score(scaled, uniform), float("-inf"))
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
    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    greedy, has_top_k, filtered = _row_flags(temperature, top_k, top_p, min_p, vocab_size)

    chunks = tl.arange(0, CHUNKS_POW2)
    part = row64 * num_chunks + chunks
    in_row = chunks < num_chunks
    # The chunks' race winners: over every token (rows that do not filter), or over the tokens above the
    # candidates (rows that filter, written by the compaction pass).
    scores = tl.load(part_score_ptr + part, mask=in_row, other=float("-inf"))
    indices = tl.load(part_index_ptr + part, mask=in_row, other=vocab_size)
    top_score = tl.max(scores, axis=0)
    token = tl.min(tl.where(scores == top_score, indices, vocab_size), axis=0)
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
            best = tl.full([BLOCK], float("-inf"), tl.float32)
            best_index = tl.zeros([BLOCK], tl.int32) + vocab_size
            for start in range(0, vocab_size, BLOCK):
                offsets = start + lanes
                in_vocab = offsets < vocab_size
                scaled = tl.load(work_row_ptr + offsets, mask=in_vocab, other=float("-inf"))
                keep = (_ordered_key(scaled) >= floor_key) & (tl.exp(scaled - row_max) >= min_p)
                if HAS_NOISE:
                    uniform = tl.load(noise_ptr + row64 * noise_stride + offsets, mask=in_vocab, other=0.5)
                else:
                    uniform = _uniform_noise(seed, position, offsets)
                score = tl.where(keep, _race_score(scaled, uniform), float("-inf"))
                take = in_vocab & ((score > best) | (best_index == vocab_size))
                best = tl.where(take, score, best)
                best_index = tl.where(take, offsets, best_index)
            best_score = tl.max(best, axis=0)
            token = tl.min(tl.where(best == best_score, best_index, vocab_size), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))
