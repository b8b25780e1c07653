"""ASGI middleware: a request whose client has gone is cancelled at once, whatever it waits for.

The generation routes abort their engine requests when cancelled (ChoiceRunner.submit and merged,
deployments/openai_api/choices.py), so a client that gives up frees its sequences and KV blocks within an
engine step. Nothing else guarantees the cancel: Serve cancels a request whose client closed, but not one
that sent `x-request-disconnect-disabled: ?1` (any client may); Starlette notices a streamed response's
client only when it next writes to it (ASGI 2.4: a long prefill writes nothing), and a plain response's not
at all. So this watches the connection itself, from when the app has read the whole body (until then its
messages are the app's) to the end of the response.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class CancelOnDisconnect:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = asyncio.current_task()
        assert request is not None
        watcher: asyncio.Task | None = None
        answered = disconnected = False

        async def watch() -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            if not answered:  # a server reports a disconnect once the response is complete, too
                disconnected = True
                request.cancel()

        async def app_receive() -> dict:
            nonlocal watcher
            message = await receive()
            if watcher is None and message["type"] == "http.request" and not message.get("more_body"):
                watcher = asyncio.get_running_loop().create_task(watch())
            return message

        async def app_send(message: dict) -> None:
            nonlocal answered
            answered = answered or (message["type"] == "http.response.body" and not message.get("more_body"))
            await send(message)

        try:
            await self.app(scope, app_receive, app_send)
        except asyncio.CancelledError:
            if not disconnected or request.uncancel() > 0:  # cancelled by someone else as well
                raise
        else:
            if disconnected:  # the app took the cancel itself
                request.uncancel()
        finally:
            if watcher is not None:
                watcher.cancel()
