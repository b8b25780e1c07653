"""The ingress's Inbox (deployments/replicas/engine_client.py): how a paced stream's reader waits for its
Deltas."""

from __future__ import annotations

import asyncio

from tileinfer.deployments.replicas.engine_client import Inbox


def _delta(token: int, finish: str | None = None) -> tuple[str, tuple]:
    return ("choice", ("request", [token], finish, None, None))


def test_a_paced_reader_waits_for_its_deadline_or_the_last_delta() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        inbox = Inbox()
        loop.call_later(0.01, inbox.put_nowait, _delta(1))
        assert await inbox.take() == [_delta(1)]  # no deadline: the first item wakes it

        # a deadline: items that do not end the choice wait for it, and come together
        deadline = loop.time() + 0.2
        loop.call_later(0.01, inbox.put_nowait, _delta(2))
        loop.call_later(0.02, inbox.put_nowait, _delta(3))
        assert await inbox.take(deadline) == [_delta(2), _delta(3)]
        assert loop.time() >= deadline

        # the last Delta of a choice does not wait for the deadline
        deadline = loop.time() + 10.0
        loop.call_later(0.01, inbox.put_nowait, _delta(4))
        loop.call_later(0.02, inbox.put_nowait, _delta(5, "length"))
        assert await asyncio.wait_for(inbox.take(deadline), 5.0) == [_delta(4), _delta(5, "length")]

        # eager (a request with stop strings): every item wakes it, deadline or not
        inbox.eager = True
        loop.call_later(0.01, inbox.put_nowait, _delta(6))
        assert await asyncio.wait_for(inbox.take(loop.time() + 10.0), 5.0) == [_delta(6)]

        # a reader cancelled while it waits loses nothing
        waiting = asyncio.ensure_future(inbox.take())
        await asyncio.sleep(0)
        waiting.cancel()
        inbox.put_nowait(_delta(7))
        assert await inbox.take() == [_delta(7)]

    asyncio.run(scenario())
