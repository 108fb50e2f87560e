"""Terminals: bash on a pseudo-terminal of the guest, typed into, resized, killed."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from forkd import AsyncSandbox, BadRequestError, Sandbox, TerminalClosedError


def _until(screen: bytearray, lock: threading.Lock, want: str, secs: float = 30) -> None:
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        with lock:
            if want in screen.decode(errors="replace"):
                return
        time.sleep(0.05)
    raise AssertionError(f"never saw {want!r}: {screen.decode(errors='replace')!r}")


def test_a_terminal_types_resizes_and_exits_with_its_code(sbx: Sandbox) -> None:
    screen = bytearray()
    lock = threading.Lock()

    def on_data(b: bytes) -> None:
        with lock:
            screen.extend(b)

    t = sbx.pty.create(cols=80, rows=24, on_data=on_data, cmd=["bash"], envs={"PS1": "$ "})
    assert t.pid > 1
    t.send_input("stty size\n")
    _until(screen, lock, "24 80")
    t.resize(cols=100, rows=30)
    t.send_input(b"stty size\n")
    _until(screen, lock, "30 100")
    t.send_input("exit 3\n")
    assert t.wait(30) == 3


def _commands(sbx: Sandbox) -> str:
    """The command lines of the guest's processes (the template has no ps)."""
    r = sbx.commands.run("for c in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $c; echo; done 2>/dev/null")
    assert "sh -c" in r.stdout, r
    return r.stdout


def test_a_killed_terminal_says_so_and_bad_sizes_are_refused(sbx: Sandbox) -> None:
    t = sbx.pty.create(cmd=["sleep", "600"])
    assert "sleep 600" in _commands(sbx)
    t.kill()
    with pytest.raises(TerminalClosedError) as e:
        t.wait(30)
    assert e.value.reason == "killed"
    with pytest.raises(BadRequestError):
        sbx.pty.create(cols=0)
    # The sleep went with its terminal.
    for _ in range(100):
        if "sleep 600" not in _commands(sbx):
            break
        time.sleep(0.1)
    assert "sleep 600" not in _commands(sbx)


def test_the_async_terminal(snapshot: str) -> None:
    async def main() -> None:
        async with await AsyncSandbox.create(snapshot=snapshot) as s:
            seen = bytearray()

            async def on_data(b: bytes) -> None:
                seen.extend(b)

            t = await s.pty.create(cols=50, rows=10, on_data=on_data)
            await t.send_input("stty size; echo login=$0\n")
            for _ in range(600):
                if "10 50" in seen.decode(errors="replace") and "login=-" in seen.decode(errors="replace"):
                    break
                await asyncio.sleep(0.05)
            assert "10 50" in seen.decode(errors="replace"), seen
            await t.resize(60, 12)
            await t.send_input("stty size; exit 4\n")
            assert await t.wait(30) == 4
            assert "12 60" in seen.decode(errors="replace"), seen

    asyncio.run(main())
