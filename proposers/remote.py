"""Both ends of a proposer in another process, over a shared-memory channel (proposers/channel.py).

RemoteProposer is the engine's Proposer: it keeps, per request, how many tokens the server mirrors and
sends only the new ones: a live request's tokens only grow (the Proposer contract), and one whose list
got shorter all the same is forgotten and sent again. ProposerServer runs in the proposer's process: it
mirrors each request's tokens and asks the real proposer for drafts. The only call across processes
outside the channel is `connect` (e.g. a Serve handle call asking the proposer actor to attach to a
channel), made at start and after a failure, never per step.

For DFlash the target's hidden states cross too. Their layout (HiddenLayout: the target layers, the row
width and dtype) is the proposer's, asked once before the RemoteProposer is made (hidden_layout() on the
proposer's side); the channel is created with it and the server refuses a channel of another layout.
RemoteProposer sends each context row exactly once, in position order: rows of a sequence that does not
fit a step wait on this side (a long prompt crosses over several steps, drafting nothing until it has),
so the proposer never sees a gap or a row twice.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import torch
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.spec_decode.proposer_interface import DraftRequest, Proposer, ProposerUnavailableError
from tileinfer.proposers.channel import (
    HIDDEN_DTYPES,
    ChannelCapacity,
    ChannelClient,
    ChannelRequest,
    ChannelServer,
)
from tileinfer.proposers.draft_ring import RingDrafts

logger = logging.getLogger(__name__)

CONNECT_RETRY_S = 1.0  # between attempts to attach while the proposer (re)starts
DEFAULT_STEP_ROWS = 2048  # hidden rows per step when the capacity names none


@dataclasses.dataclass(frozen=True)
class HiddenLayout:
    """What a proposer reads of the target's hidden states: none for n-gram and draft models."""

    target_layer_ids: tuple[int, ...] = ()
    width: int = 0  # values per row: len(target_layer_ids) x the target's hidden size
    dtype: str = "float32"  # a key of tileinfer.proposers.channel.HIDDEN_DTYPES


def hidden_layout(proposer: Proposer) -> HiddenLayout:
    """The layout of the rows `proposer` reads (a proposer that reads hidden states, DFlash, says which
    layers, how wide and in what dtype)."""
    layer_ids = tuple(proposer.target_layer_ids)
    if not layer_ids:
        return HiddenLayout()
    dtype = next(name for name, value in HIDDEN_DTYPES.items() if value == proposer.hidden_dtype)
    return HiddenLayout(layer_ids, proposer.hidden_width, dtype)


@dataclasses.dataclass
class _Rows:
    """A sequence's context rows: how many the server's proposer holds (positions 0..held - 1, as of the
    last step that crossed) and the next ones that wait here ([num_waiting, width])."""

    held: int = 0
    waiting: torch.Tensor | None = None


@dataclasses.dataclass(eq=False)
class _Connection:
    channel: ChannelClient
    attached: threading.Event = dataclasses.field(default_factory=threading.Event)
    given_up: threading.Event = dataclasses.field(default_factory=threading.Event)


class RemoteProposer(Proposer):
    """A Proposer whose drafts come from a proposer in another process.

    connect(channel_name) must make the other side attach to that channel (ProposerServer) and return
    once it has, raising if it cannot. It runs on a thread of its own, retried for connect_timeout_s.

    propose() raises ProposerUnavailableError until the first attach, and TimeoutError (a dead or stalled
    proposer) when an answer takes longer than timeout_s plus timeout_per_new_token_s per new token (a
    new prompt is the proposer's prefill, which takes a draft model a while). After any failure it starts
    over on a new channel, so that a restarted proposer is used again. Sequences that do not fit this
    step's channel capacity get no drafts this step and cross on a later one.

    With a `hidden` layout (DFlash) it exposes target_layer_ids, so that the engine captures those
    layers, and sends each request's new rows of DraftRequest.target_hidden (from a GPU `device`, in GPU
    memory when the proposer's process can map it: proposers/device_rows.py). A sequence whose rows
    were on a channel that failed cannot be drafted again (the engine has handed those rows over
    already): it decodes plainly until it is forgotten; later sequences draft on the new channel.
    """

    def __init__(
        self,
        connect: Callable[[str], object],
        capacity: ChannelCapacity | None = None,
        timeout_s: float = 0.5,
        timeout_per_new_token_s: float = 1e-3,
        connect_timeout_s: float = 60.0,
        hidden: HiddenLayout | None = None,
        device: torch.device | None = None,
        use_ring: bool = False,
    ) -> None:
        """use_ring: drafts made by a model cross in the draft ring where the channel has one (launch)."""
        capacity = capacity or ChannelCapacity()
        self.target_layer_ids: tuple[int, ...] = ()
        if hidden is not None and hidden.target_layer_ids:
            self.target_layer_ids = hidden.target_layer_ids
            capacity = dataclasses.replace(
                capacity, hidden_width=hidden.width, hidden_dtype=hidden.dtype,
                max_step_rows=capacity.max_step_rows or DEFAULT_STEP_ROWS,
            )  # fmt: skip
        self.capacity = capacity
        self.timeout_s = timeout_s
        self.timeout_per_new_token_s = timeout_per_new_token_s
        self.connect_timeout_s = connect_timeout_s
        self.device = device  # where the engine's hidden rows are: on a GPU they cross in GPU memory
        self.use_ring = use_ring
        self._connect = connect
        self._next_key = itertools.count()
        self._keys: dict[str, int] = {}  # request id -> its key on the current channel
        self._num_mirrored: dict[str, int] = {}  # request id -> tokens the server holds for it
        self._forget_keys: list[int] = []  # keys to drop, sent with the next step
        self._rows: dict[str, _Rows] = {}  # request id -> its hidden rows (DFlash)
        self._lost: set[str] = set()  # request ids whose rows went down with a failed channel
        self._connection: _Connection | None = None
        self._reconnect()

    @property
    def rows_in_gpu_memory(self) -> bool:
        """Whether hidden rows cross in GPU memory on the current channel (proposers/device_rows.py)."""
        connection = self._connection
        return connection is not None and connection.channel.rows_in_gpu_memory

    def wait_attached(self, timeout_s: float) -> bool:
        """Block until the current channel is attached (True) or timeout_s passed (False)."""
        return self._connection is not None and self._connection.attached.wait(timeout_s)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        connection, items, included = self._send(requests, to_ring=False)
        try:
            answers = connection.channel.receive(self._timeout(items))
        except Exception:
            self._reconnect()
            raise
        drafts: list[list[int]] = [[] for _ in requests]
        for index, answer in zip(included, answers, strict=True):
            drafts[index] = answer
        return drafts

    def launch(self, requests: Sequence[DraftRequest]) -> RingDrafts | None:
        """Send a step whose drafts the proposer writes into the draft ring (proposers/draft_ring.py),
        without waiting for them; None when this channel's drafts do not cross in a ring (not attached
        yet, or a proposer whose drafts are made on the host: call propose). Raises as propose does."""
        connection = self._connection
        ring = None if connection is None or not connection.attached.is_set() else connection.channel.ring
        if ring is None or not self.use_ring:
            return None
        _, items, included = self._send(requests, to_ring=True)
        rows: list[int | None] = [None] * len(requests)
        num_drafts = [0] * len(requests)
        for slot, (index, item) in enumerate(zip(included, items, strict=True)):
            if item.num_drafts:
                rows[index], num_drafts[index] = slot, item.num_drafts
        return RingDrafts(ring, connection.channel.last_step, rows, num_drafts, self._timeout(items),
                          self._reconnect)  # fmt: skip

    def _timeout(self, items: Sequence[ChannelRequest]) -> float:
        num_new = sum(len(item.new_tokens) + item.num_rows for item in items)
        return self.timeout_s + num_new * self.timeout_per_new_token_s

    def _send(
        self, requests: Sequence[DraftRequest], to_ring: bool
    ) -> tuple[_Connection, list[ChannelRequest], list[int]]:
        """Send a step over the current channel: the connection, the channel requests, and the index in
        `requests` of each. Records what the proposer now mirrors (after a failure the next step starts
        over on a new channel, so an answer that never comes changes nothing)."""
        connection = self._connection
        if connection is None or not connection.attached.is_set():
            if connection is None or connection.given_up.is_set():
                self._reconnect()
            raise ProposerUnavailableError("the proposer has not attached to the channel yet")
        for request in requests:
            if len(request.token_ids) < self._num_mirrored.get(request.request_id, 0):
                self._start_over(request.request_id)
        # nothing else here changes until the step has crossed: after a failure the engine hands the same
        # rows over again (it keeps what a failed call did not take)
        rows = {} if not self.target_layer_ids else self._context_rows(requests)
        items, included, rows_after = self._pack(requests, rows)
        forget_keys = self._forget_keys[: self.capacity.max_forgets]
        try:
            connection.channel.send(items, forget_keys, self._timeout(items), to_ring)
        except Exception:
            self._reconnect()  # a fresh channel and fresh mirrors: its state is unknown now
            raise
        del self._forget_keys[: len(forget_keys)]
        self._rows.update(rows_after)
        for index, item in zip(included, items, strict=True):
            request_id = requests[index].request_id
            self._keys[request_id] = item.key
            self._num_mirrored[request_id] = item.keep + len(item.new_tokens)
        return connection, items, included

    def _context_rows(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, torch.Tensor]]:
        """Per request (not lost): (rows the server holds, [num_rows, width] the rows of the positions
        after them up to its last token's, waiting ones first); raises InvalidRequestError for a
        request without the rows it needs."""
        rows = {}
        for request in requests:
            request_id = request.request_id
            if request_id in self._lost:
                continue
            # a new sequence's rows start where the target's prefix cache left off (0 without a hit)
            state = self._rows.get(request_id) or _Rows(held=request.hidden_start or 0)
            num_context = max(len(request.token_ids) - 1, 0)  # the last token has not run in the target
            held = state.held
            waiting = state.waiting if state.waiting is not None and held < num_context else None
            waiting = waiting[: num_context - held] if waiting is not None else None
            num_needed = num_context - held - (0 if waiting is None else waiting.shape[0])
            fresh = request.target_hidden
            width = self.capacity.hidden_width
            if num_needed and (fresh is None or fresh.dim() != 2 or fresh.shape[1] != width
                               or fresh.shape[0] < num_needed):  # fmt: skip
                got = "none" if fresh is None else list(fresh.shape)
                raise InvalidRequestError(
                    f"request {request_id}: the proposer needs the target's hidden states of tokens "
                    f"{num_context - num_needed}..{num_context - 1} ([{num_needed}, {width}]), got {got}"
                )
            parts = [
                part for part in (waiting, fresh[:num_needed] if num_needed else None) if part is not None
            ]
            rows[request_id] = (held, torch.cat(parts) if parts else torch.empty(0, width))
        return rows

    def _pack(
        self, requests: Sequence[DraftRequest], rows: dict[str, tuple[int, torch.Tensor]]
    ) -> tuple[list[ChannelRequest], list[int], dict[str, _Rows]]:
        """The channel requests of this step (what fits), the index in `requests` of each, and each
        request's rows once the step has crossed. A sequence whose rows do not all fit sends those that
        do, with the tokens they belong to, and asks for no drafts."""
        capacity = self.capacity
        items: list[ChannelRequest] = []
        included: list[int] = []
        rows_after: dict[str, _Rows] = {}
        budget, row_budget = capacity.max_step_tokens, capacity.hidden_rows
        for index, request in enumerate(requests):
            request_id, token_ids, num_drafts = request.request_id, request.token_ids, request.num_drafts
            if request_id in self._lost:
                continue
            held, hidden = rows.get(request_id, (0, None))
            if hidden is not None and hidden.shape[0] > row_budget > 0:
                hidden, token_ids, num_drafts = hidden[:row_budget], token_ids[: held + row_budget + 1], 0
            keep = self._num_mirrored.get(request_id, 0)  # the token ids only grow (_send)
            num_new = len(token_ids) - keep
            num_rows = 0 if hidden is None else hidden.shape[0]
            fits = len(items) < capacity.max_requests and num_new <= budget and num_rows <= row_budget
            if request_id in rows:
                all_rows = rows[request_id][1]
                num_sent = num_rows if fits else 0
                rows_after[request_id] = _Rows(
                    held + num_sent, all_rows[num_sent:] if num_sent < len(all_rows) else None
                )
            if not fits:
                continue
            key = self._keys.get(request_id)
            if key is None:
                key = next(self._next_key)
            num_drafts = min(num_drafts, capacity.max_drafts)
            items.append(
                ChannelRequest(key, keep, token_ids[keep:], num_drafts, hidden if num_rows else None, held)
            )
            included.append(index)
            budget -= num_new
            row_budget -= num_rows
        return items, included, rows_after

    def _start_over(self, request_id: str) -> None:
        """A live request's tokens were replaced, not extended (against the Proposer contract): the
        proposer forgets it, and its tokens cross again. One whose hidden rows crossed cannot draft
        again (the engine has handed them over already): it decodes plainly until it is forgotten."""
        rows_crossed = request_id in self._rows and self._rows[request_id].held > 0
        self.forget(request_id)
        if rows_crossed:
            self._lost.add(request_id)

    def forget(self, request_id: str) -> None:
        self._num_mirrored.pop(request_id, None)
        self._rows.pop(request_id, None)
        self._lost.discard(request_id)
        key = self._keys.pop(request_id, None)
        if key is not None:
            self._forget_keys.append(key)

    def _reconnect(self) -> None:
        """Abandon the current channel (and everything mirrored on it) and attach the proposer to a
        new one, on a thread of its own."""
        self.close()
        self._keys.clear()
        self._num_mirrored.clear()
        self._forget_keys.clear()
        # rows that crossed are gone with the old proposer; rows that only waited here still hold
        self._lost |= {request_id for request_id, state in self._rows.items() if state.held}
        self._rows = {request_id: state for request_id, state in self._rows.items() if not state.held}
        connection = _Connection(ChannelClient(self.capacity, self.device))
        self._connection = connection
        threading.Thread(
            target=self._attach, args=(connection,), name="tileinfer-attach", daemon=True
        ).start()

    def _attach(self, connection: _Connection) -> None:
        deadline = time.monotonic() + self.connect_timeout_s
        while self._connection is connection:
            try:
                self._connect(connection.channel.name)
            except Exception:  # noqa: BLE001 - a proposer that is restarting: try again shortly
                logger.debug("attaching the proposer failed", exc_info=True)
                if time.monotonic() + CONNECT_RETRY_S > deadline:
                    logger.warning("the proposer did not attach within %.0f s", self.connect_timeout_s)
                    connection.given_up.set()
                    return
                time.sleep(CONNECT_RETRY_S)
                continue
            connection.attached.set()
            return

    def close(self) -> None:
        if self._connection is not None:
            self._connection.channel.close()
            self._connection = None


class ProposerServer:
    """Serves one channel for a proposer: mirrors each key's tokens, asks for drafts, answers.

    Several servers may share one proposer one after another (a re-attached engine); `lock` keeps their
    calls apart, and a server that stops forgets every request it mirrored.
    """

    def __init__(
        self, proposer: Proposer, channel_name: str, lock: threading.Lock, draft_ahead: bool = False
    ) -> None:
        """draft_ahead: after each answer, call the proposer's draft_ahead() (nothing for one that cannot),
        which drafts the next block while the engine verifies; worth it when the proposer has a GPU of its
        own."""
        self.proposer = proposer
        self.draft_ahead = draft_ahead
        self.channel = ChannelServer(channel_name)
        layout, capacity = hidden_layout(proposer), self.channel.capacity
        if (capacity.hidden_width, capacity.hidden_dtype) != (layout.width, layout.dtype) and (
            capacity.hidden_width or layout.width
        ):
            self.channel.close()
            raise ValueError(
                f"channel {channel_name} carries hidden rows of {capacity.hidden_width} "
                f"{capacity.hidden_dtype} values; this proposer reads {layout.width} {layout.dtype} values"
            )
        self.lock = lock
        self._reads_hidden = bool(layout.width)
        # drafts made by a model (on the proposer's GPU) cross in the draft ring; n-gram's stay on the host
        self.channel.offer_ring(proposer.drafts_from_model)
        self.stop_event = threading.Event()
        self._mirrors: dict[int, list[int]] = {}  # key -> the request's tokens so far
        # the proposer's request ids are this server's own: a re-attached engine reuses keys
        self._id_prefix = uuid.uuid4().hex[:8]

    def _request_id(self, key: int) -> str:
        return f"{self._id_prefix}-{key}"

    def serve(self) -> None:
        """Answer steps until the client closes the channel or stop() is called."""
        try:
            while (step := self.channel.next_step(self.stop_event)) is not None:
                with self.lock:
                    try:
                        drafts = self._draft(step.requests, step.forget_keys)
                    except Exception as error:  # noqa: BLE001 - the engine decodes without drafts then
                        logger.exception("the proposer failed on a step")
                        self.channel.respond_error(f"{type(error).__name__}: {error}")
                        continue
                self.channel.respond(drafts)
                if self.draft_ahead:
                    with self.lock:
                        self._draft_ahead()
        finally:
            with self.lock:
                for key in self._mirrors:
                    self.proposer.forget(self._request_id(key))
                self._mirrors.clear()
            self.channel.close()

    def stop(self) -> None:
        self.stop_event.set()

    def _draft_ahead(self) -> None:
        try:
            self.proposer.draft_ahead()
        except Exception:  # noqa: BLE001 - drafts made ahead only save time; the next step drafts anew
            logger.exception("drafting ahead failed")

    def _draft(self, requests: Sequence[ChannelRequest], forget_keys: Sequence[int]) -> list[list[int]]:
        for key in forget_keys:
            if self._mirrors.pop(key, None) is not None:
                self.proposer.forget(self._request_id(key))
        draft_requests = []
        for request in requests:
            mirror = self._mirrors.setdefault(request.key, [])
            if request.keep != len(mirror):  # a live request's tokens only grow (RemoteProposer._send)
                raise ValueError(
                    f"sequence {request.key}: asked to keep {request.keep} tokens, but {len(mirror)} are held"
                )
            mirror.extend(request.new_tokens)
            draft_requests.append(
                DraftRequest(
                    self._request_id(request.key),
                    mirror,
                    request.num_drafts,
                    request.hidden,
                    hidden_start=request.row_start if self._reads_hidden else None,
                )  # fmt: skip
            )
        return self.proposer.propose(draft_requests)
