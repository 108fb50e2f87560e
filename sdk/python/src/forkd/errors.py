"""Errors the daemon answers with, as exceptions: one class per kind of failure.

Every error response of the REST API is ``{"error": {"code": ..., "message": ...}}``;
``raise_for`` maps its ``code`` (and failing that its HTTP status) to a class here.
"""

from __future__ import annotations

from typing import Dict, Optional, Type


class ForkdError(Exception):
    """Any error from forkd: ``status`` is the HTTP status, ``code`` the API's code."""

    def __init__(self, message: str, status: int = 0, code: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code


class BadRequestError(ForkdError):
    """The request was malformed (a bad tag, path, field or value)."""


class AuthError(ForkdError):
    """No token, or a wrong one (TCP listeners need ``FORKD_TOKEN``)."""


class ForbiddenError(ForkdError):
    """The guest refused the operation (permissions)."""


class NotFoundError(ForkdError):
    """No such sandbox, snapshot, operation, process or guest file."""


class ConflictError(ForkdError):
    """The thing exists, is in use, or is not in a state that allows this."""


class TooLargeError(ForkdError):
    """The request or upload passed a limit of the daemon or of the agent protocol."""


class CapacityError(ForkdError):
    """The daemon has no room: its sandbox limit or the host's memory (retry later)."""


class StorageError(ForkdError):
    """The data directory's disk is too full for this."""


class SandboxFailedError(ForkdError):
    """The sandbox's VM died or broke."""


class UnreachableError(ForkdError):
    """No daemon answers at the URL tried (it is stopped, or the URL or socket is wrong)."""


class TimeoutError(ForkdError):  # noqa: A001 - the SDK's own, distinct from builtins
    """The sandbox did not answer in time (its agent is unresponsive), or a wait ran out."""


_BY_CODE: Dict[str, Type[ForkdError]] = {
    "bad_request": BadRequestError,
    "unauthorized": AuthError,
    "forbidden": ForbiddenError,
    "not_found": NotFoundError,
    "conflict": ConflictError,
    "too_large": TooLargeError,
    "at_capacity": CapacityError,
    "insufficient_memory": CapacityError,
    "sandbox_unresponsive": TimeoutError,
    "insufficient_storage": StorageError,
    "sandbox_failed": SandboxFailedError,
}

_BY_STATUS: Dict[int, Type[ForkdError]] = {
    400: BadRequestError,
    401: AuthError,
    403: ForbiddenError,
    404: NotFoundError,
    409: ConflictError,
    413: TooLargeError,
    502: SandboxFailedError,
    503: CapacityError,
    507: StorageError,
}


def error_for(status: int, body: Optional[object]) -> ForkdError:
    """The exception for an error response with this status and decoded JSON body."""
    code, message = "", ""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = str(body["error"].get("code", ""))
        message = str(body["error"].get("message", ""))
    cls = _BY_CODE.get(code) or _BY_STATUS.get(status, ForkdError)
    return cls(message or f"forkd answered HTTP {status}", status, code)
