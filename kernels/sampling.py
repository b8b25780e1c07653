"""Sampling: penalties, greedy, temperature, top-k, top-p, min-p and the exponential race, as a torch
reference (the CPU's sampler) and the launches of its Triton kernels (a GPU's: kernels/sampling_triton.py
has their plan).

Every sampling parameter is held per row in a tensor (SamplingTensors), so a decode step's sampling is
captured in its CUDA graph: no host sync, no shape that depends on the data. Order: repetition penalty ->
frequency/presence penalties -> greedy argmax when temperature == 0 -> temperature -> top-k -> top-p ->
min-p -> argmax(p / E) with E ~ Exponential(1), run in log space as argmax(logit / T - log(E)).

Noise: E = -log(U), U from Philox-4x32-10 keyed by the row's seed, with counter (vocab index, position,
stream): position is the drawn token's index in its sequence, stream TOKEN_STREAM for the race and
ACCEPT_STREAM for sampled verification's draft-acceptance uniforms. philox_uniform_reference computes
the kernels' bits, so the same logits, seed and position give the same token on the CPU and on a GPU,
whatever shares the batch.

Ties: every argmax picks the lowest index (as torch.argmax does); top-k keeps every token tied with the
k-th; top-p keeps or drops a group of tied logits as a whole, decided by the mass strictly above them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy
import torch
import triton
from tileinfer.kernels import sampling_finish, sampling_search, sampling_stream, sampling_triton
from tileinfer.kernels.triton_common import num_sms

TOKEN_STREAM = 0  # the race's noise
ACCEPT_STREAM = 1  # sampled verification's acceptance uniforms (vocab index 0 of each draft's position)


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
    positions: torch.Tensor  # [B] int64: the index in its sequence of the token drawn
    output_counts: torch.Tensor  # [B, V] int32: how often each token was generated so far
    prompt_mask: torch.Tensor  # [B, V] bool: tokens of the prompt or generated (repetition penalty)

    @classmethod
    def from_params(
        cls,
        params: Sequence,  # tileinfer.engine.sampling.params.SamplingParams
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        positions: Sequence[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        """Build the tensors (tests, eager steps, and the runner when a slot is (re)filled). The [B, V]
        counts and mask are zeroed on `device` and only the given tokens are sent there: built on the
        host, 256 rows of a 152k vocabulary were a 194 MB copy per step."""

        def floats(field: str) -> torch.Tensor:
            return torch.tensor([getattr(request, field) for request in params], dtype=torch.float32)

        batch = len(params)
        output_rows = [row for row in range(batch) for _ in output_token_ids[row]]
        output_ids = [token for row in range(batch) for token in output_token_ids[row]]
        seen_rows = output_rows + [row for row in range(batch) for _ in prompt_token_ids[row]]
        seen_ids = output_ids + [token for row in range(batch) for token in prompt_token_ids[row]]
        output_counts = torch.zeros(batch, vocab_size, dtype=torch.int32, device=device)
        prompt_mask = torch.zeros(batch, vocab_size, dtype=torch.bool, device=device)
        if output_ids:
            index = torch.tensor([output_rows, output_ids], dtype=torch.long).to(device)
            ones = torch.ones(len(output_ids), dtype=torch.int32, device=device)
            output_counts.index_put_((index[0], index[1]), ones, accumulate=True)
        if seen_ids:
            index = torch.tensor([seen_rows, seen_ids], dtype=torch.long).to(device)
            prompt_mask[index[0], index[1]] = True
        tensors = cls(
            temperature=floats("temperature"),
            top_k=torch.tensor([max(request.top_k, 0) for request in params], dtype=torch.int32),
            top_p=floats("top_p"),
            min_p=floats("min_p"),
            presence_penalty=floats("presence_penalty"),
            frequency_penalty=floats("frequency_penalty"),
            repetition_penalty=floats("repetition_penalty"),
            seeds=torch.tensor([seed_to_int64(seed) for seed in seeds], dtype=torch.int64),
            positions=torch.tensor(list(positions), dtype=torch.int64),
            output_counts=output_counts,
            prompt_mask=prompt_mask,
        )
        return tensors.to(device)  # the per-row fields; the counts and the mask are there already

    def to(self, device: torch.device | str) -> SamplingTensors:
        fields = {field.name: getattr(self, field.name).to(device) for field in dataclasses.fields(self)}
        return SamplingTensors(**fields)


def seed_to_int64(seed: int) -> int:
    """A seed in [-2**63, 2**64) as the int64 with the same low 64 bits (what Philox is keyed by)."""
    seed &= 2**64 - 1
    return seed - 2**64 if seed >= 2**63 else seed


def top_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of the RAW logits [B, V]: (sampled token's [B], top-k ids [B, k], their logprobs [B, k])."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token_logprob = logprobs.gather(1, token_ids.to(torch.int64).unsqueeze(1)).squeeze(1)
    top_values, top_ids = logprobs.topk(k, dim=-1)  # best first
    return token_logprob, top_ids, top_values


# --- the torch reference ----------------------------------------------------------------------------------

_PHILOX_ROUND_A = numpy.uint64(0xD2511F53)
_PHILOX_ROUND_B = numpy.uint64(0xCD9E8D57)
_PHILOX_KEY_A = numpy.uint64(0x9E3779B9)
_PHILOX_KEY_B = numpy.uint64(0xBB67AE85)
_MASK32 = numpy.uint64(0xFFFFFFFF)
_SHIFT32 = numpy.uint64(32)


def philox_uniform_reference(
    seeds: torch.Tensor, positions: torch.Tensor, width: int, stream: int = TOKEN_STREAM
) -> torch.Tensor:
    """The kernels' noise, U(0, 1) [B, width] fp32 at vocab indices 0 .. width - 1: Philox-4x32-10 (Triton's
    tl.philox), key = seed (low, high 32 bits), counter = (index, position low, position high, stream).
    Exact integer arithmetic in numpy uint64 (a 32 x 32-bit product fits), on the host."""

    def words(values: torch.Tensor) -> numpy.ndarray:  # int64 -> their bits as uint64, [B, 1]
        return values.cpu().to(torch.int64).numpy().view(numpy.uint64)[:, None]

    seeds_bits, position_bits = words(seeds), words(positions)
    c0 = numpy.broadcast_to(numpy.arange(width, dtype=numpy.uint64), (len(seeds_bits), width))
    c1, c2 = position_bits & _MASK32, position_bits >> _SHIFT32
    c3 = numpy.full_like(seeds_bits, stream)
    k0, k1 = seeds_bits & _MASK32, seeds_bits >> _SHIFT32
    for _ in range(10):
        product_b, product_a = _PHILOX_ROUND_B * c2, _PHILOX_ROUND_A * c0
        c0, c1 = (product_b >> _SHIFT32) ^ c1 ^ k0, product_b & _MASK32
        c2, c3 = (product_a >> _SHIFT32) ^ c3 ^ k1, product_a & _MASK32
        k0, k1 = (k0 + _PHILOX_KEY_A) & _MASK32, (k1 + _PHILOX_KEY_B) & _MASK32
    # 23 random bits, centred in their cell: (2j + 1) / 2**24, never 0 or 1, exact in fp32.
    uniform = ((c0 >> numpy.uint64(9)) * numpy.uint64(2) + numpy.uint64(1)).astype(numpy.float32) / 2**24
    return torch.from_numpy(uniform).to(seeds.device)


def apply_penalties_reference(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Repetition (HF/CTRL, over prompt + generated), then frequency and presence (OpenAI, generated)."""
    counts = tensors.output_counts.to(logits.dtype)
    seen = tensors.prompt_mask | (tensors.output_counts > 0)
    repetition = tensors.repetition_penalty.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - tensors.frequency_penalty.unsqueeze(1) * counts
    return logits - tensors.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)


def _filters(tensors: SamplingTensors, vocab_size: int) -> bool:
    """Whether any row filters (top-k, top-p or min-p): the sort costs more than the rest on a CPU."""
    top_k = tensors.top_k
    return bool(
        ((top_k > 0) & (top_k < vocab_size)).any() or (tensors.top_p < 1).any() or (tensors.min_p > 0).any()
    )


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


def _penalized_and_scaled(
    logits: torch.Tensor, tensors: SamplingTensors
) -> tuple[torch.Tensor, torch.Tensor]:
    """(penalized logits, penalized logits / temperature), [B, V] fp32; greedy rows are divided by 1."""
    logits = apply_penalties_reference(logits.float(), tensors)
    temperature = torch.where(tensors.temperature == 0, 1.0, tensors.temperature).unsqueeze(1)
    return logits, logits / temperature


def filtered_probs_reference(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """The distribution a sampled row draws from: softmax over the kept tokens, [B, V] fp32."""
    scaled = _penalized_and_scaled(logits, tensors)[1]
    if _filters(tensors, scaled.shape[1]):
        scaled = scaled.masked_fill(~keep_mask_reference(scaled, tensors), -math.inf)
    return scaled.softmax(dim=-1)


def sample_reference(
    logits: torch.Tensor, tensors: SamplingTensors, uniform_noise: torch.Tensor | None = None
) -> torch.Tensor:
    """The next token of each row [B] int64 from logits [B, V]; uniform_noise [B, V] replaces the draws."""
    logits, scaled = _penalized_and_scaled(logits, tensors)
    greedy = tensors.temperature == 0
    greedy_ids = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return greedy_ids
    if uniform_noise is None:  # the sampled rows' (the draws cost more than the rest on a CPU)
        uniform_noise = torch.full_like(scaled, 0.5)
        rows = (~greedy).nonzero()[:, 0]
        uniform_noise[rows] = philox_uniform_reference(
            tensors.seeds[rows], tensors.positions[rows], logits.shape[1]
        )
    scores = race_scores_reference(scaled, uniform_noise.float())
    if _filters(tensors, logits.shape[1]):
        scores = scores.masked_fill(~keep_mask_reference(scaled, tensors), -math.inf)
    return torch.where(greedy, greedy_ids, scores.argmax(dim=-1))


# --- the Triton launches ----------------------------------------------------------------------------------


@dataclasses.dataclass
class SamplingWorkspace:
    """Scratch for sample_triton, allocated once for up to max_batch rows (a CUDA graph reuses it)."""

    work: torch.Tensor  # [max_batch, V] fp32
    part_score: torch.Tensor  # [max_batch * max_chunks] fp32
    part_index: torch.Tensor  # [max_batch * max_chunks] int32
    part_max: torch.Tensor  # [max_batch * max_chunks] fp32
    part_min: torch.Tensor  # [max_batch * max_chunks] fp32
    hist_count: torch.Tensor  # [max_batch * levels * bins] int32
    hist_mass: torch.Tensor  # [max_batch * levels * bins] int64
    state: torch.Tensor  # [max_batch * (levels + 1) * fields] int64
    final: torch.Tensor  # [max_batch * fields] int64
    candidates: torch.Tensor  # [max_batch * CANDIDATES] int64
    candidate_count: torch.Tensor  # [max_batch] int32

    @classmethod
    def allocate(cls, max_batch: int, vocab_size: int, device: torch.device | str) -> SamplingWorkspace:
        parts = max_batch * triton.cdiv(
            vocab_size, sampling_triton.STREAM_BLOCK
        )  # enough for any batch up to max_batch
        levels = len(sampling_triton.LEVEL_SHIFTS)

        def empty(size: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(size, dtype=dtype, device=device)

        return cls(
            work=torch.empty(max_batch, vocab_size, dtype=torch.float32, device=device),
            part_score=empty(parts, torch.float32),
            part_index=empty(parts, torch.int32),
            part_max=empty(parts, torch.float32),
            part_min=empty(parts, torch.float32),
            hist_count=empty(max_batch * levels * sampling_triton.NUM_BINS, torch.int32),
            hist_mass=empty(max_batch * levels * sampling_triton.NUM_BINS, torch.int64),
            state=empty(max_batch * (levels + 1) * sampling_triton.STATE_FIELDS, torch.int64),
            final=empty(max_batch * sampling_triton.STATE_FIELDS, torch.int64),
            candidates=empty(max_batch * sampling_triton.CANDIDATES, torch.int64),
            candidate_count=empty(max_batch, torch.int32),
        )


def _chunking(batch: int, vocab_size: int, device: torch.device) -> tuple[int, int]:
    """(chunk_size, num_chunks) for pass 1: about two programs per SM over the whole batch."""
    sms = num_sms(device.index or 0) if device.type == "cuda" else 8
    num_blocks = triton.cdiv(vocab_size, sampling_triton.STREAM_BLOCK)
    num_chunks = min(num_blocks, max(1, triton.cdiv(2 * sms, batch)))
    chunk_size = triton.cdiv(num_blocks, num_chunks) * sampling_triton.STREAM_BLOCK
    return chunk_size, triton.cdiv(vocab_size, chunk_size)


def _chunks_pow2(vocab_size: int, device: torch.device) -> int:
    """CHUNKS_POW2 for every batch: the power of two above the most chunks a row takes (one row's). One
    value for all batch sizes keeps the kernels at one compiled variant each: a value per batch size
    compiled the bracket and finish kernels once per power of two, 61 % of a cold engine build."""
    return triton.next_power_of_2(_chunking(1, vocab_size, device)[1])


@dataclasses.dataclass
class _KernelArguments:
    """The arguments the sampling kernels share, named as their parameters: each launch passes its kernel's
    by keyword (for_kernel)."""

    logits_ptr: torch.Tensor
    logits_stride: int
    counts_ptr: torch.Tensor
    counts_stride: int
    seen_ptr: torch.Tensor
    seen_stride: int
    noise_ptr: torch.Tensor
    noise_stride: int
    temperature_ptr: torch.Tensor
    top_k_ptr: torch.Tensor
    top_p_ptr: torch.Tensor
    min_p_ptr: torch.Tensor
    presence_ptr: torch.Tensor
    frequency_ptr: torch.Tensor
    repetition_ptr: torch.Tensor
    seeds_ptr: torch.Tensor
    positions_ptr: torch.Tensor
    work_ptr: torch.Tensor
    work_stride: int
    part_score_ptr: torch.Tensor
    part_index_ptr: torch.Tensor
    part_max_ptr: torch.Tensor
    part_min_ptr: torch.Tensor
    hist_count_ptr: torch.Tensor
    hist_mass_ptr: torch.Tensor
    state_ptr: torch.Tensor
    final_ptr: torch.Tensor
    cand_ptr: torch.Tensor
    cand_count_ptr: torch.Tensor
    out_ptr: torch.Tensor
    vocab_size: int
    num_chunks: int
    chunk_size: int
    HAS_NOISE: bool
    CHUNKS_POW2: int
    LEVELS: int

    def for_kernel(self, kernel: triton.JITFunction, **own: object) -> dict[str, object]:
        """Every parameter of `kernel` by name: from `own`, else this structure, else sampling_triton's
        constant of that name (tiles, search states: read at each launch, so that tests can shrink them)."""
        values = {**vars(self), **own}
        return {
            name: values[name] if name in values else getattr(sampling_triton, name)
            for name in kernel.arg_names
        }


def sample_triton(
    logits: torch.Tensor,
    tensors: SamplingTensors,
    uniform_noise: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    workspace: SamplingWorkspace | None = None,
) -> torch.Tensor:
    """As sample_reference, in six launches (stream, four search passes, finish) whatever the rows need;
    allocates nothing when out [B] int64 and workspace are given."""
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
    assert workspace.candidates.numel() >= batch * sampling_triton.CANDIDATES
    chunk_size, num_chunks = _chunking(batch, vocab_size, device)
    levels = len(sampling_triton.LEVEL_SHIFTS)
    noise = uniform_noise if uniform_noise is not None else logits  # a placeholder pointer, never read
    assert noise.stride(1) == 1
    prompt_mask = tensors.prompt_mask.view(torch.uint8)
    args = _KernelArguments(
        logits_ptr=logits, logits_stride=logits.stride(0),
        counts_ptr=tensors.output_counts, counts_stride=tensors.output_counts.stride(0),
        seen_ptr=prompt_mask, seen_stride=prompt_mask.stride(0),
        noise_ptr=noise, noise_stride=noise.stride(0),
        temperature_ptr=tensors.temperature, top_k_ptr=tensors.top_k, top_p_ptr=tensors.top_p,
        min_p_ptr=tensors.min_p, presence_ptr=tensors.presence_penalty,
        frequency_ptr=tensors.frequency_penalty, repetition_ptr=tensors.repetition_penalty,
        seeds_ptr=tensors.seeds, positions_ptr=tensors.positions,
        work_ptr=workspace.work, work_stride=workspace.work.stride(0),
        part_score_ptr=workspace.part_score, part_index_ptr=workspace.part_index,
        part_max_ptr=workspace.part_max, part_min_ptr=workspace.part_min,
        hist_count_ptr=workspace.hist_count, hist_mass_ptr=workspace.hist_mass,
        state_ptr=workspace.state, final_ptr=workspace.final,
        cand_ptr=workspace.candidates, cand_count_ptr=workspace.candidate_count, out_ptr=out,
        vocab_size=vocab_size, num_chunks=num_chunks, chunk_size=chunk_size,
        HAS_NOISE=uniform_noise is not None, CHUNKS_POW2=_chunks_pow2(vocab_size, device), LEVELS=levels,
    )  # fmt: skip
    stream_kernel = sampling_stream.sample_stream_kernel
    stream_kernel[(batch, num_chunks)](
        **args.for_kernel(stream_kernel, BLOCK=sampling_triton.STREAM_BLOCK),
        num_warps=sampling_triton.STREAM_WARPS,
        enable_fp_fusion=False,  # logit - penalty * count rounded twice, as torch does
    )
    shifts = sampling_triton.LEVEL_SHIFTS
    bracket_kernel = sampling_search.sample_bracket_kernel
    for level in range(1, levels + 2):
        bracket_kernel[(batch, num_chunks)](
            **args.for_kernel(
                bracket_kernel,
                LEVEL=level,
                PREV_SHIFT=shifts[level - 2] if level > 1 else 0,
                SHIFT=shifts[level - 1] if level <= levels else 0,
                BLOCK=sampling_triton.BRACKET_BLOCK,
            ),
            num_warps=sampling_triton.BRACKET_WARPS,
            enable_fp_fusion=False,  # the buckets and masses are recomputed bit for bit in every pass
        )
    finish_kernel = sampling_finish.sample_finish_kernel
    finish_kernel[(batch,)](
        **args.for_kernel(finish_kernel, BLOCK=sampling_triton.SEARCH_BLOCK),
        num_warps=sampling_triton.FINISH_WARPS,
        enable_fp_fusion=False,
    )
    return out


_UNIFORM_BLOCK = 1024


def philox_uniform_triton(
    seeds: torch.Tensor, positions: torch.Tensor, width: int, stream: int = TOKEN_STREAM
) -> torch.Tensor:
    """philox_uniform_reference's bits from a Triton kernel: U(0, 1) [B, width] fp32 on the seeds' device."""
    out = torch.empty(len(seeds), width, dtype=torch.float32, device=seeds.device)
    if out.numel() > 0:
        grid = (len(seeds), triton.cdiv(width, _UNIFORM_BLOCK))
        sampling_triton.philox_uniform_kernel[grid](
            seeds_ptr=seeds,
            positions_ptr=positions,
            out_ptr=out,
            stream=stream,
            width=width,
            BLOCK=_UNIFORM_BLOCK,
        )
    return out
