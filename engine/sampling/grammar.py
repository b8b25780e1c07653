"""Structured output's grammars (llguidance, chosen in BENCHMARKS.md): compiled off the engine's loop and
cached, and one matcher per constrained sequence that writes its allowed-token mask and follows its tokens.

llguidance's tokenizer is built once per model, on a worker thread when the engine starts: natively from
the tokenizer's JSON (Rust's tokenizers, which a mask fill calls without the GIL), where it spells every
token as the engine's tokenizer does (engine/text/tokenizer.py's token_bytes); else through a Python wrapper
around the engine's tokenizer, whose calls back into Python serialize a fill's threads on the GIL.
Natively, llguidance takes every added token as a special one (matched only as a token, never as text):
the grammars name markers such as <tool_call> by token or by characters
(deployments/openai_api/tool_calls.py).

A GrammarSpec compiles on a worker thread into a template matcher, kept in a bounded LRU cache keyed by the
spec; each sequence deep-copies the spec's template with the fewest live copies. Copies of one template
share its lexer, which a mask computation holds locked (llguidance's Parser.compute_bias), so one batch
fill computes rows of different templates at once only. When the chosen template has live copies already,
another template of the spec compiles on a thread of its own, up to MASK_SHARDS: a spec used by one
request at a time keeps one (warm: a template's lexer caches the states its copies reach), and one under
load gets more. A spec that does not compile, or takes more than COMPILE_TIMEOUT_S, is a request error
(InvalidRequestError, a 400) whose message is llguidance's (it names the problem: "Unimplemented keys:
[...]", a regex parse error).

A grammar that compiles may still fail as it constrains: llguidance's parser limits a row's items (an object
with hundreds of optional properties passes it at its brace), and a rule that only recurses (a $ref with no
base case) leaves nothing that can follow. The matcher then stops in error, for good: a refused token, or a
mask that allows only the end-of-sequence tokens. So each compile probes its grammar (GrammarProbe): one
path through it, at most PROBE_TOKENS tokens, taking the lowest allowed byte each time (an object's next
member before its closing brace, a number's sign), but not a byte of the two just taken (a string's
characters go on no further than its closing quote); and where few bytes are allowed (a branch, not free
text) it tries each of them one token deep. A grammar that fails on that path is a request error (refused
before generation); one that fails later, on a path the model took, ends that request with an
error (SequenceGrammar.error; Engine, finish_reason "error"), never as a "stop".

Masks: bit j of word i allows token 32 i + j (kernels/token_mask.py applies them). The end-of-sequence
tokens are allowed only where the grammar accepts; once it is complete (it allows nothing more) they are
all it allows, so the sequence ends with one (Engine._emit).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import os
import re
import threading
import time
import weakref
from collections.abc import Collection, Sequence
from typing import Any

import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer
from llguidance._tokenizer import TokenizerWrapper
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.sampling.params import GrammarSpec
from tileinfer.engine.text.tokenizer import Tokenizer

COMPILE_TIMEOUT_S = 10.0
CACHE_SIZE = 256  # compiled specs kept (a JSON schema's template matcher is tens of KB to a few MB)
COMPILE_THREADS = 2
PROBE_TOKENS = 32  # a compile's probe of its grammar walks at most this many tokens (a few ms)
BRANCH_BYTES = 16  # where it allows at most this many bytes, the probe tries each (a few, not free text)
# templates per spec, and the batch mask fill's threads (the host's other cores serve the engine's loop)
MASK_SHARDS = max(1, min(8, (os.cpu_count() or 1) - 2))
# JSON on one line, ", " and ": " between items (what json.dumps writes): whitespace left free, a small model
# spends its tokens on newlines and indents. A schema's own "x-guidance" options take precedence. Both a json
# spec and a schema in a Lark grammar (lark_json) are laid out so.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class _TokenizerSource:
    """What llguidance's TokenizerWrapper reads: every id's bytes (holes and ids past the tokenizer's
    vocabulary are empty, never allowed), the special ids, and an encoder."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = min(eos_token_ids)
        self.bos_token_id = tokenizer.bos_token_id
        known = min(vocab_size, tokenizer.vocab_size)
        self.tokens = [tokenizer.token_bytes(i) for i in range(known)] + [b""] * (vocab_size - known)
        self.special_token_ids = [i for i in range(known) if tokenizer.is_special(i)]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def llguidance_tokenizer(
    tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Collection[int]
) -> LLTokenizer:
    """llguidance's tokenizer for the model: the native one where it agrees with the engine's tokenizer on
    every token that is not special to it, else the wrapped one (the module's docstring)."""
    source = _TokenizerSource(tokenizer, vocab_size, eos_token_ids)
    eos_token = sorted(eos_token_ids)
    try:
        native = LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos_token)
    except Exception:  # noqa: BLE001 - a tokenizer JSON llguidance cannot read
        native = None
    if native is not None and all(
        native.is_special_token(token_id) or native.decode_bytes([token_id]) == spelled
        for token_id, spelled in enumerate(source.tokens)
    ):
        return native
    return LLTokenizer(TokenizerWrapper(source), n_vocab=vocab_size, eos_token=eos_token)


def grammar_text(spec: GrammarSpec) -> str:
    """The spec as llguidance's grammar (Lark text or its JSON); raises InvalidRequestError for a spec
    llguidance cannot even read (JSON that does not parse, a choice that is not a list of strings)."""
    if spec.kind == "json":
        try:
            return LLMatcher.grammar_from_json_schema(spec.source, defaults=_JSON_LAYOUT)
        except ValueError as error:
            raise InvalidRequestError(f"invalid JSON schema: {error}") from None
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(spec.source)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.source)
        except ValueError as error:
            raise InvalidRequestError(f"choice must be a JSON list of strings: {error}") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise InvalidRequestError("choice must be a non-empty list of strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    raise InvalidRequestError(f"unknown grammar kind {spec.kind!r}: json, regex, choice or lark")


def lark_json(schema: dict[str, Any]) -> str:
    """Lark's `%json` of a schema, its output laid out as a json spec's: %json takes no compile defaults, so
    _JSON_LAYOUT goes in the schema's own "x-guidance", under the options that one names."""
    own = schema.get("x-guidance")
    layout = {**_JSON_LAYOUT, **(own if isinstance(own, dict) else {})}
    return f"%json {json.dumps({**schema, 'x-guidance': layout})}"


_WHAT = {"json": "JSON schema", "regex": "regex", "lark": "grammar", "choice": "choice"}
# llguidance's errors of a grammar that fails as it constrains, in words a schema's author can act on
_FAILURES = (
    (re.compile(r"Current row has (\d+) items; max is (\d+)"),
     r"too many alternatives at one point (\1 parser items, at most \2), as in an object with hundreds of "
     r"optional properties"),
    (re.compile(r"^NoExtension"),
     "nothing can follow there, as where a $ref only recurses, with no base case"),
)  # fmt: skip


def failure(matcher: LLMatcher) -> str:
    """Why a matcher in error failed: llguidance's first line, or what it means where it is one of
    _FAILURES."""
    message = (matcher.get_error().splitlines() or ["unknown error"])[0]
    for pattern, meaning in _FAILURES:
        found = pattern.search(message)
        if found is not None:
            return found.expand(meaning)
    return message


class GrammarProbe:
    """Walks one path through a compiled grammar, to find where it fails (the module's docstring)."""

    def __init__(self, tokenizer: LLTokenizer, eos_token_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = frozenset(eos_token_ids)
        spelled = [(byte, tokenizer.tokenize_bytes(bytes([byte]))) for byte in range(256)]
        # (byte, its token), ascending by byte, for the bytes one token spells
        self._byte_tokens = [(byte, ids[0]) for byte, ids in spelled if len(ids) == 1]

    def problem(self, template: LLMatcher) -> str | None:
        """Where and why the grammar fails on the probe's path, or None (it completes, or the path ends at
        PROBE_TOKENS without failing)."""
        matcher = template.deep_copy()
        walked = bytearray()
        recent: list[int] = []  # the last two bytes taken, where they were single-byte tokens
        for _ in range(PROBE_TOKENS):
            if matcher.is_stopped():
                break
            mask = matcher.compute_bitmask()  # bit b of byte k allows token 8 k + b
            if matcher.is_error():
                break
            allowed = [
                (byte, token) for byte, token in self._byte_tokens if mask[token >> 3] >> (token & 7) & 1
            ]
            if len(allowed) <= BRANCH_BYTES:  # a branch point (not free text): each way, one token deep
                failed = self._failing_byte(matcher, allowed)
                if failed is not None:
                    walked.append(failed)
                    break
            fresh = [(byte, token) for byte, token in allowed if byte not in recent] or allowed
            if fresh:
                byte, token_id = fresh[0]
                recent[:] = [*recent, byte][-2:]
            else:
                token_id = self._lowest_other(mask)  # a token llguidance forces, such as a canonical `{"`
                recent.clear()
                if token_id is None:  # only an end-of-sequence token: the grammar accepts here
                    return None
            walked += self._tokenizer.decode_bytes([token_id])
            if not matcher.consume_token(token_id):
                break
        if not matcher.is_error():
            return None
        return f"after the output {walked.decode('utf-8', 'replace')!r}, {failure(matcher)}"

    @staticmethod
    def _failing_byte(matcher: LLMatcher, allowed: list[tuple[int, int]]) -> int | None:
        """The first allowed (byte, token) whose token the matcher takes in error (left in it): its byte;
        or None (each taken and rolled back)."""
        for byte, token_id in allowed:
            if not matcher.consume_token(token_id):
                return byte
            matcher.rollback(1)
        return None

    def _lowest_other(self, mask: bytes) -> int | None:
        """The lowest id the mask allows that does not end the sequence, or None."""
        position = 0
        while rest := mask[position:].lstrip(b"\0"):
            position = len(mask) - len(rest)
            for bit in range(8):
                token_id = 8 * position + bit
                if mask[position] >> bit & 1 and token_id not in self._eos_token_ids:
                    return token_id
            position += 1
        return None


class SequenceGrammar:
    """One constrained sequence's matcher: its mask for the next token, and its committed tokens."""

    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher

    def consume(self, token_id: int) -> bool:
        """Commit a generated token; False when the grammar does not allow it (the matcher is then in
        error and allows nothing)."""
        return self.matcher.consume_token(token_id)

    @property
    def is_complete(self) -> bool:
        """Whether the grammar allows no more tokens (but an end-of-sequence token)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the grammar failed as it constrained (the module's docstring), or None. Once failed, its
        mask allows only the end-of-sequence tokens, and it takes no token."""
        return failure(self.matcher) if self.matcher.is_error() else None

    def valid_drafts(self, drafts: Sequence[int]) -> int:
        """How many of the drafts, from the first, the grammar allows after the committed tokens."""
        return self.matcher.validate_tokens(list(drafts))


class Grammars:
    """One engine's grammar compiler and cache."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        """vocab_size: the width of the logits (masks cover it); eos_token_ids: the ids that end a
        sequence, allowed where the grammar accepts."""
        self.vocab_size = vocab_size
        self._source = (tokenizer, vocab_size, eos_token_ids)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            COMPILE_THREADS, thread_name_prefix="tileinfer-grammar"
        )
        # the specs' further templates: never ahead of a request's compile
        self._shard_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tileinfer-shards")
        self._tokenizer: concurrent.futures.Future[LLTokenizer] | None = None
        self._probe: GrammarProbe | None = None  # set with the tokenizer
        self._lock = threading.RLock()  # also taken by the copies' finalizers
        self._cache: collections.OrderedDict[GrammarSpec, concurrent.futures.Future[_Templates]] = (
            collections.OrderedDict()
        )
        self._live: collections.Counter[int] = collections.Counter()  # live copies by template id

    def start(self) -> concurrent.futures.Future[LLTokenizer]:
        """Build llguidance's tokenizer on a worker thread, once (a few tenths of a second to 1.6 s; the
        first compile waits for it). Engine.warm_up starts it before the engine serves."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(self._build_tokenizer)
            return self._tokenizer

    def _build_tokenizer(self) -> LLTokenizer:
        tokenizer = llguidance_tokenizer(*self._source)
        self._probe = GrammarProbe(tokenizer, self._source[2])
        return tokenizer

    def compile(self, spec: GrammarSpec) -> concurrent.futures.Future[_Templates]:
        """The spec's templates, compiling the first on a worker thread (cached: at most CACHE_SIZE specs,
        the least recently asked dropped). The future fails with InvalidRequestError."""
        self.start()
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec, time.monotonic())
            self._cache[spec] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def _compile(self, spec: GrammarSpec, asked_at: float) -> _Templates:
        tokenizer = self.start().result()
        try:
            text = grammar_text(spec)
            matcher = LLMatcher(tokenizer, text, log_level=0)
        except InvalidRequestError:
            raise
        except Exception as error:  # noqa: BLE001 - e.g. text llguidance cannot take (a lone surrogate)
            raise InvalidRequestError(f"invalid {_WHAT[spec.kind]}: {error}") from None
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {_WHAT[spec.kind]}: {matcher.get_error()}")
        assert self._probe is not None  # built with the tokenizer
        problem = self._probe.problem(matcher)
        if problem is not None:
            raise InvalidRequestError(f"the {_WHAT[spec.kind]} cannot constrain generation: {problem}")
        if time.monotonic() - asked_at > COMPILE_TIMEOUT_S:
            raise InvalidRequestError(
                f"the {_WHAT[spec.kind]} did not compile within {COMPILE_TIMEOUT_S:g} s"
            )
        return _Templates([matcher], text)

    def check(self, spec: GrammarSpec) -> list[LLMatcher]:
        """The spec's compiled templates; waits for the first (at most COMPILE_TIMEOUT_S from when it was
        first asked). Raises InvalidRequestError for a spec that does not compile in time."""
        return self._templates(spec).matchers

    def _templates(self, spec: GrammarSpec) -> _Templates:
        future = self.compile(spec)
        try:
            return future.result(timeout=COMPILE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise InvalidRequestError(
                f"the {_WHAT[spec.kind]} did not compile within {COMPILE_TIMEOUT_S:g} s"
            ) from None

    def matcher(self, spec: GrammarSpec) -> SequenceGrammar:
        """A fresh matcher for a sequence: a copy of the spec's template with the fewest live copies; when
        it has some already, the spec gets another template (up to MASK_SHARDS) for the next ones."""
        templates = self._templates(spec)
        with self._lock:
            template = min(templates.matchers, key=lambda template: self._live[id(template)])
            if self._live[id(template)] and len(templates.matchers) < MASK_SHARDS and not templates.growing:
                templates.growing = True
                self._shard_pool.submit(self._add_template, templates)
            self._live[id(template)] += 1
        grammar = SequenceGrammar(template.deep_copy())
        weakref.finalize(grammar, self._released, id(template))
        return grammar

    def _released(self, template_id: int) -> None:
        with self._lock:
            self._live[template_id] -= 1
            if self._live[template_id] <= 0:
                del self._live[template_id]

    def _add_template(self, templates: _Templates) -> None:
        template = LLMatcher(self.start().result(), templates.text, log_level=0)
        with self._lock:
            templates.matchers.append(template)
            templates.growing = False


@dataclasses.dataclass
class _Templates:
    """A spec's compiled template matchers (its grammar text compiled once each) and whether one more is
    compiling."""

    matchers: list[LLMatcher]
    text: str
    growing: bool = False


class MaskFiller:
    """Writes constrained rows' allowed-token bitmasks with llguidance's batch call, which spreads the rows
    over its threads and releases the GIL: now (fill), or on a worker thread while the engine's own thread
    goes on (start). Host int32 bitmasks [rows, ceil(vocab / 32)], C-contiguous."""

    def __init__(self) -> None:
        self._executor = LLExecutor(MASK_SHARDS)
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tileinfer-masks")

    def fill(self, rows: list[tuple[SequenceGrammar, int, list[int]]], bitmask: torch.Tensor) -> None:
        """For each (grammar, first row, drafts): its mask for the next token at the first row, and after
        each draft at the rows below it (drafts the grammar allows: SequenceGrammar.valid_drafts). Other
        rows are left as they are."""
        row_bytes = bitmask.shape[1] * 4
        drafted = [(grammar.matcher, row, list(drafts)) for grammar, row, drafts in rows if drafts]
        if drafted:  # llguidance's draft call refuses an empty draft list
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                drafted, bitmask.data_ptr(), row_bytes, bitmask.shape[0]
            )
        undrafted = [(grammar.matcher, row) for grammar, row, drafts in rows if not drafts]
        if undrafted:
            self._executor.unsafe_compute_mask_ptr(undrafted, bitmask.data_ptr(), row_bytes, bitmask.shape[0])

    def start(
        self, rows: list[tuple[SequenceGrammar, int, list[int]]], bitmask: torch.Tensor
    ) -> concurrent.futures.Future[None]:
        """fill(rows, bitmask) on the worker thread; the future is done once the masks are written. Returns
        once that thread is about to let go of the GIL: a thread waiting for it would otherwise wait until
        this one blocks, up to Python's switch interval (5 ms)."""
        started = threading.Event()

        def run() -> None:
            started.set()
            self.fill(rows, bitmask)

        future = self._worker.submit(run)
        started.wait()
        return future
