"""What the sync and the asyncio clients share: request bodies, and the readers that turn
the daemon's streamed NDJSON lines into results. No I/O here."""

from __future__ import annotations

import base64
import codecs
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

from .errors import ForkdError, SandboxFailedError
from .models import CodeContext, CommandResult, Execution, ExecutionError, Limits, Network, Result

OutputHandler = Callable[[str], None]

# Uploads go in pieces of this size.
CHUNK = 1 << 20


def command_body(
    cmd: Union[str, List[str]],
    envs: Optional[Mapping[str, str]],
    cwd: Optional[str],
    timeout: Optional[float],
) -> Dict[str, Any]:
    """A command as exec and the process routes take it: a str is a shell command
    line, a list an argv."""
    body: Dict[str, Any] = {"shell": cmd} if isinstance(cmd, str) else {"cmd": list(cmd)}
    if envs:
        body["env"] = dict(envs)
    if cwd:
        body["cwd"] = cwd
    if timeout:
        body["timeout_s"] = timeout
    return body


def stdin_b64(stdin: Union[str, bytes]) -> str:
    data = stdin.encode() if isinstance(stdin, str) else stdin
    return base64.b64encode(data).decode()


# A stdin write goes in pieces of this size: a JSON body is at most 1 MiB, base64 takes
# 4 bytes for 3.
STDIN_PIECE = 512 << 10


def stdin_pieces(data: Union[str, bytes], close: bool) -> List[Dict[str, Any]]:
    """The bodies that write ``data`` to a background process's stdin, the last one
    closing it if ``close``."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    bodies: List[Dict[str, Any]] = [
        {"data_b64": base64.b64encode(raw[i : i + STDIN_PIECE]).decode()}
        for i in range(0, len(raw), STDIN_PIECE)
    ] or [{}]
    bodies[-1]["close"] = close
    return bodies


def background_stdin(
    stdin: Optional[Union[str, bytes, bool]],
) -> Optional[Union[str, bytes]]:
    """For a background command: the data to write once it started (None: none), after
    checking ``stdin`` is True (keep it open), False/None, or data (written, then
    closed)."""
    if stdin is None or isinstance(stdin, bool):
        return None
    if isinstance(stdin, (str, bytes, bytearray)):
        return bytes(stdin) if isinstance(stdin, bytearray) else stdin
    raise TypeError(f"stdin must be str, bytes or bool, not {type(stdin).__name__}")


def foreground_stdin(stdin: Optional[Union[str, bytes, bool]]) -> Optional[Union[str, bytes]]:
    if isinstance(stdin, bool):
        raise ValueError("stdin=True keeps stdin open, which only a background command has")
    return stdin


def fork_body(
    snapshot: str,
    n: int,
    timeout: Optional[int] = None,
    labels: Optional[Mapping[str, str]] = None,
    vcpus: Optional[int] = None,
    memory_mib: Optional[int] = None,
    envs: Optional[Mapping[str, str]] = None,
    limits: Optional[Limits] = None,
    network: Optional[Network] = None,
    on_timeout: Optional[str] = None,
    auto_pause_after: Optional[int] = None,
) -> Dict[str, Any]:
    body: Dict[str, Any] = {"snapshot": snapshot, "n": n}
    if on_timeout is not None:
        body["on_timeout"] = on_timeout
    if auto_pause_after is not None:
        body["auto_pause_after_s"] = auto_pause_after
    if limits is not None:
        body["limits"] = limits.to_api()
    if network is not None:
        body["network"] = network.to_api()
    if timeout is not None:
        body["timeout_s"] = timeout
    if labels:
        body["labels"] = dict(labels)
    if envs:
        body["env"] = dict(envs)
    if vcpus is not None:
        body["vcpus"] = vcpus
    if memory_mib is not None:
        body["memory_mib"] = memory_mib
    return body


def label_params(labels: Optional[Mapping[str, str]]) -> List[Any]:
    return [("label", f"{k}={v}") for k, v in (labels or {}).items()]


def branch_body(tag: Optional[str], mode: Optional[str]) -> Dict[str, Any]:
    body: Dict[str, Any] = {}
    if tag:
        body["tag"] = tag
    if mode:
        body["mode"] = mode
    return body


def context_id(context: Union[str, CodeContext]) -> str:
    return context.id if isinstance(context, CodeContext) else context


def context_body(cwd: Optional[str], envs: Optional[Mapping[str, str]]) -> Dict[str, Any]:
    body: Dict[str, Any] = {}
    if cwd:
        body["cwd"] = cwd
    if envs:
        body["env"] = dict(envs)
    return body


def code_body(
    code: str,
    context: Optional[Union[str, CodeContext]],
    timeout: Optional[float],
    envs: Optional[Mapping[str, str]] = None,
) -> Dict[str, Any]:
    body: Dict[str, Any] = {"code": code}
    if context is not None:
        body["context"] = context_id(context)
    if timeout:
        body["timeout_s"] = timeout
    if envs:
        body["env"] = dict(envs)
    return body


def execution_from_api(v: Dict[str, Any]) -> Execution:
    """An :class:`Execution` from the collected (non-streamed) answer of a code run."""
    x = Execution(
        results=[Result.from_api(r) for r in v.get("results") or []],
        execution_count=int(v.get("execution_count") or 0),
    )
    if v.get("stdout"):
        x.logs.stdout.append(v["stdout"])
    if v.get("stderr"):
        x.logs.stderr.append(v["stderr"])
    if v.get("error"):
        e = v["error"]
        x.error = ExecutionError(e["name"], e["value"], e["traceback"])
    return x


def file_params(path: str, mode: Optional[int] = None) -> Dict[str, Any]:
    params: Dict[str, Any] = {"path": path}
    if mode is not None:
        params["mode"] = format(mode, "o")
    return params


def decode_file(data: bytes, format: str) -> Any:
    if format == "bytes":
        return data
    if format == "text":
        return data.decode("utf-8")
    raise ValueError(f"format must be text, bytes or stream, not {format!r}")


class ExecReader:
    """Reads a streamed exec's lines: hands output to the handlers as text (decoded as
    UTF-8 across pieces) and keeps the bytes; :meth:`feed` returns the result at the
    exit line."""

    def __init__(self, on_stdout: Optional[OutputHandler], on_stderr: Optional[OutputHandler]):
        self._streams = {
            "stdout": (codecs.getincrementaldecoder("utf-8")(errors="replace"), on_stdout, bytearray()),
            "stderr": (codecs.getincrementaldecoder("utf-8")(errors="replace"), on_stderr, bytearray()),
        }

    def feed(self, line: Dict[str, Any]) -> Optional[CommandResult]:
        kind = line.get("type")
        if kind in self._streams:
            decoder, handler, buf = self._streams[kind]
            data = base64.b64decode(line.get("data_b64", ""))
            buf.extend(data)
            text = decoder.decode(data)
            if handler and text:
                handler(text)
            return None
        if kind == "exit":
            for decoder, handler, _ in self._streams.values():
                rest = decoder.decode(b"", final=True)
                if handler and rest:
                    handler(rest)
            return CommandResult(
                exit_code=int(line["exit_code"]),
                stdout_bytes=bytes(self._streams["stdout"][2]),
                stderr_bytes=bytes(self._streams["stderr"][2]),
                signal=line.get("signal"),
                timed_out=bool(line.get("timed_out")),
                duration_ms=int(line.get("duration_ms") or 0),
            )
        if kind == "error":
            raise SandboxFailedError(str(line.get("message", "the command failed")))
        return None

    @staticmethod
    def ended_early() -> ForkdError:
        return ForkdError("the daemon ended the command's stream without its exit")


class CodeReader:
    """Reads a streamed code run's lines into an :class:`Execution`, calling the
    handlers as events come; :meth:`feed` returns the execution at its end."""

    def __init__(
        self,
        on_stdout: Optional[OutputHandler] = None,
        on_stderr: Optional[OutputHandler] = None,
        on_result: Optional[Callable[[Result], None]] = None,
        on_error: Optional[Callable[[ExecutionError], None]] = None,
    ) -> None:
        self.x = Execution()
        self._on = (on_stdout, on_stderr, on_result, on_error)

    def feed(self, line: Dict[str, Any]) -> Optional[Execution]:
        on_stdout, on_stderr, on_result, on_error = self._on
        kind = line.get("type")
        if kind == "stdout":
            self.x.logs.stdout.append(line["text"])
            if on_stdout:
                on_stdout(line["text"])
        elif kind == "stderr":
            self.x.logs.stderr.append(line["text"])
            if on_stderr:
                on_stderr(line["text"])
        elif kind == "result":
            r = Result.from_api(line)
            self.x.results.append(r)
            if on_result:
                on_result(r)
        elif kind == "error":
            # The daemon's own line when the sandbox failed mid-cell (no traceback).
            if line.get("name") == "SandboxError" and not line.get("traceback"):
                raise SandboxFailedError(str(line.get("value", "the sandbox failed")))
            self.x.error = ExecutionError(line["name"], line["value"], line["traceback"])
            if on_error:
                on_error(self.x.error)
        elif kind == "done":
            self.x.execution_count = int(line.get("execution_count") or 0)
            return self.x
        return None

    @staticmethod
    def ended_early() -> ForkdError:
        return ForkdError("the daemon ended the cell's stream before its end")
