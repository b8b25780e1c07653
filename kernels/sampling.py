"""Sampling on the device: penalties, greedy, temperature, top-k, top-p, min-p and the exponential race.

The semantics are engine/sampling.py's, batched, with every sampling parameter held per row in a device
tensor (SamplingTensors), so a decode step's sampling is captured in its CUDA graph: no host sync, no
shape that depends on the data. Order: repetition penalty -> frequency/presence penalties -> greedy argmax
when temperature == 0 -> temperature -> top-k -> top-p -> min-p -> argmax(p / E) with E ~ Exponential(1).

Noise: E = -log(U), U from Philox-4x32-10 keyed by the row's seed with counter (vocab index, step), so a
seeded request draws the same tokens whatever shares its batch, on the GPU and on the CPU alike
(`philox_uniform_reference` is the same generator in torch). The race is run in log space,
argmax(logit / T - log(E)), which picks the same token as argmax(p / E).

Ties: every argmax picks the lowest index (as torch.argmax does); top-k keeps every token tied with the
k-th (as engine/sampling.py does); top-p keeps or drops a group of tied logits as a whole, decided by the
mass strictly above them (engine/sampling.py's unstable sort may split such a group).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.triton_common import INTERPRET, num_sms


@dataclasses.dataclass
class SamplingTensors:
    """One row per sequence slot of the batch; all on the logits' device."""

    temperature: torch.Tensor  # [B] fp32 (0 = greedy)
    top_k: torch.Tensor  # [B] int32 (0 = off; so is anything >= the vocab size)
    top_p: torch.Tensor  # [B] fp32 (1 = off)
    min_p: torch.Tensor  # [B] fp32 (0 = off)
    presence_penalty: torch.Tensor  # [B] fp32
    frequency_penalty: torch.Tensor  # [B] fp32
    repetition_penalty: torch.Tensor  # [B] fp32 (1 = off)
    seeds: torch.Tensor  # [B] int64: the request's seed (or a random one), as int64 bits
    step: torch.Tensor  # [B] int64: which draw of that request this is
    output_counts: torch.Tensor  # [B, V] int32: how often each token was generated so far
    prompt_mask: torch.Tensor  # [B, V] bool: tokens of the prompt or generated (repetition penalty)

    @classmethod
    def from_params(
        cls,
        params: Sequence,  # engine.sampling.SamplingParams
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        steps: Sequence[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        """Build the tensors on the host (tests, and the runner when a slot is (re)filled)."""

        def floats(field: str) -> torch.Tensor:
            return torch.tensor([getattr(request, field) for request in params], dtype=torch.float32)

        batch = len(params)
        output_counts = torch.zeros(batch, vocab_size, dtype=torch.int32)
        prompt_mask = torch.zeros(batch, vocab_size, dtype=torch.bool)
        for row in range(batch):
            output = torch.as_tensor(list(output_token_ids[row]), dtype=torch.long)
            output_counts[row].index_add_(0, output, torch.ones_like(output, dtype=torch.int32))
            prompt_mask[row, torch.as_tensor(list(prompt_token_ids[row]), dtype=torch.long)] = True
            prompt_mask[row, output] = True
        tensors = cls(
            temperature=floats("temperature"),
            top_k=torch.tensor([max(request.top_k, 0) for request in params], dtype=torch.int32),
            top_p=floats("top_p"),
            min_p=floats("min_p"),
            presence_penalty=floats("presence_penalty"),
            frequency_penalty=floats("frequency_penalty"),
            repetition_penalty=floats("repetition_penalty"),
            seeds=torch.tensor([seed_to_int64(seed) for seed in seeds], dtype=torch.int64),
            step=torch.tensor(list(steps), dtype=torch.int64),
            output_counts=output_counts,
            prompt_mask=prompt_mask,
        )
        return tensors.to(device)

    def to(self, device: torch.device | str) -> SamplingTensors:
        fields = {field.name: getattr(self, field.name).to(device) for field in dataclasses.fields(self)}
        return SamplingTensors(**fields)


def seed_to_int64(seed: int) -> int:
    """A seed in [-2**63, 2**64) as the int64 with the same low 64 bits (what Philox is keyed by)."""
    seed &= 2**64 - 1
    return seed - 2**64 if seed >= 2**63 else seed


def update_token_counts(tensors: SamplingTensors, token_ids: torch.Tensor) -> None:
    """In place, on the device: output_counts[b, t] += 1 and prompt_mask[b, t] = True for t = token_ids[b]."""
    index = token_ids.to(torch.int64).unsqueeze(1)  # [B, 1]
    tensors.output_counts.scatter_add_(1, index, torch.ones_like(index, dtype=tensors.output_counts.dtype))
    tensors.prompt_mask.scatter_(1, index, True)


def top_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of the RAW logits [B, V]: (sampled token's [B], top-k ids [B, k], their logprobs [B, k])."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token_logprob = logprobs.gather(1, token_ids.to(torch.int64).unsqueeze(1)).squeeze(1)
    top_values, top_ids = logprobs.topk(k, dim=-1)  # best first
    return token_logprob, top_ids, top_values


# --- the torch reference ----------------------------------------------------------------------------------

_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a * b) >> 32 and (a * b) mod 2**32 for a constant a < 2**32 and int64 b in [0, 2**32), in int64."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    high_part, low_part = a * b_hi, a * b_lo  # each < 2**48
    hi = (high_part + (low_part >> 16)) >> 16
    lo = (((high_part & 0xFFFF) << 16) + low_part) & _MASK32
    return hi, lo


def philox_uniform_reference(seeds: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The kernel's noise: U(0, 1) [B, V] fp32 from Philox-4x32-10, key = seed, counter = (index, step, 0)."""
    device = seeds.device
    seeds, step = seeds.to(torch.int64).unsqueeze(1), step.to(torch.int64).unsqueeze(1)  # [B, 1]
    c0 = torch.arange(vocab_size, dtype=torch.int64, device=device).unsqueeze(0).expand(len(seeds), -1)
    c1 = (step & _MASK32).expand_as(c0)
    c2 = ((step >> 32) & _MASK32).expand_as(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seeds & _MASK32, (seeds >> 32) & _MASK32
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _MASK32, (k1 + _PHILOX_KEY_B) & _MASK32
    # 23 random bits, centred in their cell: (2j + 1) / 2**24, never 0 or 1, exact in fp32.
    return ((c0 >> 9) * 2 + 1).to(torch.float32) * (1.0 / 2**24)


def apply_penalties_reference(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Repetition (HF/CTRL, over prompt + generated), then frequency and presence (OpenAI, generated)."""
    counts = tensors.output_counts.to(logits.dtype)
    seen = tensors.prompt_mask | (tensors.output_counts > 0)
    repetition = tensors.repetition_penalty.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - tensors.frequency_penalty.unsqueeze(1) * counts
    return logits - tensors.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)


def keep_mask_reference(scaled: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Which tokens top-k, top-p and min-p keep, given logits divided by the temperature: [B, V] bool."""
    vocab_size = scaled.shape[1]
    sorted_logits = scaled.sort(dim=-1, descending=True).values
    top_k = tensors.top_k.to(torch.int64)
    top_k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size).unsqueeze(1)
    kth_logit = sorted_logits.gather(1, top_k - 1)  # top-k keeps the ties of the k-th
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_logit, -math.inf)

    # top-p keeps a tie group when the mass strictly above it (within top-k) is below p: the smallest
    # prefix of groups whose mass reaches p. Rows with top_p == 1 keep everything.
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    positions = torch.arange(vocab_size, device=scaled.device).expand_as(sorted_logits)
    group_start = torch.ones_like(sorted_logits, dtype=torch.bool)
    group_start[:, 1:] = sorted_logits[:, 1:] != sorted_logits[:, :-1]
    first_of_group = torch.where(group_start, positions, 0).cummax(dim=-1).values
    top_p = tensors.top_p.unsqueeze(1)
    drop = (mass_before.gather(1, first_of_group) >= top_p) & (top_p < 1)
    num_kept = (~drop & (sorted_logits > -math.inf)).sum(dim=-1, keepdim=True).clamp_min(1)
    threshold = sorted_logits.gather(1, num_kept - 1)
    keep = (scaled >= threshold) & (scaled >= kth_logit)

    # min-p drops the tokens less likely than min_p times the best one, after top-k and top-p (as HF).
    probs = scaled.masked_fill(~keep, -math.inf).softmax(dim=-1)
    min_p = tensors.min_p.unsqueeze(1)
    return keep & ~(probs < min_p * probs.max(dim=-1, keepdim=True).values)


def race_scores_reference(scaled: torch.Tensor, uniform_noise: torch.Tensor) -> torch.Tensor:
    """log p - log E up to a per-row constant, E = -log(U): its argmax is argmax(p / E)."""
    scores = scaled - torch.log(-torch.log(uniform_noise))
    return torch.where(scaled == -math.inf, -math.inf, scores)


def sample_reference(
    logits: torch.Tensor, tensors: SamplingTensors, uniform_noise: torch.Tensor | None = None
) -> torch.Tensor:
    """The next token of each row [B] int64 from logits [B, V]; uniform_noise [B, V] replaces the draws."""
    logits = apply_penalties_reference(logits.float(), tensors)
    greedy = tensors.temperature == 0
    greedy_ids = logits.argmax(dim=-1)
    temperature = torch.where(greedy, 1.0, tensors.temperature).unsqueeze(1)
    scaled = logits / temperature
    if uniform_noise is None:
        uniform_noise = philox_uniform_reference(tensors.seeds, tensors.step, logits.shape[1])
    scores = race_scores_reference(scaled, uniform_noise.float())
    scores = scores.masked_fill(~keep_mask_reference(scaled, tensors), -math.inf)
    return torch.where(greedy, greedy_ids, scores.argmax(dim=-1))


# --- the Triton kernels -----------------------------------------------------------------------------------
#
# Pass 1, grid (B, num_chunks): each program streams a chunk of its row's vocab once: penalties,
# temperature, noise, and the race winner of the chunk (the penalized argmax for greedy rows). Rows
# that filter (top-k / top-p / min-p) also store their scaled logits in the workspace and the chunk max.
# Pass 2, grid (B,): a row that does not filter takes the best of its chunks' winners and is done. A row
# that filters finds its thresholds without sorting: the k-th largest logit and the top-p cut are each
# found by a radix search over the logits' order-preserving int32 keys, four bits per pass over the
# workspace row (which the L2 still holds), counting (top-k) or summing probability mass (top-p) above
# 16 pivots at once; then one more pass runs the race over the tokens kept.

_INT32_MIN = -(2**31)
# Pass 1: 1024 fp32 = 8 per thread with 4 warps (two 16-byte loads). Small blocks in the interpreter so
# that the tests' small vocabularies still span several blocks and chunks.
_STREAM_BLOCK = 128 if INTERPRET else 1024
_STREAM_WARPS = 4
# Pass 2: [16 pivots, BLOCK] tiles.
_SEARCH_BLOCK = 256 if INTERPRET else 1024
_SEARCH_WARPS = 8
# The interpreter pays per operation, not per element: fewer, wider passes there.
_RADIX_BITS = 8 if INTERPRET else 4


@triton.jit
def _uniform_noise(seed, step, offsets):
    """U(0, 1) for vocab indices `offsets`: Philox-4x32-10, key = seed (int64), counter = (index, step, 0)."""
    c0 = offsets.to(tl.uint32)
    zero = c0 * 0
    c1 = zero + (step & 0xFFFFFFFF).to(tl.uint32)
    c2 = zero + ((step >> 32) & 0xFFFFFFFF).to(tl.uint32)
    random, _, _, _ = tl.philox(seed, c0, c1, c2, zero)
    return ((random >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)


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
def _sample_stream_kernel(
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
    step_ptr,
    work_ptr,  # [B, V] fp32: penalized logits / temperature, written for rows that filter
    work_stride,
    part_score_ptr,  # [B, num_chunks] fp32: each chunk's best race score
    part_index_ptr,  # [B, num_chunks] int32: and its token
    part_max_ptr,  # [B, num_chunks] fp32: each chunk's largest scaled logit (rows that filter)
    vocab_size,
    num_chunks,
    chunk_size,  # a multiple of BLOCK
    HAS_NOISE: tl.constexpr,
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
    step = tl.load(step_ptr + row)
    greedy, has_top_k, filtered = _row_flags(temperature, top_k, top_p, min_p, vocab_size)
    penalized = (repetition != 1.0) | (frequency != 0.0) | (presence != 0.0)

    lanes = tl.arange(0, BLOCK)
    # Per lane: the best score so far and the lowest index reaching it (vocab_size = none yet).
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32) + vocab_size
    chunk_max = tl.full([BLOCK], float("-inf"), tl.float32)
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
            if HAS_NOISE:
                uniform = tl.load(noise_ptr + row64 * noise_stride + offsets, mask=in_vocab, other=0.5)
            else:
                uniform = _uniform_noise(seed, step, offsets)
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
def _sample_finish_kernel(
    work_ptr,
    work_stride,
    noise_ptr,
    noise_stride,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seeds_ptr,
    step_ptr,
    part_score_ptr,
    part_index_ptr,
    part_max_ptr,
    out_ptr,  # [B] int64
    vocab_size,
    num_chunks,
    HAS_NOISE: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
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
    if filtered:
        row_max = tl.max(tl.load(part_max_ptr + part, mask=in_row, other=float("-inf")), axis=0)
        work_row_ptr = work_ptr + row64 * work_stride
        floor_key = top_k * 0 - 2147483647 - 1  # INT32_MIN: keep everything
        if has_top_k:
            floor_key = _threshold_key(
                work_row_ptr, vocab_size, floor_key, row_max, top_k.to(tl.float32), False, RADIX_BITS, BLOCK
            )
        if top_p < 1.0:
            floor_key = _threshold_key(
                work_row_ptr, vocab_size, floor_key, row_max, top_p, True, RADIX_BITS, BLOCK
            )
        # The race over the tokens kept; min_p == 0 keeps all (exp >= 0).
        seed = tl.load(seeds_ptr + row)
        step = tl.load(step_ptr + row)
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
                uniform = _uniform_noise(seed, step, offsets)
            score = tl.where(keep, _race_score(scaled, uniform), float("-inf"))
            take = in_vocab & ((score > best) | (best_index == vocab_size))
            best = tl.where(take, score, best)
            best_index = tl.where(take, offsets, best_index)
        top_score = tl.max(best, axis=0)
        token = tl.min(tl.where(best == top_score, best_index, vocab_size), axis=0)
    else:
        scores = tl.load(part_score_ptr + part, mask=in_row, other=float("-inf"))
        indices = tl.load(part_index_ptr + part, mask=in_row, other=vocab_size)
        top_score = tl.max(scores, axis=0)
        token = tl.min(tl.where(scores == top_score, indices, vocab_size), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))


@dataclasses.dataclass
class SamplingWorkspace:
    """Scratch for sample_triton, allocated once for up to max_batch rows (a CUDA graph reuses it)."""

    work: torch.Tensor  # [max_batch, V] fp32
    part_score: torch.Tensor  # [max_batch * max_chunks] fp32
    part_index: torch.Tensor  # [max_batch * max_chunks] int32
    part_max: torch.Tensor  # [max_batch * max_chunks] fp32

    @classmethod
    def allocate(cls, max_batch: int, vocab_size: int, device: torch.device | str) -> SamplingWorkspace:
        parts = max_batch * triton.cdiv(vocab_size, _STREAM_BLOCK)  # enough for any batch up to max_batch
        return cls(
            work=torch.empty(max_batch, vocab_size, dtype=torch.float32, device=device),
            part_score=torch.empty(parts, dtype=torch.float32, device=device),
            part_index=torch.empty(parts, dtype=torch.int32, device=device),
            part_max=torch.empty(parts, dtype=torch.float32, device=device),
        )


def _chunking(batch: int, vocab_size: int, device: torch.device) -> tuple[int, int]:
    """(chunk_size, num_chunks) for pass 1: about two programs per SM over the whole batch."""
    sms = num_sms(device.index or 0) if device.type == "cuda" else 8
    num_blocks = triton.cdiv(vocab_size, _STREAM_BLOCK)
    num_chunks = min(num_blocks, max(1, triton.cdiv(2 * sms, batch)))
    chunk_size = triton.cdiv(num_blocks, num_chunks) * _STREAM_BLOCK
    return chunk_size, triton.cdiv(vocab_size, chunk_size)


def sample_triton(
    logits: torch.Tensor,
    tensors: SamplingTensors,
    uniform_noise: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    workspace: SamplingWorkspace | None = None,
) -> torch.Tensor:
    """As sample_reference, in two launches; allocates nothing when out [B] int64 and workspace are given."""
    batch, vocab_size = logits.shape
    device = logits.device
    assert (
        logits.stride(1) == 1 and tensors.output_counts.stride(1) == 1 and tensors.prompt_mask.stride(1) == 1
    )
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=device)
    if batch == 0:
        return out
    if workspace is None:
        workspace = SamplingWorkspace.allocate(batch, vocab_size, device)
    assert workspace.work.shape[0] >= batch and workspace.work.shape[1] == vocab_size
    chunk_size, num_chunks = _chunking(batch, vocab_size, device)
    has_noise = uniform_noise is not None
    noise = uniform_noise if has_noise else logits  # a placeholder pointer, never read
    assert noise.stride(1) == 1
    prompt_mask = tensors.prompt_mask.view(torch.uint8)
    _sample_stream_kernel[(batch, num_chunks)](
        logits,
        logits.stride(0),
        tensors.output_counts,
        tensors.output_counts.stride(0),
        prompt_mask,
        prompt_mask.stride(0),
        noise,
        noise.stride(0),
        tensors.temperature,
        tensors.top_k,
        tensors.top_p,
        tensors.min_p,
        tensors.presence_penalty,
        tensors.frequency_penalty,
        tensors.repetition_penalty,
        tensors.seeds,
        tensors.step,
        workspace.work,
        workspace.work.stride(0),
        workspace.part_score,
        workspace.part_index,
        workspace.part_max,
        vocab_size,
        num_chunks,
        chunk_size,
        HAS_NOISE=has_noise,
        BLOCK=_STREAM_BLOCK,
        num_warps=_STREAM_WARPS,
        enable_fp_fusion=False,  # logit - penalty * count rounded twice, as torch does
    )
    _sample_finish_kernel[(batch,)](
        workspace.work,
        workspace.work.stride(0),
        noise,
        noise.stride(0),
        tensors.temperature,
        tensors.top_k,
        tensors.top_p,
        tensors.min_p,
        tensors.seeds,
        tensors.step,
        workspace.part_score,
        workspace.part_index,
        workspace.part_max,
        out,
        vocab_size,
        num_chunks,
        HAS_NOISE=has_noise,
        CHUNKS_POW2=triton.next_power_of_2(num_chunks),
        RADIX_BITS=_RADIX_BITS,
        BLOCK=_SEARCH_BLOCK,
        num_warps=_SEARCH_WARPS,
    )
    return out
