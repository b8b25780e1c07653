"""Draft-model proposer: a smaller model with the target's vocabulary, or the target's own first layers
(self-draft), drafts greedily with its own paged KV cache and, on a GPU, its own decode graphs.

Per request it keeps a Sequence whose tokens are the request's tokens as of the last call plus the drafts
it proposed then. A call rolls that back to where it agrees with the request's tokens now (rejected drafts
drop out; their KV slots are simply overwritten later), computes the new tokens, and decodes the drafts.

Drafting ahead (draft_ahead, called by a proposer actor on its own GPU while the engine verifies): each
sequence of the last call is extended by one more block, as if the engine accepts every draft and its next
token is the draft model's own guess. If that is what happens, the next call finds those drafts ready;
otherwise the roll-back drops them like any rejected draft.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as TokenIds

from tileinfer.engine.config import EngineConfig
from tileinfer.engine.errors import InvalidRequestError, ModelLoadError
from tileinfer.engine.kv.block_manager import BlockManager, common_prefix_length
from tileinfer.engine.models.decoder import Decoder
from tileinfer.engine.models.loader import LoadedModel
from tileinfer.engine.ops import ops_for
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.sampling.params import SamplingParams
from tileinfer.engine.sequence import Sequence
from tileinfer.engine.spec_decode.proposer_interface import AheadStats, DraftRequest, Proposer
from tileinfer.engine.step import PendingStep, ScheduledRow

# Argmax drafts: deterministic, so the engine verifies them with a one-hot q (draft_probs=None).
_GREEDY = SamplingParams(temperature=0.0)


@dataclasses.dataclass(eq=False)
class _DraftState:
    seq: Sequence  # token_ids: the request's tokens as of the last call, then that call's drafts
    num_request_tokens: int = 0  # how many of seq.token_ids were the request's own at the last call
    num_drafts: int = 0  # how many drafts the last call returned


class DraftModelProposer(Proposer):
    """Proposes each request's greedy continuation under the draft model (see
    tileinfer.engine.spec_decode.proposer_interface.Proposer).

    config: the draft side's own settings (EngineConfig's fields): device, dtype, block_size, its KV
    capacity (kv_cache_tokens), max_model_len, max_num_seqs (the batch of one decode step, and the largest
    CUDA graph), max_num_batched_tokens (one prefill chunk) and cuda_graphs. A request that does not fit
    the KV capacity or max_model_len gets fewer drafts, or none; drafts only affect speed.
    """

    drafts_from_model = True  # in another process, its drafts cross in the draft ring (proposers/channel.py)

    def __init__(
        self, draft: LoadedModel, target_vocab_size: int, config: EngineConfig | None = None
    ) -> None:
        """target_vocab_size: the target's logits width (LoadedModel.logit_vocab_size); the draft's must
        be the same, its drafts then being ids the target scores."""
        if draft.logit_vocab_size != target_vocab_size:
            raise ModelLoadError(
                f"the draft model {draft.name} has a vocabulary of {draft.logit_vocab_size} tokens but the "
                f"target's has {target_vocab_size}: a draft model must use the target's tokenizer"
            )
        config = config or EngineConfig()
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise InvalidRequestError("max_num_seqs and max_num_batched_tokens must be at least 1")
        device, dtype = config.torch_device(), config.torch_dtype()
        self.name = draft.name
        self.max_model_len = min(config.max_model_len or draft.spec.max_position_embeddings, 1 << 20)
        self.max_num_seqs = config.max_num_seqs  # sequences drafting together (one decode step's batch)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        num_blocks = -(-(config.kv_cache_tokens or self.max_model_len) // config.block_size)
        self.block_manager = BlockManager(num_blocks, config.block_size)
        # .to() returns the same tensor when device and dtype already match: weights are shared, not copied
        weights = {name: tensor.to(device=device, dtype=dtype) for name, tensor in draft.weights.items()}
        decoder = Decoder.from_weights(
            draft.spec, weights, self.max_model_len, ops_for(device), draft.logit_vocab_size
        )
        self.runner = ModelRunner(
            decoder, num_blocks, config.block_size, dtype, config.max_num_seqs, self.max_model_len,
            graphs=None if config.cuda_graphs else False,
        )  # fmt: skip
        self._states: dict[str, _DraftState] = {}
        self._last_call: list[_DraftState] = []  # what draft_ahead extends
        self.ahead_stats = AheadStats()

    @classmethod
    def self_draft(
        cls, target: LoadedModel, num_layers: int, config: EngineConfig | None = None
    ) -> DraftModelProposer:
        """Draft with the target's first num_layers layers, its final norm and its LM head. The weight
        tensors are the target's own (a subset of its dict, not copies)."""
        if not 1 <= num_layers <= target.spec.num_layers:
            raise InvalidRequestError(
                f"a self-draft runs 1 to {target.spec.num_layers} of the target's layers, got {num_layers}"
            )
        weights = {name: tensor for name, tensor in target.weights.items() if _layer_index(name) < num_layers}
        draft = dataclasses.replace(
            target,
            name=f"{target.name} (first {num_layers} layers)",
            spec=dataclasses.replace(target.spec, num_layers=num_layers),
            weights=weights,
        )
        return cls(draft, target.logit_vocab_size, config)

    # --- Proposer ---------------------------------------------------------------------------------

    def propose(self, requests: TokenIds[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        wanted = [(row, request) for row, request in enumerate(requests) if request.num_drafts > 0]
        self._last_call = []
        for start in range(0, len(wanted), self.max_num_seqs):
            group: dict[Sequence, int] = {}  # sequence -> its token count once its drafts are in
            rows: list[tuple[int, _DraftState]] = []
            for row, request in wanted[start : start + self.max_num_seqs]:
                state = self._catch_up(request)
                num_drafts = self._reserve(state.seq, state.num_request_tokens, request.num_drafts)
                if num_drafts > 0:
                    goal = state.num_request_tokens + num_drafts
                    self._trim(state.seq, goal)  # drafts made ahead beyond this call's
                    self.ahead_stats.drafts_reused += state.seq.num_tokens - state.num_request_tokens
                    group[state.seq] = goal
                    rows.append((row, state))
            self._decode(group)
            for row, state in rows:
                drafts[row] = state.seq.token_ids[state.num_request_tokens :]
                state.num_drafts = len(drafts[row])
                self._last_call.append(state)
        return drafts

    def draft_ahead(self) -> None:
        """Extend each sequence of the last call by one more block (its guess of the engine's next token,
        then as many drafts as the last call gave), as if the engine accepted all of that call's drafts.
        Meant for idle time: a proposer actor calls it after answering, while the engine verifies."""
        group: dict[Sequence, int] = {}
        for state in self._last_call:
            seq = state.seq
            if self._states.get(seq.request_id) is not state or state.num_drafts == 0:
                continue  # forgotten since, or no drafts to build on
            extra = self._room(seq, seq.num_tokens, state.num_drafts + 1)
            if extra > 0:
                self.block_manager.append_slots(seq, extra - 1)
                group[seq] = seq.num_tokens + extra
        self._last_call = []
        before = {seq: seq.num_tokens for seq in group}
        self._decode(group)
        # the first token of each block is the guess of the engine's own token, not a draft
        self.ahead_stats.drafts_made += sum(goal - before[seq] - 1 for seq, goal in group.items())

    def forget(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self._free(state.seq)
            self.runner.forget(request_id)

    # --- per request --------------------------------------------------------------------------------

    def _catch_up(self, request: DraftRequest) -> _DraftState:
        """Roll the request's sequence back to where it agrees with the request's tokens, then append the
        rest of them (uncomputed)."""
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = _DraftState(Sequence(request.request_id, [], _GREEDY))
        seq, token_ids = state.seq, request.token_ids
        # The first num_request_tokens tokens were the request's at the last call, and its tokens only
        # grow (the Proposer contract): only what came after needs comparing, i.e. about k + 1 tokens.
        known = state.num_request_tokens if len(token_ids) >= state.num_request_tokens else 0
        common = known + common_prefix_length(seq.token_ids[known:], token_ids[known:])
        if common == len(token_ids) and seq.num_tokens > common:
            # every request token agrees and drafts made ahead follow them: keep those (and their KV)
            state.num_request_tokens = len(token_ids)
            return state
        del seq.token_ids[common:]
        seq.token_ids += token_ids[common:]
        # keep at least the last token to compute: its logits give the first draft
        seq.num_computed_tokens = max(0, min(seq.num_computed_tokens, common, len(token_ids) - 1))
        state.num_request_tokens = len(token_ids)
        return state

    def _reserve(self, seq: Sequence, num_request_tokens: int, num_drafts: int) -> int:
        """How many drafts the sequence can have after its first num_request_tokens tokens (at most
        num_drafts), with KV slots reserved for them; 0 frees its blocks for the others."""
        num_drafts = self._room(seq, num_request_tokens, num_drafts)
        if num_drafts <= 0 or num_request_tokens == 0:
            self._free(seq)
            return 0
        self.block_manager.append_slots(seq, max(num_request_tokens + num_drafts - 1 - seq.num_tokens, 0))
        return num_drafts

    def _room(self, seq: Sequence, num_tokens: int, num_drafts: int) -> int:
        """How many of num_drafts tokens after the sequence's first num_tokens the cache and
        max_model_len leave room for. Token i after them is computed at position num_tokens + i - 1, so
        the last (never computed) one needs no slot."""
        manager = self.block_manager
        num_slots = (len(seq.block_table) + manager.num_free_blocks) * manager.block_size
        return min(num_drafts, min(num_slots, self.max_model_len) + 1 - num_tokens)

    @staticmethod
    def _trim(seq: Sequence, num_tokens: int) -> None:
        """Drop tokens (drafts made ahead) beyond the first num_tokens, and their KV with them."""
        if seq.num_tokens > num_tokens:
            del seq.token_ids[num_tokens:]
            seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens - 1)

    def _free(self, seq: Sequence) -> None:
        # With no computed tokens, free() registers no partial block in the prefix cache (the draft side
        # shares no KV: a rolled-back block is overwritten in place).
        seq.num_computed_tokens = 0
        self.block_manager.free(seq)

    # --- the batched drafting loop ---------------------------------------------------------------------

    def _decode(self, goal: dict[Sequence, int]) -> None:
        """Compute each sequence's uncomputed tokens (chunked), then decode greedily until it holds
        goal[seq] tokens. Steps of one new token per sequence are launched before the previous one's
        tokens are read (on a GPU: CUDA-graph replays back to back, each fed the previous one's samples on
        the device); a step that needs the tokens on the host reads them first."""
        pending: PendingStep | None = None  # the launched step whose tokens are unread
        in_flight: dict[Sequence, int] = {}  # its sequences (one token ahead) and their rows of its samples
        active = [seq for seq, num_tokens in goal.items() if seq.num_tokens < num_tokens]
        while active:
            if all(seq in in_flight or seq.num_uncomputed_tokens == 1 for seq in active):
                rows = [ScheduledRow(seq, 1, in_flight.get(seq)) for seq in active]
                launched = self.runner.launch(rows, pending)
                _append(pending)
                for seq in active:
                    seq.num_computed_tokens += 1
                pending = launched
            else:
                _append(pending)
                pending = None
                scheduled = self._prefill_chunks(active)
                for item, result in zip(scheduled, self.runner.execute(scheduled), strict=True):
                    item.seq.num_computed_tokens += item.num_new_tokens
                    item.seq.token_ids += result.token_ids
            in_flight = pending.sample_rows() if pending is not None else {}
            active = [seq for seq in active if seq.num_tokens + (seq in in_flight) < goal[seq]]
        _append(pending)

    def _prefill_chunks(self, seqs: list[Sequence]) -> list[ScheduledRow]:
        """Each sequence's uncomputed tokens, in order, as far as one step's token budget goes."""
        scheduled: list[ScheduledRow] = []
        budget = self.max_num_batched_tokens
        for seq in seqs:
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new > 0:
                scheduled.append(ScheduledRow(seq, num_new))
                budget -= num_new
        return scheduled


def _append(pending: PendingStep | None) -> None:
    """Read a launched step's sampled tokens into their sequences."""
    if pending is not None:
        for seq, token_id in zip(pending.seqs, pending.read(), strict=True):
            seq.token_ids.append(token_id)


def _layer_index(weight_name: str) -> int:
    """The layer a weight belongs to, -1 for the embedding, final norm and LM head."""
    parts = weight_name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else -1
