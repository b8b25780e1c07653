"""The OpenAI-compatible HTTP API: the ingress, request and response models, SSE, tool calls, reasoning,
structured output, OpenAPI."""
