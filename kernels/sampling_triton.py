"""The sampler's Triton kernels: their plan, tiles and search states, and the pieces every pass shares (the
Philox noise, the token race, ordered keys, a row's flags). kernels/sampling.py launches them and holds
their torch reference; each pass is a module of its own: sampling_stream.py, sampling_search.py and
sampling_finish.py.

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
def philox_uniform(seed, position, stream, offsets):
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
def token_noise(seed, position, offsets):
    """The token race's noise: stream 0."""
    return philox_uniform(seed, position, 0, offsets)


@triton.jit(do_not_specialize=["stream", "width"])
def philox_uniform_kernel(seeds_ptr, positions_ptr, out_ptr, stream, width, BLOCK: tl.constexpr):
    """out[row, :width] = U(0, 1) at vocab indices 0 .. width - 1 for the row's seed and position."""
    row = tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    uniform = philox_uniform(seed, position, stream, offsets)
    tl.store(out_ptr + row.to(tl.int64) * width + offsets, uniform, mask=offsets < width)


@triton.jit
def race_score(scaled, uniform):
    """scaled - log(E) with E = -log(U); -inf stays -inf (a masked token never wins)."""
    score = scaled - tl.log(-tl.log(uniform))
    return tl.where(scaled == float("-inf"), float("-inf"), score)


@triton.jit
def ordered_key(x):
    """int32 keys that order as the fp32 values do (-0 and +0 equal)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x == 0.0, 0, key)


@triton.jit
def fixed_mass(scaled, row_max, MASS_ONE: tl.constexpr):
    """exp(x - row_max) in [0, 1] as int64 fixed point: sums are exact whatever their order."""
    return (tl.exp(scaled - row_max) * MASS_ONE).to(tl.int64)


@triton.jit
def row_filters(temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab_size):
    """A row's temperature, top_k, top_p and min_p, and what work it needs: greedy, has_top_k, filtered."""
    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    greedy = temperature == 0.0
    has_top_k = (top_k > 0) & (top_k < vocab_size)
    filtered = (temperature != 0.0) & (has_top_k | (top_p < 1.0) | (min_p > 0.0))
    return temperature, top_k, top_p, min_p, greedy, has_top_k, filtered


@triton.jit
def race_uniform(noise_row_ptr, offsets, mask, seed, position, HAS_NOISE: tl.constexpr):
    """The race's U(0, 1) at vocab indices `offsets`: the row's given noise (HAS_NOISE), else Philox's."""
    if HAS_NOISE:
        uniform = tl.load(noise_row_ptr + offsets, mask=mask, other=0.5)
    else:
        uniform = token_noise(seed, position, offsets)
    return uniform


@triton.jit
def race_lanes(vocab_size, BLOCK: tl.constexpr):
    """A race not yet run, per lane: the best score so far and the lowest index reaching it (vocab_size:
    none yet)."""
    return tl.full([BLOCK], float("-inf"), tl.float32), tl.zeros([BLOCK], tl.int32) + vocab_size


@triton.jit
def race_step(score, offsets, in_vocab, best, best_index, vocab_size):
    """The lanes' race with the scores of the tokens `offsets` taken in."""
    take = in_vocab & ((score > best) | (best_index == vocab_size))
    return tl.where(take, score, best), tl.where(take, offsets, best_index)


@triton.jit
def race_winner(best, best_index, vocab_size):
    """The race's (score, token) over its lanes: the best score, and the lowest index reaching it."""
    top_score = tl.max(best, axis=0)
    return top_score, tl.min(tl.where(best == top_score, best_index, vocab_size), axis=0)
