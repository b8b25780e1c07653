"""OpenAI's error object: the HTTP errors the ingress answers with, and the exceptions they stand for."""

from __future__ import annotations

from typing import Any

from tileinfer.engine.errors import CapacityError, ContextLengthExceededError, InvalidRequestError

RETRY_AFTER_S = 1  # every 503 (overloaded, or the engine restarting) tells the client to retry this soon


class OpenAIError(Exception):
    """An error the ingress returns as OpenAI's error object with its HTTP status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        # crosses Ray actor boundaries by pickle, which would otherwise call __init__(message) alone
        return (type(self), (self.status_code, self.message, self.type, self.param, self.code))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """The HTTP headers of this error's response: Retry-After on a 503 (RFC 9110 15.6.4)."""
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status_code == 503 else {}

    @classmethod
    def invalid_request(cls, message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def unsupported(cls, field_name: str, detail: str = "") -> OpenAIError:
        message = f"{field_name} is not supported by this server{detail}"
        return cls(400, message, param=field_name, code="unsupported_parameter")

    @classmethod
    def context_length_exceeded(cls, message: str, param: str | None) -> OpenAIError:
        return cls(400, message, param=param, code="context_length_exceeded")

    @classmethod
    def invalid_api_key(cls, provided: bool = True) -> OpenAIError:
        if provided:
            message = "Incorrect API key provided."
        else:
            # OpenAI's own words
            message = (
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        return cls(401, message, code="invalid_api_key")

    @classmethod
    def model_not_found(cls, model: str, served_model: str | None = None) -> OpenAIError:
        message = f"The model `{model}` does not exist or you do not have access to it."
        if served_model is not None:
            message += f" This server serves `{served_model}`."
        return cls(404, message, param="model", code="model_not_found")

    @classmethod
    def request_too_large(cls, limit_bytes: int) -> OpenAIError:
        message = f"The request body is larger than this server's limit of {limit_bytes} bytes."
        return cls(413, message, code="request_too_large")

    @classmethod
    def queue_full(cls) -> OpenAIError:
        # OpenAI answers overload with 503 and type server_error
        message = "The server is currently overloaded with other requests; please retry later."
        return cls(503, message, type="server_error", code="queue_full")

    @classmethod
    def service_unavailable(cls, message: str) -> OpenAIError:
        return cls(503, message, type="server_error")

    @classmethod
    def internal(cls) -> OpenAIError:
        return cls(500, "The server had an error while processing your request.", type="server_error")


def openai_error_from(exc: BaseException, prompt_param: str | None = None) -> OpenAIError:
    """The OpenAI error for an exception, also one raised in a Ray actor (unwrapped to its cause).

    `prompt_param` ("messages" or "prompt") is the field a context-length error names. Errors the user did
    not cause become a generic 500, so internals never reach the client.
    """
    exc = original_exception(exc)
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ContextLengthExceededError):
        return OpenAIError.context_length_exceeded(str(exc), prompt_param)
    if isinstance(exc, InvalidRequestError):
        return OpenAIError.invalid_request(str(exc))
    if isinstance(exc, CapacityError):
        return OpenAIError.queue_full()
    return OpenAIError.internal()


def original_exception(exc: BaseException) -> BaseException:
    # Ray re-raises an actor's exception as a RayTaskError subclass that is also an instance of the
    # original class and keeps it in `.cause`; its str() is a traceback, so take the cause's message.
    cause = getattr(exc, "cause", None)
    while isinstance(cause, BaseException) and cause is not exc and isinstance(exc, type(cause)):
        exc, cause = cause, getattr(cause, "cause", None)
    return exc
