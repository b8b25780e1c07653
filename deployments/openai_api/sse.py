"""Server-sent events, as OpenAI streams its chunks."""

from __future__ import annotations

import json
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"  # a stream's last event


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying a JSON object (or a ready string)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
