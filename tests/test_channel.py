"""The shared-memory proposer channel between two real processes: the raw layout, hidden-state rows, the
token mirror (keep/new, forget), capacities, and a dead server (timeout, then a new channel to a new
server)."""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from tileinfer.engine.spec_decode.proposer_interface import DraftRequest, Proposer
from tileinfer.proposers.channel import (
    ChannelCapacity,
    ChannelCapacityError,
    ChannelClient,
    ChannelRequest,
    ChannelServer,
)
from tileinfer.proposers.ngram import NgramProposer
from tileinfer.proposers.remote import ProposerServer, ProposerUnavailableError, RemoteProposer

CONTEXT = multiprocessing.get_context("spawn")


def exchange(
    client: ChannelClient, requests: list[ChannelRequest], forget_keys: list[int], timeout_s: float
) -> list[list[int]]:
    """One step as RemoteProposer sends it when it waits for the drafts: send, then receive."""
    client.send(requests, forget_keys, timeout_s)
    return client.receive(timeout_s)


class MirrorReport(Proposer):
    """A proposer whose drafts describe what it holds: [number of tokens, number of live requests,
    the last token]."""

    def __init__(self) -> None:
        self.live: set[str] = set()

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        self.live |= {request.request_id for request in requests}
        return [[len(request.token_ids), len(self.live), request.token_ids[-1]] for request in requests]

    def forget(self, request_id: str) -> None:
        self.live.discard(request_id)


class AheadCounter(Proposer):
    """Counts draft_ahead calls; each draft is the count so far. Every second call raises, which must
    cost nothing but that call."""

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [[self.calls] for _ in requests]

    def forget(self, request_id: str) -> None:
        pass

    def draft_ahead(self) -> None:
        self.calls += 1
        if self.calls % 2 == 0:
            raise RuntimeError("drafting ahead failed")


def _serve_raw(name: str) -> None:
    """Answer each request with what crossed: [key, keep, number of new tokens, their sum, forgets]."""
    server = ChannelServer(name)
    stop = threading.Event()
    while (step := server.next_step(stop)) is not None:
        server.respond(
            [
                [r.key, r.keep, len(r.new_tokens), sum(r.new_tokens), len(step.forget_keys)]
                for r in step.requests
            ]
        )
    server.close()


def _echo_rows(name: str, gpu: int | None) -> None:
    """Answer each request with the GPU its hidden rows are on (-1: host memory) and their bits (as
    int32 words, float32 or two 16-bit values per word), so that the client can check every value that
    crossed exactly. The server works on `gpu` (None: no GPU of its own)."""
    if gpu is not None:
        torch.cuda.set_device(gpu)
    server = ChannelServer(name)
    while (step := server.next_step(threading.Event())) is not None:
        answers = []
        for request in step.requests:
            rows = request.hidden if request.hidden is not None else torch.empty(0)
            where = rows.device.index if rows.is_cuda else -1
            answers.append([where, *rows.contiguous().view(torch.int32).flatten().tolist()])
        server.respond(answers)
    server.close()


def _serve_proposer(kind: str, channel_names: multiprocessing.Queue, attached: multiprocessing.Queue) -> None:
    """The proposer process: attach to each channel name that arrives and serve it on a thread."""
    kinds = {"ngram": NgramProposer, "report": MirrorReport, "ahead": AheadCounter, "ahead-off": AheadCounter}
    proposer = kinds[kind]()
    lock = threading.Lock()
    while True:
        server = ProposerServer(proposer, channel_names.get(), lock, draft_ahead=kind == "ahead")
        threading.Thread(target=server.serve, daemon=True).start()
        attached.put(True)


class ProposerProcess:
    """A proposer in a spawned process, and the `connect` that a RemoteProposer calls to attach it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.channel_names, self.attached = CONTEXT.Queue(), CONTEXT.Queue()
        self.process = CONTEXT.Process(target=_serve_proposer, args=(kind, self.channel_names, self.attached))
        self.process.start()

    def connect(self, channel_name: str) -> None:
        if not self.process.is_alive():
            raise ConnectionError("the proposer process is gone")
        self.channel_names.put(channel_name)
        self.attached.get(timeout=60)

    def kill(self) -> None:
        self.process.kill()
        self.process.join()


@pytest.fixture
def proposer_process(request: pytest.FixtureRequest):  # noqa: ANN201
    process = ProposerProcess(request.param)
    yield process
    process.kill()


def test_raw_steps_cross_with_their_layout() -> None:
    client = ChannelClient(ChannelCapacity(max_requests=4, max_step_tokens=64, max_drafts=5, max_forgets=3))
    process = CONTEXT.Process(target=_serve_raw, args=(client.name,))
    process.start()
    try:
        steps = [
            ([ChannelRequest(7, 0, [5, 6, 7], 5), ChannelRequest(9, 2, [], 5)], [1, 2]),
            ([ChannelRequest(7, 3, list(range(100, 161)), 5)], []),  # 61 tokens: near the capacity
            ([ChannelRequest(3, 1, [2**31 - 1], 5), ChannelRequest(4, 0, [0], 5)], [3, 4, 5]),
        ]
        for requests, forget_keys in steps:
            answers = exchange(client, requests, forget_keys, timeout_s=60)
            assert answers == [
                [r.key, r.keep, len(r.new_tokens), sum(r.new_tokens), len(forget_keys)] for r in requests
            ]
        # drafts are cut at the request's num_drafts
        assert exchange(client, [ChannelRequest(1, 0, [4], 2)], [], timeout_s=60) == [[1, 0]]
    finally:
        client.close()  # the server sees the closed flag and exits
        process.join(timeout=60)
    assert process.exitcode == 0


def test_steps_beyond_the_capacity_raise_before_anything_crosses() -> None:
    client = ChannelClient(ChannelCapacity(max_requests=2, max_step_tokens=8, max_drafts=4, max_forgets=1))
    try:
        for requests, forget_keys, what in [
            ([ChannelRequest(key, 0, [1], 1) for key in range(3)], [], "3 sequences"),
            ([ChannelRequest(0, 0, list(range(9)), 1)], [], "9 new tokens"),
            ([ChannelRequest(0, 0, [1], 5)], [], "5 drafts per sequence"),
            ([], [1, 2], "2 forgotten sequences"),
        ]:
            with pytest.raises(ChannelCapacityError, match=what):
                client.send(requests, forget_keys, timeout_s=0.01)
        with pytest.raises(TimeoutError):  # a step that fits, with no server: the deadline holds
            exchange(client, [ChannelRequest(0, 0, [1], 1)], [], timeout_s=0.05)
    finally:
        client.close()


TWO_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)


@pytest.mark.parametrize(
    "placement",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.gpu),
        pytest.param("cuda-peer", marks=[pytest.mark.gpu, TWO_GPUS]),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hidden_rows_cross_exactly_once(dtype: str, placement: str) -> None:
    """On a GPU the rows cross in GPU memory (CUDA IPC) when the server's process maps it; a server on
    a second GPU (cuda-peer) maps the engine's buffer into its own GPU and reads the rows there."""
    width, max_rows = 6, 5
    capacity = ChannelCapacity(
        max_requests=3, max_step_tokens=16, max_drafts=1 + max_rows * width, max_step_rows=max_rows,
        hidden_width=width, hidden_dtype=dtype,
    )  # fmt: skip
    device = "cpu" if placement == "cpu" else "cuda:0"
    server_gpu = {"cpu": None, "cuda": 0, "cuda-peer": 1}[placement]
    rows_seen_on = -1 if server_gpu is None else server_gpu
    client = ChannelClient(capacity, torch.device(device))
    process = CONTEXT.Process(target=_echo_rows, args=(client.name, server_gpu))
    process.start()
    generator = torch.Generator().manual_seed(3)

    def rows(count: int) -> torch.Tensor:
        return (torch.randn(count, width, generator=generator) * 1e3).to(device)

    try:
        steps = [
            [ChannelRequest(0, 0, [1, 2, 3], 31, rows(2)), ChannelRequest(1, 0, [4], 31, rows(3))],  # full
            [ChannelRequest(0, 3, [5], 31, rows(1)), ChannelRequest(1, 1, [], 31)],  # one sequence, no rows
            [ChannelRequest(2, 0, [6, 7], 31, rows(5))],  # the whole area, after smaller steps
            [ChannelRequest(2, 2, [8], 31, rows(0)), ChannelRequest(0, 4, [9], 31, rows(4))],
        ]
        for requests in steps:
            # steps sent before the server has mapped the GPU buffer cross in host memory
            mapped = client.rows_in_gpu_memory
            answers = exchange(client, requests, [], timeout_s=60)
            for request, answer in zip(requests, answers, strict=True):
                # what the server read: the rows in the channel's dtype, bit for bit
                sent = torch.empty(0) if not request.num_rows else request.hidden.to(getattr(torch, dtype))
                if request.num_rows:
                    assert answer[0] == rows_seen_on if mapped else answer[0] in (-1, rows_seen_on)
                assert answer[1:] == sent.cpu().contiguous().view(torch.int32).flatten().tolist()
        assert client.rows_in_gpu_memory == (placement != "cpu")
        with pytest.raises(ChannelCapacityError, match="6 hidden rows"):
            client.send([ChannelRequest(0, 5, [], 1, rows(3)), ChannelRequest(1, 1, [], 1, rows(3))], [], 60)
        with pytest.raises(ChannelCapacityError, match="the channel's rows have 6 values"):
            client.send([ChannelRequest(0, 5, [], 1, torch.zeros(1, width + 1))], [], 60)
        zeros = torch.zeros(1, width, device=device)
        assert exchange(client, [ChannelRequest(0, 5, [], 2, zeros)], [], 60) == [[rows_seen_on, 0]]
    finally:
        client.close()
        process.join(timeout=60)
    assert process.exitcode == 0
    with pytest.raises(ValueError, match="max_step_rows"):
        ChannelCapacity(hidden_width=4)
    plain = ChannelClient(ChannelCapacity(max_step_tokens=4))  # a channel without a hidden area
    try:
        with pytest.raises(ChannelCapacityError, match="rows have 0 values"):
            plain.send([ChannelRequest(0, 0, [1], 1, torch.zeros(1, 4))], [], 0.01)
    finally:
        plain.close()


@pytest.mark.parametrize("proposer_process", ["report"], indirect=True)
def test_the_server_mirrors_new_tokens_and_forgets(proposer_process: ProposerProcess) -> None:
    remote = RemoteProposer(proposer_process.connect, ChannelCapacity(max_step_tokens=40), timeout_s=30)
    try:
        assert remote.wait_attached(60)
        first, second = list(range(1, 31)), [50, 51]
        # [tokens held, live requests, last token]: the whole prefix, though only the new tokens cross
        assert remote.propose([DraftRequest("a", first, 3), DraftRequest("b", second, 3)]) == [
            [30, 2, 30], [2, 2, 51],
        ]  # fmt: skip
        first += [31, 32]
        second += [52]
        assert remote.propose([DraftRequest("a", first, 3), DraftRequest("b", second, 3)]) == [
            [32, 2, 32], [3, 2, 52],
        ]  # fmt: skip
        remote.forget("a")
        assert remote.propose([DraftRequest("b", second + [53], 3)]) == [[4, 1, 53]]
        # a sequence beyond this step's token capacity waits; the one that fits is drafted
        long = list(range(100, 145))
        assert remote.propose([DraftRequest("c", long, 3), DraftRequest("d", [7, 8], 3)]) == [[], [2, 2, 8]]
        # a request whose tokens got shorter (against the contract) is forgotten and sent again
        assert remote.propose([DraftRequest("d", [7], 3)]) == [[1, 2, 7]]
    finally:
        remote.close()


@pytest.mark.parametrize("proposer_process", ["ahead", "ahead-off"], indirect=True)
def test_the_server_drafts_ahead_after_each_answer_when_asked(proposer_process: ProposerProcess) -> None:
    """With draft_ahead, the server calls the proposer's draft_ahead after each answer and before the next
    step (a failing call is logged and skipped); without it, never."""
    remote = RemoteProposer(proposer_process.connect, timeout_s=30)
    try:
        assert remote.wait_attached(60)
        got = [remote.propose([DraftRequest("a", list(range(1, 3 + step)), 2)]) for step in range(4)]
        ahead = proposer_process.kind == "ahead"
        assert got == [[[step if ahead else 0]] for step in range(4)]
    finally:
        remote.close()


@pytest.mark.parametrize("proposer_process", ["ngram"], indirect=True)
def test_remote_ngram_drafts_equal_in_process_drafts_on_real_text(
    proposer_process: ProposerProcess, smollm2_gguf: Path
) -> None:
    from tileinfer.engine.models.loader import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_gguf))
    text = "The quick brown fox jumps over the lazy dog. " * 3 + "A quick brown fox jumps over the lazy cat."
    token_ids = tokenizer.encode(text)
    remote = RemoteProposer(proposer_process.connect, timeout_s=30)
    local = NgramProposer()
    try:
        assert remote.wait_attached(60)
        num_drafted = 0
        # the sequences grow the way decoding grows them: a prompt, then 1-3 accepted tokens a step
        for length in [12, 13, 15, 16, 19, 20, 21, 24, *range(25, len(token_ids) + 1)]:
            requests = [
                DraftRequest("x", token_ids[:length], 4),
                DraftRequest("y", token_ids[: length // 2], 2),
            ]
            expected = local.propose(requests)
            assert remote.propose(requests) == expected
            num_drafted += len(expected[0])
        assert num_drafted > 20  # the repeated sentence is drafted from its earlier occurrence
    finally:
        remote.close()


@pytest.mark.parametrize("proposer_process", ["report"], indirect=True)
def test_a_dead_server_times_out_and_a_new_one_is_attached(proposer_process: ProposerProcess) -> None:
    replacement: list[ProposerProcess] = []

    def connect(channel_name: str) -> None:
        (replacement or [proposer_process])[-1].connect(channel_name)

    remote = RemoteProposer(connect, timeout_s=0.3, connect_timeout_s=120)
    try:
        assert remote.wait_attached(60)
        assert remote.propose([DraftRequest("a", [1, 2, 3], 3)]) == [[3, 1, 3]]
        proposer_process.kill()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            remote.propose([DraftRequest("a", [1, 2, 3, 4], 3)])
        assert time.monotonic() - started < 30  # the deadline, not a hang (generous: a shared machine)
        replacement.append(ProposerProcess("report"))
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    answer = remote.propose([DraftRequest("a", [1, 2, 3, 4, 5], 3)])
                    break
                except ProposerUnavailableError:
                    assert time.monotonic() < deadline, "the new proposer was never attached"
                    time.sleep(0.2)
            assert answer == [[5, 1, 5]]  # a fresh mirror: the whole sequence crossed again
        finally:
            replacement[-1].kill()
    finally:
        remote.close()


def test_connect_failures_leave_propose_unavailable() -> None:
    attempts: queue.Queue[str] = queue.Queue()

    def connect(channel_name: str) -> None:
        attempts.put(channel_name)
        raise ConnectionError("nobody there")

    remote = RemoteProposer(connect, connect_timeout_s=0.1)
    try:
        assert not remote.wait_attached(0.5)
        with pytest.raises(ProposerUnavailableError):
            remote.propose([DraftRequest("a", [1], 1)])
        first = attempts.get(timeout=10)
        assert first.startswith("tileinfer-")
    finally:
        remote.close()
