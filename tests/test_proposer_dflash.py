"""DFlash drafter: a tiny random checkpoint in the published format, a random Qwen3 target run by
transformers for the hidden states, and an independent re-implementation of the paper's equations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import random_dflash
import torch
import transformers
from test_loader import save_tiny_tokenizer
from tileinfer.deployments.launch.app_args import AppArgs
from tileinfer.deployments.replicas import proposer_actor
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.errors import InvalidRequestError, ModelLoadError
from tileinfer.engine.models.loader import LoadedModel, load_model
from tileinfer.engine.models.shape import ModelSpec
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.spec_decode.proposer_interface import DraftRequest, Proposer
from tileinfer.proposers.dflash import DFlashDrafter, DFlashProposer, load_dflash_checkpoint

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 160, 64, 4, 2, 16, 96
TARGET_LAYERS, DRAFT_LAYERS, TARGET_LAYER_IDS = 4, 2, [0, 2]
BLOCK_SIZE, MASK_TOKEN_ID, ROPE_THETA, EPS = 5, 151, 10000.0, 1e-6
MAX_POSITIONS = 64

DRAFT_CONFIG = random_dflash.draft_config(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_target_layers=TARGET_LAYERS, target_layer_ids=TARGET_LAYER_IDS,
    num_layers=DRAFT_LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
    intermediate_size=INTERMEDIATE, block_size=BLOCK_SIZE, mask_token_id=MASK_TOKEN_ID, rope_theta=ROPE_THETA,
    rms_norm_eps=EPS,
)  # fmt: skip


def random_draft_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """The published tensor names (no embedding, no LM head), random values."""
    return random_dflash.random_draft_weights(DRAFT_CONFIG, seed)


def write_checkpoint(folder: Path, config: dict | None = None, weights: dict | None = None) -> Path:
    """DRAFT_CONFIG's random weights unless given, also beside another (a broken) config."""
    return random_dflash.write_checkpoint(folder, config or DRAFT_CONFIG, weights or random_draft_weights())


@pytest.fixture(scope="module")
def target() -> transformers.Qwen3ForCausalLM:
    return build_target()


def build_target() -> transformers.Qwen3ForCausalLM:
    """A tiny random Qwen3 (transformers), the target the tiny DFlash checkpoint drafts for."""
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=TARGET_LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("dflash"))


@pytest.fixture(scope="module")
def sequence(target: transformers.Qwen3ForCausalLM) -> tuple[list[int], torch.Tensor]:
    """Random tokens and their context features: the outputs of target layers TARGET_LAYER_IDS
    (hidden_states[i + 1] in transformers), concatenated per token -> [num_tokens, 2 * HIDDEN]."""
    token_ids = torch.randint(0, 150, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden_states = target(token_ids[None], output_hidden_states=True).hidden_states
    features = torch.cat([hidden_states[layer + 1][0] for layer in TARGET_LAYER_IDS], dim=-1)
    return token_ids.tolist(), features


def make_proposer(checkpoint: Path, target: transformers.Qwen3ForCausalLM) -> DFlashProposer:
    return DFlashProposer.from_checkpoint(
        checkpoint, target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach(), MAX_POSITIONS
    )


def make_drafter(
    checkpoint: Path, target: transformers.Qwen3ForCausalLM
) -> tuple[dict[str, torch.Tensor], DFlashDrafter, torch.Tensor, torch.Tensor]:
    """The checkpoint's weights, its drafter, and the target's embedding and LM head."""
    config, weights = load_dflash_checkpoint(checkpoint)
    drafter = DFlashDrafter.from_weights(config, weights, MAX_POSITIONS)
    return weights, drafter, target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()


def target_engine(target: transformers.Qwen3ForCausalLM) -> tuple[LoadedModel, EngineConfig]:
    """The tiny target as the engine's model, and a config of small pages and prefill chunks (a 13-token
    prompt takes two steps)."""
    spec = ModelSpec.from_hf_config(target.config.to_dict())
    weights = {name: tensor.detach() for name, tensor in target.state_dict().items()}
    model = LoadedModel(name="tiny-qwen3", source=Path("random"), spec=spec, weights=weights, tokenizer=None)
    return model, EngineConfig(max_model_len=MAX_POSITIONS, block_size=4, max_num_batched_tokens=8)


# ----------------------------------------------------------------------------------------------------------
# (a) the drafter against the paper's equations, written out densely in float64
# ----------------------------------------------------------------------------------------------------------


def reference_draft_logits(
    weights: dict[str, torch.Tensor],
    context_features: torch.Tensor,  # [num_context, 2 * HIDDEN], for positions 0..num_context - 1
    block_token_ids: list[int],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
) -> torch.Tensor:
    w = {name: tensor.double() for name, tensor in weights.items()}
    num_context, block_len = context_features.shape[0], len(block_token_ids)

    def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)

    def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x [tokens, heads, HEAD_DIM]
        inv_freq = ROPE_THETA ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
        angles = positions[:, None].double() * inv_freq  # [tokens, HEAD_DIM / 2]
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        first, second = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

    # context = RMSNorm(fc(concatenated target hidden states)), shared by every layer
    context = rms_norm(context_features.double() @ w["fc.weight"].T, w["hidden_norm.weight"])
    positions = torch.arange(num_context + block_len)  # context tokens, then the block right after
    x = embed.double()[block_token_ids]
    for layer in range(DRAFT_LAYERS):
        p = f"layers.{layer}."
        h = rms_norm(x, w[p + "input_layernorm.weight"])
        q = rms_norm((h @ w[p + "self_attn.q_proj.weight"].T).view(block_len, HEADS, HEAD_DIM),
                     w[p + "self_attn.q_norm.weight"])  # fmt: skip
        kv_input = torch.cat([context, h])  # the keys/values: projected context, then the block itself
        k = (kv_input @ w[p + "self_attn.k_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM)
        k = rms_norm(k, w[p + "self_attn.k_norm.weight"])
        v = (kv_input @ w[p + "self_attn.v_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM)
        q, k = rotate(q, positions[num_context:]), rotate(k, positions)
        group = HEADS // KV_HEADS
        out = torch.empty(block_len, HEADS, HEAD_DIM, dtype=torch.float64)
        for head in range(HEADS):
            scores = q[:, head] @ k[:, head // group].T / HEAD_DIM**0.5  # [block, context + block], no mask
            out[:, head] = torch.softmax(scores, dim=-1) @ v[:, head // group]
        x = x + out.reshape(block_len, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(x, w["norm.weight"])[1:] @ lm_head.double().T  # block positions 1.. are the drafts


def test_drafter_matches_the_equations(
    checkpoint: Path, target: transformers.Qwen3ForCausalLM, sequence: tuple[list[int], torch.Tensor]
) -> None:
    token_ids, features = sequence
    weights, drafter, embed, lm_head = make_drafter(checkpoint, target)
    num_context = 11  # tokens 0..10 ran through the target; token 11 is the last one, starting the block
    block = [token_ids[num_context]] + [MASK_TOKEN_ID] * (BLOCK_SIZE - 1)
    expected = reference_draft_logits(weights, features[:num_context], block, embed, lm_head)
    with torch.no_grad():
        got = drafter(
            features[:num_context], torch.arange(num_context), torch.tensor(block),
            torch.arange(num_context, num_context + BLOCK_SIZE), embed, lm_head,
        )  # fmt: skip
    assert got.shape == (BLOCK_SIZE - 1, VOCAB) and got.dtype == torch.float32
    assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))

    # the proposer drafts the same greedy tokens from a request carrying the same hidden states
    proposer = make_proposer(checkpoint, target)
    request = DraftRequest("r", token_ids[: num_context + 1], BLOCK_SIZE - 1, features[:num_context])
    assert proposer.propose([request]) == [expected.argmax(-1).tolist()]
    assert proposer.target_layer_ids == tuple(TARGET_LAYER_IDS)


def test_context_matters(checkpoint: Path, target: transformers.Qwen3ForCausalLM) -> None:
    """A sanity check on the test itself: different context features give different drafts' logits."""
    _, drafter, embed, lm_head = make_drafter(checkpoint, target)
    block, positions = torch.tensor([3] + [MASK_TOKEN_ID] * 4), torch.arange(6, 11)
    features = torch.randn(6, 2 * HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        first = drafter(features, torch.arange(6), block, positions, embed, lm_head)
        second = drafter(features.flip(0), torch.arange(6), block, positions, embed, lm_head)
    assert (first - second).abs().max() > 1e-3 * first.abs().max()


# ----------------------------------------------------------------------------------------------------------
# (b) the per-request context cache: incremental steps and rollback equal a recomputation from scratch
# ----------------------------------------------------------------------------------------------------------


def test_incremental_context_and_rollback_equal_recomputing(
    checkpoint: Path, target: transformers.Qwen3ForCausalLM, sequence: tuple[list[int], torch.Tensor]
) -> None:
    token_ids, features = sequence
    _, drafter, embed, lm_head = make_drafter(checkpoint, target)
    wrong = torch.randn(features.shape, generator=torch.Generator().manual_seed(2))  # rejected drafts' states
    cache = drafter.new_cache()
    num_cached = 0
    # (context length after the step, rows of rejected drafts that were appended and are then rolled back)
    for num_context, num_rejected in [(7, 0), (8, 0), (8, 3), (12, 2), (13, 0), (19, 4)]:
        if num_rejected:  # e.g. drafted ahead: context appended for drafts that verification then rejected
            drafter.extend_context(
                cache, wrong[num_cached : num_cached + num_rejected],
                torch.arange(num_cached, num_cached + num_rejected),
            )  # fmt: skip
            cache.truncate(num_cached)
        block = torch.tensor([token_ids[num_context]] + [MASK_TOKEN_ID] * (BLOCK_SIZE - 1))
        block_positions = torch.arange(num_context, num_context + BLOCK_SIZE)
        with torch.no_grad():
            incremental = drafter(
                features[num_cached:num_context], torch.arange(num_cached, num_context),
                block, block_positions, embed, lm_head, cache,
            )  # fmt: skip
            from_scratch = drafter(
                features[:num_context], torch.arange(num_context), block, block_positions, embed, lm_head
            )
        num_cached = num_context
        assert cache.num_tokens == num_context
        torch.testing.assert_close(incremental, from_scratch, rtol=1e-5, atol=1e-5)


def test_proposer_steps_equal_a_fresh_proposer(
    checkpoint: Path, target: transformers.Qwen3ForCausalLM, sequence: tuple[list[int], torch.Tensor]
) -> None:
    """A proposer fed only the new rows each step (plus ignored trailing rows of rejected drafts, and one
    rollback of the sequence) drafts what a fresh proposer drafts from the whole context."""
    token_ids, features = sequence
    proposer = make_proposer(checkpoint, target)
    num_seen = 0  # context rows the proposer has been given
    for num_tokens, num_drafts in [(6, 4), (7, 2), (11, 0), (14, 4), (12, 3), (20, 4)]:
        num_context = num_tokens - 1
        start = min(num_seen, num_context)  # after a rollback the engine sends nothing new
        extra = 2  # the engine may publish its whole verified block, rejected drafts included
        request = DraftRequest("r", token_ids[:num_tokens], num_drafts, features[start : num_context + extra])
        drafts = proposer.propose([request])[0]
        fresh = make_proposer(checkpoint, target).propose(
            [DraftRequest("f", token_ids[:num_tokens], num_drafts, features[:num_context])]
        )[0]
        assert drafts == fresh and len(drafts) == num_drafts
        num_seen = num_context


# ----------------------------------------------------------------------------------------------------------
# (c) the proposer contract
# ----------------------------------------------------------------------------------------------------------


def test_proposer_contract(
    checkpoint: Path, target: transformers.Qwen3ForCausalLM, sequence: tuple[list[int], torch.Tensor]
) -> None:
    token_ids, features = sequence
    proposer: Proposer = make_proposer(checkpoint, target)
    assert proposer.propose([]) == []
    requests = [
        DraftRequest(f"r{num_drafts}", token_ids[:9], num_drafts, features[:8])
        for num_drafts in (0, 1, 3, BLOCK_SIZE - 1, BLOCK_SIZE + 5)
    ]
    drafts = proposer.propose(requests)
    assert [len(d) for d in drafts] == [0, 1, 3, BLOCK_SIZE - 1, BLOCK_SIZE - 1]
    assert drafts[2] == drafts[3][:3] == drafts[4][:3]  # the same block, cut to the number asked for
    assert all(0 <= token < VOCAB for draft in drafts for token in draft)
    # num_drafts 0 still took the context: the next call needs only the new rows
    assert len(proposer.propose([DraftRequest("r0", token_ids[:10], 2, features[8:9])])[0]) == 2
    # forget retires the context: a new request whose tokens start the same way takes it over (a chat's
    # next turn, its prefix served from the target's cache), so its rows start after the shared prefix
    proposer.forget("r0")
    proposer.forget("never seen")
    turn = DraftRequest("turn2", token_ids[:11], 2, features[9:10], hidden_start=9)
    assert len(proposer.propose([turn])[0]) == 2  # with no context to take over it would get none
    # a request that shares no retired prefix must bring every row...
    other = [(token + 1) % VOCAB for token in token_ids]
    with pytest.raises(InvalidRequestError, match="needs the target's hidden states"):
        proposer.propose([DraftRequest("fresh", other[:11], 2, features[9:10])])
    # ...and one whose rows start past any context it holds (a prefix-cache hit) gets no drafts
    assert proposer.propose([DraftRequest("hit", other[:11], 2, features[5:10], hidden_start=5)]) == [[]]
    with pytest.raises(InvalidRequestError, match="needs the target's hidden states"):
        proposer.propose([DraftRequest("x", token_ids[:5], 2)])
    with pytest.raises(InvalidRequestError, match="must be"):
        proposer.propose([DraftRequest("y", token_ids[:5], 2, features[:4, :HIDDEN])])
    # a one-token prompt has no context yet: the block alone still drafts
    assert len(proposer.propose([DraftRequest("z", token_ids[:1], 3, features[:0])])[0]) == 3


def test_proposer_checks_the_target(checkpoint: Path, target: transformers.Qwen3ForCausalLM) -> None:
    embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    with pytest.raises(ModelLoadError, match="mask token"):
        DFlashProposer.from_checkpoint(checkpoint, embed[:100], lm_head[:100], MAX_POSITIONS)
    with pytest.raises(ModelLoadError, match="hidden size"):
        DFlashProposer.from_checkpoint(checkpoint, embed[:, :32], lm_head[:, :32], MAX_POSITIONS)


# ----------------------------------------------------------------------------------------------------------
# (d) the loader
# ----------------------------------------------------------------------------------------------------------


def test_loader_reads_the_published_format(checkpoint: Path) -> None:
    config, weights = load_dflash_checkpoint(checkpoint, torch.bfloat16)
    assert (config.block_size, config.mask_token_id, config.target_layer_ids) == (5, 151, (0, 2))
    assert config.spec.num_layers == DRAFT_LAYERS and config.spec.qk_norm
    assert weights["fc.weight"].shape == (HIDDEN, 2 * HIDDEN) and weights["fc.weight"].dtype == torch.bfloat16
    assert set(weights) == set(random_draft_weights())
    assert torch.equal(weights["norm.weight"], random_draft_weights()["norm.weight"].bfloat16())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "not a DFlash draft checkpoint"),
        (lambda c: c["dflash_config"].pop("target_layer_ids"), "target_layer_ids"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: c.pop("block_size"), "block_size"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[0, 4]), "reach past"),
        (lambda c: c.update(layer_types=["sliding_attention"] * 2), "sliding-window"),
        (lambda c: c.pop("num_attention_heads"), "missing or has a bad field"),
    ],
)
def test_loader_refuses_bad_configs(change, message: str, tmp_path: Path) -> None:  # noqa: ANN001
    config = json.loads(json.dumps(DRAFT_CONFIG))
    change(config)
    with pytest.raises(ModelLoadError, match=message):
        load_dflash_checkpoint(write_checkpoint(tmp_path, config))


def test_loader_refuses_bad_weights(tmp_path: Path) -> None:
    weights = random_draft_weights()
    del weights["layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ModelLoadError, match="missing 1 DFlash tensor"):
        load_dflash_checkpoint(write_checkpoint(tmp_path / "missing", weights=weights))
    weights = random_draft_weights() | {"fc.weight": torch.zeros(HIDDEN, 3 * HIDDEN)}
    with pytest.raises(ModelLoadError, match="shape"):
        load_dflash_checkpoint(write_checkpoint(tmp_path / "shape", weights=weights))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(DRAFT_CONFIG))
    (pickled / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(ModelLoadError, match="never unpickles"):
        load_dflash_checkpoint(pickled)
    with pytest.raises(ModelLoadError, match="not a folder"):
        load_dflash_checkpoint(tmp_path / "absent")


class _CheckingProposer(Proposer):
    """Delegates to a DFlashProposer and checks every hand-over: the hidden rows the engine sends are
    the target's own (transformers) features of exactly the tokens the proposer has not seen yet."""

    def __init__(self, inner: DFlashProposer, target: transformers.Qwen3ForCausalLM) -> None:
        self.inner, self.target = inner, target
        self.target_layer_ids = inner.target_layer_ids
        self.rows_seen: dict[str, int] = {}
        self.calls = 0

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        for request in requests:
            tokens = torch.tensor(list(request.token_ids))
            with torch.no_grad():
                hidden_states = self.target(tokens[None, :-1], output_hidden_states=True).hidden_states
            features = torch.cat([hidden_states[layer + 1][0] for layer in TARGET_LAYER_IDS], dim=-1)
            seen = self.rows_seen.get(request.request_id, 0)
            assert request.target_hidden is not None
            assert request.target_hidden.shape[0] == len(tokens) - 1 - seen
            torch.testing.assert_close(request.target_hidden, features[seen:], atol=1e-4, rtol=1e-4)
            self.rows_seen[request.request_id] = len(tokens) - 1
        self.calls += 1
        return self.inner.propose(requests)

    def forget(self, request_id: str) -> None:
        self.rows_seen.pop(request_id, None)
        self.inner.forget(request_id)


def test_the_engine_hands_dflash_the_target_hidden_states(
    checkpoint: Path, target: transformers.Qwen3ForCausalLM
) -> None:
    model, config = target_engine(target)
    proposer = _CheckingProposer(make_proposer(checkpoint, target), target)
    speculative = Engine(model, config, proposer=proposer)
    plain = Engine(model, config)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = torch.randint(0, 150, (13,), generator=torch.Generator().manual_seed(5)).tolist()  # 2 chunks
    assert speculative.generate(prompt, params)[0] == plain.generate(prompt, params)[0]
    stats = speculative.speculator.stats
    assert proposer.calls > 1 and stats.drafts_proposed > 0
    assert stats.proposer_failures == 0  # the speculator would swallow a failed check in propose


def test_a_chats_next_turn_drafts_from_the_last_turns_context(
    checkpoint: Path, target: transformers.Qwen3ForCausalLM
) -> None:
    """The second turn's prompt (the first turn, its reply and a new message) is served from the
    target's prefix cache, so the target never runs its prefix again; DFlash takes over the first turn's
    retired context and drafts for the second turn too. The output stays plain decoding's."""
    model, config = target_engine(target)
    proposer = make_proposer(checkpoint, target)
    speculative, plain = Engine(model, config, proposer=proposer), Engine(model, config)
    speculative.speculator.record_step = lambda seconds, verified_drafts: None  # drafts every step
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(7)
    first = torch.randint(0, 150, (13,), generator=generator).tolist()
    reply = speculative.generate(first, params)[0]
    assert reply == plain.generate(first, params)[0]
    second = first + reply + torch.randint(0, 150, (5,), generator=generator).tolist()
    drafted_before = speculative.speculator.stats.drafts_proposed
    outputs = list(speculative.stream(second, params))
    assert outputs[0].num_cached_tokens > len(first)  # the prefix came from the target's cache
    assert [t for output in outputs for t in output.new_token_ids] == plain.generate(second, params)[0]
    # drafts need the first turn's context: the second turn's rows start after its cached prefix
    assert speculative.speculator.stats.drafts_proposed > drafted_before


def test_warm_up_leaves_no_context_behind(checkpoint: Path, target: transformers.Qwen3ForCausalLM) -> None:
    """The proposer actor warms DFlash up before serving; a request with the same tokens afterwards
    starts from an empty context, not from the warm-up's zero rows."""
    proposer, fresh = make_proposer(checkpoint, target), make_proposer(checkpoint, target)
    proposer.warm_up(num_drafts=3)
    tokens = list(range(16))
    hidden = torch.randn(len(tokens) - 1, len(TARGET_LAYER_IDS) * HIDDEN)
    request = DraftRequest("r", tokens, BLOCK_SIZE - 1, hidden, hidden_start=0)
    assert proposer.propose([request]) == fresh.propose([request])


def test_a_block_drafted_ahead_is_used_only_when_the_engine_took_all_of_its_assumptions(
    checkpoint: Path, target: transformers.Qwen3ForCausalLM, sequence: tuple[list[int], torch.Tensor]
) -> None:
    """draft_ahead anchors the next block at the drafter's guess of the target's token after the drafts.
    The next call returns that block only if the tokens are exactly the drafts and the guess; either way
    the context it keeps is the one a proposer without drafting ahead has, so later steps draft the same."""
    token_ids, features = sequence
    num_drafts = 3
    width = features.shape[1]
    for accepted_all in (True, False):
        ahead, plain = make_proposer(checkpoint, target), make_proposer(checkpoint, target)
        first = DraftRequest("r", token_ids[:8], num_drafts, features[:7])
        drafts = ahead.propose([first])[0]
        assert plain.propose([first])[0] == drafts
        longer = DraftRequest("g", token_ids[:8], num_drafts + 1, features[:7])
        guess = make_proposer(checkpoint, target).propose([longer])[0][-1]
        ahead.draft_ahead()
        assert ahead.ahead_stats.drafts_made > 0
        following = drafts + [guess if accepted_all else (guess + 1) % 150]
        rows = torch.randn(len(following), width, generator=torch.Generator().manual_seed(4))
        second = DraftRequest("r", token_ids[:8] + following, num_drafts, rows)
        got, fresh = ahead.propose([second])[0], plain.propose([second])[0]
        assert len(got) == num_drafts
        assert ahead.ahead_stats.drafts_reused == (num_drafts if accepted_all else 0)
        if not accepted_all:
            assert got == fresh  # a miss drafts afresh
        # the next step drafts as without drafting ahead: the context took the real rows either way
        third = DraftRequest("r", second.token_ids + [7], num_drafts, torch.zeros(1, width))
        assert ahead.propose([third])[0] == plain.propose([third])[0]


# ----------------------------------------------------------------------------------------------------------
# (e) the proposer actor (deployments/replicas/proposer_actor.py)
# ----------------------------------------------------------------------------------------------------------


def test_the_proposer_actor_reads_only_the_targets_embedding_and_head(
    checkpoint: Path,
    target: transformers.Qwen3ForCausalLM,
    sequence: tuple[list[int], torch.Tensor],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The actor loads the target's embedding and LM head alone, and drafts what it drafted with the whole
    target loaded."""
    folder = tmp_path / "target"
    target.save_pretrained(folder)  # a safetensors folder, as the actor gets it
    save_tiny_tokenizer(folder)  # 300 ids: each of the target's 160 rows gets logits
    args = AppArgs.model_validate(
        {"model": str(folder), "proposer": "dflash", "draft_model": str(checkpoint)}
    )

    def start(whole_target: bool) -> tuple[proposer_actor.ProposerActor, LoadedModel]:
        loaded = []

        def load(*args: Any, names: Any = None, **kwargs: Any) -> LoadedModel:
            loaded.append(load_model(*args, names=None if whole_target else names, **kwargs))
            return loaded[-1]

        monkeypatch.setattr(proposer_actor, "load_model", load)
        threads = torch.get_num_threads()
        try:
            return proposer_actor.ProposerActor(args, "cpu", "float32"), loaded[0]
        finally:
            torch.set_num_threads(threads)  # the actor takes every core (Ray gives it one)

    actor, its_target = start(whole_target=False)
    before, whole_target = start(whole_target=True)
    assert set(its_target.weights) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert len(whole_target.weights) > 2
    token_ids, features = sequence
    for num_tokens in (1, 9, 20):
        request = DraftRequest(
            f"r{num_tokens}", token_ids[:num_tokens], BLOCK_SIZE - 1, features[: num_tokens - 1]
        )
        drafts = actor.proposer.propose([request])[0]
        assert drafts == before.proposer.propose([request])[0] and len(drafts) == BLOCK_SIZE - 1
