"""The draft-model proposer on the real SmolLM2-135M: drafted with the target itself it proposes exactly
the target's greedy continuation across calls with accepted, rejected and foreign tokens; the self-draft
equals transformers running the same first layers; batches, forgetting and a KV cache too small; drafting
ahead, alone and behind a channel."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import transformers
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.errors import InvalidRequestError, ModelLoadError
from tileinfer.engine.models.loader import LoadedModel, load_model
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.spec_decode.proposer_interface import DraftRequest, Proposer
from tileinfer.proposers.draft_model import DraftModelProposer
from tileinfer.proposers.remote import ProposerServer, RemoteProposer

CHATS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers and explain why they are prime."}],
    [{"role": "user", "content": "What is the capital of France?"}],
]
SELF_DRAFT_LAYERS = 10


@pytest.fixture(scope="module")
def model(smollm2_model: LoadedModel) -> LoadedModel:
    return smollm2_model  # loaded once for the session (tests/conftest.py)


@pytest.fixture(scope="module")
def engine(model: LoadedModel) -> Engine:
    return Engine(model, EngineConfig(block_size=16, kv_cache_tokens=4096, max_model_len=1024))


def greedy(engine: Engine, token_ids: Sequence[int], num_tokens: int) -> list[int]:
    """The target's plain greedy continuation (EOS does not stop drafts, so it does not stop this)."""
    if num_tokens == 0:
        return []
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate(list(token_ids), params)[0]


def propose_one(
    proposer: Proposer, token_ids: Sequence[int], num_drafts: int, request_id: str = "r"
) -> list[int]:
    return proposer.propose([DraftRequest(request_id, list(token_ids), num_drafts)])[0]


def agreeing_prefix(drafts: Sequence[int], truth: Sequence[int]) -> int:
    length = 0
    while length < min(len(drafts), len(truth)) and drafts[length] == truth[length]:
        length += 1
    return length


# (drafts asked for, drafts the engine accepts, then the tokens it appends: "t" = the target's own next
# token, as after a rejection or as the bonus token; "f" = one the draft did not propose, as when a sampled
# target disagrees, so KV computed for rejected drafts must be overwritten; several = steps without drafts)
SCENARIO = [(4, 1, "t"), (5, 5, "t"), (3, 0, "f"), (6, 2, "ftt"), (1, 0, "t"), (2, 2, "tfft"), (7, 3, "t")]


def run_scenario(
    engine: Engine, proposer: DraftModelProposer, prompt: list[int], draft_ahead: bool = False
) -> None:
    """draft_ahead: the proposer drafts the next block after each call, as a proposer actor does while
    the engine verifies; what it proposes must not change."""
    token_ids = list(prompt)
    for num_drafts, num_accepted, appended in SCENARIO:
        drafts = propose_one(proposer, token_ids, num_drafts)
        expected = greedy(engine, token_ids, num_drafts)
        assert drafts == expected, f"after {len(token_ids) - len(prompt)} generated tokens"
        if draft_ahead:
            proposer.draft_ahead()
        token_ids += drafts[:num_accepted]
        for source in appended:
            next_token = greedy(engine, token_ids, 1)[0]
            token_ids.append(next_token if source == "t" else (next_token + 1) % engine.spec.vocab_size)
    proposer.forget("r")
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks


def test_is_a_proposer(model: LoadedModel) -> None:
    proposer: Proposer = DraftModelProposer(model, model.spec.vocab_size, EngineConfig(kv_cache_tokens=64))
    assert proposer.propose([]) == []
    proposer.forget("never seen")


@pytest.mark.parametrize("draft_ahead", [False, True], ids=["plain", "draft-ahead"])
def test_same_model_drafts_the_targets_greedy_continuation(
    model: LoadedModel, engine: Engine, draft_ahead: bool
) -> None:
    proposer = DraftModelProposer(
        model, model.spec.vocab_size, EngineConfig(kv_cache_tokens=1024, max_model_len=1024, max_num_seqs=4)
    )
    run_scenario(engine, proposer, engine.tokenizer.encode_chat(CHATS[0]), draft_ahead)
    stats = proposer.ahead_stats
    # with the target as its own draft model, the target's next token always agrees with the next draft:
    # after (4 drafts, 1 accepted, the target's token) the 2 drafts after those were ready
    reused_without_ahead = 2
    if draft_ahead:  # and after (5 drafts, all accepted, the target's token) the next 3 were made ahead
        assert stats.drafts_made > 0 and stats.drafts_reused >= reused_without_ahead + 3
    else:
        assert stats.drafts_made == 0 and stats.drafts_reused == reused_without_ahead


@pytest.mark.gpu
def test_same_model_drafts_the_targets_greedy_continuation_on_cuda_with_graphs(smollm2_gguf: Path) -> None:
    config = EngineConfig(device="cuda", kv_cache_tokens=1024, max_model_len=1024, max_num_seqs=4)
    cuda_model = load_model(str(smollm2_gguf), device="cuda")
    cuda_engine = Engine(cuda_model, config)
    proposer = DraftModelProposer(cuda_model, cuda_model.spec.vocab_size, config)
    assert proposer.runner.graphs is not None
    run_scenario(cuda_engine, proposer, cuda_engine.tokenizer.encode_chat(CHATS[0]))


def transformers_first_layers(model: LoadedModel, num_layers: int) -> transformers.LlamaForCausalLM:
    """transformers' llama with the first num_layers layers of the same weight tensors."""
    spec = model.spec
    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        rms_norm_eps=spec.rms_norm_eps,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=True,
    )
    reference = transformers.LlamaForCausalLM(config)
    weights = {
        name: tensor
        for name, tensor in model.weights.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    missing, unexpected = reference.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # SmolLM2 ties the head to the embedding
    reference.tie_weights()
    return reference.float().eval()


def transformers_greedy(
    reference: transformers.LlamaForCausalLM, token_ids: list[int], num_tokens: int
) -> list[int]:
    """Greedy decoding by recomputing the whole sequence at every step: no KV cache to share bugs with."""
    tokens = list(token_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = reference(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(token_ids) :]


def test_self_draft_equals_the_first_layers_run_alone_and_shares_the_weights(
    model: LoadedModel, engine: Engine
) -> None:
    proposer = DraftModelProposer.self_draft(
        model, SELF_DRAFT_LAYERS, EngineConfig(kv_cache_tokens=512, max_model_len=512, max_num_seqs=2)
    )
    decoder = proposer.runner.decoder
    assert len(decoder.model.layers) == SELF_DRAFT_LAYERS
    assert proposer.runner.kv_cache.shape[0] == SELF_DRAFT_LAYERS
    shared = {
        "model.embed_tokens.weight": decoder.model.embed_tokens.weight,
        "model.norm.weight": decoder.model.norm.weight,
        "model.layers.9.input_layernorm.weight": decoder.model.layers[9].input_layernorm.weight,
        "model.layers.4.self_attn.o_proj.weight": decoder.model.layers[4].self_attn.o_proj.weight,
        "model.layers.0.mlp.down_proj.weight": decoder.model.layers[0].mlp.down_proj.weight,
    }
    for name, tensor in shared.items():
        assert tensor.data_ptr() == model.weights[name].data_ptr(), name
    assert decoder.lm_head_weight.data_ptr() == model.weights["model.embed_tokens.weight"].data_ptr()

    reference = transformers_first_layers(model, SELF_DRAFT_LAYERS)
    prompt = engine.tokenizer.encode_chat(CHATS[1])
    target_output = greedy(engine, prompt, 20)  # what the 30-layer target emits
    num_target_tokens = 0
    num_drafts = 4
    while num_target_tokens < 14:
        token_ids = prompt + target_output[:num_target_tokens]
        drafts = propose_one(proposer, token_ids, num_drafts)
        assert drafts == transformers_greedy(reference, token_ids, num_drafts)
        # the engine keeps the drafts the target agrees with, plus the target's own next token
        num_target_tokens += agreeing_prefix(drafts, target_output[num_target_tokens:]) + 1


def test_self_draft_checks_the_layer_count(model: LoadedModel) -> None:
    for num_layers in (0, model.spec.num_layers + 1):
        with pytest.raises(InvalidRequestError, match="1 to 30"):
            DraftModelProposer.self_draft(model, num_layers, EngineConfig(kv_cache_tokens=64))


def test_a_batch_of_requests_with_chunked_prefills_and_forget(model: LoadedModel, engine: Engine) -> None:
    # two sequences per group and 16-token prefill chunks: four requests take two groups, and prompts
    # are computed over several steps alongside sequences that already decode
    config = EngineConfig(kv_cache_tokens=1024, max_model_len=1024, max_num_seqs=2, max_num_batched_tokens=16)
    proposer = DraftModelProposer(model, model.spec.vocab_size, config)
    prompts = [engine.tokenizer.encode_chat(chat) for chat in CHATS]
    token_ids = {"a": prompts[0], "b": prompts[1], "c": prompts[2], "d": prompts[2][:9]}
    for num_drafts in ({"a": 3, "b": 0, "c": 5, "d": 2}, {"a": 2, "b": 4, "c": 1, "d": 0}):
        requests = [DraftRequest(rid, token_ids[rid], num_drafts[rid]) for rid in token_ids]
        drafts = proposer.propose(requests)
        for request, proposed in zip(requests, drafts, strict=True):
            assert proposed == greedy(engine, request.token_ids, request.num_drafts), request.request_id
        # the engine accepts the first draft of each request that had some, plus its own next token
        for request, proposed in zip(requests, drafts, strict=True):
            grown = request.token_ids + proposed[:1]
            token_ids[request.request_id] = grown + greedy(engine, grown, 1)
    # a forgotten request id starts over, even with other tokens
    proposer.forget("a")
    assert propose_one(proposer, prompts[1], 3, "a") == greedy(engine, prompts[1], 3)
    for request_id in token_ids:
        proposer.forget(request_id)
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks


def test_a_kv_cache_too_small_gives_fewer_drafts_or_none(model: LoadedModel, engine: Engine) -> None:
    config = EngineConfig(block_size=16, kv_cache_tokens=32, max_model_len=1024, max_num_seqs=2)
    proposer = DraftModelProposer(model, model.spec.vocab_size, config)
    long_prompt = engine.tokenizer.encode_chat(CHATS[0])
    assert len(long_prompt) > 32
    assert propose_one(proposer, long_prompt, 4, "long") == []
    short_prompt = long_prompt[:20]
    # 32 slots hold the prompt and 12 computed drafts; the 13th draft needs no slot
    assert propose_one(proposer, short_prompt, 20, "short") == greedy(engine, short_prompt, 13)
    # while "short" holds the cache, another request gets nothing; once it is forgotten, drafts again
    assert propose_one(proposer, short_prompt[:5], 2, "other") == []
    proposer.forget("short")
    assert propose_one(proposer, short_prompt[:5], 2, "other") == greedy(engine, short_prompt[:5], 2)
    # max_model_len limits the positions a draft is computed at just the same
    tight = DraftModelProposer(
        model, model.spec.vocab_size, EngineConfig(kv_cache_tokens=64, max_model_len=24)
    )
    assert propose_one(tight, short_prompt, 10) == greedy(engine, short_prompt, 5)


def test_a_draft_model_with_another_vocabulary_is_refused(model: LoadedModel) -> None:
    with pytest.raises(ModelLoadError, match="vocabulary of 49152 tokens but the target's has 32000"):
        DraftModelProposer(model, 32000, EngineConfig(kv_cache_tokens=64))


def test_an_engine_with_a_remote_draft_model_drafting_ahead(model: LoadedModel, engine: Engine) -> None:
    """The draft-model proposer behind a channel, served on a thread that drafts the next block while the
    engine verifies: the greedy output equals plain decoding's, and blocks made ahead were used (the
    target as its own draft model always guesses the engine's next token)."""
    proposer = DraftModelProposer.self_draft(
        model, model.spec.num_layers, EngineConfig(kv_cache_tokens=2048, max_model_len=1024)
    )
    lock = threading.Lock()
    servers: list[ProposerServer] = []

    def connect(channel_name: str) -> None:
        servers.append(ProposerServer(proposer, channel_name, lock, draft_ahead=True))
        threading.Thread(target=servers[-1].serve, daemon=True).start()

    remote = RemoteProposer(connect, timeout_s=30)
    try:
        assert remote.wait_attached(60)
        speculative = Engine(model, EngineConfig(kv_cache_tokens=2048, max_model_len=1024), proposer=remote)
        prompt = engine.tokenizer.encode_chat(CHATS[1])
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        assert speculative.generate(prompt, params)[0] == engine.generate(prompt, params)[0]
        assert speculative.speculator.stats.drafts_accepted > 0
        assert proposer.ahead_stats.drafts_made > 0 and proposer.ahead_stats.drafts_reused > 0
    finally:
        remote.close()
        for server in servers:
            server.stop()
