"""Errors a user can cause and fix: each carries a message meant to be read, not a traceback."""


class TileInferError(Exception):
    """Base of every error that the CLI and the server report as a plain message."""


class ModelLoadError(TileInferError):
    """A model path, file or config that cannot be loaded."""


class InvalidRequestError(TileInferError):
    """A prompt or sampling parameter that the engine cannot honour."""


class ContextLengthExceededError(InvalidRequestError):
    """A prompt (plus its requested tokens) longer than the model's context."""


class GrammarFailedError(InvalidRequestError):
    """A grammar that failed as it constrained a request's output (llguidance hit one of its limits, or a
    rule that only recurses): what was generated does not match it, and the request ends with this."""


class CapacityError(TileInferError):
    """Every running slot and queue place is taken; the request may be retried later."""
