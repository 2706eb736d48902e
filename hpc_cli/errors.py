"""User-facing errors.

Every failure a user can cause (a bad profile, a forbidden option combination, an unknown
plugin, a damaged cache file, a bad request) raises an :class:`HpcError` subclass with a
one-line message and a hint that says how to fix it. The CLI prints ``error: message`` and
``hint: hint`` without a traceback and exits 2; the server maps them to 4xx answers in the
API's own error shape. Internal invariants use ``assert`` with a message instead.
"""

from __future__ import annotations


class HpcError(Exception):
    """A failure the user can fix; ``hint`` says how."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message

    def render(self) -> str:
        """The text the CLI prints: the message, then the hint on its own line."""
        text = f"error: {self.message}"
        if self.hint:
            text += f"\nhint: {self.hint}"
        return text


class ConfigError(HpcError):
    """A profile file, environment variable or flag is wrong or conflicts with another."""


class PluginError(HpcError):
    """A plugin could not be loaded, registered twice, or an unknown plugin name was asked for."""


class ModelError(HpcError):
    """A checkpoint directory, config or tensor is missing or malformed."""


class CacheFileError(HpcError):
    """A prefix cache file (or expert profile file) is damaged, mismatched or unusable."""


class CapacityError(HpcError):
    """A requested memory size cannot be allocated or is too small to work."""


class RequestError(HpcError):
    """A bad API request (the server answers 4xx)."""

    def __init__(self, message: str, hint: str | None = None, *, status: int = 400,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, hint)
        self.status = status
        self.param = param
        self.code = code


class OverloadedError(RequestError):
    """The server's queue is full (429): retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, hint: str | None = None, *, retry_after_s: int = 1) -> None:
        super().__init__(message, hint, status=429, code="rate_limit_exceeded")
        self.retry_after_s = retry_after_s


class EngineError(HpcError):
    """The engine failed (a transfer fault, a kernel error) or is stopping."""


class EngineFatalError(EngineError):
    """The engine's worker stopped after an error: ``serve`` exits with status 3 so that a
    supervisor restarts it."""

    exit_code = 3


class UnavailableError(EngineError):
    """The engine is stopping or stopped; the request was not (or not fully) served."""
