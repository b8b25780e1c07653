"""An ingress replica's side of the engine replicas: one outputs stream to each, requests placed by the
routing policy, and requests moved to another replica when theirs dies before their first token.

Each engine replica this ingress uses gets a _Link: the long-lived `outputs` stream (heartbeats beside),
the requests running there, and the submits of this event-loop turn, sent as one call (under load many
requests arrive in one turn, and each Serve call costs the engine's process time beside its engine
thread). Every call names its replica (routing.ROUTE_KWARG).

When a replica's stream fails (the replica died, or it restarted and forgot this subscriber), its
requests that have received no token go to another replica, chosen again with that one excluded, up to
MAX_PLACEMENTS times in all; the client sees nothing of it. The others end with a 503 error, in band
once streaming.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from tileinfer.deployments.openai_api.errors import OpenAIError
from tileinfer.deployments.replicas.engine_loop import Delta
from tileinfer.deployments.replicas.engine_replica import HEARTBEAT_S, WrongReplicaError
from tileinfer.deployments.replicas.routing import ROUTE_KWARG, RoutingPolicy
from tileinfer.engine.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

MAX_PLACEMENTS = 3  # a request tries at most this many engine replicas before it fails
# what a call to a replica that is gone raises (Serve then drops it; this policy drops it at once)
REPLICA_GONE = (RayActorError, ActorUnavailableError, DeploymentUnavailableError, WrongReplicaError)


def _engine_stopped() -> OpenAIError:
    return OpenAIError.service_unavailable(
        "the engine stopped while running this request (it restarts); please retry"
    )


class Inbox:
    """A request's Deltas as they arrive, as (tag, delta), for the one task that reads them.

    take() returns everything that arrived. It waits for a first item; with a deadline (a paced stream)
    it waits until then, or until an item that ends its choice arrives, whichever is first; `eager`
    (a request with stop strings, which the reader looks for as tokens arrive) wakes it for every item.
    One future and at most one timer per wait: asyncio.Queue with wait_for cost a task's worth of
    timeout machinery per event (the ingress's busiest code at 256 clients)."""

    __slots__ = ("eager", "_items", "_waiter", "_wake_on_any", "_last_arrived")

    def __init__(self) -> None:
        self.eager = False
        self._items: list[tuple[Any, Delta]] = []
        self._waiter: asyncio.Future | None = None
        self._wake_on_any = True
        self._last_arrived = False  # an item that ends its choice is among _items

    def put_nowait(self, item: tuple[Any, Delta]) -> None:
        self._items.append(item)
        delta = item[1]
        last = delta[2] is not None or delta[4] is not None
        self._last_arrived |= last
        if self._waiter is not None and (self._wake_on_any or last) and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self, deadline: float | None = None) -> list[tuple[Any, Delta]]:
        """deadline: the event loop's time; None waits for a first item only."""
        loop = asyncio.get_running_loop()
        ready = (
            self._last_arrived
            or (bool(self._items) and (deadline is None or self.eager))
            or (deadline is not None and loop.time() >= deadline)
        )
        if not ready:
            self._waiter = loop.create_future()
            self._wake_on_any = deadline is None or self.eager
            timer = None if deadline is None else loop.call_at(deadline, _wake, self._waiter)
            try:
                await self._waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        items, self._items, self._last_arrived = self._items, [], False
        return items


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclasses.dataclass(eq=False)
class _Route:
    """One request, from its submit to its last Delta."""

    inbox: Inbox  # its Deltas go here as (tag, delta)
    tag: Any
    prompt_token_ids: list[int]
    params: SamplingParams
    block_keys: Sequence[int]
    link: _Link | None = None  # where it runs, once placed
    counted: str | None = None  # the replica the policy counts it in flight on
    started: bool = False  # a token reached the inbox: it can no longer move to another replica
    tried: list[str] = dataclasses.field(default_factory=list)  # replicas it failed on


@dataclasses.dataclass(eq=False)
class _Link:
    """This ingress replica's connection to one engine replica."""

    replica_id: str | None  # None until the stream names it, for a replica Serve chose (no policy view)
    routes: dict[str, _Route] = dataclasses.field(default_factory=dict)  # its running requests
    subscribed: asyncio.Future | None = None  # done when the stream is open (or failed to open)
    pump: asyncio.Task | None = None
    batch: list[tuple[str, _Route, asyncio.Future]] = dataclasses.field(default_factory=list)


class EngineClient:
    def __init__(self, engine: DeploymentHandle, policy: RoutingPolicy | None = None) -> None:
        self.engine = engine
        self.policy = policy if policy is not None else RoutingPolicy()
        self.subscriber_id = uuid.uuid4().hex
        self._links: dict[str | None, _Link] = {}
        self._routes: dict[str, _Route] = {}  # request_id -> route, while it runs
        self._calls: set[asyncio.Task] = set()  # calls that outlive their request, kept until sent

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        inbox: Inbox,
        tag: Any,
        block_keys: Sequence[int] = (),
    ) -> str:
        """Start a request on the engine replica the policy picks for its prompt (block_keys:
        routing.block_keys); its Deltas arrive in `inbox` as (tag, delta) until one ends it. Raises what
        the engine refuses it with, or a 503 when no replica took it."""
        request_id = uuid.uuid4().hex  # chosen here, so that no output can arrive before its route
        route = _Route(inbox, tag, prompt_token_ids, params, block_keys)
        self._routes[request_id] = route
        try:
            await self._place(request_id, route)
        except BaseException:
            self._routes.pop(request_id, None)
            raise
        return request_id

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request that has not ended; returns at once (the call goes out in the background)."""
        route = self._routes.pop(request_id, None)
        link = route.link if route is not None else None
        if link is None:
            return  # ended, or not placed yet (_place aborts it once it is)
        self._leave(request_id, route)
        self._abort_on(link, request_id, reason)

    def close(self) -> None:
        """End the outputs streams (the engines abort this replica's requests); from any thread."""
        for link in list(self._links.values()):
            if link.pump is not None:
                with contextlib.suppress(RuntimeError):  # its loop has closed: the stream is gone already
                    link.pump.get_loop().call_soon_threadsafe(link.pump.cancel)

    # --- placing requests -----------------------------------------------------------------------

    async def _place(self, request_id: str, route: _Route) -> None:
        """Submit the request to a replica, moving on to another while the chosen one is gone."""
        while True:
            route.counted = self.policy.choose(route.block_keys, exclude=route.tried, retry=bool(route.tried))
            link = self._link(route.counted)
            link.routes[request_id] = route  # before the submit: its first outputs may beat the reply
            try:
                await asyncio.shield(link.subscribed)
                refused = await self._submit_on(link, request_id, route)
            except asyncio.CancelledError:  # the engine may have queued it
                self._leave(request_id, route, link)
                self._abort_on(link, request_id)
                raise
            except Exception as gone:  # noqa: BLE001 - the call failed, not the request: try another
                self._leave(request_id, route, link)
                if not self._may_move(route, link):
                    raise OpenAIError.service_unavailable(
                        f"no engine replica took the request ({type(gone).__name__}: {gone}); please retry"
                    ) from None
                continue
            if refused is not None:
                self._leave(request_id, route, link)
                raise refused
            if link.pump is None or link.pump.done():  # its stream ended before the reply came back
                self._leave(request_id, route, link)
                if route.started or not self._may_move(route, link):
                    raise _engine_stopped()
                continue
            route.link = link
            if request_id not in self._routes:  # aborted while it was being placed
                self._leave(request_id, route)
                self._abort_on(link, request_id)
            return

    def _may_move(self, route: _Route, link: _Link) -> bool:
        """Note that the route failed on the link's replica; whether it may try another."""
        route.tried.append(link.replica_id or "")
        return len(route.tried) < MAX_PLACEMENTS

    def _leave(self, request_id: str, route: _Route, link: _Link | None = None) -> None:
        """The request no longer runs on its link (or on `link`, where it was being placed)."""
        link = link or route.link
        if link is not None:
            link.routes.pop(request_id, None)
        if route.counted is not None:
            self.policy.finished(route.counted)
            route.counted = None
        route.link = None

    async def _submit_on(self, link: _Link, request_id: str, route: _Route) -> BaseException | None:
        """Submit with the link's other submits of this event-loop turn, in one call."""
        reply = asyncio.get_running_loop().create_future()
        link.batch.append((request_id, route, reply))
        if len(link.batch) == 1:
            asyncio.get_running_loop().call_soon(self._send_batch, link, context=contextvars.Context())
        return await asyncio.shield(reply)

    def _send_batch(self, link: _Link) -> None:
        batch, link.batch = link.batch, []
        requests = [(request_id, route.prompt_token_ids, route.params) for request_id, route, _ in batch]
        response = self.engine.submit.remote(requests, self.subscriber_id, **{ROUTE_KWARG: link.replica_id})

        async def send() -> None:
            try:
                refused = await response
            except BaseException as failure:  # noqa: BLE001 - each submit gets it
                refused = None
                for *_, reply in batch:
                    if not reply.done():
                        reply.set_exception(failure)
                return
            for (*_, reply), error in zip(batch, refused, strict=True):
                if not reply.done():
                    reply.set_result(error)

        self._keep(send())

    def _abort_on(self, link: _Link, request_id: str, reason: str = "abort") -> None:
        self._call(lambda: self.engine.abort.remote(request_id, reason, **{ROUTE_KWARG: link.replica_id}))

    def _call(self, send: Callable[[], Any]) -> None:
        """Make a handle call that outlives the request it is made for, in an empty context: Serve cancels
        the calls made in a request's context when that request is cancelled (its client went away), and
        an abort cancelled with it left the sequence running to its end (seen in a test run: "CALL abort
        CANCELLED")."""
        response = contextvars.Context().run(send)

        async def wait() -> None:
            with contextlib.suppress(Exception):  # best effort: a dead engine has dropped the request
                await response

        self._keep(wait())

    def _keep(self, call: Any) -> None:
        task = asyncio.get_running_loop().create_task(call, context=contextvars.Context())
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    # --- the outputs streams --------------------------------------------------------------------

    def _link(self, replica_id: str | None) -> _Link:
        """The link to the replica, its stream opening if it is new."""
        link = self._links.get(replica_id)
        if link is None or link.pump is None or link.pump.done():
            link = _Link(replica_id)
            loop = asyncio.get_running_loop()
            link.subscribed = loop.create_future()
            self._links[replica_id] = link
            link.pump = loop.create_task(self._read(link), context=contextvars.Context())
        return link

    async def _beat(self, link: _Link) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            # a failure here shows in the outputs stream too (it ends or errors), and is handled there
            with contextlib.suppress(Exception):
                decisions = dict(self.policy.decisions)
                await self.engine.heartbeat.remote(
                    self.subscriber_id, **{ROUTE_KWARG: link.replica_id}, decisions=decisions
                )

    async def _read(self, link: _Link) -> None:
        """Route the link's Deltas until its stream ends; then move or fail the requests it carried."""
        subscribed = link.subscribed
        stream = self.engine.options(stream=True).outputs.remote(
            self.subscriber_id, **{ROUTE_KWARG: link.replica_id}
        )
        beating = asyncio.get_running_loop().create_task(self._beat(link))
        failure: BaseException | None = None
        try:
            async for item in stream:
                if isinstance(item, str):  # the replica's id: the subscription is open
                    if link.replica_id is None:  # Serve chose it: later requests for it use this link
                        link.replica_id = item
                        self._links.setdefault(item, link)
                    subscribed.set_result(None)
                    continue
                routes = link.routes
                for delta in item:
                    route = routes.get(delta[0])
                    if route is None:
                        continue  # aborted here
                    if delta[1]:
                        route.started = True
                    if delta[2] is not None or delta[4] is not None:  # its last
                        self._routes.pop(delta[0], None)
                        self._leave(delta[0], route)
                    route.inbox.put_nowait((route.tag, delta))
        except Exception as error:  # noqa: BLE001 - the engine replica died or restarted
            logger.warning("engine replica %s: its outputs stream failed: %s", link.replica_id, error)
            failure = error
        finally:
            beating.cancel()
            stream.cancel()  # if this task was cancelled: the engine aborts this replica's requests
            for key in [key for key, value in self._links.items() if value is link]:
                del self._links[key]
            if isinstance(failure, REPLICA_GONE) and link.replica_id is not None:
                self.policy.forget(link.replica_id)
            if not subscribed.done():  # the subscription itself failed: the submits that wait get why
                subscribed.set_exception(failure or WrongReplicaError("its outputs stream ended"))
                subscribed.exception()  # retrieved: a request may not be waiting for it
            self._move_or_fail(link)

    def _move_or_fail(self, link: _Link) -> None:
        """The link's stream ended: its requests without a token go elsewhere, the others fail."""
        routes, link.routes = link.routes, {}
        for request_id, route in routes.items():
            if route.link is not link:
                continue  # still being placed: _place sees the failure
            self._leave(request_id, route)
            if request_id not in self._routes:
                continue  # aborted meanwhile
            if not route.started and self._may_move(route, link):
                self._keep(self._move(request_id, route))
            else:
                self._routes.pop(request_id, None)
                route.inbox.put_nowait((route.tag, (request_id, [], None, None, _engine_stopped())))

    async def _move(self, request_id: str, route: _Route) -> None:
        try:
            await self._place(request_id, route)
        except BaseException as error:  # noqa: BLE001 - it ends with the error, in band
            if self._routes.pop(request_id, None) is not None:
                route.inbox.put_nowait((route.tag, (request_id, [], None, None, error)))
