"""What the API answers with, as typed values."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


def _b64(text: Optional[str]) -> bytes:
    return base64.b64decode(text) if text else b""


class _Output:
    """``stdout``/``stderr``: the captured bytes decoded as UTF-8, invalid bytes replaced."""

    stdout_bytes: bytes
    stderr_bytes: bytes

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")


@dataclass
class CommandResult(_Output):
    """How a command ended and what it wrote. ``stdout``/``stderr`` are the bytes
    decoded as UTF-8 (invalid bytes replaced); ``stdout_bytes``/``stderr_bytes`` are
    exactly what it wrote."""

    exit_code: int
    stdout_bytes: bytes
    stderr_bytes: bytes
    signal: Optional[int] = None
    timed_out: bool = False
    duration_ms: int = 0
    truncated: bool = False

    @classmethod
    def from_api(cls, v: Dict[str, Any]) -> "CommandResult":
        return cls(
            exit_code=int(v["exit_code"]),
            stdout_bytes=_b64(v.get("stdout_b64")),
            stderr_bytes=_b64(v.get("stderr_b64")),
            signal=v.get("signal"),
            timed_out=bool(v.get("timed_out")),
            duration_ms=int(v.get("duration_ms") or 0),
            truncated=bool(v.get("truncated")),
        )


@dataclass
class ProcessInfo(_Output):
    """A background process as the sandbox tracks it (the last 1 MiB of each stream)."""

    id: int
    pid: int
    argv: List[str]
    started_at_ms: int
    running: bool
    exit_code: Optional[int]
    signal: Optional[int]
    timed_out: bool
    stdout_bytes: bytes
    stderr_bytes: bytes
    stdin_open: bool = False

    @classmethod
    def from_api(cls, v: Dict[str, Any]) -> "ProcessInfo":
        return cls(
            id=int(v["id"]),
            pid=int(v["pid"]),
            argv=list(v.get("argv") or []),
            started_at_ms=int(v.get("started_at_ms") or 0),
            running=bool(v["running"]),
            exit_code=v.get("exit_code"),
            signal=v.get("signal"),
            timed_out=bool(v.get("timed_out")),
            stdout_bytes=_b64(v.get("stdout_b64")),
            stderr_bytes=_b64(v.get("stderr_b64")),
            stdin_open=bool(v.get("stdin_open")),
        )


@dataclass
class EntryInfo:
    """A file, directory or link in the guest."""

    path: str
    name: str
    type: str
    size: int
    mode: int
    mtime_ms: int

    @classmethod
    def from_api(cls, v: Dict[str, Any]) -> "EntryInfo":
        return cls(
            path=v["path"],
            name=v["name"],
            type=v["kind"],
            size=int(v["size"]),
            mode=int(v["mode"]),
            mtime_ms=int(v["mtime_ms"]),
        )


@dataclass
class Result:
    """A value a code cell produced: its text, and HTML or a PNG (base64) where it has one."""

    text: str
    html: Optional[str] = None
    png: Optional[str] = None

    @classmethod
    def from_api(cls, v: Dict[str, Any]) -> "Result":
        return cls(text=v.get("text", ""), html=v.get("html"), png=v.get("png"))


@dataclass
class ExecutionError:
    """The exception a code cell raised."""

    name: str
    value: str
    traceback: str


@dataclass
class Logs:
    """What a code cell printed, in the pieces it came in."""

    stdout: List[str] = field(default_factory=list)
    stderr: List[str] = field(default_factory=list)


@dataclass
class Execution:
    """Everything one code cell produced."""

    results: List[Result] = field(default_factory=list)
    logs: Logs = field(default_factory=Logs)
    error: Optional[ExecutionError] = None
    execution_count: int = 0

    @property
    def text(self) -> Optional[str]:
        """The text of the cell's value, if it had one."""
        return self.results[0].text if self.results else None


@dataclass
class CodeContext:
    """A Python interpreter in a sandbox whose state persists between cells."""

    id: str
    language: str
    pid: int
    execution_count: int

    @classmethod
    def from_api(cls, v: Dict[str, Any]) -> "CodeContext":
        return cls(
            id=v["id"],
            language=v.get("language", "python"),
            pid=int(v.get("pid") or 0),
            execution_count=int(v.get("execution_count") or 0),
        )


@dataclass
class Limits:
    """What a sandbox's QEMU may use, chosen at fork; what is left unset takes the
    daemon's default (memory: the guest's RAM plus 512 MiB; one core per vCPU; weight
    100; 256 processes)."""

    memory_mib: Optional[int] = None
    """Memory in MiB, guest RAM included (less than the RAM is allowed)."""
    cpu_cores: Optional[float] = None
    """CPU quota in cores; 0 for none."""
    cpu_weight: Optional[int] = None
    """Share of CPU under contention, 1 to 10000."""
    pids: Optional[int] = None
    """Processes and threads."""

    def to_api(self) -> Dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class Network:
    """A sandbox's egress policy: what its guest may reach. Chosen at fork (a fork that
    gives none takes its snapshot's default), changed while it runs with
    :meth:`forkd.Sandbox.set_network`, and read back in :attr:`SandboxInfo.network`.

    Destinations are ``ADDRESS[/PREFIX][:PORT]`` (IPv4; a port means TCP and UDP) or
    ``NAME[:PORT]`` (a DNS name: ``pypi.org``, or ``*.pythonhosted.org`` for the names
    under it). Private ranges, the host and other sandboxes stay shut in every mode
    unless a network inside them is in ``allow``."""

    egress: str = "deny"
    """``"deny"``: only what ``allow`` lists gets out; ``"allow"``: every public
    destination but what ``deny`` lists; ``"off"``: the NIC's link is down (no lists)."""
    allow: List[str] = field(default_factory=list)
    """Destinations let out."""
    deny: List[str] = field(default_factory=list)
    """Destinations refused, in ``"allow"`` mode only (``allow`` entries win over them)."""

    def to_api(self) -> Dict[str, Any]:
        return {"egress": self.egress, "allow": list(self.allow), "deny": list(self.deny)}

    @classmethod
    def from_api(cls, v: Dict[str, Any]) -> "Network":
        return cls(
            egress=v.get("egress") or "deny",
            allow=list(v.get("allow") or []),
            deny=list(v.get("deny") or []),
        )


@dataclass
class SandboxLimits:
    """A sandbox's limits as the daemon reports them, with what its cgroup counts."""

    memory_bytes: int
    cpu_cores: Optional[float]
    cpu_weight: int
    pids: int
    disk_bytes: Optional[int]
    enforced_by: Optional[str]
    """``cgroup v1`` or ``cgroup v2``; None when the host enforces no limits."""
    memory_used_bytes: Optional[int]

    @classmethod
    def from_api(cls, v: Dict[str, Any]) -> "SandboxLimits":
        return cls(
            memory_bytes=int(v.get("memory_bytes") or 0),
            cpu_cores=v.get("cpu_cores"),
            cpu_weight=int(v.get("cpu_weight") or 0),
            pids=int(v.get("pids") or 0),
            disk_bytes=v.get("disk_bytes"),
            enforced_by=v.get("enforced_by"),
            memory_used_bytes=v.get("memory_used_bytes"),
        )


@dataclass
class SandboxInfo:
    """A sandbox as the daemon lists it."""

    id: str
    snapshot: str
    status: str
    labels: Dict[str, str]
    vcpus: int
    memory_mib: int
    created_at: str
    timeout_at: Optional[int]
    error: Optional[str]
    limits: Optional[SandboxLimits] = None
    network: Optional[Network] = None
    """Its egress policy; None for a sandbox without NIC."""

    @classmethod
    def from_api(cls, v: Dict[str, Any]) -> "SandboxInfo":
        return cls(
            id=v["id"],
            snapshot=v["snapshot"],
            status=v["status"],
            labels=dict(v.get("labels") or {}),
            vcpus=int(v.get("vcpus") or 0),
            memory_mib=int(v.get("memory_mib") or 0),
            created_at=v.get("created_at", ""),
            timeout_at=v.get("timeout_at"),
            error=v.get("error"),
            limits=SandboxLimits.from_api(v["limits"]) if v.get("limits") else None,
            network=Network.from_api(v["network"]) if v.get("network") else None,
        )


@dataclass
class FilesystemEvent:
    """A change in a watched directory: ``type`` is ``create``, ``write``, ``remove``,
    ``rename`` (moved away; the new name comes as a ``create``), ``chmod`` or
    ``overflow`` (events were dropped because they came faster than they were read;
    ``dropped`` says how many at least)."""

    type: str
    path: str
    dir: bool = False
    dropped: Optional[int] = None

    @staticmethod
    def from_api(v: Dict[str, Any]) -> "FilesystemEvent":
        return FilesystemEvent(
            type=v["type"],
            path=v.get("path") or "",
            dir=bool(v.get("dir")),
            dropped=v.get("dropped"),
        )
