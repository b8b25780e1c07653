"""ASGI middleware: a request body over max_request_bytes gets 413, whether or not it declares its length."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tileinfer.deployments.openai_api.errors import OpenAIError


class BodySizeLimit:
    """A declared Content-Length over the limit is refused before the app runs. A chunked body is counted
    as the app reads it: receive raises the 413 OpenAIError, which the app's own handler turns into the
    response (an exception of another type came out as a 500: FastAPI's catch-all handler answered it
    before it reached this middleware).
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        received = 0

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise OpenAIError.request_too_large(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)

    async def _reject(self, send: Callable) -> None:
        error = OpenAIError.request_too_large(self.max_bytes)
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": body})
