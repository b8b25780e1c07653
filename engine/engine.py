"""The engine: requests in, tokens and text out, one step at a time.

A step schedules sequences (scheduler), runs the model over their new tokens (runner), samples
the next token of every sequence whose tokens are all computed (sampling), and turns the tokens
into text with stop strings honoured (detokenizer).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import time
from collections.abc import Iterator

from tileinfer.engine.admission import check_request
from tileinfer.engine.config import EngineConfig
from tileinfer.engine.errors import GrammarFailedError, InvalidRequestError
from tileinfer.engine.graph_buckets import step_sizes
from tileinfer.engine.kv.block_manager import BlockManager
from tileinfer.engine.kv.budget import gpu_kv_cache_tokens
from tileinfer.engine.kv.calibration import calibration_ids
from tileinfer.engine.models.decoder import Decoder
from tileinfer.engine.models.loader import LoadedModel, load_model
from tileinfer.engine.ops import ops_for
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.sampling.grammar import Grammars
from tileinfer.engine.sampling.params import SamplingParams, TokenLogprob
from tileinfer.engine.scheduler import Scheduler
from tileinfer.engine.sequence import Sequence, SequenceStatus
from tileinfer.engine.spec_decode.proposer_interface import Proposer
from tileinfer.engine.spec_decode.speculator import DEFAULT_DRAFT_COST, Speculator
from tileinfer.engine.step import (
    Drafts,
    LateSamples,
    PendingStep,
    RowOutput,
    ScheduledRow,
    StepWork,
    is_decode_step,
)
from tileinfer.engine.step_cost import StepCostModel
from tileinfer.engine.stopping import finish_reason, grammar_failed, grammar_finish
from tileinfer.engine.text.detokenizer import TextStream
from tileinfer.engine.warm_up import warm_up_engine
from tileinfer.kernels.int8 import Int8Weight

# How often the engine looks again, while it waits for the in-flight step's masks, at whether the device has
# finished that step (then the late rows sit out the next launch: Engine._defer_late_masks).
LATE_POLL_S = 50e-6
# Whether such late rows sit the next launch out; False: the launch waits for their masks (the masked
# replays then sample every constrained row, as tests of them need on the CPU, where a run-ahead step is
# computed in its launch and so has always finished).
LATE_ROWS_SIT_OUT = True


@dataclasses.dataclass(slots=True)  # one per request per step: slots make it cheaper to build
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" (its grammar failed: error says why)
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens reused from the prefix cache
    new_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    error: GrammarFailedError | None = None  # finish_reason "error": why (the output does not match)


@dataclasses.dataclass(eq=False)
class _Request:
    seq: Sequence
    text: TextStream | None  # None when the engine does not detokenize (no tokenizer, or detokenize off)


class Engine:
    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig | None = None,
        proposer: Proposer | None = None,
        draft_cost: float = DEFAULT_DRAFT_COST,
    ) -> None:
        """proposer: drafts for speculative decoding, the one config.proposer names (built in this process,
        or a client of a proposer actor: deployments/replicas/proposer_build.py); draft_cost: what one more of
        its drafts costs, as a share of a plain decode step (deployments/replicas/proposer_build.py
        draft_cost)."""
        config = config or EngineConfig()
        config.validate()
        if config.proposer is not None and proposer is None:
            raise ValueError(f"config.proposer is {config.proposer!r}: pass the proposer (build_proposer)")
        self.config = config
        self.spec = model.spec
        self.tokenizer = model.tokenizer
        self.model_name = model.name
        self.device = config.torch_device()
        # what the layer linears run in: as asked, or INT8 where the file held it (a GGUF's Q8_0)
        held_int8 = any(isinstance(weight, Int8Weight) for weight in model.weights.values())
        self.quantization = config.quantization or ("int8" if held_int8 else None)
        self.logit_vocab_size = model.logit_vocab_size  # the ids the engine can emit (Decoder)
        tokenizer_eos = model.tokenizer.eos_token_ids if model.tokenizer is not None else ()
        self.eos_token_ids = frozenset(tokenizer_eos) | frozenset(model.spec.eos_token_ids)
        self.requests: dict[str, _Request] = {}
        self._request_counter = itertools.count()
        # structured output (SamplingParams.grammar): compiled off the engine's loop
        # (engine/sampling/grammar.py)
        self.grammars: Grammars | None = None
        if model.tokenizer is not None and self.eos_token_ids:
            self.grammars = Grammars(model.tokenizer, self.logit_vocab_size, self.eos_token_ids)
        self.speculator = None
        if proposer is not None:
            self.speculator = Speculator(proposer, config.num_draft, draft_cost)
        # a verify step needs the logits of every draft position, plain steps one row a sequence
        max_logit_rows = config.max_num_seqs * (1 + config.num_draft if proposer is not None else 1)
        max_model_len = min(config.max_model_len or model.spec.max_position_embeddings, 1 << 20)
        kv_cache_tokens = config.kv_cache_tokens
        if kv_cache_tokens is None and self.device.type == "cuda":
            kv_cache_tokens = gpu_kv_cache_tokens(
                model.spec, model.weights, config, self.quantization, max_logit_rows, max_model_len,
                self.logit_vocab_size,
            )  # fmt: skip
        num_blocks = -(-(kv_cache_tokens or max_model_len) // config.block_size)
        # No sequence may outgrow the whole cache (it would preempt itself forever): the context is at
        # most what the cache holds, and /v1/models says so.
        self.max_model_len = min(max_model_len, num_blocks * config.block_size)
        if self.max_model_len < 2:
            raise InvalidRequestError(f"max_model_len must be at least 2, got {self.max_model_len}")
        self.block_manager = BlockManager(num_blocks, config.block_size)
        decoder = Decoder.from_weights(
            model.spec, model.weights, self.max_model_len, ops_for(self.device), self.logit_vocab_size,
            quantization=config.quantization,
        )  # fmt: skip
        if config.persistent_decode and self.device.type == "cuda" and decoder.can_stack_layers():
            decoder.stack_layers()
        self.runner = ModelRunner(
            decoder, num_blocks, config.block_size, config.torch_dtype(), config.max_num_seqs,
            self.max_model_len, graphs=None if config.cuda_graphs else False, step_graphs=config.step_graphs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_logit_rows=max_logit_rows,
            capture_layers=self.speculator.target_layer_ids if self.speculator is not None else (),
            kv_cache_dtype=config.kv_cache_dtype,
            calibration_tokens=calibration_ids(model.tokenizer, self.logit_vocab_size),
        )  # fmt: skip
        # A step's tokens fit the largest step graph: a larger step would run eagerly and compile kernels
        # for its shapes.
        graphs = self.runner.graphs
        self.max_num_batched_tokens = min(
            config.max_num_batched_tokens, (graphs.max_step_tokens if graphs is not None else 0) or 1 << 62
        )
        # What the engine's steps cost, measured as they run: the scheduler cuts long prompts' chunks by it.
        self.step_cost = StepCostModel()
        step_ms = config.long_prefill_step_ms
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, self.max_num_batched_tokens,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_long_partial_prefills=config.max_long_partial_prefills, max_model_len=self.max_model_len,
            step_budget_s=step_ms / 1e3 if step_ms else None, step_cost=self.step_cost,
            step_sizes=step_sizes(self.max_num_batched_tokens),
        )  # fmt: skip
        self._last_step_done = 0.0  # perf_counter seconds: when the last step measured had its tokens
        self.measuring_steps = bool(step_ms)  # whether steps teach the step-cost model (warm-up's compile)
        run_ahead = config.run_ahead if config.run_ahead is not None else self.device.type == "cuda"
        # Drafting needs the tokens on the host: a step that drafts first reads any launched one. DFlash's
        # hidden states come from step graphs or eager steps, not decode graphs, so it never runs ahead.
        self.run_ahead = run_ahead and (self.speculator is None or not self.speculator.target_layer_ids)
        self.in_flight: PendingStep | None = None  # the launched step whose tokens are unread
        self.late: LateSamples | None = None  # its constrained rows that sit out while their masks fill

    @classmethod
    def load(cls, model: str, config: EngineConfig | None = None) -> Engine:
        config = config or EngineConfig()
        config.validate()  # before the model loads
        loaded = load_model(model, config.torch_dtype(), config.torch_device(), config.quantization)
        return cls(loaded, config)

    # --- requests -------------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError (or ContextLengthExceededError) for a request the engine cannot
        run (admission.py). Reads only fixed configuration, so any thread may call it."""
        check_request(
            prompt_token_ids, params, self.tokenizer is not None, self.grammars, self.logit_vocab_size,
            self.max_prompt_tokens, self.block_manager.num_blocks * self.config.block_size,
        )  # fmt: skip

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_model_len - 1  # max_model_len is within the KV cache (__init__)

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        self.check_request(prompt_token_ids, params)
        request_id = request_id or f"req-{next(self._request_counter)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, list(prompt_token_ids), params)
        if params.grammar is not None:
            seq.grammar = self.grammars.matcher(params.grammar)  # compiled by check_request
        text = None
        if self.tokenizer is not None and self.config.detokenize:
            text = TextStream(self.tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens)
        self.requests[request_id] = _Request(seq, text)
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.remove(request.seq)
            self.runner.forget(request_id)
            if self.speculator is not None:
                self.speculator.forget(request_id)
            request.seq.status = SequenceStatus.FINISHED
            request.seq.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None or self.late is not None

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step. With run-ahead, a step is launched and the previous one's tokens are returned,
        so each token comes back one step after the step that sampled it."""
        started = time.perf_counter()
        outputs = self._take_late()
        if self.in_flight is not None and not self._can_schedule_ahead():
            outputs += self._apply_in_flight()
        self._defer_late_masks()
        drafts = Drafts()
        if self.speculator is not None:
            num_drafts = self.speculator.draft_lengths(
                self.scheduler.running, self.block_manager, self.max_num_batched_tokens, self.max_model_len,
                self._in_flight_rows(),
            )  # fmt: skip
            if num_drafts:  # the proposer must see every token
                outputs += self._apply_in_flight() + self._take_late(wait=True)
                num_drafts = {seq: k for seq, k in num_drafts.items() if not seq.is_finished}
                drafts = self.speculator.request_drafts(num_drafts)
        scheduled_at = time.perf_counter()
        batch = self.scheduler.schedule(
            in_flight=self._in_flight_rows(), drafts=drafts, sitting_out=self._late_seqs()
        )
        if not batch:
            return outputs + self._apply_in_flight() + self._take_late(wait=True)
        self.runner.copy_blocks(batch.block_copies)
        scheduled = batch.scheduled
        is_decode = is_decode_step(scheduled)
        # what the step computes, for the step-cost model (only where the scheduler budgets time with it)
        work = StepWork.of(scheduled) if self.measuring_steps else None
        if not drafts and self.run_ahead and self.runner.can_launch_ahead(scheduled):
            launched = self.runner.launch(scheduled, self.in_flight)
            launched.work, launched.scheduled_at = work, scheduled_at
            if launched.ready is None:  # the CPU computed it in launch
                launched.done_at = time.perf_counter()
            outputs += self._apply_in_flight(launched)
            self._commit(scheduled)
            self.in_flight = launched
        else:
            if self.in_flight is not None:  # scheduled ahead, yet this step needs the host's tokens
                outputs += self._apply_in_flight()
                # their fed-back tokens are the sequences' own now
                scheduled = [
                    ScheduledRow(item.seq, item.num_new_tokens)
                    for item in scheduled
                    if not item.seq.is_finished
                ]
                if not scheduled:
                    return outputs
            results = self.runner.execute(scheduled, drafts.ring)
            self._measured(work, scheduled_at, time.perf_counter())
            if drafts.ring is not None:
                read = {item.seq: result.draft_ids for item, result in zip(scheduled, results, strict=True)}
                self.speculator.took_ring_drafts(drafts, read)
            outputs += self._apply(scheduled, results)
        if drafts:
            self.speculator.record_step(time.perf_counter() - started, verified_drafts=True)
        elif is_decode and self.speculator is not None:
            self.speculator.record_step(time.perf_counter() - started, verified_drafts=False)
        return outputs

    def _apply(self, scheduled: list[ScheduledRow], results: list[RowOutput]) -> list[RequestOutput]:
        """Apply a step's output: each sequence takes its new tokens (a verified one its accepted drafts
        and the target's next token; its KV stops at the last accepted draft, so rolling back only moves
        num_computed_tokens), commits its computed blocks and hands the proposer the hidden rows of the
        tokens it kept; then every row's new tokens are emitted."""
        for item, result in zip(scheduled, results, strict=True):
            seq = item.seq
            if result.hidden is not None:
                self.speculator.add_hidden(seq.request_id, result.hidden, seq.num_computed_tokens)
            seq.token_ids += result.token_ids
            seq.num_computed_tokens += item.num_new_tokens + result.num_accepted
            self.block_manager.commit_computed(seq)
            if item.num_drafts:
                self.speculator.record(seq, len(result.draft_ids), result.num_accepted)
        return [
            self._emit_new(item.seq, len(result.token_ids), result.logprob)
            for item, result in zip(scheduled, results, strict=True)
            if result.token_ids
        ]

    def _emit_new(self, seq: Sequence, num_new: int, logprob: TokenLogprob | None) -> RequestOutput:
        """Emit the sequence's last num_new tokens one by one (a stop among them ends the request there) as
        one output."""
        parts = []
        for position in range(seq.num_tokens - num_new, seq.num_tokens):
            token_id = seq.token_ids[position]
            finished = grammar_finish(seq, token_id, self.eos_token_ids) if seq.grammar is not None else None
            parts.append(self._emit(seq, logprob, position + 1, finished))
            if parts[-1].finished:
                break
        merged = parts[-1]
        if len(parts) > 1:
            merged.new_token_ids = [token for part in parts for token in part.new_token_ids]
            merged.new_text = "".join(part.new_text for part in parts)
        return merged

    def _in_flight_rows(self) -> dict[Sequence, int]:
        """The sequences whose next token the in-flight step sampled, and their rows of its samples (not
        the late ones: their samples there are not theirs)."""
        if self.in_flight is None:
            return {}
        late = self._late_seqs()
        return {seq: row for seq, row in self.in_flight.sample_rows().items() if seq not in late}

    def _late_seqs(self) -> set[Sequence]:
        """The sequences whose rows sit out while their masks fill (_defer_late_masks)."""
        return set(self.late.seqs) if self.late is not None else set()

    def _defer_late_masks(self) -> None:
        """If the in-flight step's constrained rows' masks are still being filled once the device has run
        it (so the next launch is due), those rows sit out the next launch (ModelRunner.defer_masks) and
        the others go on without waiting; _take_late samples them once their masks are written."""
        pending = self.in_flight
        if pending is None or pending.masks is None or self.late is not None or not LATE_ROWS_SIT_OUT:
            return
        fill = pending.masks.fill
        while not fill.done():
            if pending.ready is None or pending.ready.query():  # the device has nothing else to run
                self.late = self.runner.defer_masks(pending)
                return
            concurrent.futures.wait([fill], timeout=LATE_POLL_S)

    def _take_late(self, wait: bool = False) -> list[RequestOutput]:
        """The late rows' tokens (_defer_late_masks), applied and emitted once their masks are written (or
        at once, waiting for them)."""
        late = self.late
        if late is None or not (wait or late.masks.fill.done()):
            return []
        self.late = None
        return self._take_tokens(self.runner.sample_late(late))

    def _can_schedule_ahead(self) -> bool:
        """Whether the next step can be scheduled before the in-flight step's tokens are read: the cache
        has room for every running sequence's next token without preempting (a preempted sequence
        would lose its pending token)."""
        manager = self.block_manager
        pending = self._in_flight_rows()
        new_blocks = sum(
            manager.blocks_needed(seq.num_tokens + (seq in pending)) - len(seq.block_table)
            for seq in self.scheduler.running
        )
        return new_blocks <= manager.num_free_blocks

    def _apply_in_flight(self, launched: PendingStep | None = None) -> list[RequestOutput]:
        """Read the in-flight step's tokens, append them to their sequences and emit them; rows of
        sequences that finished or were aborted meanwhile are dropped. launched: the step launched after
        it, whose constrained rows' masks are begun (ModelRunner.start_masks) as soon as their grammars have
        taken these tokens, so that they are filled while the host emits and schedules."""
        pending, self.in_flight = self.in_flight, None
        read = []
        if pending is not None:
            tokens = self.runner.read(pending)
            self._measured(pending.work, pending.scheduled_at, pending.done_at or time.perf_counter())
            late = self._late_seqs()
            read = [(seq, token) for seq, token in zip(pending.seqs, tokens, strict=True) if seq not in late]
        return self._take_tokens(read, launched)

    def _take_tokens(
        self, read: list[tuple[Sequence, int]], launched: PendingStep | None = None
    ) -> list[RequestOutput]:
        """Append tokens the host has read to their sequences (those that finished or were aborted
        meanwhile drop theirs), have their grammars take them, begin the masks of `launched` (see
        _apply_in_flight) and emit them."""
        read = [(seq, token) for seq, token in read if not seq.is_finished]
        grammar_finishes: dict[Sequence, str | None] = {}
        for seq, token_id in read:
            seq.token_ids.append(token_id)
            if seq.grammar is not None:
                grammar_finishes[seq] = grammar_finish(seq, token_id, self.eos_token_ids)
        if launched is not None:
            ending = {seq for seq, finish in grammar_finishes.items() if finish is not None}
            self.runner.start_masks(launched, ending=ending)
        return [self._emit(seq, None, grammar_finished=grammar_finishes.get(seq)) for seq, _ in read]

    def _measured(self, work: StepWork | None, scheduled_at: float, done_at: float) -> None:
        """Give the step-cost model a step's time: from when it was scheduled, or when the step before it had
        its tokens if that was later (run ahead, it waited for that one on the device), to when it had its
        own. That is how long a request sent during it waits for it."""
        if work is not None:
            self.step_cost.observe(work, done_at - max(scheduled_at, self._last_step_done))
        self._last_step_done = done_at

    def _commit(self, scheduled: list[ScheduledRow]) -> None:
        for item in scheduled:
            if not item.seq.is_finished:
                item.seq.num_computed_tokens += item.num_new_tokens
                self.block_manager.commit_computed(item.seq)

    def _emit(
        self,
        seq: Sequence,
        logprob: TokenLogprob | None,
        num_known_tokens: int | None = None,
        grammar_finished: str | None = None,
    ) -> RequestOutput:
        """Stop-check (and detokenize, when the engine does) the sequence's newest known token (the last
        of its first num_known_tokens; by default all of them) and say what it adds (stopping.py).
        grammar_finished: what stopping.grammar_finish said for the token."""
        text = self.requests[seq.request_id].text
        num_known_tokens = num_known_tokens or seq.num_tokens
        reason, new_text = finish_reason(
            seq, text, num_known_tokens, self.max_model_len, self.eos_token_ids, grammar_finished
        )
        error = None
        if reason == "error":  # its grammar failed
            error = grammar_failed(seq, num_known_tokens - seq.num_prompt_tokens)
        if reason is not None:
            if text is not None:
                new_text += text.finish(flush=reason == "length")
            self._finish(seq, reason)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[seq.token_ids[num_known_tokens - 1]],
            new_text=new_text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_prompt_tokens,
            new_logprobs=[logprob] if logprob is not None else [],
            error=error,
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self.runner.forget(seq.request_id)
        if self.speculator is not None:
            self.speculator.finish(seq)
        del self.requests[seq.request_id]

    # --- conveniences ---------------------------------------------------------------------------

    def stream(self, prompt_token_ids: list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Add one request and step until it finishes, yielding its outputs (others may run too)."""
        request_id = self.add_request(prompt_token_ids, params)
        try:
            while True:
                for output in self.step():
                    if output.request_id == request_id:
                        yield output
                        if output.finished:
                            return
        finally:
            self.abort(request_id)

    def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> tuple[list[int], str, str]:
        """Run one request to the end: (generated token ids, text, finish reason)."""
        token_ids: list[int] = []
        text = ""
        finish_reason = ""
        for output in self.stream(prompt_token_ids, params):
            token_ids += output.new_token_ids
            text += output.new_text
            finish_reason = output.finish_reason or finish_reason
        return token_ids, text, finish_reason

    def warm_up(self, force: bool = False) -> float:
        """Compile every kernel variant the engine can launch before it serves, and leave the engine as
        built (engine/warm_up.py). Skipped on the CPU (no Triton) unless forced (tests). Returns the
        seconds."""
        return warm_up_engine(self, force)
