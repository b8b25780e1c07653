"""Serving many users on the real SmolLM2-135M with tiny KV caches: no request stalls the
others, no head-of-line blocking, preempted requests resume first, and only the tokenizer's ids ever
come out of a model whose embedding has padding rows beyond them.

Every loop is bounded by a step count (MAX_STEPS), so a stall fails the test rather than hanging it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tileinfer.deployments.openai_api.chat_request import ChatCompletionRequest
from tileinfer.deployments.openai_api.request_to_engine import max_tokens_for
from tileinfer.deployments.replicas.proposer_build import build_engine
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.errors import ContextLengthExceededError, InvalidRequestError
from tileinfer.engine.kv.block_manager import BlockManager
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.scheduler import MAX_TIMES_PASSED_OVER, Scheduler
from tileinfer.engine.sequence import Sequence, SequenceStatus
from tileinfer.engine.spec_decode.proposer_interface import DraftRequest
from tileinfer.engine.text.detokenizer import IncrementalDetokenizer
from tileinfer.proposers.draft_model import DraftModelProposer

MAX_STEPS = 400
TEXTS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the old red barn.",
    "In 1969 the first humans walked on the Moon, and millions watched the landing on television.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar and oxygen inside green leaves.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(smollm2_model: LoadedModel) -> LoadedModel:
    return smollm2_model  # loaded once for the session (tests/conftest.py)


@pytest.fixture(scope="module")
def roomy(model: LoadedModel) -> Engine:
    """Runs each request alone: the reference outputs."""
    return Engine(model, EngineConfig(block_size=4, kv_cache_tokens=256))


def prompt(model: LoadedModel, index: int, length: int) -> list[int]:
    """A prompt of exactly `length` tokens; different indices share no prefix (no shared blocks)."""
    token_ids = model.tokenizer.encode(TEXTS[index] * 2)
    assert len(token_ids) >= length
    return token_ids[:length]


def step(engine: Engine, collected: dict[str, list[int]]) -> None:
    for output in engine.step():
        collected.setdefault(output.request_id, []).extend(output.new_token_ids)


def run(engine: Engine, collected: dict[str, list[int]], after_step=None) -> None:  # noqa: ANN001
    """Step until every request finishes (after_step(): a check after each step)."""
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            return
        step(engine, collected)
        if after_step is not None:
            after_step()
    raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")


def alone(roomy: Engine, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
    return roomy.generate(prompt_token_ids, params)[0]


# --- the KV cache bounds the context -----------------------------------------------------------------


def test_max_model_len_is_clamped_to_what_the_kv_cache_holds(model: LoadedModel) -> None:
    assert model.spec.max_position_embeddings == 8192
    engine = Engine(model, EngineConfig(block_size=16, kv_cache_tokens=200))  # 13 blocks
    assert (engine.max_model_len, engine.max_prompt_tokens) == (208, 207)
    shorter = Engine(model, EngineConfig(block_size=16, kv_cache_tokens=200, max_model_len=100))
    assert (shorter.max_model_len, shorter.max_prompt_tokens) == (100, 99)


def test_a_request_the_cache_cannot_hold_is_refused_no_one_stalls(model: LoadedModel, roomy: Engine) -> None:
    """A stall once seen, scaled down: 1,720 + 400 tokens, ignore_eos, in a 2,048-token cache span
    the cache; it used to be preempted forever, every later request waiting behind it."""
    engine = Engine(model, EngineConfig(block_size=4, kv_cache_tokens=48))
    big = prompt(model, 0, 36)
    with pytest.raises(ContextLengthExceededError, match="the KV cache holds 48 tokens") as refused:
        engine.add_request(big, greedy(20))
    assert isinstance(refused.value, InvalidRequestError)  # the HTTP layer's 400
    # Over HTTP an unset max_tokens is the rest of the (clamped) context: admitted, and it completes.
    unset = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    rest = max_tokens_for(unset, len(big), engine.max_model_len)
    assert rest == 12
    small = [prompt(model, index, 4) for index in (1, 2)]
    ids = [engine.add_request(big, greedy(rest))] + [engine.add_request(p, greedy(3)) for p in small]
    collected: dict[str, list[int]] = {}
    run(engine, collected)
    assert [collected[request_id] for request_id in ids] == [
        alone(roomy, big, greedy(rest)),
        *(alone(roomy, p, greedy(3)) for p in small),
    ]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_big_request_waiting_for_room_does_not_block_a_small_one(model: LoadedModel, roomy: Engine) -> None:
    engine = Engine(model, EngineConfig(block_size=4, kv_cache_tokens=32))  # 8 blocks
    collected: dict[str, list[int]] = {}
    engine.add_request(prompt(model, 0, 14), greedy(6))  # 4 blocks, 5 as it grows
    step(engine, collected)
    big = prompt(model, 1, 26)  # 7 blocks: fits alone, not beside the first
    small = prompt(model, 2, 3)  # 1 block
    big_id, small_id = engine.add_request(big, greedy(2)), engine.add_request(small, greedy(2))
    big_seq, small_seq = engine.requests[big_id].seq, engine.requests[small_id].seq
    step(engine, collected)
    assert big_seq.status is SequenceStatus.WAITING and small_seq.status is SequenceStatus.RUNNING
    run(engine, collected)
    assert collected[small_id] == alone(roomy, small, greedy(2))
    assert collected[big_id] == alone(roomy, big, greedy(2))


def test_preempted_requests_resume_first_and_lose_nothing(model: LoadedModel, roomy: Engine) -> None:
    engine = Engine(model, EngineConfig(block_size=4, kv_cache_tokens=24))  # 6 blocks
    prompts = [prompt(model, 0, 6), prompt(model, 1, 6)]  # 2 blocks each, 5 when done
    ids = [engine.add_request(p, greedy(12)) for p in prompts]
    preempted = engine.requests[ids[1]].seq  # the most recently admitted
    collected: dict[str, list[int]] = {}
    for _ in range(MAX_STEPS):
        step(engine, collected)
        if engine.scheduler.num_preemptions:
            break
    assert preempted.status is SequenceStatus.WAITING
    late = prompt(model, 2, 3)  # one block: it would fit now, but the preempted one goes first
    late_id = engine.add_request(late, greedy(2))
    late_seq = engine.requests[late_id].seq

    def late_never_overtakes() -> None:
        assert not (late_seq.status is SequenceStatus.RUNNING and preempted.status is SequenceStatus.WAITING)

    run(engine, collected, late_never_overtakes)
    assert [collected[request_id] for request_id in ids] == [alone(roomy, p, greedy(12)) for p in prompts]
    assert collected[late_id] == alone(roomy, late, greedy(2))
    assert engine.scheduler.num_preemptions == 1


def test_a_request_passed_over_often_enough_reserves_the_cache() -> None:
    """The scheduler alone (no model): later requests start before a big one only a bounded number of
    times, then wait until it fits."""
    manager = BlockManager(num_blocks=40, block_size=4)
    scheduler = Scheduler(manager, max_num_seqs=32, max_num_batched_tokens=1024)
    params = SamplingParams(max_tokens=1)

    def schedule() -> None:
        for item in scheduler.schedule().scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens

    holder = Sequence("holder", list(range(120)), params)  # 30 blocks
    scheduler.add(holder)
    schedule()
    big = Sequence("big", list(range(1000, 1048)), params)  # 12 blocks: waits for the holder
    scheduler.add(big)
    smalls = [Sequence(f"small-{n}", [2000 + n], params) for n in range(MAX_TIMES_PASSED_OVER + 1)]
    for seq in smalls:
        scheduler.add(seq)
        schedule()
    assert all(seq.status is SequenceStatus.RUNNING for seq in smalls[:-1])
    assert big.status is SequenceStatus.WAITING and smalls[-1].status is SequenceStatus.WAITING
    assert manager.num_free_blocks >= 1  # the last small one would fit: the big one reserves the room
    scheduler.remove(holder)
    schedule()
    assert big.status is SequenceStatus.RUNNING and smalls[-1].status is SequenceStatus.RUNNING


# --- only the tokenizer's ids come out -------------------------------------------------------------------

NUM_PADDING_ROWS = 64


@pytest.fixture(scope="module")
def padded(model: LoadedModel) -> LoadedModel:
    """SmolLM2 with 64 padding rows after its 49,152 tokens, as Qwen3's embedding has 151,936 rows for
    151,669 tokens. The rows are +-100x real rows, so for any hidden state one of them has the largest
    logit by far: sampling the padding would win every time."""
    embedding = model.weights["model.embed_tokens.weight"]  # tied: the LM head too
    assert model.spec.tie_word_embeddings and embedding.shape[0] == model.tokenizer.vocab_size
    rows = embedding[: NUM_PADDING_ROWS // 2] * 100
    weights = {**model.weights, "model.embed_tokens.weight": torch.cat([embedding, rows, -rows])}
    spec = dataclasses.replace(model.spec, vocab_size=embedding.shape[0] + NUM_PADDING_ROWS)
    return dataclasses.replace(model, spec=spec, weights=weights)


def test_the_padding_rows_would_win_without_the_tokenizer(padded: LoadedModel) -> None:
    """The premise: with no tokenizer every row gets logits, and the padding rows are what comes out."""
    untokenized = dataclasses.replace(padded, tokenizer=None)
    assert untokenized.logit_vocab_size == padded.spec.vocab_size
    engine = Engine(untokenized, EngineConfig(kv_cache_tokens=256))
    (token_id,), _, _ = engine.generate(prompt(padded, 0, 8), greedy(1))
    assert token_id >= padded.tokenizer.vocab_size


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5),
        SamplingParams(max_tokens=4, temperature=1.0, seed=3, ignore_eos=True, logprobs=5),
        SamplingParams(max_tokens=4, temperature=1.0, seed=3, ignore_eos=True, repetition_penalty=1.2),
    ],
    ids=["greedy", "sampled", "penalized"],
)
def test_only_the_tokenizers_ids_are_sampled(padded: LoadedModel, params: SamplingParams) -> None:
    vocab_size = padded.tokenizer.vocab_size
    engine = Engine(padded, EngineConfig(kv_cache_tokens=256))
    assert engine.logit_vocab_size == vocab_size
    outputs = list(engine.stream(prompt(padded, 0, 8), params))
    assert sum(len(output.new_token_ids) for output in outputs) == 4
    for output in outputs:
        assert all(token < vocab_size for token in output.new_token_ids)
        for logprob in output.new_logprobs:
            assert len(logprob.top) == 5 and all(token < vocab_size for token, _ in logprob.top)
    with pytest.raises(InvalidRequestError, match=f"prompt token ids must be in \\[0, {vocab_size}\\)"):
        engine.add_request([vocab_size], params)


def test_verified_and_drafted_tokens_are_the_tokenizers(padded: LoadedModel) -> None:
    vocab_size = padded.tokenizer.vocab_size
    # repeats, so that n-gram drafts are proposed and verified
    repeated = prompt(padded, 0, 6) * 3
    engine = build_engine(padded, EngineConfig(kv_cache_tokens=256, proposer="ngram", num_draft=3))
    engine.speculator.adaptive = False
    token_ids, _, _ = engine.generate(repeated, greedy(8))
    assert engine.speculator.stats.drafts_proposed > 0
    assert len(token_ids) == 8 and all(token < vocab_size for token in token_ids)
    # a draft model built from the padded model (its first layers) drafts only the tokenizer's ids too
    drafter = DraftModelProposer.self_draft(padded, 2, EngineConfig(kv_cache_tokens=256, max_model_len=256))
    (drafts,) = drafter.propose([DraftRequest("r", repeated, 4)])
    assert len(drafts) == 4 and all(token < vocab_size for token in drafts)


def test_an_id_the_tokenizer_cannot_map_detokenizes_to_nothing(model: LoadedModel) -> None:
    tokenizer = model.tokenizer
    detokenizer = IncrementalDetokenizer(tokenizer)
    hello = tokenizer.encode("Hello")[0]
    detokenizer.push(hello)
    assert detokenizer.push(tokenizer.vocab_size + 5) == ""  # e.g. a padding row: no text, no error
    assert detokenizer.text == tokenizer.decode([hello])
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):  # explicit checks stay
        tokenizer.token_bytes(tokenizer.vocab_size + 5)


def test_warm_up_keeps_to_the_tokenizers_ids(model: LoadedModel) -> None:
    """Warm-up prompts are valid requests of a model whose embedding is larger than its tokenizer (a
    Qwen3 engine failed its warm-up on prompt ids past the tokenizer's 151,669). Here half the embedding's
    rows are padding, so a prompt drawn from all of them would be refused."""
    embedding = model.weights["model.embed_tokens.weight"]
    padded_embedding = torch.cat([embedding, torch.zeros_like(embedding)])
    weights = {**model.weights, "model.embed_tokens.weight": padded_embedding}
    spec = dataclasses.replace(model.spec, vocab_size=2 * embedding.shape[0])
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=24, kv_cache_tokens=256, max_model_len=256)
    engine = Engine(dataclasses.replace(model, spec=spec, weights=weights), config)
    assert engine.warm_up(force=True) > 0
    assert not engine.has_unfinished()
