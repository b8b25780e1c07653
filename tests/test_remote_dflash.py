"""DFlash in a process of its own: the target's hidden states cross the shared-memory channel with the
tokens, and the drafts are those of the same DFlashProposer in process (tiny random checkpoint and target
of tests/test_proposer_dflash.py)."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_proposer_dflash import (
    MAX_POSITIONS,
    TARGET_LAYER_IDS,
    make_proposer,
    target_engine,
    write_checkpoint,
)
from tileinfer.engine.engine import Engine
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.spec_decode.proposer_interface import DraftRequest
from tileinfer.proposers.channel import ChannelCapacity, ChannelClient
from tileinfer.proposers.dflash import DFlashProposer
from tileinfer.proposers.remote import HiddenLayout, ProposerServer, RemoteProposer, hidden_layout

CONTEXT = multiprocessing.get_context("spawn")


@pytest.fixture(scope="module")
def target() -> transformers.Qwen3ForCausalLM:
    from test_proposer_dflash import build_target

    return build_target()


def _serve_dflash(
    checkpoint: str, head_path: str, channel_names: multiprocessing.Queue, replies: multiprocessing.Queue
) -> None:
    """The proposer process: a DFlashProposer on the target's embedding and head; it says what it reads,
    then attaches to each channel that arrives, (name, whether to draft ahead)."""
    head = load_file(head_path)
    proposer = DFlashProposer.from_checkpoint(checkpoint, head["embed"], head["lm_head"], MAX_POSITIONS)
    replies.put(hidden_layout(proposer))
    lock = threading.Lock()
    while True:
        name, draft_ahead = channel_names.get()
        server = ProposerServer(proposer, name, lock, draft_ahead=draft_ahead)
        threading.Thread(target=server.serve, daemon=True).start()
        replies.put("attached")


class DFlashProcess:
    def __init__(self, checkpoint: Path, target: transformers.Qwen3ForCausalLM, folder: Path) -> None:
        head_path = folder / "head.safetensors"
        embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
        save_file({"embed": embed.detach().clone(), "lm_head": lm_head.detach().clone()}, str(head_path))
        self.channel_names, self.replies = CONTEXT.Queue(), CONTEXT.Queue()
        self.process = CONTEXT.Process(
            target=_serve_dflash, args=(str(checkpoint), str(head_path), self.channel_names, self.replies)
        )
        self.process.start()
        self.layout: HiddenLayout = self.replies.get(timeout=120)  # asked once, before any channel
        self.draft_ahead = False  # whether the next channel's server drafts ahead

    def connect(self, channel_name: str) -> None:
        self.channel_names.put((channel_name, self.draft_ahead))
        assert self.replies.get(timeout=60) == "attached"

    def remote(
        self, max_step_rows: int = 64, use_ring: bool = False, draft_ahead: bool = False
    ) -> RemoteProposer:
        self.draft_ahead = draft_ahead
        capacity = ChannelCapacity(max_step_rows=max_step_rows, max_drafts=8)
        remote = RemoteProposer(self.connect, capacity, timeout_s=30, hidden=self.layout, use_ring=use_ring)
        assert remote.wait_attached(60)
        return remote


@pytest.fixture(scope="module")
def dflash_process(tmp_path_factory: pytest.TempPathFactory, target: transformers.Qwen3ForCausalLM):  # noqa: ANN201
    folder = tmp_path_factory.mktemp("remote-dflash")
    process = DFlashProcess(write_checkpoint(folder / "checkpoint"), target, folder)
    yield process
    process.process.kill()
    process.process.join()


@pytest.fixture(scope="module")
def features(target: transformers.Qwen3ForCausalLM) -> tuple[list[int], torch.Tensor]:
    """40 random tokens and the target's hidden states at TARGET_LAYER_IDS, [40, 2 * hidden]."""
    token_ids = torch.randint(0, 150, (40,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        hidden_states = target(token_ids[None], output_hidden_states=True).hidden_states
    return token_ids.tolist(), torch.cat([hidden_states[layer + 1][0] for layer in TARGET_LAYER_IDS], dim=-1)


def test_the_layout_is_the_proposers(dflash_process: DFlashProcess) -> None:
    assert dflash_process.layout == HiddenLayout(tuple(TARGET_LAYER_IDS), 2 * 64, "float32")
    remote = dflash_process.remote()
    try:
        assert remote.target_layer_ids == tuple(TARGET_LAYER_IDS)  # what makes the engine capture them
    finally:
        remote.close()


def test_the_server_refuses_a_channel_without_hidden_rows(
    dflash_process: DFlashProcess, target: transformers.Qwen3ForCausalLM, tmp_path: Path
) -> None:
    proposer = make_proposer(write_checkpoint(tmp_path), target)
    client = ChannelClient(ChannelCapacity())
    try:
        with pytest.raises(
            ValueError, match="carries hidden rows of 0 float32 values; this proposer reads 128"
        ):
            ProposerServer(proposer, client.name, threading.Lock())
    finally:
        client.close()


def _steps(
    token_ids: list[int], features: torch.Tensor, schedule: list[tuple[int, int]], extra: int
) -> list[list[DraftRequest]]:
    """Each step's DraftRequests for two sequences, as an engine sends them: every token so far (they only
    grow), and the rows of the context tokens not handed over yet (plus `extra` trailing rows of rejected
    drafts)."""
    handed: dict[str, int] = {}
    steps = []
    for num_tokens, num_drafts in schedule:
        step = []
        for request_id, offset in (("a", 0), ("b", 7)):
            tokens = token_ids[offset : offset + num_tokens]
            num_context = len(tokens) - 1
            start = handed.get(request_id, 0)
            rows = features[offset + start : offset + num_context + extra]
            step.append(DraftRequest(request_id, tokens, num_drafts, rows))
            handed[request_id] = num_context
        steps.append(step)
    return steps


SCHEDULE = [(6, 4), (7, 2), (11, 0), (14, 4), (15, 3), (16, 4), (20, 4), (21, 1), (26, 4)]


def test_remote_drafts_equal_in_process_drafts(
    dflash_process: DFlashProcess,
    target: transformers.Qwen3ForCausalLM,
    features: tuple[list[int], torch.Tensor],
    tmp_path: Path,
) -> None:
    token_ids, hidden = features
    local = make_proposer(write_checkpoint(tmp_path), target)
    remote = dflash_process.remote()
    try:
        for step in _steps(token_ids, hidden[: len(token_ids)], SCHEDULE, extra=2):
            expected = local.propose(step)
            assert remote.propose(step) == expected
            assert [len(drafts) for drafts in expected] == [min(request.num_drafts, 4) for request in step]
    finally:
        remote.close()


def test_rows_beyond_the_step_capacity_cross_over_several_steps(
    dflash_process: DFlashProcess,
    target: transformers.Qwen3ForCausalLM,
    features: tuple[list[int], torch.Tensor],
    tmp_path: Path,
) -> None:
    """5 rows a step: the first sequence's 12 prompt rows cross in three steps, the second's follow in
    the room the first leaves; neither drafts until all its rows are over, then drafts what the in-process
    proposer drafts (no row lost, none sent twice)."""
    token_ids, hidden = features
    local = make_proposer(write_checkpoint(tmp_path), target)
    remote = dflash_process.remote(max_step_rows=5)
    schedule = [(13, 4), (13, 4), (14, 4), (16, 4), (17, 4), (19, 4), (20, 4), (21, 4)]
    try:
        got = [remote.propose(step) for step in _steps(token_ids, hidden, schedule, extra=0)]
        expected = [local.propose(step) for step in _steps(token_ids, hidden, schedule, extra=0)]
    finally:
        remote.close()
    assert [[len(drafts) for drafts in step] for step in got] == [[0, 0]] * 2 + [[4, 0]] * 5 + [[4, 4]]
    for got_step, expected_step in zip(got, expected, strict=True):
        for got_drafts, expected_drafts in zip(got_step, expected_step, strict=True):
            assert got_drafts in ([], expected_drafts)


@pytest.mark.parametrize(
    ("use_ring", "draft_ahead"), [(False, False), (True, False), (False, True)],
    ids=["host-drafts", "draft-ring", "drafting-ahead"],
)  # fmt: skip
def test_an_engine_drafts_with_a_remote_dflash_proposer(
    dflash_process: DFlashProcess, target: transformers.Qwen3ForCausalLM, use_ring: bool, draft_ahead: bool
) -> None:
    model, config = target_engine(target)
    # the 13-token prompt's rows take two steps
    remote = dflash_process.remote(max_step_rows=8, use_ring=use_ring, draft_ahead=draft_ahead)
    try:
        speculative = Engine(model, config, proposer=remote)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        prompts = [
            torch.randint(0, 150, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
            for seed, length in ((5, 13), (6, 4))
        ]
        plain = Engine(model, config)
        for prompt in prompts:
            assert speculative.generate(prompt, params)[0] == plain.generate(prompt, params)[0]
        stats = speculative.speculator.stats
        assert stats.proposer_failures == 0 and stats.drafts_proposed > 0
        assert (stats.ring_steps > 0) == use_ring
    finally:
        remote.close()


def test_a_chats_next_turn_drafts_with_a_remote_dflash_proposer(
    dflash_process: DFlashProcess, target: transformers.Qwen3ForCausalLM
) -> None:
    """Across the channel too, a second turn served from the target's prefix cache drafts: its rows
    cross with the position of the first (past the cached prefix), and the proposer takes over the first
    turn's context."""
    model, config = target_engine(target)
    remote = dflash_process.remote()
    try:
        speculative, plain = Engine(model, config, proposer=remote), Engine(model, config)
        # the random drafter's drafts are all rejected: with the verify cost measured, the controller
        # would soon stop asking; held at a plain step's, it drafts every step
        speculative.speculator.record_step = lambda seconds, verified_drafts: None
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        generator = torch.Generator().manual_seed(8)
        first = torch.randint(0, 150, (11,), generator=generator).tolist()
        reply = speculative.generate(first, params)[0]
        second = first + reply + torch.randint(0, 150, (4,), generator=generator).tolist()
        drafted_before = speculative.speculator.stats.drafts_proposed
        outputs = list(speculative.stream(second, params))
        assert outputs[0].num_cached_tokens > len(first)
        assert [t for output in outputs for t in output.new_token_ids] == plain.generate(second, params)[0]
        stats = speculative.speculator.stats
        assert stats.proposer_failures == 0 and stats.drafts_proposed > drafted_before
    finally:
        remote.close()
