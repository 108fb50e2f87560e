"""The SDK's surface on asyncio: :class:`AsyncSandbox` is :class:`forkd.Sandbox` with
every call awaited, and streamed output handed over as it comes."""

from __future__ import annotations

import asyncio
from typing import (
    IO,
    Any,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Dict,
    List,
    Mapping,
    Optional,
    Union,
)

from . import _api
from ._api import OutputHandler
from ._connection import AsyncConnection
from ._pty import AsyncPty
from .errors import NotFoundError, SandboxFailedError, TimeoutError
from .models import (
    CodeContext,
    CommandResult,
    EntryInfo,
    Execution,
    ExecutionError,
    Limits,
    Network,
    ProcessInfo,
    Result,
    SandboxInfo,
    FilesystemEvent,
)


class AsyncCommandHandle:
    """A command running in the background."""

    def __init__(self, sandbox: "AsyncSandbox", process_id: int, pid: int) -> None:
        self._sandbox = sandbox
        self.id = process_id
        self.pid = pid

    def _path(self, tail: str = "") -> str:
        return f"/v1/sandboxes/{self._sandbox.id}/processes/{self.id}{tail}"

    async def info(self) -> ProcessInfo:
        return ProcessInfo.from_api(await self._sandbox._conn.request("GET", self._path()))

    async def wait(self, timeout: Optional[float] = None) -> ProcessInfo:
        """Waits until the process ends; raises :class:`TimeoutError` if it still runs
        after ``timeout`` seconds (it keeps running)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            left = 3600.0 if deadline is None else max(0.0, deadline - loop.time())
            v = await self._sandbox._conn.request(
                "POST", self._path("/wait"), params={"timeout_s": min(left, 3600.0)}
            )
            info = ProcessInfo.from_api(v)
            if not info.running:
                return info
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError(f"process {self.id} still runs after {timeout} s")

    async def send_signal(self, signal: Union[int, str], group: bool = True) -> ProcessInfo:
        body = {"signal": signal, "group": group}
        v = await self._sandbox._conn.request("POST", self._path("/signal"), body)
        return ProcessInfo.from_api(v)

    async def kill(self) -> ProcessInfo:
        return ProcessInfo.from_api(await self._sandbox._conn.request("DELETE", self._path()))

    async def send_stdin(self, data: Union[str, bytes]) -> ProcessInfo:
        """Writes ``data`` to the process's stdin (started with ``stdin=True``)."""
        return await self._stdin(data, close=False)

    async def close_stdin(self) -> ProcessInfo:
        """Closes the process's stdin: its reads see end of file."""
        return await self._stdin(b"", close=True)

    async def _stdin(self, data: Union[str, bytes], close: bool) -> ProcessInfo:
        v: Dict[str, Any] = {}
        for body in _api.stdin_pieces(data, close):
            v = await self._sandbox._conn.request("POST", self._path("/stdin"), body)
        return ProcessInfo.from_api(v)


class AsyncCommands:
    """``sandbox.commands`` on asyncio (see :class:`forkd.Commands`)."""

    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self._sandbox = sandbox

    async def run(
        self,
        cmd: Union[str, List[str]],
        envs: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout: Optional[float] = None,
        stdin: Optional[Union[str, bytes, bool]] = None,
        on_stdout: Optional[OutputHandler] = None,
        on_stderr: Optional[OutputHandler] = None,
        background: bool = False,
    ) -> Any:
        body = _api.command_body(cmd, envs, cwd, timeout)
        path = f"/v1/sandboxes/{self._sandbox.id}"
        if background:
            data = _api.background_stdin(stdin)
            if stdin:
                body["stdin"] = True
            v = await self._sandbox._conn.request("POST", path + "/processes", body)
            handle = AsyncCommandHandle(self._sandbox, int(v["id"]), int(v["pid"]))
            if data is not None:
                await handle._stdin(data, close=True)
            return handle
        stdin = _api.foreground_stdin(stdin)
        if stdin is not None:
            body["stdin_b64"] = _api.stdin_b64(stdin)
        if on_stdout is None and on_stderr is None:
            v = await self._sandbox._conn.request("POST", path + "/exec", body)
            return CommandResult.from_api(v)
        body["stream"] = True
        reader = _api.ExecReader(on_stdout, on_stderr)
        async for line in self._sandbox._conn.stream_lines("POST", path + "/exec", body):
            result = reader.feed(line)
            if result is not None:
                return result
        raise reader.ended_early()

    async def list(self) -> List[ProcessInfo]:
        v = await self._sandbox._conn.request(
            "GET", f"/v1/sandboxes/{self._sandbox.id}/processes"
        )
        return [ProcessInfo.from_api(p) for p in v]


class AsyncWatchHandle:
    """:class:`forkd.WatchHandle` on asyncio: events go to ``on_event`` (a function or a
    coroutine function) from a task of its own until :meth:`stop`."""

    def __init__(self, response: Any, lines: AsyncIterator[Dict[str, Any]], on_event: Callable[[FilesystemEvent], Any]) -> None:
        self._response = response
        self.error: Optional[SandboxFailedError] = None
        self._task = asyncio.ensure_future(self._run(lines, on_event))

    async def _run(self, lines: AsyncIterator[Dict[str, Any]], on_event: Callable[[FilesystemEvent], Any]) -> None:
        try:
            async for v in lines:
                if v.get("type") == "error":
                    self.error = SandboxFailedError(str(v.get("message")))
                    return
                r = on_event(FilesystemEvent.from_api(v))
                if asyncio.iscoroutine(r):
                    await r
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.error = SandboxFailedError(f"the watch ended: {e}")

    @property
    def running(self) -> bool:
        return not self._task.done()

    async def stop(self) -> None:
        """Ends the watch; no event is delivered after this returns."""
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):
            pass
        await self._response.aclose()


class AsyncFiles:
    """``sandbox.files`` on asyncio (see :class:`forkd.Files`)."""

    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self._sandbox = sandbox
        self._base = f"/v1/sandboxes/{sandbox.id}/files"

    async def watch_dir(
        self, path: str, on_event: Callable[[FilesystemEvent], Any], recursive: bool = False
    ) -> AsyncWatchHandle:
        """See :meth:`forkd.Files.watch_dir`."""
        params = {"path": path, "recursive": "true" if recursive else "false"}
        r, lines = await self._sandbox._conn.open_lines("GET", f"{self._base}/watch", params)
        return AsyncWatchHandle(r, lines, on_event)

    async def read(self, path: str, format: str = "text") -> Any:
        """``format="stream"`` gives an async iterator of byte chunks."""
        chunks = self._sandbox._conn.stream_bytes("GET", self._base, {"path": path})
        if format == "stream":
            return chunks
        return _api.decode_file(b"".join([c async for c in chunks]), format)

    async def write(
        self,
        path: str,
        data: Union[str, bytes, IO[bytes], AsyncIterable[bytes]],
        mode: Optional[int] = None,
    ) -> EntryInfo:
        """Writes text, bytes, a binary file object (read in pieces) or an async
        iterable of byte chunks to ``path``."""
        content: Any
        if isinstance(data, str):
            content = data.encode()
        elif isinstance(data, (bytes, bytearray)):
            content = bytes(data)
        elif hasattr(data, "read"):
            reader = data

            async def pieces() -> AsyncIterator[bytes]:
                while True:
                    piece = reader.read(_api.CHUNK)
                    if not piece:
                        return
                    yield piece

            content = pieces()
        else:
            content = data
        params = _api.file_params(path, mode)
        await self._sandbox._conn.request("PUT", self._base, params=params, content=content)
        return await self.stat(path)

    async def list(self, path: str) -> List[EntryInfo]:
        v = await self._sandbox._conn.request("GET", self._base + "/list", params={"path": path})
        return [EntryInfo.from_api(e) for e in v["entries"]]

    async def stat(self, path: str) -> EntryInfo:
        v = await self._sandbox._conn.request("GET", self._base + "/stat", params={"path": path})
        return EntryInfo.from_api(v)

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
            return True
        except NotFoundError:
            return False

    async def make_dir(self, path: str) -> EntryInfo:
        v = await self._sandbox._conn.request("POST", self._base + "/mkdir", {"path": path})
        return EntryInfo.from_api(v)

    async def remove(self, path: str, recursive: bool = False) -> None:
        params = {"path": path, "recursive": "true" if recursive else "false"}
        await self._sandbox._conn.request("DELETE", self._base, params=params)

    async def rename(self, old_path: str, new_path: str) -> EntryInfo:
        v = await self._sandbox._conn.request(
            "POST", self._base + "/rename", {"from": old_path, "to": new_path}
        )
        return EntryInfo.from_api(v)


class AsyncSnapshot:
    """A snapshot (see :class:`forkd.Snapshot`)."""

    def __init__(self, info: Dict[str, Any], conn: AsyncConnection) -> None:
        self._conn = conn
        self.info = info
        self.tag: str = info["tag"]

    def __repr__(self) -> str:
        return f"AsyncSnapshot({self.tag!r})"

    @classmethod
    async def list(cls, connection: Optional[AsyncConnection] = None) -> List["AsyncSnapshot"]:
        conn = connection or AsyncConnection()
        v = await conn.request("GET", "/v1/snapshots")
        return [cls(s, conn) for s in v["snapshots"]]

    @classmethod
    async def get(cls, tag: str, connection: Optional[AsyncConnection] = None) -> "AsyncSnapshot":
        conn = connection or AsyncConnection()
        return cls(await conn.request("GET", f"/v1/snapshots/{tag}"), conn)

    async def fork(self, n: int = 1, **options: Any) -> List["AsyncSandbox"]:
        return await AsyncSandbox._fork(self._conn, self.tag, n, **options)

    async def delete(self, cascade: bool = False, force: bool = False) -> None:
        params = {"cascade": str(cascade).lower(), "force": str(force).lower()}
        await self._conn.request("DELETE", f"/v1/snapshots/{self.tag}", params=params)


class AsyncSandbox:
    """One running sandbox, on asyncio; ``async with`` kills it on exit."""

    def __init__(self, info: Dict[str, Any], conn: AsyncConnection) -> None:
        self._conn = conn
        self.id: str = info["id"]
        self.info = SandboxInfo.from_api(info)
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)
        self.pty = AsyncPty(self)

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.id!r})"

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.kill()
        except NotFoundError:
            pass

    @classmethod
    async def _fork(
        cls,
        conn: AsyncConnection,
        snapshot: str,
        n: int,
        timeout: Optional[int] = None,
        labels: Optional[Mapping[str, str]] = None,
        vcpus: Optional[int] = None,
        memory_mib: Optional[int] = None,
        envs: Optional[Mapping[str, str]] = None,
        env: Optional[Mapping[str, str]] = None,
        limits: Optional[Limits] = None,
        network: Optional[Network] = None,
        on_timeout: Optional[str] = None,
        auto_pause_after: Optional[int] = None,
    ) -> List["AsyncSandbox"]:
        # ``envs`` as in E2B's SDK and ``commands.run``; ``env`` as the REST API names it.
        merged = {**(env or {}), **(envs or {})}
        body = _api.fork_body(
            snapshot,
            n,
            timeout,
            labels,
            vcpus,
            memory_mib,
            merged,
            limits,
            network,
            on_timeout,
            auto_pause_after,
        )
        v = await conn.request("POST", "/v1/sandboxes", body)
        return [cls(s, conn) for s in v["sandboxes"]]

    @classmethod
    async def create(
        cls,
        template: str = "python",
        snapshot: Optional[str] = None,
        timeout: Optional[int] = None,
        labels: Optional[Mapping[str, str]] = None,
        envs: Optional[Mapping[str, str]] = None,
        connection: Optional[AsyncConnection] = None,
        **options: Any,
    ) -> "AsyncSandbox":
        conn = connection or AsyncConnection()
        children = await cls._fork(
            conn, snapshot or template, 1, timeout, labels, envs=envs, **options
        )
        return children[0]

    @classmethod
    async def fork(
        cls,
        snapshot: str,
        n: int = 1,
        connection: Optional[AsyncConnection] = None,
        **options: Any,
    ) -> List["AsyncSandbox"]:
        return await cls._fork(connection or AsyncConnection(), snapshot, n, **options)

    @classmethod
    async def connect(
        cls, sandbox_id: str, connection: Optional[AsyncConnection] = None
    ) -> "AsyncSandbox":
        """The sandbox ``sandbox_id``, resumed first if it is paused."""
        conn = connection or AsyncConnection()
        await conn.request("POST", f"/v1/sandboxes/{sandbox_id}/resume")
        return cls(await conn.request("GET", f"/v1/sandboxes/{sandbox_id}"), conn)

    @classmethod
    async def list(
        cls,
        labels: Optional[Mapping[str, str]] = None,
        connection: Optional[AsyncConnection] = None,
    ) -> List[SandboxInfo]:
        conn = connection or AsyncConnection()
        v = await conn.request("GET", "/v1/sandboxes", params=_api.label_params(labels))
        return [SandboxInfo.from_api(s) for s in v["sandboxes"]]

    async def refresh(self) -> SandboxInfo:
        v = await self._conn.request("GET", f"/v1/sandboxes/{self.id}")
        self.info = SandboxInfo.from_api(v)
        return self.info

    async def is_running(self) -> bool:
        try:
            return (await self.refresh()).status == "running"
        except NotFoundError:
            return False

    async def kill(self) -> None:
        await self._conn.request("DELETE", f"/v1/sandboxes/{self.id}")

    async def pause(self) -> None:
        """Writes the sandbox to disk and ends its VM (see :meth:`forkd.Sandbox.pause`)."""
        await self._conn.request("POST", f"/v1/sandboxes/{self.id}/pause")
        await self.refresh()

    async def resume(self) -> None:
        """Runs the paused sandbox again, as it was."""
        await self._conn.request("POST", f"/v1/sandboxes/{self.id}/resume")
        await self.refresh()

    async def set_timeout(self, timeout: Optional[int]) -> None:
        await self._conn.request(
            "PUT", f"/v1/sandboxes/{self.id}/timeout", {"timeout_s": timeout}
        )

    async def set_network(self, network: Network) -> SandboxInfo:
        """Replaces the sandbox's egress policy while it runs (see
        :meth:`forkd.Sandbox.set_network`); returns its info with the new policy."""
        v = await self._conn.request(
            "PUT", f"/v1/sandboxes/{self.id}/network", network.to_api()
        )
        self.info = SandboxInfo.from_api(v)
        return self.info

    async def branch(self, tag: Optional[str] = None, mode: Optional[str] = None) -> AsyncSnapshot:
        v = await self._conn.request(
            "POST", f"/v1/sandboxes/{self.id}/branch", _api.branch_body(tag, mode)
        )
        return await AsyncSnapshot.get(v["snapshot"], self._conn)

    async def run_code(
        self,
        code: str,
        context: Optional[Union[str, CodeContext]] = None,
        timeout: Optional[float] = None,
        on_stdout: Optional[OutputHandler] = None,
        on_stderr: Optional[OutputHandler] = None,
        on_result: Optional[Callable[[Result], None]] = None,
        on_error: Optional[Callable[[ExecutionError], None]] = None,
        envs: Optional[Mapping[str, str]] = None,
    ) -> Execution:
        body = _api.code_body(code, context, timeout, envs)
        path = f"/v1/sandboxes/{self.id}/code"
        if not any((on_stdout, on_stderr, on_result, on_error)):
            return _api.execution_from_api(await self._conn.request("POST", path, body))
        body["stream"] = True
        reader = _api.CodeReader(on_stdout, on_stderr, on_result, on_error)
        async for line in self._conn.stream_lines("POST", path, body):
            x = reader.feed(line)
            if x is not None:
                return x
        raise reader.ended_early()

    async def create_code_context(
        self, cwd: Optional[str] = None, envs: Optional[Mapping[str, str]] = None
    ) -> CodeContext:
        v = await self._conn.request(
            "POST", f"/v1/sandboxes/{self.id}/contexts", _api.context_body(cwd, envs)
        )
        return CodeContext.from_api(v)

    async def list_code_contexts(self) -> List[CodeContext]:
        v = await self._conn.request("GET", f"/v1/sandboxes/{self.id}/contexts")
        return [CodeContext.from_api(c) for c in v]

    async def reset_code_context(self, context: Union[str, CodeContext]) -> CodeContext:
        cid = _api.context_id(context)
        v = await self._conn.request("POST", f"/v1/sandboxes/{self.id}/contexts/{cid}/reset")
        return CodeContext.from_api(v)

    async def remove_code_context(self, context: Union[str, CodeContext]) -> None:
        cid = _api.context_id(context)
        await self._conn.request("DELETE", f"/v1/sandboxes/{self.id}/contexts/{cid}")
