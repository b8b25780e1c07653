"""The choice of engine replica (deployments/replicas/routing.py): prefix affinity, the load guard, what
engines report of their caches, and power of two choices; and that the ingress keys prompts by the very hashes
the engine's block manager registers."""

from __future__ import annotations

import random
import struct

from tileinfer.deployments.replicas.routing import RoutingPolicy, block_keys, cached_block_keys
from tileinfer.engine.kv.block_manager import BlockManager
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.sequence import Sequence

BLOCK = 16


def _prompt(seed: int, length: int = 10 * BLOCK) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50000) for _ in range(length)]


def _policy(**settings: object) -> RoutingPolicy:
    policy = RoutingPolicy(balance_abs_threshold=4, **settings)  # type: ignore[arg-type]
    policy.set_replicas({"a": {}, "b": {}})
    return policy


def test_later_turns_follow_the_first() -> None:
    policy = _policy()
    conversations = [_prompt(seed) for seed in range(6)]
    first = [policy.choose(block_keys(prompt, BLOCK)) for prompt in conversations]
    for replica in first:
        policy.finished(replica)
    assert set(first) == {"a", "b"}  # new prompts spread: each goes to the least loaded replica
    for turn in range(3):
        for index, prompt in enumerate(conversations):
            conversations[index] = prompt + _prompt(100 + turn * 10 + index, 3 * BLOCK)
            replica = policy.choose(block_keys(conversations[index], BLOCK))
            assert replica == first[index]
            policy.finished(replica)
    assert policy.decisions["affinity"] == 18 and policy.decisions["least_loaded"] == 6


def test_an_uneven_load_sends_the_request_to_the_least_loaded() -> None:
    policy = _policy()
    prompt = _prompt(0)
    assert policy.choose(block_keys(prompt, BLOCK)) == (home := policy.choose(block_keys(prompt, BLOCK)))
    for _ in range(3):  # the home replica gets busy: 5 in flight against 0
        assert policy.choose(block_keys(prompt, BLOCK)) == home
    other = policy.choose(block_keys(prompt, BLOCK))  # 5 > 0 + 4 and 5 > 1.5 x 0
    assert other != home and policy.decisions["load_fallback"] == 1


def test_a_share_below_the_threshold_is_no_affinity() -> None:
    policy = _policy()
    shared = _prompt(0, 2 * BLOCK)
    home = policy.choose(block_keys(shared + _prompt(1, 8 * BLOCK), BLOCK))
    policy.finished(home)
    policy.choose(block_keys(shared + _prompt(2, 8 * BLOCK), BLOCK))  # 2 of 10 blocks: under 0.3
    assert policy.decisions["affinity"] == 0 and policy.decisions["least_loaded"] == 2


def test_blocks_an_engine_reported_draw_requests_from_any_ingress() -> None:
    prompt = _prompt(0)
    engine_keys = block_keys(prompt[: 8 * BLOCK], BLOCK)  # another ingress sent it there
    policy = RoutingPolicy()
    policy.set_replicas({"a": {}, "b": {"cached_blocks": struct.pack(f"<{len(engine_keys)}Q", *engine_keys)}})
    assert policy.choose(block_keys(prompt, BLOCK)) == "b"
    policy.forget("b")
    assert policy.choose(block_keys(prompt, BLOCK)) == "a"  # b died
    assert policy.choose(block_keys(prompt, BLOCK), exclude=["a"]) is None  # none left: Serve picks


def test_power_of_two_ignores_prefixes() -> None:
    policy = _policy(prefix_aware=False)
    prompt = _prompt(0)
    chosen = [policy.choose(block_keys(prompt, BLOCK)) for _ in range(8)]
    assert policy.decisions["power_of_two"] == 8 and policy.decisions["affinity"] == 0
    assert chosen.count("a") == chosen.count("b") == 4  # the less loaded of the two each time


def test_the_keys_are_those_the_block_manager_registers() -> None:
    manager = BlockManager(num_blocks=32, block_size=BLOCK)
    prompt = _prompt(0, 5 * BLOCK + 3)
    seq = Sequence("r", prompt, SamplingParams())
    seq.token_ids = list(prompt)
    manager.allocate(seq)
    seq.num_computed_tokens = len(prompt)
    manager.commit_computed(seq)
    reported = cached_block_keys(manager.hash_to_block)
    assert list(struct.unpack(f"<{len(reported) // 8}Q", reported)) == block_keys(prompt, BLOCK)
    assert len(block_keys(prompt, BLOCK)) == 5  # full blocks only
