"""Both ends of a proposer in another process, over a shared-memory channel (proposers/channel.py).

RemoteProposer is the engine's Proposer: it keeps, per request, how many tokens the server mirrors and
sends only the new ones. ProposerServer runs in the proposer's process: it mirrors each request's tokens
and asks the real proposer for drafts. The only call across processes outside the channel is `connect`
(e.g. a Serve handle call asking the proposer actor to attach to a channel), made at start and after a
failure, never per step.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from proposers.base import DraftRequest, Proposer, ProposerUnavailableError
from proposers.channel import ChannelCapacity, ChannelClient, ChannelRequest, ChannelServer

logger = logging.getLogger(__name__)

CONNECT_RETRY_S = 1.0  # between attempts to attach while the proposer (re)starts


@dataclasses.dataclass(eq=False)
class _Connection:
    channel: ChannelClient
    attached: threading.Event = dataclasses.field(default_factory=threading.Event)
    given_up: threading.Event = dataclasses.field(default_factory=threading.Event)


class RemoteProposer:
    """A Proposer whose drafts come from a proposer in another process.

    connect(channel_name) must make the other side attach to that channel (ProposerServer) and return
    once it has, raising if it cannot. It runs on a thread of its own, retried for connect_timeout_s.

    propose() raises ProposerUnavailableError until the first attach, and TimeoutError (a dead or stalled
    proposer) when an answer takes longer than timeout_s plus timeout_per_new_token_s per new token (a
    new prompt is the proposer's prefill, which takes a draft model a while). After any failure it starts
    over on a new channel, so that a restarted proposer is used again. Sequences that do not fit this
    step's channel capacity get no drafts this step and cross on a later one.
    """

    def __init__(
        self,
        connect: Callable[[str], object],
        capacity: ChannelCapacity | None = None,
        timeout_s: float = 0.5,
        timeout_per_new_token_s: float = 1e-3,
        connect_timeout_s: float = 60.0,
    ) -> None:
        self.capacity = capacity or ChannelCapacity()
        self.timeout_s = timeout_s
        self.timeout_per_new_token_s = timeout_per_new_token_s
        self.connect_timeout_s = connect_timeout_s
        self._connect = connect
        self._next_key = itertools.count()
        self._keys: dict[str, int] = {}  # request id -> its key on the current channel
        self._num_mirrored: dict[str, int] = {}  # request id -> tokens the server holds for it
        self._forget_keys: list[int] = []  # keys to drop, sent with the next step
        self._connection: _Connection | None = None
        self._reconnect()

    def wait_attached(self, timeout_s: float) -> bool:
        """Block until the current channel is attached (True) or timeout_s passed (False)."""
        return self._connection is not None and self._connection.attached.wait(timeout_s)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        connection = self._connection
        if connection is None or not connection.attached.is_set():
            if connection is None or connection.given_up.is_set():
                self._reconnect()
            raise ProposerUnavailableError("the proposer has not attached to the channel yet")
        items, included = self._pack(requests)
        forget_keys = self._forget_keys[: self.capacity.max_forgets]
        try:
            num_new_tokens = sum(len(item.new_tokens) for item in items)
            timeout_s = self.timeout_s + num_new_tokens * self.timeout_per_new_token_s
            answers = connection.channel.exchange(items, forget_keys, timeout_s)
        except Exception:
            self._reconnect()  # a fresh channel and fresh mirrors: its state is unknown now
            raise
        del self._forget_keys[: len(forget_keys)]
        drafts: list[list[int]] = [[] for _ in requests]
        for index, item, answer in zip(included, items, answers, strict=True):
            request_id = requests[index].request_id
            self._keys[request_id] = item.key
            self._num_mirrored[request_id] = item.keep + len(item.new_tokens)
            drafts[index] = answer
        return drafts

    def _pack(self, requests: Sequence[DraftRequest]) -> tuple[list[ChannelRequest], list[int]]:
        """The channel requests of this step (what fits) and the index in `requests` of each."""
        capacity = self.capacity
        items: list[ChannelRequest] = []
        included: list[int] = []
        budget = capacity.max_step_tokens
        for index, request in enumerate(requests):
            if len(items) == capacity.max_requests:
                break
            # the token ids only grow between calls (the Proposer contract); a shorter list keeps less
            keep = min(self._num_mirrored.get(request.request_id, 0), len(request.token_ids))
            num_new = len(request.token_ids) - keep
            if num_new > budget:
                continue
            key = self._keys.get(request.request_id)
            if key is None:
                key = next(self._next_key)
            new_tokens = request.token_ids[keep:]
            num_drafts = min(request.num_drafts, capacity.max_drafts)
            items.append(ChannelRequest(key, keep, new_tokens, num_drafts))
            included.append(index)
            budget -= num_new
        return items, included

    def forget(self, request_id: str) -> None:
        self._num_mirrored.pop(request_id, None)
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
        connection = _Connection(ChannelClient(self.capacity))
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

    def __init__(self, proposer: Proposer, channel_name: str, lock: threading.Lock) -> None:
        self.proposer = proposer
        self.channel = ChannelServer(channel_name)
        self.lock = lock
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
        finally:
            with self.lock:
                for key in self._mirrors:
                    self.proposer.forget(self._request_id(key))
                self._mirrors.clear()
            self.channel.close()

    def stop(self) -> None:
        self.stop_event.set()

    def _draft(self, requests: Sequence[ChannelRequest], forget_keys: Sequence[int]) -> list[list[int]]:
        for key in forget_keys:
            if self._mirrors.pop(key, None) is not None:
                self.proposer.forget(self._request_id(key))
        draft_requests = []
        for request in requests:
            mirror = self._mirrors.setdefault(request.key, [])
            if request.keep > len(mirror):
                raise ValueError(
                    f"sequence {request.key}: asked to keep {request.keep} tokens, but {len(mirror)} are held"
                )
            if request.keep < len(mirror):  # tokens replaced, not extended: the proposer starts over
                self.proposer.forget(self._request_id(request.key))
                del mirror[request.keep :]
            mirror.extend(request.new_tokens)
            draft_requests.append(DraftRequest(self._request_id(request.key), mirror, request.num_drafts))
        return self.proposer.propose(draft_requests)
