"""Terminals in a sandbox: ``sandbox.pty``. Each is a command (by default the user's
login shell) on a pseudo-terminal of the guest, carried by the daemon's WebSocket
``/v1/sandboxes/{id}/pty``: bytes typed in, the screen's bytes out, resizes, and the
command's exit code at the end."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Dict, List, Optional, Tuple, Union

from .errors import ForkdError

if TYPE_CHECKING:
    from .async_sandbox import AsyncSandbox
    from .sandbox import Sandbox


class TerminalClosedError(ForkdError):
    """The terminal ended without its command's exit: ``reason`` is ``paused`` (its
    sandbox was paused), ``removed``, ``failed``, or ``killed`` (by :meth:`kill`)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"the terminal ended: {reason}: {message}" if message else f"the terminal ended: {reason}", 0, reason)
        self.reason = reason


def _query(
    cols: int, rows: int, cmd: Optional[List[str]], envs: Optional[Dict[str, str]], cwd: Optional[str], user: Optional[str]
) -> List[Tuple[str, str]]:
    q = [("cols", str(cols)), ("rows", str(rows))]
    q += [("cmd", w) for w in cmd or []]
    q += [("env", f"{k}={v}") for k, v in (envs or {}).items()]
    if cwd is not None:
        q.append(("cwd", cwd))
    if user is not None:
        q.append(("user", user))
    return q


def _started(first: Any) -> int:
    msg = json.loads(first) if isinstance(first, str) else {}
    if msg.get("type") != "started":
        raise ForkdError(f"the terminal did not start: {first!r}", 0, "")
    return int(msg["pid"])


class _End:
    """How a terminal ended, as its last messages said."""

    def __init__(self) -> None:
        self.exit_code: Optional[int] = None
        self.closed: Optional[TerminalClosedError] = None

    def take(self, text: str) -> None:
        msg = json.loads(text)
        if msg.get("type") == "exit":
            self.exit_code = int(msg["exit_code"])
        elif msg.get("type") == "closed":
            self.closed = TerminalClosedError(str(msg.get("reason")), str(msg.get("message", "")))

    def result(self, killed: bool) -> int:
        if self.exit_code is not None:
            return self.exit_code
        if self.closed is not None:
            raise self.closed
        if killed:
            raise TerminalClosedError("killed", "")
        raise TerminalClosedError("failed", "the connection to the daemon closed before the command ended")


def _resize_message(cols: int, rows: int) -> str:
    return json.dumps({"type": "resize", "cols": cols, "rows": rows})


class PtyHandle:
    """A terminal (:meth:`Pty.create`): its output goes to ``on_data`` from a thread of
    the handle's as it comes."""

    def __init__(self, ws: Any, on_data: Optional[Callable[[bytes], None]]) -> None:
        self._ws = ws
        self.pid: int = _started(ws.recv())
        self._end = _End()
        self._killed = False
        self._thread = threading.Thread(target=self._run, args=(on_data,), daemon=True)
        self._thread.start()

    def _run(self, on_data: Optional[Callable[[bytes], None]]) -> None:
        try:
            for msg in self._ws:
                if isinstance(msg, bytes):
                    if on_data is not None:
                        on_data(msg)
                else:
                    self._end.take(msg)
        except Exception:  # the socket broke: wait() says how it ended
            pass

    def send_input(self, data: Union[str, bytes]) -> None:
        """Types ``data`` into the terminal (``"\\x03"`` is ^C)."""
        self._ws.send(data.encode() if isinstance(data, str) else bytes(data))

    def resize(self, cols: int, rows: int) -> None:
        """Changes the terminal's size; its foreground command gets SIGWINCH."""
        self._ws.send(_resize_message(cols, rows))

    def kill(self) -> None:
        """Ends the terminal: its command's process group is killed."""
        self._killed = True
        self._ws.close()

    def wait(self, timeout: Optional[float] = None) -> int:
        """The command's exit code once it ended (128 + the signal when one ended it);
        :class:`TerminalClosedError` if the terminal ended otherwise."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            from .errors import TimeoutError

            raise TimeoutError(f"the terminal's command still runs after {timeout} s", 0, "")
        return self._end.result(self._killed)


class Pty:
    """The sandbox's terminals: ``sandbox.pty``."""

    def __init__(self, sandbox: "Sandbox") -> None:
        self._sandbox = sandbox

    def create(
        self,
        cols: int = 80,
        rows: int = 24,
        on_data: Optional[Callable[[bytes], None]] = None,
        cmd: Optional[List[str]] = None,
        envs: Optional[Dict[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
    ) -> PtyHandle:
        """Starts ``cmd`` (the user's login shell if none) on a terminal of ``cols`` by
        ``rows``; it runs when this returns."""
        ws = self._sandbox._conn.websocket(
            f"/v1/sandboxes/{self._sandbox.id}/pty", _query(cols, rows, cmd, envs, cwd, user)
        )
        return PtyHandle(ws, on_data)


class AsyncPtyHandle:
    """:class:`PtyHandle` on asyncio: ``on_data`` (a function or a coroutine function) is
    called from a task of the handle's."""

    def __init__(self, ws: Any, pid: int, on_data: Optional[Callable[[bytes], Union[None, Awaitable[None]]]]) -> None:
        self._ws = ws
        self.pid = pid
        self._end = _End()
        self._killed = False
        self._task = asyncio.ensure_future(self._run(on_data))

    async def _run(self, on_data: Optional[Callable[[bytes], Union[None, Awaitable[None]]]]) -> None:
        try:
            async for msg in self._ws:
                if isinstance(msg, bytes):
                    if on_data is not None:
                        r = on_data(msg)
                        if inspect.isawaitable(r):
                            await r
                else:
                    self._end.take(msg)
        except Exception:
            pass

    async def send_input(self, data: Union[str, bytes]) -> None:
        await self._ws.send(data.encode() if isinstance(data, str) else bytes(data))

    async def resize(self, cols: int, rows: int) -> None:
        await self._ws.send(_resize_message(cols, rows))

    async def kill(self) -> None:
        self._killed = True
        await self._ws.close()

    async def wait(self, timeout: Optional[float] = None) -> int:
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except asyncio.TimeoutError:
            from .errors import TimeoutError

            raise TimeoutError(f"the terminal's command still runs after {timeout} s", 0, "") from None
        return self._end.result(self._killed)


class AsyncPty:
    """:class:`Pty` on asyncio: ``sandbox.pty`` of an :class:`AsyncSandbox`."""

    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self._sandbox = sandbox

    async def create(
        self,
        cols: int = 80,
        rows: int = 24,
        on_data: Optional[Callable[[bytes], Union[None, Awaitable[None]]]] = None,
        cmd: Optional[List[str]] = None,
        envs: Optional[Dict[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
    ) -> AsyncPtyHandle:
        ws = await self._sandbox._conn.websocket(
            f"/v1/sandboxes/{self._sandbox.id}/pty", _query(cols, rows, cmd, envs, cwd, user)
        )
        pid = _started(await ws.recv())
        return AsyncPtyHandle(ws, pid, on_data)
