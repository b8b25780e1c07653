"""The draft ring (proposers/draft_ring.py): a proposer in another process answers a step in the ring, and
the verify side gathers the drafts only once the flag says so (on a GPU: the engine's stream waits on the
device, with its host already past the launch); a proposer that never answers is released at the
deadline; an engine whose drafts cross in the ring decodes what plain decoding does, whatever the
proposer wrote, and a stalled one costs only speed."""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import torch
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.spec_decode.proposer_interface import DraftRequest
from tileinfer.proposers import draft_ring
from tileinfer.proposers.channel import ChannelCapacity, ChannelClient, ChannelRequest, ChannelServer
from tileinfer.proposers.draft_ring import RingDrafts, RingRead
from tileinfer.proposers.ngram import NgramProposer
from tileinfer.proposers.remote import ProposerServer, RemoteProposer

CONTEXT = multiprocessing.get_context("spawn")
TWO_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
PLACEMENTS = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.gpu),
    pytest.param("cuda-peer", marks=[pytest.mark.gpu, TWO_GPUS]),
]
ANSWER_DELAY_S = 0.2  # the server answers this late, so that a gather that does not wait reads nothing


def _drafts_for(request: ChannelRequest) -> list[int]:
    """Odd keys get one draft fewer than asked (a proposer may give fewer)."""
    return [1000 * request.key + j for j in range(request.num_drafts - request.key % 2)]


def _serve_ring(name: str, gpu: int | None, answer: bool) -> None:
    """Answer each step late, in the ring (or never, `answer` False). Works on `gpu` (None: no GPU)."""
    if gpu is not None:
        torch.cuda.set_device(gpu)
    server = ChannelServer(name)
    server.offer_ring(True)
    stop = threading.Event()
    while (step := server.next_step(stop)) is not None:
        if not answer:
            continue
        time.sleep(ANSWER_DELAY_S)
        server.respond([_drafts_for(request) for request in step.requests])
        if gpu is not None:
            torch.cuda.synchronize()
    server.close()


@contextlib.contextmanager
def _ring_channel(
    placement: str, capacity: ChannelCapacity, answer: bool
) -> Iterator[tuple[ChannelClient, torch.device]]:
    """A channel whose server, in a spawned process (on the placement's GPU), answers in the ring (or
    never); yields once the server offered its ring. On exit the server has stopped."""
    device, server_gpu = {
        "cpu": (torch.device("cpu"), None),
        "cuda": (torch.device("cuda:0"), 0),
        "cuda-peer": (torch.device("cuda:0"), 1),
    }[placement]
    client = ChannelClient(capacity, device)
    process = CONTEXT.Process(target=_serve_ring, args=(client.name, server_gpu, answer))
    process.start()
    try:
        deadline = time.monotonic() + 120
        while client.ring is None:
            assert time.monotonic() < deadline, "the server never offered its ring"
            time.sleep(0.01)
        assert client.ring.on_gpu == (device.type == "cuda")
        yield client, device
    finally:
        client.close()
        process.join(timeout=60)
    assert process.exitcode == 0


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_ring_step_is_gathered_once_the_proposer_answered(placement: str) -> None:
    timed_out: list[bool] = []
    capacity = ChannelCapacity(max_requests=4, max_step_tokens=64, max_drafts=5)
    with _ring_channel(placement, capacity, answer=True) as (client, device):
        for step in range(3):
            requests = [ChannelRequest(2 * step, 0, [1, 2], 4), ChannelRequest(2 * step + 1, 0, [3], 5)]
            number = client.send(requests, [], timeout_s=60, to_ring=True)
            launch = RingDrafts(client.ring, number, [0, 1], [4, 5], 60.0, lambda: timed_out.append(True))
            # ids 2..5 take request 0's four slots, ids 7..11 request 1's five
            read = RingRead(launch, [2, 3, 4, 5, 7, 8, 9, 10, 11], [(0, j) for j in range(4)]
                            + [(1, j) for j in range(5)], device)  # fmt: skip
            ids = torch.full((12,), -7, dtype=torch.int64, device=device)
            started = time.monotonic()
            read.gather_into(ids)  # on a GPU: queued behind the wait, returns at once
            used, lengths = read.finish()
            assert time.monotonic() - started >= ANSWER_DELAY_S * 0.9  # it waited for the answer
            first, second = _drafts_for(requests[0]), _drafts_for(requests[1])
            assert lengths == {0: 4, 1: 4}
            assert used[:4] == first and used[4:8] == second  # the fifth slot of request 1 is padding
            assert ids[[0, 1, 6]].tolist() == [-7, -7, -7]
    assert not timed_out


@pytest.mark.parametrize("placement", PLACEMENTS[:2])
def test_a_ring_step_never_answered_is_released_at_the_deadline(placement: str) -> None:
    given_up: list[bool] = []
    capacity = ChannelCapacity(max_requests=2, max_step_tokens=8, max_drafts=3)
    with _ring_channel(placement, capacity, answer=False) as (client, device):
        number = client.send([ChannelRequest(0, 0, [1], 3)], [], timeout_s=60, to_ring=True)
        launch = RingDrafts(client.ring, number, [0], [3], 0.3, lambda: given_up.append(True))
        read = RingRead(launch, [1, 2, 3], [(0, 0), (0, 1), (0, 2)], device)
        ids = torch.zeros(4, dtype=torch.int64, device=device)
        # Fail fast, never hang: a backstop releases the flag well after the deadline (a read that needed it
        # is not timed_out), and a stuck host prints every thread's stack
        backstop = threading.Timer(10.0, client.ring.release, (number,))
        backstop.daemon = True
        backstop.start()
        faulthandler.dump_traceback_later(20)
        try:
            started = time.monotonic()
            read.gather_into(ids)
            used, lengths = read.finish()
        finally:
            backstop.cancel()
            faulthandler.cancel_dump_traceback_later()
        assert time.monotonic() - started < 5  # the deadline, not the backstop or a hang
        assert read.timed_out and launch.timed_out and given_up == [True]
        assert lengths == {0: 0} and len(used) == 3  # no drafts count; the stream went on
        if device.type == "cuda":
            torch.cuda.synchronize()


class RingNgram(NgramProposer):
    """n-gram drafts, sent through the ring as a model's would be: often fewer than asked, or none."""

    drafts_from_model = True


class StallingRingNgram(RingNgram):
    """Stops answering at its third call, until released."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.release = threading.Event()

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        self.calls += 1
        if self.calls == 3:
            self.release.wait(120)
        return super().propose(requests)


@pytest.fixture(scope="module")
def model(smollm2_model: LoadedModel) -> LoadedModel:
    return smollm2_model  # loaded once for the session (tests/conftest.py)


def _served(proposer: NgramProposer, timeout_s: float) -> tuple[RemoteProposer, list[ProposerServer]]:
    lock = threading.Lock()
    servers: list[ProposerServer] = []

    def connect(channel_name: str) -> None:
        servers.append(ProposerServer(proposer, channel_name, lock))
        threading.Thread(target=servers[-1].serve, daemon=True).start()

    remote = RemoteProposer(connect, timeout_s=timeout_s, use_ring=True)
    assert remote.wait_attached(60)
    return remote, servers


CODE_EDIT = (
    "Rename `total` to `running_sum` and return the whole function.\n\n"
    "def add_all(values):\n    total = 0\n    for value in values:\n        total = total + value\n"
    "    return total\n"
)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
        # sampled, but top-k 1 leaves one token: rejection sampling must then give plain decoding's
        SamplingParams(max_tokens=48, temperature=0.8, top_k=1, seed=7, ignore_eos=True),
    ],
    ids=["greedy", "sampled-top-k-1"],
)
def test_an_engine_with_ring_drafts_decodes_what_plain_decoding_does(
    model: LoadedModel, params: SamplingParams
) -> None:
    """Every step asks for 4 drafts; the ring holds 0 to 4 of them (n-gram), and the step verifies only
    those."""
    config = EngineConfig(num_draft=4, max_model_len=1024, kv_cache_tokens=4096)
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": CODE_EDIT}])
    remote, servers = _served(RingNgram(), timeout_s=30)
    try:
        engine = Engine(model, config, proposer=remote)
        engine.speculator.adaptive = False
        got = engine.generate(prompt, params)[0]
        stats = engine.speculator.stats
        assert stats.ring_steps > 0 and stats.drafts_accepted > 0 and stats.proposer_failures == 0
        assert stats.ring_steps > stats.steps  # some steps found fewer drafts than asked: none at all
    finally:
        remote.close()
        for server in servers:
            server.stop()
    assert got == Engine(model, config).generate(prompt, params)[0]


def test_a_stalled_ring_proposer_costs_only_speed(model: LoadedModel) -> None:
    config = EngineConfig(num_draft=4, max_model_len=1024, kv_cache_tokens=4096)
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": CODE_EDIT}])
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    proposer = StallingRingNgram()
    remote, servers = _served(proposer, timeout_s=0.3)
    try:
        engine = Engine(model, config, proposer=remote)
        engine.speculator.adaptive = False
        assert engine.generate(prompt, params)[0] == Engine(model, config).generate(prompt, params)[0]
        assert engine.speculator.stats.proposer_failures >= 1 and proposer.calls >= 3
    finally:
        proposer.release.set()
        remote.close()
        for server in servers:
            server.stop()


def test_the_deadline_watchdog_calls_what_is_still_armed_at_its_deadline() -> None:
    """A GPU ring's release at the deadline runs on the watchdog's thread (the engine's may be blocked):
    armed calls run at their deadlines, in order, and a disarmed one never does."""
    watchdog = draft_ring._Watchdog()
    calls: list[tuple[str, float]] = []
    start = time.monotonic()
    watchdog.arm(start + 0.2, lambda: calls.append(("late", time.monotonic() - start)))
    dropped = watchdog.arm(start + 0.1, lambda: calls.append(("dropped", time.monotonic() - start)))
    watchdog.arm(start + 0.05, lambda: calls.append(("early", time.monotonic() - start)))
    watchdog.disarm(dropped)
    deadline = time.monotonic() + 10
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert [name for name, _ in calls] == ["early", "late"], calls
    assert calls[0][1] >= 0.05 and calls[1][1] >= 0.2
