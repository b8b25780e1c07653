"""The engine on the real SmolLM2-135M-Instruct: greedy output equals transformers', prefix reuse
across chat turns, stop conditions, seeds, logprobs, and a KV cache too small for everyone at once."""

from __future__ import annotations

import pytest
import torch
import transformers
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.errors import ContextLengthExceededError, InvalidRequestError
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.sampling.params import SamplingParams

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Write a haiku about the sea."},
    ],
    [{"role": "user", "content": "List three prime numbers and explain why they are prime."}],
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)


@pytest.fixture(scope="module")
def engine(smollm2_model: LoadedModel) -> Engine:
    return Engine(smollm2_model, EngineConfig(block_size=16, kv_cache_tokens=4096))


@pytest.fixture(scope="module")
def reference_model(transformers_smollm2: tuple[dict, dict]) -> transformers.PreTrainedModel:
    """transformers' own reading of the same GGUF (its dequantization, its modelling code)."""
    config, tensors = transformers_smollm2
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # the head is tied to the embedding
    model.tie_weights()
    return model.float().eval()


def _prefix_length(a: list[int], b: list[int]) -> int:
    length = 0
    while length < min(len(a), len(b)) and a[length] == b[length]:
        length += 1
    return length


@pytest.mark.parametrize("chat_index", range(len(CHATS)))
def test_greedy_equals_transformers(
    engine: Engine, reference_model: transformers.PreTrainedModel, chat_index: int
) -> None:
    prompt = engine.tokenizer.encode_chat(CHATS[chat_index])
    token_ids, text, finish_reason = engine.generate(prompt, GREEDY)
    with torch.no_grad():
        generated = reference_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=sorted(engine.eos_token_ids),
            pad_token_id=0,
        )
    expected = generated[0, len(prompt) :].tolist()
    assert token_ids == expected
    assert finish_reason == ("stop" if expected[-1] in engine.eos_token_ids else "length")
    assert text == engine.tokenizer.decode(token_ids, skip_special_tokens=True)


def test_second_turn_prefills_only_what_changed(engine: Engine) -> None:
    messages = [{"role": "user", "content": "Name a colour of the rainbow and say why you like it."}]
    first_prompt = engine.tokenizer.encode_chat(messages)
    first_output, first_text, _ = engine.generate(first_prompt, SamplingParams(max_tokens=20, temperature=0))
    messages += [
        {"role": "assistant", "content": first_text},
        {"role": "user", "content": "And another one?"},
    ]
    second_prompt = engine.tokenizer.encode_chat(messages)
    outputs = list(engine.stream(second_prompt, SamplingParams(max_tokens=2, temperature=0)))
    num_prefilled = len(second_prompt) - outputs[0].num_cached_tokens
    already_computed = first_prompt + first_output[:-1]  # the last sampled token never ran through the model
    new_tokens = len(second_prompt) - _prefix_length(second_prompt, already_computed)
    # reuse reaches the first token that differs from what the first turn computed
    assert num_prefilled == new_tokens
    assert num_prefilled <= len(second_prompt) - len(first_prompt)


def test_stop_string_cuts_text_and_holds_back_partial_matches(engine: Engine) -> None:
    prompt = engine.tokenizer.encode_chat(CHATS[0])
    full_ids, full_text, _ = engine.generate(prompt, GREEDY)
    stop = full_text[10:14]
    assert len(stop) == 4 and stop not in full_text[:13]
    outputs = list(engine.stream(prompt, SamplingParams(max_tokens=32, temperature=0, stop=(stop,))))
    text = "".join(output.new_text for output in outputs)
    assert text == full_text[: full_text.index(stop)]
    assert outputs[-1].finish_reason == "stop"
    token_ids = [token for output in outputs for token in output.new_token_ids]
    assert token_ids == full_ids[: len(token_ids)]


def test_stop_token_ids_and_max_tokens(engine: Engine) -> None:
    prompt = engine.tokenizer.encode_chat(CHATS[1])
    full_ids, _, _ = engine.generate(prompt, GREEDY)
    ids, _, reason = engine.generate(prompt, SamplingParams(max_tokens=5, temperature=0))
    assert ids == full_ids[:5] and reason == "length"
    stop_at = full_ids[3]
    ids, _, reason = engine.generate(
        prompt, SamplingParams(max_tokens=32, temperature=0, stop_token_ids=(stop_at,))
    )
    assert ids == full_ids[: full_ids.index(stop_at) + 1] and reason == "stop"


def test_seeded_sampling_is_reproducible_and_logprobs_are_consistent(engine: Engine) -> None:
    prompt = engine.tokenizer.encode_chat(CHATS[2])
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, logprobs=3)
    first = list(engine.stream(prompt, params))
    second = list(engine.stream(prompt, params))
    assert [o.new_token_ids for o in first] == [o.new_token_ids for o in second]
    other = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=99))[0]
    assert other != [t for o in first for t in o.new_token_ids]
    for output in first:
        (logprob,) = output.new_logprobs
        assert logprob.token_id == output.new_token_ids[0]
        assert len(logprob.top) == 3 and logprob.top[0][1] >= logprob.top[-1][1]
        assert logprob.logprob <= logprob.top[0][1] + 1e-6


def test_many_requests_in_a_small_cache_wait_or_are_preempted_and_lose_nothing(
    smollm2_model: LoadedModel,
) -> None:
    # room for about two of the eight full sequences at a time: requests wait, some are preempted
    small = Engine(smollm2_model, EngineConfig(block_size=16, kv_cache_tokens=112, max_num_seqs=8))
    prompts = [small.tokenizer.encode(f"Count from {n} to {n + 9}:") for n in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [small.generate(prompt, params)[0] for prompt in prompts[:2]]
    ids = [small.add_request(prompt, params) for prompt in prompts]
    collected: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while small.has_unfinished():
        for output in small.step():
            collected[output.request_id] += output.new_token_ids
    assert all(len(tokens) == 24 for tokens in collected.values())
    assert [collected[ids[0]], collected[ids[1]]] == alone
    assert small.scheduler.num_preemptions > 0
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks


def test_bad_requests_get_clear_errors(engine: Engine) -> None:
    with pytest.raises(ContextLengthExceededError, match="4095 prompt tokens"):
        engine.add_request([1] * 5000, GREEDY)
    with pytest.raises(InvalidRequestError, match="temperature"):
        engine.add_request([1, 2], SamplingParams(temperature=-1))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request([49152], GREEDY)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):  # never generated: a client's mistake
        engine.add_request([1, 2], SamplingParams(stop_token_ids=(engine.logit_vocab_size,)))
    assert not engine.has_unfinished()
