"""Structured output in the engine (engine/sampling/grammar.py, the runner's mask, run-ahead with masked
samples, the speculator's draft check), on the real SmolLM2-135M-Instruct and its tokenizer: what a grammar
allows is all that comes out, the sequence ends when the grammar is complete, a bad grammar is a request
error, and neither n-gram speculation nor run-ahead changes a constrained output or holds the unconstrained
rows back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import torch
from assets import llama3_tokenizer_dir, qwen3_tokenizer_dir
from llguidance import LLMatcher, LLTokenizer
from llguidance._tokenizer import TokenizerWrapper
from tileinfer.deployments.replicas.proposer_build import build_engine
from tileinfer.engine import engine as engine_module
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.models.loader import LoadedModel, load_model
from tileinfer.engine.sampling import grammar, masked_sampling
from tileinfer.engine.sampling.params import GrammarSpec, SamplingParams
from tileinfer.engine.text.tokenizer import Tokenizer
from tileinfer.kernels.token_mask import apply_token_mask, bitmask_words

SCHEMA = {
    "type": "object",
    "properties": {"river": {"type": "string", "maxLength": 8}, "km": {"type": "integer", "maximum": 9999}},
    "required": ["river", "km"],
    "additionalProperties": False,
}
JSON_SPEC = GrammarSpec("json", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def model(smollm2_model: LoadedModel) -> LoadedModel:
    return smollm2_model


@pytest.fixture(scope="module")
def engine(model: LoadedModel) -> Engine:
    return Engine(model, EngineConfig(max_num_seqs=4))


def _prompt(model: LoadedModel, text: str) -> list[int]:
    return model.tokenizer.encode_chat([{"role": "user", "content": text}])


def _run(engine: Engine, prompt: list[int], requests: list[SamplingParams]) -> list[list[int]]:
    """Each request's tokens, all added at once and stepped to the end."""
    ids = [engine.add_request(prompt, params) for params in requests]
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    return [tokens[request_id] for request_id in ids]


def test_each_kind_gives_what_its_grammar_allows(engine: Engine, model: LoadedModel) -> None:
    """All four kinds in one batch: each output matches its grammar and ends with it."""
    prompt = _prompt(model, "Name a European river and its length in km, as JSON.")
    specs = {
        "json": JSON_SPEC,
        "regex": GrammarSpec("regex", "[0-9]{3}-[a-z]{2}"),
        "choice": GrammarSpec("choice", '["yes", "no"]'),
        "lark": GrammarSpec("lark", 'start: "river: " NAME\nNAME: /[A-Z][a-z]{1,8}/'),
    }
    sampling = {  # sampled (top-k; top-p with a penalty), and greedy with logprobs
        "json": SamplingParams(temperature=0.8, top_k=20, seed=3),
        "regex": SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.2, seed=4),
        "choice": SamplingParams(temperature=0.0, logprobs=2),
        "lark": SamplingParams(temperature=0.0),
    }
    texts, finishes, logprobs = {}, {}, []
    for kind, spec in specs.items():
        engine.add_request(prompt, dataclasses.replace(sampling[kind], max_tokens=24, grammar=spec), kind)
        texts[kind] = ""
    while engine.has_unfinished():
        for output in engine.step():
            texts[output.request_id] += output.new_text
            finishes[output.request_id] = output.finish_reason
            if output.request_id == "choice":
                logprobs += output.new_logprobs
    jsonschema.validate(json.loads(texts["json"]), SCHEMA)
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", texts["regex"]), texts["regex"]
    assert texts["choice"] in ("yes", "no")
    assert re.fullmatch("river: [A-Z][a-z]{1,8}", texts["lark"]), texts["lark"]
    assert set(finishes.values()) == {"stop"}  # each ended when its grammar was complete
    # logprobs are the raw logits': the chosen tokens' are finite, and the top ones not only the allowed
    assert logprobs and all(math.isfinite(entry.logprob) and len(entry.top) == 2 for entry in logprobs)


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        (GrammarSpec("json", '{"type": "string", "not": {"const": "a"}}'), "Unimplemented keys"),
        (GrammarSpec("json", '{"type": "strin"}'), "strin"),
        (GrammarSpec("json", '{"type": '), "invalid JSON schema"),
        (GrammarSpec("regex", "[0-9"), "unclosed character class"),
        (GrammarSpec("choice", "[]"), "choice"),
        (GrammarSpec("lark", "start: missing_rule"), "missing_rule"),
    ],
)
def test_a_grammar_that_does_not_compile_is_a_request_error(engine: Engine, spec: GrammarSpec,
                                                            named: str) -> None:  # fmt: skip
    with pytest.raises(InvalidRequestError, match=named):
        engine.add_request([1, 2, 3], SamplingParams(grammar=spec))
    assert not engine.has_unfinished()


def test_constrained_output_equals_itself_with_ngram_speculation(engine: Engine, model: LoadedModel) -> None:
    """Greedy and sampled: drafts are cut at the first one the grammar refuses and each draft position is
    masked, so speculation changes nothing (beside an unconstrained request in the same steps)."""
    prompt = _prompt(model, 'Repeat exactly: {"river": "Rhine", "km": 1233}')
    requests = [
        SamplingParams(max_tokens=14, temperature=0.0, grammar=JSON_SPEC),
        SamplingParams(max_tokens=14, temperature=0.7, seed=11, grammar=JSON_SPEC),
        SamplingParams(max_tokens=4, temperature=0.0),
    ]

    plain = _run(engine, prompt, requests)
    speculative = build_engine(model, EngineConfig(max_num_seqs=4, proposer="ngram", num_draft=4))
    assert _run(speculative, prompt, requests) == plain
    assert speculative.speculator.stats.drafts_accepted > 0  # the drafts were verified, not skipped


@pytest.mark.parametrize("late", [False, True], ids=["masks-waited-for", "late-masks-sit-out"])
def test_constrained_rows_run_ahead_beside_free_ones(
    model: LoadedModel, late: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With run-ahead, a constrained sequence launches beside the free one (its sample is masked once the
    host has read its previous token), and both outputs equal step-by-step decoding. Waiting for its masks,
    it launches every step. With every fill made late (50 ms), it sits launches out while its mask fills
    (sampled from its kept logits after), the free one launches without waiting, and the tokens are the
    same, the seeded draws too."""
    prompt = _prompt(model, "Count from 1 to 30.")
    requests = {
        "free": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        "json": SamplingParams(max_tokens=10, temperature=0.7, seed=5, grammar=JSON_SPEC),
    }
    monkeypatch.setattr(engine_module, "LATE_ROWS_SIT_OUT", late)

    def run(run_ahead: bool) -> tuple[dict[str, list[int]], list[set[str]], int]:
        engine = Engine(model, EngineConfig(max_num_seqs=4, run_ahead=run_ahead))
        for request_id, params in requests.items():
            engine.add_request(prompt, params, request_id)
        tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
        launched: list[set[str]] = []  # the sequences of each step left in flight
        free_beside_late = 0  # launches of the free sequence while the constrained one's mask fills
        while engine.has_unfinished():
            for output in engine.step():
                tokens[output.request_id] += output.new_token_ids
            if engine.in_flight is not None:
                launched.append({seq.request_id for seq in engine.in_flight.seqs})
                if engine.late is not None and "free" in launched[-1]:
                    assert {seq.request_id for seq in engine.late.seqs} == {"json"} != launched[-1]
                    free_beside_late += 1
        return tokens, launched, free_beside_late

    plain, _, _ = run(run_ahead=False)
    if late:
        fill = grammar.MaskFiller.fill

        def late_fill(self: grammar.MaskFiller, *args: object) -> None:
            time.sleep(0.05)
            fill(self, *args)

        monkeypatch.setattr(grammar.MaskFiller, "fill", late_fill)
    ahead, launched, free_beside_late = run(run_ahead=True)
    assert ahead == plain
    if late:
        assert free_beside_late >= 5, launched
    else:  # every token after the first (a prompt step's) comes from a launch ahead, the constrained too
        for request_id in requests:
            assert sum(request_id in step for step in launched) >= len(plain[request_id]) - 1


def test_a_late_row_aborted_while_its_mask_fills_leaves_nothing_behind(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sampled constrained request aborted while it sits out for its late mask: the free one goes on to
    its end, the late row draws no token, and the engine keeps no state of it (its sampling key)."""
    fill = grammar.MaskFiller.fill

    def late_fill(self: grammar.MaskFiller, *args: object) -> None:
        time.sleep(0.05)
        fill(self, *args)

    monkeypatch.setattr(grammar.MaskFiller, "fill", late_fill)
    engine = Engine(model, EngineConfig(max_num_seqs=4, run_ahead=True))
    prompt = _prompt(model, "Count from 1 to 30.")
    engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), "free")
    engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.9, grammar=JSON_SPEC), "json")
    free_tokens, aborted_late = [], False
    while engine.has_unfinished():
        for output in engine.step():
            assert output.request_id == "free" or not output.finished
            if output.request_id == "free":
                free_tokens += output.new_token_ids
        if engine.late is not None and "json" in engine.requests:
            engine.abort("json")
            aborted_late = True
    assert aborted_late and len(free_tokens) == 8 and engine.late is None
    assert "json" not in engine.requests and "json" not in engine.runner.sampler.keys


def test_one_fill_of_rows_with_and_without_drafts_equals_each_alone(model: LoadedModel) -> None:
    """A verify step's fill: a row with host drafts (its mask, then one after each draft) beside a row
    with none gives each row what a fill of it alone gives (llguidance's draft call refuses an empty
    draft list, so a row without drafts must not go through it)."""
    grammars = grammar.Grammars(model.tokenizer, model.logit_vocab_size, model.tokenizer.eos_token_ids)
    spec = GrammarSpec("regex", "[a-z]{2,6}")
    drafts = model.tokenizer.encode("ab", add_special_tokens=False)[:1]
    drafted, plain = grammars.matcher(spec), grammars.matcher(spec)
    words = bitmask_words(model.logit_vocab_size)
    together = torch.zeros(3, words, dtype=torch.int32)
    grammar.MaskFiller().fill([(drafted, 0, drafts), (plain, 2, [])], together)
    alone = torch.zeros(3, words, dtype=torch.int32)
    grammar.MaskFiller().fill([(drafted, 0, drafts)], alone)
    grammar.MaskFiller().fill([(plain, 2, [])], alone)
    assert bool(together[2].any()) and not torch.equal(together[0], together[1])
    assert torch.equal(together, alone)


def test_compiles_are_cached_by_spec_in_a_bounded_cache(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence copies the spec's template with the fewest live copies; a second live copy asks for
    another template (up to MASK_SHARDS), and copies of each fill the same masks in one batch fill."""
    monkeypatch.setattr(grammar, "CACHE_SIZE", 2)
    monkeypatch.setattr(grammar, "MASK_SHARDS", 2)
    grammars = grammar.Grammars(model.tokenizer, model.logit_vocab_size, model.tokenizer.eos_token_ids)
    specs = [GrammarSpec("regex", pattern) for pattern in ("[a-c]+", "[d-f]+", "[g-i]+")]
    templates = grammars.check(specs[0])
    assert len(templates) == 1
    one = grammars.matcher(specs[0])
    assert len(templates) == 1  # one live copy at a time needs one template
    copies = [one, grammars.matcher(specs[0])]  # a second live copy: another template compiles
    deadline = time.monotonic() + 10
    while len(templates) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    copies += [grammars.matcher(specs[0]) for _ in range(3)]
    assert len(templates) == 2  # at most MASK_SHARDS
    assert sorted(grammars._live[id(template)] for template in templates) == [2, 3]
    for copy in copies:
        assert copy.consume(model.tokenizer.encode("ab", add_special_tokens=False)[0])
    bitmask = torch.zeros(len(copies), bitmask_words(model.logit_vocab_size), dtype=torch.int32)
    grammar.MaskFiller().fill([(copy, row, []) for row, copy in enumerate(copies)], bitmask)
    assert bool(bitmask[0].any()) and all(torch.equal(bitmask[0], row) for row in bitmask)
    del one, copies, copy  # (the loop variable holds the last one)
    for _ in range(2):  # one at a time (as at one client): the first template, whose lexer is warm
        held = grammars.matcher(specs[0])
        assert grammars._live == {id(templates[0]): 1}
        del held
    first = grammars.compile(specs[0])
    assert grammars.compile(GrammarSpec("regex", "[a-c]+")) is first  # an equal spec: the same compile
    grammars.compile(specs[1])
    grammars.compile(specs[2])  # the least recently asked (specs[0]) is dropped
    assert grammars.compile(specs[0]) is not first
    assert not any(template.is_error() for template in grammars.check(specs[0]))


def test_a_compile_over_its_time_limit_is_a_request_error(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limit (10 s) shrunk to nothing: a real compile then overruns it."""
    monkeypatch.setattr(grammar, "COMPILE_TIMEOUT_S", 0.0)
    grammars = grammar.Grammars(model.tokenizer, model.logit_vocab_size, model.tokenizer.eos_token_ids)
    with pytest.raises(InvalidRequestError, match="did not compile within 0 s"):
        grammars.check(JSON_SPEC)


@pytest.mark.parametrize(
    "tokenizer_dir", [None, qwen3_tokenizer_dir, llama3_tokenizer_dir], ids=["smollm2", "qwen3", "llama3"]
)
def test_masks_fill_natively_as_the_wrapped_tokenizer_would(
    model: LoadedModel, tokenizer_dir: Callable[[], Path] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llguidance's tokenizer is its native one (grammar.llguidance_tokenizer) for SmolLM2, Qwen3 and
    Llama 3: a batch fill then never calls back into Python (a wrapped tokenizer does, holding the GIL),
    and gives the wrapped tokenizer's masks but on the added tokens, which it takes as special."""
    tokenizer = model.tokenizer
    if tokenizer_dir is not None:
        tokenizer = Tokenizer.from_folder(tokenizer_dir())
    vocab_size = -(-tokenizer.vocab_size // 64) * 64  # a model's padded vocabulary
    calls = []
    encode = grammar._TokenizerSource.__call__
    monkeypatch.setattr(
        grammar._TokenizerSource, "__call__", lambda self, text: calls.append(text) or encode(self, text)
    )
    eos = tokenizer.eos_token_ids
    native = grammar.llguidance_tokenizer(tokenizer, vocab_size, eos)
    wrapped = LLTokenizer(
        TokenizerWrapper(grammar._TokenizerSource(tokenizer, vocab_size, eos)),
        n_vocab=vocab_size,
        eos_token=sorted(eos),
    )
    special = torch.tensor([native.is_special_token(i) for i in range(vocab_size)])
    text = grammar.grammar_text(
        GrammarSpec("json", json.dumps({"type": "array", "items": SCHEMA, "maxItems": 2}))
    )
    filler = grammar.MaskFiller()
    masks: dict[str, list[torch.Tensor]] = {}
    num_calls: dict[str, int] = {}
    for name, llguidance_tokenizer in (("native", native), ("wrapped", wrapped)):
        matcher = grammar.SequenceGrammar(LLMatcher(llguidance_tokenizer, text, log_level=0))
        calls.clear()
        masks[name] = []
        for token_id in tokenizer.encode(
            '[{"river": "Rhine", "km": 1233}, {"river": "Po", "km": 652}]', add_special_tokens=False
        ):
            bitmask = torch.zeros(1, bitmask_words(vocab_size), dtype=torch.int32)
            filler.fill([(matcher, 0, [])], bitmask)
            logits = torch.zeros(1, vocab_size)
            apply_token_mask(logits, bitmask)
            masks[name].append(logits[0] == 0)
            assert matcher.consume(token_id)
        num_calls[name] = len(calls)
    assert num_calls["native"] == 0 and num_calls["wrapped"] > 0, num_calls
    for native_mask, wrapped_mask in zip(masks["native"], masks["wrapped"], strict=True):
        assert torch.equal(native_mask[~special], wrapped_mask[~special])


@pytest.mark.gpu
@pytest.mark.parametrize("proposer", [None, "ngram"])
def test_cuda_constrained_beside_free_rows_equals_the_cpu(
    smollm2_gguf: Path, proposer: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU (float32, graphs and run-ahead on): constrained rows beside free ones, all in decode
    buckets run ahead (the constrained ones sampled again by masked-sampling replays of one row: three
    replays a step, each staged while the ones before may not have run yet), or in verify steps with
    n-gram drafts (masked at each draft position), give the CPU's tokens."""
    monkeypatch.setattr(masked_sampling, "MAX_MASKED_ROWS", 1)
    settings = dict(dtype="float32", kv_cache_tokens=4096, max_model_len=2048, max_num_seqs=8,
                    max_num_batched_tokens=256, proposer=proposer)  # fmt: skip

    def build(device: str) -> Engine:
        loaded = load_model(str(smollm2_gguf), torch.float32, device)
        return build_engine(loaded, EngineConfig(device=device, **settings))

    cuda, cpu = build("cuda"), build("cpu")
    prompt = cpu.tokenizer.encode_chat([{"role": "user", "content": 'Say: {"river": "Rhine", "km": 1233}'}])
    requests = [
        SamplingParams(max_tokens=20, temperature=0.0, grammar=JSON_SPEC),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, grammar=GrammarSpec("regex", "[0-9]{2,6}")),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, grammar=GrammarSpec("regex", "[a-z ]{4,40}")),
    ]

    got = _run(cuda, prompt, requests)
    assert got == _run(cpu, prompt, requests)
    jsonschema.validate(json.loads(cuda.tokenizer.decode(got[0], skip_special_tokens=True)), SCHEMA)
