"""Sandboxes and snapshots: the SDK's surface over forkd's REST API."""

from __future__ import annotations

import socket
import threading
import time
from typing import IO, Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Union

from . import _api
from ._api import OutputHandler
from ._connection import Connection
from ._pty import Pty
from .errors import NotFoundError, SandboxFailedError, TimeoutError
from .models import (
    CodeContext,
    CommandResult,
    EntryInfo,
    Execution,
    ExecutionError,
    FilesystemEvent,
    Limits,
    Network,
    ProcessInfo,
    Result,
    SandboxInfo,
)


class CommandHandle:
    """A command running in the background. ``wait`` blocks until it ends."""

    def __init__(self, sandbox: "Sandbox", process_id: int, pid: int) -> None:
        self._sandbox = sandbox
        self.id = process_id
        self.pid = pid

    def _path(self, tail: str = "") -> str:
        return f"/v1/sandboxes/{self._sandbox.id}/processes/{self.id}{tail}"

    def info(self) -> ProcessInfo:
        """The process now: running or how it ended, with its output so far."""
        return ProcessInfo.from_api(self._sandbox._conn.request("GET", self._path()))

    def wait(self, timeout: Optional[float] = None) -> ProcessInfo:
        """Waits until the process ends; raises :class:`TimeoutError` if it still runs
        after ``timeout`` seconds (it keeps running)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 3600.0 if deadline is None else max(0.0, deadline - time.monotonic())
            v = self._sandbox._conn.request(
                "POST", self._path("/wait"), params={"timeout_s": min(left, 3600.0)}
            )
            info = ProcessInfo.from_api(v)
            if not info.running:
                return info
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"process {self.id} still runs after {timeout} s")

    def send_signal(self, signal: Union[int, str], group: bool = True) -> ProcessInfo:
        """Sends ``signal`` (a number, 15, or a name, ``"SIGTERM"``) to the process's
        group, or with ``group=False`` to the process alone."""
        body = {"signal": signal, "group": group}
        v = self._sandbox._conn.request("POST", self._path("/signal"), body)
        return ProcessInfo.from_api(v)

    def kill(self) -> ProcessInfo:
        """Kills the process's group and forgets it; returns how it ended."""
        return ProcessInfo.from_api(self._sandbox._conn.request("DELETE", self._path()))

    def send_stdin(self, data: Union[str, bytes]) -> ProcessInfo:
        """Writes ``data`` to the process's stdin (started with ``stdin=True``)."""
        return self._stdin(data, close=False)

    def close_stdin(self) -> ProcessInfo:
        """Closes the process's stdin: its reads see end of file."""
        return self._stdin(b"", close=True)

    def _stdin(self, data: Union[str, bytes], close: bool) -> ProcessInfo:
        v: Dict[str, Any] = {}
        for body in _api.stdin_pieces(data, close):
            v = self._sandbox._conn.request("POST", self._path("/stdin"), body)
        return ProcessInfo.from_api(v)


class Commands:
    """Running commands in a sandbox: ``sandbox.commands``."""

    def __init__(self, sandbox: "Sandbox") -> None:
        self._sandbox = sandbox

    def run(
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
        """Runs ``cmd`` (a shell command line, or an argv list) and returns its
        :class:`CommandResult` once it ends; a non-zero exit is a result, not an error.

        With ``on_stdout``/``on_stderr`` the output is handed over as it comes (text,
        decoded as UTF-8 across the pieces). With ``background=True`` it returns a
        :class:`CommandHandle` at once instead; there ``stdin=True`` keeps the process's
        stdin open for :meth:`CommandHandle.send_stdin`, and data is written to it and
        then closed."""
        body = _api.command_body(cmd, envs, cwd, timeout)
        path = f"/v1/sandboxes/{self._sandbox.id}"
        if background:
            data = _api.background_stdin(stdin)
            if stdin:
                body["stdin"] = True
            v = self._sandbox._conn.request("POST", path + "/processes", body)
            handle = CommandHandle(self._sandbox, int(v["id"]), int(v["pid"]))
            if data is not None:
                handle._stdin(data, close=True)
            return handle
        stdin = _api.foreground_stdin(stdin)
        if stdin is not None:
            body["stdin_b64"] = _api.stdin_b64(stdin)
        if on_stdout is None and on_stderr is None:
            return CommandResult.from_api(self._sandbox._conn.request("POST", path + "/exec", body))
        body["stream"] = True
        reader = _api.ExecReader(on_stdout, on_stderr)
        for line in self._sandbox._conn.stream_lines("POST", path + "/exec", body):
            result = reader.feed(line)
            if result is not None:
                return result
        raise reader.ended_early()

    def list(self) -> List[ProcessInfo]:
        """The sandbox's background processes, running and ended."""
        v = self._sandbox._conn.request("GET", f"/v1/sandboxes/{self._sandbox.id}/processes")
        return [ProcessInfo.from_api(p) for p in v]

    def connect(self, process_id: int) -> CommandHandle:
        """A handle on a background process started earlier."""
        info = ProcessInfo.from_api(
            self._sandbox._conn.request(
                "GET", f"/v1/sandboxes/{self._sandbox.id}/processes/{process_id}"
            )
        )
        return CommandHandle(self._sandbox, info.id, info.pid)


class WatchHandle:
    """A directory watch (:meth:`Files.watch_dir`): its events go to ``on_event`` from a
    thread of its own until :meth:`stop`. If the watch ends by itself (the sandbox paused
    or removed, the directory gone), ``error`` says why (``None`` for the directory)."""

    def __init__(self, response: Any, lines: Iterator[Dict[str, Any]], on_event: Callable[[FilesystemEvent], None]) -> None:
        self._response = response
        self._stopped = False
        self.error: Optional[SandboxFailedError] = None
        self._thread = threading.Thread(target=self._run, args=(lines, on_event), daemon=True)
        self._thread.start()

    def _run(self, lines: Iterator[Dict[str, Any]], on_event: Callable[[FilesystemEvent], None]) -> None:
        try:
            for v in lines:
                if v.get("type") == "error":
                    self.error = SandboxFailedError(str(v.get("message")))
                    return
                on_event(FilesystemEvent.from_api(v))
        except Exception as e:  # the stream broke; unless stopped, say how
            if not self._stopped:
                self.error = SandboxFailedError(f"the watch ended: {e}")

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Ends the watch; no event is delivered after this returns."""
        self._stopped = True
        # Closing the response alone does not wake a read blocked on its socket in the
        # watch's thread; shutting the socket down does.
        stream = self._response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._response.close()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)


class Files:
    """The sandbox's filesystem: ``sandbox.files``. Paths are absolute guest paths."""

    def __init__(self, sandbox: "Sandbox") -> None:
        self._sandbox = sandbox
        self._base = f"/v1/sandboxes/{sandbox.id}/files"

    def watch_dir(
        self, path: str, on_event: Callable[[FilesystemEvent], None], recursive: bool = False
    ) -> WatchHandle:
        """Watches the directory ``path`` (and, with ``recursive``, those under it):
        each change goes to ``on_event``, from a thread of the handle's, until
        ``stop()``. Watching has begun when this returns."""
        params = {"path": path, "recursive": "true" if recursive else "false"}
        r, lines = self._sandbox._conn.open_lines("GET", f"{self._base}/watch", params)
        return WatchHandle(r, lines, on_event)

    def read(self, path: str, format: str = "text") -> Any:
        """The file's contents: ``format="text"`` (UTF-8) gives a str, ``"bytes"``
        bytes, and ``"stream"`` an iterator of byte chunks as they arrive."""
        chunks = self._sandbox._conn.stream_bytes("GET", self._base, {"path": path})
        if format == "stream":
            return chunks
        return _api.decode_file(b"".join(chunks), format)

    def write(
        self,
        path: str,
        data: Union[str, bytes, IO[bytes], Iterable[bytes]],
        mode: Optional[int] = None,
    ) -> EntryInfo:
        """Writes ``data`` (text, bytes, a binary file object or an iterable of byte
        chunks, sent as it is read) to ``path``, replacing it once complete."""
        content: Any
        if isinstance(data, str):
            content = data.encode()
        elif isinstance(data, (bytes, bytearray)):
            content = bytes(data)
        elif hasattr(data, "read"):
            reader = data

            def pieces() -> Iterator[bytes]:
                while True:
                    piece = reader.read(_api.CHUNK)
                    if not piece:
                        return
                    yield piece

            content = pieces()
        else:
            content = iter(data)
        params = _api.file_params(path, mode)
        self._sandbox._conn.request("PUT", self._base, params=params, content=content)
        return self.stat(path)

    def list(self, path: str) -> List[EntryInfo]:
        """The entries of a directory."""
        v = self._sandbox._conn.request("GET", self._base + "/list", params={"path": path})
        return [EntryInfo.from_api(e) for e in v["entries"]]

    def stat(self, path: str) -> EntryInfo:
        """One path (a link is described itself, not what it points to)."""
        return EntryInfo.from_api(
            self._sandbox._conn.request("GET", self._base + "/stat", params={"path": path})
        )

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except NotFoundError:
            return False

    def make_dir(self, path: str) -> EntryInfo:
        """Makes a directory and its missing parents."""
        return EntryInfo.from_api(
            self._sandbox._conn.request("POST", self._base + "/mkdir", {"path": path})
        )

    def remove(self, path: str, recursive: bool = False) -> None:
        """Removes a file, or a directory (with everything in it if ``recursive``)."""
        params = {"path": path, "recursive": "true" if recursive else "false"}
        self._sandbox._conn.request("DELETE", self._base, params=params)

    def rename(self, old_path: str, new_path: str) -> EntryInfo:
        return EntryInfo.from_api(
            self._sandbox._conn.request(
                "POST", self._base + "/rename", {"from": old_path, "to": new_path}
            )
        )


class Snapshot:
    """A snapshot: a template's frozen parent or a branch of a running sandbox."""

    def __init__(self, info: Dict[str, Any], conn: Connection) -> None:
        self._conn = conn
        self.info = info
        self.tag: str = info["tag"]

    def __repr__(self) -> str:
        return f"Snapshot({self.tag!r})"

    @classmethod
    def list(cls, connection: Optional[Connection] = None) -> List["Snapshot"]:
        conn = connection or Connection()
        return [cls(s, conn) for s in conn.request("GET", "/v1/snapshots")["snapshots"]]

    @classmethod
    def get(cls, tag: str, connection: Optional[Connection] = None) -> "Snapshot":
        conn = connection or Connection()
        return cls(conn.request("GET", f"/v1/snapshots/{tag}"), conn)

    def fork(self, n: int = 1, **options: Any) -> List["Sandbox"]:
        """``n`` children of this snapshot (options as for :meth:`Sandbox.create`)."""
        return Sandbox._fork(self._conn, self.tag, n, **options)

    def delete(self, cascade: bool = False, force: bool = False) -> None:
        """Removes it (``cascade``: with the snapshots that build on it; ``force``:
        stopping its children first)."""
        params = {"cascade": str(cascade).lower(), "force": str(force).lower()}
        self._conn.request("DELETE", f"/v1/snapshots/{self.tag}", params=params)


class Sandbox:
    """One running sandbox. Make one with :meth:`create`, :meth:`fork` or
    :meth:`connect`; as a context manager it is killed on exit."""

    def __init__(self, info: Dict[str, Any], conn: Connection) -> None:
        self._conn = conn
        self.id: str = info["id"]
        self.info = SandboxInfo.from_api(info)
        self.commands = Commands(self)
        self.files = Files(self)
        self.pty = Pty(self)

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r})"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.kill()
        except NotFoundError:
            pass

    @classmethod
    def _fork(
        cls,
        conn: Connection,
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
    ) -> List["Sandbox"]:
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
        v = conn.request("POST", "/v1/sandboxes", body)
        return [cls(s, conn) for s in v["sandboxes"]]

    @classmethod
    def create(
        cls,
        template: str = "python",
        snapshot: Optional[str] = None,
        timeout: Optional[int] = None,
        labels: Optional[Mapping[str, str]] = None,
        envs: Optional[Mapping[str, str]] = None,
        connection: Optional[Connection] = None,
        **options: Any,
    ) -> "Sandbox":
        """A new sandbox forked from ``snapshot`` (or from the template's snapshot,
        which has the template's name). ``timeout`` is its lifetime in seconds; ``envs``
        are environment variables its commands and code contexts get; ``limits`` (a
        :class:`Limits`) bounds its QEMU and ``network`` (a :class:`Network`) is its
        egress policy (default: the snapshot's). ``on_timeout="pause"`` pauses it
        when ``timeout`` passes instead of killing it; ``auto_pause_after`` pauses it
        after that many seconds without a request. A paused sandbox resumes on its
        next call."""
        conn = connection or Connection()
        return cls._fork(conn, snapshot or template, 1, timeout, labels, envs=envs, **options)[0]

    @classmethod
    def fork(
        cls, snapshot: str, n: int = 1, connection: Optional[Connection] = None, **options: Any
    ) -> List["Sandbox"]:
        """``n`` new sandboxes forked from ``snapshot``, all or none."""
        return cls._fork(connection or Connection(), snapshot, n, **options)

    @classmethod
    def connect(cls, sandbox_id: str, connection: Optional[Connection] = None) -> "Sandbox":
        """The sandbox ``sandbox_id``, resumed first if it is paused."""
        conn = connection or Connection()
        conn.request("POST", f"/v1/sandboxes/{sandbox_id}/resume")
        return cls(conn.request("GET", f"/v1/sandboxes/{sandbox_id}"), conn)

    @classmethod
    def list(
        cls,
        labels: Optional[Mapping[str, str]] = None,
        connection: Optional[Connection] = None,
    ) -> List[SandboxInfo]:
        """The sandboxes, those carrying every label in ``labels`` if given."""
        conn = connection or Connection()
        v = conn.request("GET", "/v1/sandboxes", params=_api.label_params(labels))
        return [SandboxInfo.from_api(s) for s in v["sandboxes"]]

    def refresh(self) -> SandboxInfo:
        self.info = SandboxInfo.from_api(self._conn.request("GET", f"/v1/sandboxes/{self.id}"))
        return self.info

    def is_running(self) -> bool:
        try:
            return self.refresh().status == "running"
        except NotFoundError:
            return False

    def kill(self) -> None:
        """Stops the sandbox and removes its files."""
        self._conn.request("DELETE", f"/v1/sandboxes/{self.id}")

    def pause(self) -> None:
        """Writes the sandbox to disk and ends its VM: it keeps its files, processes
        and memory and costs no memory until resumed (by :meth:`resume`,
        :meth:`connect` or any call that needs it). Pausing a paused sandbox raises
        :class:`ConflictError`."""
        self._conn.request("POST", f"/v1/sandboxes/{self.id}/pause")
        self.refresh()

    def resume(self) -> None:
        """Runs the paused sandbox again, as it was (a running one is left as it is)."""
        self._conn.request("POST", f"/v1/sandboxes/{self.id}/resume")
        self.refresh()

    def set_timeout(self, timeout: Optional[int]) -> None:
        """Ends the sandbox ``timeout`` seconds from now (None: never)."""
        self._conn.request("PUT", f"/v1/sandboxes/{self.id}/timeout", {"timeout_s": timeout})

    def set_network(self, network: Network) -> SandboxInfo:
        """Replaces the sandbox's egress policy while it runs; it takes effect at once
        (what the old policy's names had opened is shut again). Returns the sandbox's
        info with the new policy; a sandbox without NIC raises :class:`ConflictError`."""
        v = self._conn.request("PUT", f"/v1/sandboxes/{self.id}/network", network.to_api())
        self.info = SandboxInfo.from_api(v)
        return self.info

    def branch(self, tag: Optional[str] = None, mode: Optional[str] = None) -> Snapshot:
        """Snapshots this running sandbox, which runs on; the snapshot forks like a
        template. ``mode`` is ``"live"`` or ``"pause"`` (default: the daemon's)."""
        body = _api.branch_body(tag, mode)
        v = self._conn.request("POST", f"/v1/sandboxes/{self.id}/branch", body)
        return Snapshot.get(v["snapshot"], self._conn)

    # Code contexts: Python interpreters whose state persists between cells.

    def run_code(
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
        """Runs a cell in ``context`` (the sandbox's first by default). The cell's
        exception, if any, is in ``execution.error``: it is not raised here. ``envs`` are set
        in ``os.environ`` for this run only."""
        body = _api.code_body(code, context, timeout, envs)
        path = f"/v1/sandboxes/{self.id}/code"
        if not any((on_stdout, on_stderr, on_result, on_error)):
            return _api.execution_from_api(self._conn.request("POST", path, body))
        body["stream"] = True
        reader = _api.CodeReader(on_stdout, on_stderr, on_result, on_error)
        for line in self._conn.stream_lines("POST", path, body):
            x = reader.feed(line)
            if x is not None:
                return x
        raise reader.ended_early()

    def create_code_context(
        self, cwd: Optional[str] = None, envs: Optional[Mapping[str, str]] = None
    ) -> CodeContext:
        body = _api.context_body(cwd, envs)
        return CodeContext.from_api(
            self._conn.request("POST", f"/v1/sandboxes/{self.id}/contexts", body)
        )

    def list_code_contexts(self) -> List[CodeContext]:
        v = self._conn.request("GET", f"/v1/sandboxes/{self.id}/contexts")
        return [CodeContext.from_api(c) for c in v]

    def reset_code_context(self, context: Union[str, CodeContext]) -> CodeContext:
        """Restarts the context's interpreter with empty state."""
        cid = _api.context_id(context)
        return CodeContext.from_api(
            self._conn.request("POST", f"/v1/sandboxes/{self.id}/contexts/{cid}/reset")
        )

    def remove_code_context(self, context: Union[str, CodeContext]) -> None:
        cid = _api.context_id(context)
        self._conn.request("DELETE", f"/v1/sandboxes/{self.id}/contexts/{cid}")
