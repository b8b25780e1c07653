"""Sampling (kernels/sampling.py): the Triton sampler against its torch reference, their Philox noise bit
for bit, and the engine's sampler on the CPU (the reference) against the kernels (the GPU's) token for
token: the same logits, seed and position give the same token."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from tileinfer.engine.graphs import capture_graph
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.sampling.sampler import Sampler
from tileinfer.engine.sequence import Sequence
from tileinfer.kernels import sampling_triton
from tileinfer.kernels.sampling import (
    ACCEPT_STREAM,
    TOKEN_STREAM,
    SamplingTensors,
    SamplingWorkspace,
    filtered_probs_reference,
    philox_uniform_reference,
    philox_uniform_triton,
    sample_reference,
    sample_triton,
    top_logprobs,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_params(generator: torch.Generator, vocab_size: int) -> SamplingParams:
    """One row's parameters: greedy, plain temperature, or any mix of filters, with or without penalties."""

    def uniform(low: float, high: float) -> float:
        return low + (high - low) * torch.rand((), generator=generator).item()

    def coin(p: float = 0.5) -> bool:
        return torch.rand((), generator=generator).item() < p

    kind = torch.randint(0, 4, (), generator=generator).item()
    params = SamplingParams(temperature=0.0 if kind == 0 else uniform(0.3, 2.0))
    if kind >= 2:  # filters
        if coin():
            params.top_k = int(torch.randint(1, vocab_size + 5, (), generator=generator))
        if coin():
            params.top_p = uniform(0.05, 1.0)
        if coin(0.4):
            params.min_p = uniform(0.0, 0.5)
    if coin(0.6):
        params.repetition_penalty = uniform(0.7, 1.6)
        params.frequency_penalty = uniform(-1.0, 1.0)
        params.presence_penalty = uniform(-1.0, 1.0)
    return params


def random_history(generator: torch.Generator, logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """A prompt and an output drawn (with repeats) from the row's most likely tokens, so that the penalties
    change which tokens lead."""
    likely = logits.topk(min(16, len(logits))).indices
    prompt = likely[
        torch.randint(
            0, len(likely), (int(torch.randint(0, 8, (), generator=generator)),), generator=generator
        )
    ]
    output = likely[
        torch.randint(
            0, len(likely), (int(torch.randint(0, 12, (), generator=generator)),), generator=generator
        )
    ]
    return prompt.tolist(), output.tolist()


def random_batch(
    seed: int, batch: int, vocab_size: int, scale: float = 3.0
) -> tuple[torch.Tensor, SamplingTensors, list[SamplingParams], list[list[int]], list[list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab_size, generator=generator) * scale
    params = [random_params(generator, vocab_size) for _ in range(batch)]
    histories = [random_history(generator, row) for row in logits]
    prompts, outputs = [h[0] for h in histories], [h[1] for h in histories]
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=generator).tolist()
    positions = torch.randint(0, 2**40, (batch,), generator=generator).tolist()
    tensors = SamplingTensors.from_params(params, prompts, outputs, seeds, positions, vocab_size, DEVICE)
    return logits.to(DEVICE), tensors, params, prompts, outputs


def check_against_reference(
    logits: torch.Tensor,
    tensors: SamplingTensors,
    uniform_noise: torch.Tensor | None,
    return_workspace: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, SamplingWorkspace]:
    """sample_triton, with a poisoned output and workspace, equals sample_reference exactly."""
    batch, vocab_size = logits.shape
    out = torch.full((batch,), -1, dtype=torch.int64, device=logits.device)
    workspace = SamplingWorkspace.allocate(batch + 1, vocab_size, logits.device)
    for buffer in (workspace.work, workspace.part_score, workspace.part_max, workspace.part_min):
        buffer.fill_(math.nan)
    # The search scratch must be reset by the kernels every step: start from garbage.
    for buffer in (workspace.part_index, workspace.hist_count, workspace.candidate_count):
        buffer.fill_(-7)
    for buffer in (workspace.hist_mass, workspace.state, workspace.final, workspace.candidates):
        buffer.fill_(123456789)
    expected = sample_reference(logits, tensors, uniform_noise)
    got = sample_triton(logits, tensors, uniform_noise, out=out, workspace=workspace)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.cpu(), expected.cpu()), (got, expected)
    return (got, workspace) if return_workspace else got


# --- the kernel against the reference -----------------------------------------------------------------


@pytest.mark.parametrize("batch, vocab_size", [(3, 50), (5, 1000), (4, 257)])
@pytest.mark.parametrize("bf16_logits", [False, True], ids=["fp32", "bf16-logits"])
def test_matches_reference_with_the_same_noise(batch: int, vocab_size: int, bf16_logits: bool) -> None:
    for trial in range(2):
        logits, tensors, *_ = random_batch(1000 * vocab_size + 10 * trial + bf16_logits, batch, vocab_size)
        if bf16_logits:  # the model's bf16 logits, widened: many exact ties
            logits = logits.to(torch.bfloat16).float()
        # Each row four times, with different noise: more draws to tell a wrong filter or penalty apart.
        rows = list(range(batch)) * 4
        noise = torch.rand(len(rows), vocab_size, generator=torch.Generator().manual_seed(trial)).to(DEVICE)
        check_against_reference(logits[rows], _rows(tensors, rows), noise)


def test_matches_reference_with_its_own_noise() -> None:
    """Without uniform_noise both draw Philox noise from (seed, position): the same bits on every device."""
    logits, tensors, *_ = random_batch(7, batch=5, vocab_size=300)
    check_against_reference(logits, tensors, None)


@triton.jit
def _philox_probe_kernel(seeds_ptr, positions_ptr, out_ptr, width, stream, BLOCK: tl.constexpr):
    """Triton's own tl.philox at counter (index, position low, position high, stream), as the uniform."""
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    position = tl.load(positions_ptr + row)
    c0 = offsets.to(tl.uint32)
    zero = c0 * 0
    c1 = zero + (position & 0xFFFFFFFF).to(tl.uint32)
    c2 = zero + ((position >> 32) & 0xFFFFFFFF).to(tl.uint32)
    random, _, _, _ = tl.philox(tl.load(seeds_ptr + row), c0, c1, c2, zero + stream)
    uniform = ((random >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)
    tl.store(out_ptr + row * width + offsets, uniform, mask=offsets < width)


@triton.jit
def _race_noise_probe_kernel(seeds_ptr, positions_ptr, out_ptr, width, BLOCK: tl.constexpr):
    """The noise the sampling kernels race with."""
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    uniform = sampling_triton.token_noise(tl.load(seeds_ptr + row), tl.load(positions_ptr + row), offsets)
    tl.store(out_ptr + row * width + offsets, uniform, mask=offsets < width)


PROBE_SEEDS = [0, 1, -1, 2**63 - 1, -(2**63), 123456789012345]
PROBE_POSITIONS = [0, 5, 2**32 + 3, 7, 2**40, 1]


def test_reference_philox_is_tritons_philox() -> None:
    """philox_uniform_reference equals Triton's tl.philox (key = the seed's two halves, counter = (index,
    position, stream), ten rounds) for a few keys and counters in both streams, and so do the kernels'
    noise and philox_uniform_triton."""
    seeds = torch.tensor(PROBE_SEEDS, device=DEVICE)
    positions = torch.tensor(PROBE_POSITIONS, device=DEVICE)
    width = 100
    for stream in (TOKEN_STREAM, ACCEPT_STREAM):
        expected = philox_uniform_reference(seeds, positions, width, stream)
        got = torch.full((len(seeds), width), math.nan, device=DEVICE)
        _philox_probe_kernel[(len(seeds),)](seeds, positions, got, width, stream, BLOCK=128)
        assert torch.equal(got, expected), stream
        assert torch.equal(philox_uniform_triton(seeds, positions, width, stream), expected), stream
    race_noise = torch.full((len(seeds), width), math.nan, device=DEVICE)
    _race_noise_probe_kernel[(len(seeds),)](seeds, positions, race_noise, width, BLOCK=128)
    assert torch.equal(race_noise, philox_uniform_reference(seeds, positions, width, TOKEN_STREAM))
    # Random123's known answer for Philox-4x32-10, key 0 and counter 0: first word 0x6627e8d5.
    zero = torch.zeros(1, dtype=torch.int64)
    assert philox_uniform_reference(zero, zero, 1).item() == ((0x6627E8D5 >> 9) * 2 + 1) / 2**24


def test_philox_noise_is_uniform_and_every_counter_part_changes_it() -> None:
    seeds = torch.tensor(PROBE_SEEDS)
    positions = torch.tensor(PROBE_POSITIONS)
    vocab_size = 1000
    expected = philox_uniform_reference(seeds, positions, vocab_size)
    assert expected.min() > 0 and expected.max() < 1
    assert abs(expected.mean().item() - 0.5) < 0.03
    # The position, the seed and the stream each change every draw.
    row = expected[1]
    assert (row != philox_uniform_reference(seeds[1:2], positions[1:2] + 1, vocab_size)[0]).all()
    assert (row != philox_uniform_reference(seeds[1:2] + 1, positions[1:2], vocab_size)[0]).all()
    assert (row != philox_uniform_reference(seeds[1:2], positions[1:2], vocab_size, ACCEPT_STREAM)[0]).all()


def test_ties_pick_the_lowest_index_and_filters_keep_tied_groups() -> None:
    vocab_size = 60
    # Integer logits in a small range: every value occurs several times.
    generator = torch.Generator().manual_seed(3)
    logits = torch.randint(-3, 4, (6, vocab_size), generator=generator).float()
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=1.0, top_k=3),  # cuts through a tie group
        SamplingParams(temperature=0.5, top_p=0.3),
        SamplingParams(temperature=1.0, min_p=0.9),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.5, min_p=0.2),
    ]
    prompts = [[], [int(logits[1].argmax())], [], [], [], []]
    tensors = SamplingTensors.from_params(
        params, prompts, [[]] * 6, list(range(6)), [0] * 6, vocab_size, DEVICE
    )
    logits = logits.to(DEVICE)
    # Tied noise too: the race ties, and the lowest index must win.
    noise = torch.full((6, vocab_size), 0.5, device=DEVICE)
    got = check_against_reference(logits, tensors, noise).cpu()
    assert got[0] == logits[0].argmax().cpu()  # torch.argmax: the first of the maxima
    top = logits[2].max()
    assert got[2] == int((logits[2] == top).nonzero()[0])
    for trial in range(3):
        noise = torch.rand(6, vocab_size, generator=torch.Generator().manual_seed(trial)).to(DEVICE)
        check_against_reference(logits, tensors, noise)


def test_edge_rows() -> None:
    """top_k = 1 and top_k >= V, top_p tiny, min_p = 1, -inf logits, temperature near zero."""
    vocab_size = 40
    params = [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_k=vocab_size),
        SamplingParams(temperature=1.0, top_k=vocab_size + 100, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
        SamplingParams(temperature=1e-4),
        SamplingParams(temperature=2.0, top_k=7, top_p=0.99),
    ]
    batch = len(params)
    logits = torch.randn(batch, vocab_size, generator=torch.Generator().manual_seed(5))
    logits[:, 1::3] = -math.inf  # a masked vocabulary
    tensors = SamplingTensors.from_params(
        params, [[]] * batch, [[]] * batch, list(range(batch)), [9] * batch, vocab_size, DEVICE
    )
    logits = logits.to(DEVICE)
    for trial in range(2):
        noise = torch.rand(batch, vocab_size, generator=torch.Generator().manual_seed(trial)).to(DEVICE)
        got = check_against_reference(logits, tensors, noise).cpu()
        best = logits.argmax(dim=-1).cpu()
        assert got[0] == best[0] and got[2] == best[2] and got[3] == best[3]
        assert not torch.isinf(logits.cpu()[torch.arange(batch), got]).any()


def test_seeded_row_ignores_its_batch() -> None:
    vocab_size = 200
    logits, tensors, *_ = random_batch(11, batch=4, vocab_size=vocab_size)
    alone = sample_triton(logits[2:3], _rows(tensors, [2]))
    others = random_batch(12, batch=3, vocab_size=vocab_size)
    mixed_logits = torch.cat([others[0][:2], logits[2:3], others[0][2:]])
    mixed = _cat_rows([_rows(others[1], [0, 1]), _rows(tensors, [2]), _rows(others[1], [2])])
    together = sample_triton(mixed_logits, mixed)
    assert together[2] == alone[0]
    # A later position draws fresh noise: across positions a flat row does not repeat one token.
    flat = torch.zeros(1, vocab_size, device=DEVICE)
    row = _rows(tensors, [2])
    row.temperature.fill_(1.0)
    row.top_k.zero_()
    row.top_p.fill_(1.0)
    row.min_p.zero_()
    draws = set()
    for step in range(6):
        row.positions.fill_(step)
        draws.add(int(sample_triton(flat, row)[0]))
    assert len(draws) > 1


def _rows(tensors: SamplingTensors, rows: list[int]) -> SamplingTensors:
    index = torch.tensor(rows, device=tensors.temperature.device)
    return SamplingTensors(**{name: value.index_select(0, index) for name, value in vars(tensors).items()})


def _cat_rows(parts: list[SamplingTensors]) -> SamplingTensors:
    return SamplingTensors(**{name: torch.cat([vars(p)[name] for p in parts]) for name in vars(parts[0])})


# --- the CPU's sampler and the GPU's: the same tokens ----------------------------------------------------


def agreement_batch(vocab_size: int) -> tuple[torch.Tensor, list[Sequence]]:
    """Random logits and sequences of every kind (greedy, plain, filters, penalties; seeded, unseeded),
    with prompts and outputs of several lengths, so that the drawn positions differ."""
    generator = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(12, vocab_size, generator=generator) * 3
    seqs = []
    for row in range(12):
        params = random_params(generator, vocab_size)
        params.seed = None if row % 4 == 3 else 1000 + row
        prompt, output = random_history(generator, logits[row])
        seqs.append(Sequence(f"r{row}", prompt or [0], params, token_ids=(prompt or [0]) + output))
    return logits, seqs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_cpu_and_gpu_samplers_pick_the_same_tokens(device: str) -> None:
    """The engine's sampler on the CPU (the torch reference) and the Triton kernels, given identical logits,
    pick the same token for the same seed and position. On this machine the kernels run in Triton's
    interpreter (the poisoned workspace shows they ran); on a GPU the engine's Sampler runs them."""
    vocab_size = 700
    logits, seqs = agreement_batch(vocab_size)
    cpu_sampler = Sampler(vocab_size, torch.device("cpu"))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        on_cpu = cpu_sampler.sample(logits, seqs)
    assert len(set(on_cpu.tolist())) > 6
    if device == "cpu":
        workspace = SamplingWorkspace.allocate(len(seqs), vocab_size, "cpu")
        workspace.part_score.fill_(math.nan)
        on_kernel = sample_triton(logits, cpu_sampler.tensors(seqs), workspace=workspace)
        assert not workspace.part_score[: len(seqs)].isnan().any()
    else:
        gpu_sampler = Sampler(vocab_size, torch.device("cuda"))
        gpu_sampler.keys.update(cpu_sampler.keys)  # the unseeded requests' random keys
        on_kernel = gpu_sampler.sample(logits.cuda(), seqs).cpu()
    assert torch.equal(on_kernel, on_cpu), (on_kernel, on_cpu)


CHI_SQUARE_LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]


def chi_square_critical(degrees_of_freedom: int, z_score: float = 3.72) -> float:
    """Upper chi-square quantile (z = 3.72: p of about 1e-4) by the Wilson-Hilferty approximation."""
    k = degrees_of_freedom
    return k * (1 - 2 / (9 * k) + z_score * math.sqrt(2 / (9 * k))) ** 3


def assert_distribution(token_ids: torch.Tensor, params: SamplingParams) -> None:
    logits = torch.tensor([CHI_SQUARE_LOGITS])
    tensors = SamplingTensors.from_params([params], [[]], [[]], [0], [0], logits.shape[1])
    expected = filtered_probs_reference(logits, tensors)[0]
    counts = torch.bincount(token_ids.cpu(), minlength=len(CHI_SQUARE_LOGITS)).double()
    draws = len(token_ids)
    assert (counts[expected == 0] == 0).all(), (counts, expected)
    kept = expected > 0
    chi_square = ((counts[kept] - draws * expected[kept]) ** 2 / (draws * expected[kept])).sum().item()
    assert chi_square < chi_square_critical(int(kept.sum()) - 1), (counts, expected)


def _seeded_batch(params: SamplingParams, draws: int, position: int) -> tuple[torch.Tensor, SamplingTensors]:
    """One row per draw, each a request with its own seed, at a given position."""
    vocab_size = len(CHI_SQUARE_LOGITS)
    tensors = SamplingTensors.from_params(
        [params] * draws, [[]] * draws, [[]] * draws, range(draws), [position] * draws, vocab_size, DEVICE
    )
    return torch.tensor(CHI_SQUARE_LOGITS, device=DEVICE).expand(draws, -1).contiguous(), tensors


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.5, min_p=0.2),
        SamplingParams(temperature=1.3, top_k=6, top_p=0.9, min_p=0.1),
    ],
    ids=["top_k", "top_p", "min_p", "all"],
)
def test_philox_draws_follow_the_filtered_distribution(params: SamplingParams) -> None:
    """Over many seeds and positions, the draws (the reference's Philox noise, the kernel's bits) match
    softmax(filtered logits / T)."""
    token_ids = torch.cat([sample_reference(*_seeded_batch(params, 4000, position)) for position in range(5)])
    assert_distribution(token_ids, params)


def test_kernel_draws_follow_the_distribution() -> None:
    params = SamplingParams(temperature=1.2)
    logits, tensors = _seeded_batch(params, 400, position=3)
    assert_distribution(sample_triton(logits, tensors), params)


# --- logprobs --------------------------------------------------------------------------------------------


def test_top_logprobs_are_the_raw_log_softmax() -> None:
    logits = torch.randn(4, 77, generator=torch.Generator().manual_seed(2), dtype=torch.float64).float()
    token_ids = torch.tensor([0, 5, 76, 33])
    token_logprob, top_ids, top_values = top_logprobs(logits.to(DEVICE), token_ids.to(DEVICE), 5)
    expected = torch.log_softmax(logits.double(), dim=-1)
    assert torch.allclose(token_logprob.cpu().double(), expected[torch.arange(4), token_ids], atol=1e-5)
    assert torch.equal(top_ids.cpu(), expected.topk(5, dim=-1).indices)
    assert torch.allclose(top_values.cpu().double(), expected.topk(5, dim=-1).values, atol=1e-5)


# --- the GPU: real vocabularies, CUDA graphs -------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("vocab_size", [151936, 49152])
@pytest.mark.parametrize("batch", [1, 8])
def test_gpu_real_vocab_matches_reference(vocab_size: int, batch: int) -> None:
    for trial in range(4):
        logits, tensors, *_ = random_batch(trial * 31 + batch, batch, vocab_size, scale=4.0)
        logits = logits.to(torch.bfloat16).float()  # what a bf16 LM head produces
        if trial == 3:  # every row filters with all parameters
            tensors.temperature.fill_(0.9)
            tensors.top_k.fill_(50)
            tensors.top_p.fill_(0.9)
            tensors.min_p.fill_(0.05)
        noise = torch.rand(
            batch, vocab_size, device="cuda", generator=torch.Generator("cuda").manual_seed(trial)
        )
        check_against_reference(logits, tensors, noise)
        check_against_reference(logits, tensors, None)


@pytest.mark.gpu
def test_gpu_sampling_replays_in_a_cuda_graph() -> None:
    batch, vocab_size = 8, 151936
    logits, tensors, *_ = random_batch(5, batch, vocab_size, scale=4.0)
    out = torch.empty(batch, dtype=torch.int64, device="cuda")
    workspace = SamplingWorkspace.allocate(batch, vocab_size, "cuda")
    graph = capture_graph(lambda: sample_triton(logits, tensors, out=out, workspace=workspace), None)
    for step in range(3):
        tensors.positions.fill_(step)
        expected = sample_reference(logits, tensors)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


def test_four_bit_radix_search_as_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The slow exact path (a radix search in one program): the interpreter searches eight bits per pass,
    the GPU four. Both must find the same thresholds. One candidate forces every row (top-k > 1 with
    top-p) onto that path."""
    monkeypatch.setattr(sampling_triton, "RADIX_BITS", 4)
    monkeypatch.setattr(sampling_triton, "CANDIDATES", 1)
    logits, tensors, *_ = random_batch(21, batch=4, vocab_size=150)
    tensors.temperature.fill_(1.1)
    tensors.top_k.copy_(torch.tensor([5, 2, 40, 149]))
    tensors.top_p.copy_(torch.tensor([0.999, 0.7, 0.95, 0.2]))
    noise = torch.rand(4, 150, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    workspace = check_against_reference(logits, tensors, noise, return_workspace=True)[1]
    assert (search_statuses(workspace, 4) == sampling_triton.FALLBACK).all()


# --- the parallel threshold search: every path it can take ---------------------------------------------


def search_statuses(workspace: SamplingWorkspace, batch: int) -> torch.Tensor:
    """[batch, passes]: what each search pass did for each row (sampling_triton.SEARCH, COMPACT, ...)."""
    passes = len(sampling_triton.LEVEL_SHIFTS) + 1
    return workspace.state.view(-1, passes, sampling_triton.STATE_FIELDS)[:batch, :, 0].cpu()


def designed_logits(design: str, generator: torch.Generator, vocab_size: int) -> torch.Tensor:
    """One row of logits: plain, bf16-rounded (ties), integers (large tie groups), a tight cluster far from
    a few outliers (the search needs its finest levels), or partly masked."""
    row = torch.randn(vocab_size, generator=generator)
    if design == "normal":
        return row * 3.0
    if design == "bf16":
        return (row * 0.6).to(torch.bfloat16).float()
    if design == "integers":
        return torch.randint(-4, 3, (vocab_size,), generator=generator).float()
    if design == "cluster":
        row = 2.0 + row * 1e-3
        row[:3] = torch.tensor([40.0, -40.0, 39.0])
        return row
    assert design == "masked"
    row = row * 2.0
    row[torch.randperm(vocab_size, generator=generator)[: vocab_size // 2]] = -math.inf
    return row


# (temperature, top_k, top_p, min_p): top-k, top-p, both, min-p, with top_k near V and top_p tiny and 1.
FILTER_MIXES = [
    (1.0, 1, 1.0, 0.0),
    (0.7, 3, 1.0, 0.0),
    (1.3, 0, 0.9, 0.0),
    (1.0, 0, 1e-6, 0.0),
    (0.5, 0, 0.999, 0.1),
    (1.0, 0, 1.0, 0.2),
    (0.9, 5, 0.8, 0.0),
    (1.1, 2, 0.3, 0.05),
    (1.0, -2, 1.0, 0.0),  # V - 2
    (1.0, -1, 0.95, 0.0),  # V - 1
    (0.8, 0, 0.5, 0.0),
    (1.0, 40, 1.0, 0.0),
]


@pytest.mark.parametrize("candidates", [2, 64])
def test_search_paths_match_reference(monkeypatch: pytest.MonkeyPatch, candidates: int) -> None:
    """Every design of logits against every filter mix, in one batch with greedy and plain rows mixed in,
    with few and many candidates: compaction after one, two or three histogram levels, min-p alone, and
    the slow path; the tokens always equal the reference's."""
    monkeypatch.setattr(sampling_triton, "CANDIDATES", candidates)
    vocab_size = 241
    generator = torch.Generator().manual_seed(candidates)
    statuses = []
    # the crowded designs matter with few candidates; with many, two designs keep the suite's time
    designs = ["normal", "bf16", "integers", "cluster", "masked"] if candidates == 2 else ["normal", "masked"]
    for design in designs:
        params = [
            SamplingParams(
                temperature=temperature,
                top_k=top_k if top_k >= 0 else vocab_size + top_k,
                top_p=top_p,
                min_p=min_p,
            )
            for temperature, top_k, top_p, min_p in FILTER_MIXES
        ]
        params += [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
        batch = len(params)
        logits = torch.stack([designed_logits(design, generator, vocab_size) for _ in range(batch)])
        tensors = SamplingTensors.from_params(
            params, [[]] * batch, [[]] * batch, list(range(batch)), [1] * batch, vocab_size, DEVICE
        )
        logits = logits.to(DEVICE)
        noise = torch.rand(batch, vocab_size, generator=generator).to(DEVICE)
        check_against_reference(logits, tensors, noise)
        workspace = check_against_reference(logits, tensors, None, return_workspace=True)[1]
        statuses.append(search_statuses(workspace, batch)[: len(FILTER_MIXES)])
    statuses = torch.cat(statuses)
    compact, fallback = sampling_triton.COMPACT, sampling_triton.FALLBACK
    # Min-p alone compacts (nothing) in the first pass (index 0); the others in the pass after 1, 2 or 3
    # histogram levels (index 1, 2, 3), or give up on the slow path.
    assert (statuses[:, 0] == compact).any()
    compacted_in = {int(p) for row in statuses for p in (row == compact).nonzero()[:, 0]} - {0}
    assert 1 in compacted_in, statuses
    if candidates == 2:  # crowded brackets: every level, and the slow path
        assert {1, 2, 3} <= compacted_in and (statuses[:, -1] == fallback).any(), statuses
    if candidates == 64:  # top-k (small) with top-p: over the candidates
        both = torch.tensor([0 < k < 64 and p < 1 for _, k, p, _ in FILTER_MIXES]).repeat(len(designs))
        assert (statuses[both, -1] != fallback).all(), statuses


def test_search_is_deterministic() -> None:
    """The same inputs give the same tokens and the same search, call after call."""
    logits, tensors, *_ = random_batch(41, batch=6, vocab_size=500)
    tensors.temperature.fill_(0.9)
    tensors.top_p.fill_(0.9)
    workspace = SamplingWorkspace.allocate(6, 500, DEVICE)
    first = sample_triton(logits, tensors, workspace=workspace).clone()
    state = workspace.state.clone()
    for _ in range(2):
        assert torch.equal(sample_triton(logits, tensors, workspace=workspace), first)
        assert torch.equal(workspace.state, state)


# (logit scale, temperature, top_k, top_p, min_p) of bf16 logits over a real vocabulary: the benchmark's
# setting (a random-weight model's flat logits, temperature 0.8, top-p 0.95) and other common ones.
REAL_VOCAB_MIXES = [
    (0.64, 0.8, 0, 0.95, 0.0),
    (3.0, 0.8, 0, 0.95, 0.0),
    (0.64, 0.8, 50, 0.9, 0.0),
    (3.0, 1.0, 1000, 1.0, 0.0),
    (3.0, 0.7, 0, 1.0, 0.05),
    (4.0, 1.0, 0, 0.3, 0.0),
    (0.3, 1.0, 0, 0.999, 0.0),
    (2.0, 1.0, 20, 0.8, 0.1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
def test_gpu_real_vocab_takes_the_fast_path(batch: int) -> None:
    """Common filters over Qwen3's vocabulary: exact, and never the slow one-program path; replayed in a
    CUDA graph too."""
    vocab_size = 151936
    generator = torch.Generator().manual_seed(batch)
    for start in range(0, len(REAL_VOCAB_MIXES), batch):
        mixes = REAL_VOCAB_MIXES[start : start + batch]
        params = [
            SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
            for _, temperature, top_k, top_p, min_p in mixes
        ]
        rows = len(params)
        logits = torch.stack([torch.randn(vocab_size, generator=generator) * scale for scale, *_ in mixes])
        logits = logits.to(torch.bfloat16).float().cuda()
        tensors = SamplingTensors.from_params(
            params, [[]] * rows, [[]] * rows, list(range(rows)), [7] * rows, vocab_size, "cuda"
        )
        noise = torch.rand(
            rows, vocab_size, device="cuda", generator=torch.Generator("cuda").manual_seed(start)
        )
        for uniform_noise in (noise, None):
            workspace = check_against_reference(logits, tensors, uniform_noise, return_workspace=True)[1]
            assert (search_statuses(workspace, rows)[:, -1] != sampling_triton.FALLBACK).all()
    # The last group again, in a graph, over a few steps.
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    graph = capture_graph(lambda: sample_triton(logits, tensors, out=out, workspace=workspace), None)
    for step in range(3):
        tensors.positions.fill_(step)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, sample_reference(logits, tensors))
