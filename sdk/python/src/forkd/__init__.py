"""forkd: microVM sandboxes forked from warm snapshots, from Python.

    from forkd import Sandbox

    with Sandbox.create("python") as sbx:
        print(sbx.commands.run("uname -r").stdout)
        print(sbx.run_code("import pandas as pd; pd.__version__").text)

The daemon is found through ``FORKD_URL`` (``unix:/path``, ``http://`` or
``https://``), ``FORKD_TOKEN`` and ``FORKD_CA``, else on its local unix socket.
"""

from ._connection import AsyncConnection, Connection
from ._pty import AsyncPty, AsyncPtyHandle, Pty, PtyHandle, TerminalClosedError
from .async_sandbox import (
    AsyncCommandHandle,
    AsyncCommands,
    AsyncFiles,
    AsyncWatchHandle,
    AsyncSandbox,
    AsyncSnapshot,
)
from .errors import (
    AuthError,
    BadRequestError,
    CapacityError,
    ConflictError,
    ForbiddenError,
    ForkdError,
    NotFoundError,
    SandboxFailedError,
    StorageError,
    TimeoutError,
    TooLargeError,
    UnreachableError,
)
from .models import (
    CodeContext,
    CommandResult,
    EntryInfo,
    FilesystemEvent,
    Execution,
    ExecutionError,
    Limits,
    Logs,
    Network,
    ProcessInfo,
    Result,
    SandboxInfo,
    SandboxLimits,
)
from .sandbox import CommandHandle, Commands, Files, Sandbox, Snapshot, WatchHandle

__all__ = [
    "AsyncPty",
    "AsyncPtyHandle",
    "Pty",
    "PtyHandle",
    "TerminalClosedError",
    "AsyncCommandHandle",
    "AsyncCommands",
    "AsyncConnection",
    "AsyncFiles",
    "AsyncSandbox",
    "AsyncSnapshot",
    "AuthError",
    "BadRequestError",
    "CapacityError",
    "CodeContext",
    "CommandHandle",
    "CommandResult",
    "Commands",
    "ConflictError",
    "Connection",
    "EntryInfo",
    "Execution",
    "ExecutionError",
    "Files",
    "FilesystemEvent",
    "ForbiddenError",
    "ForkdError",
    "Limits",
    "Logs",
    "Network",
    "NotFoundError",
    "ProcessInfo",
    "Result",
    "Sandbox",
    "SandboxFailedError",
    "SandboxInfo",
    "SandboxLimits",
    "Snapshot",
    "StorageError",
    "TimeoutError",
    "TooLargeError",
    "UnreachableError",
    "WatchHandle",
    "AsyncWatchHandle",
]
