from __future__ import annotations

import hashlib
from typing import List

import pytest

from forkd import BadRequestError, ConflictError, NotFoundError, Sandbox, TimeoutError


def test_a_command_gives_its_output_and_exit_code(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    r = sbx.commands.run(["sh", "-c", "printf '\\377\\000'"])
    assert r.stdout_bytes == b"\xff\x00"
    assert r.exit_code == 0


def test_env_cwd_stdin_and_timeout(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo $A; pwd", envs={"A": "b"}, cwd="/tmp")
    assert r.stdout == "b\n/tmp\n"
    assert sbx.commands.run("wc -c", stdin=b"\x00" * 70000).stdout.strip() == "70000"
    r = sbx.commands.run("sleep 30", timeout=0.5)
    assert r.timed_out and r.exit_code != 0


def test_streamed_output_arrives_in_pieces_and_whole(sbx: Sandbox) -> None:
    out: List[str] = []
    err: List[str] = []
    r = sbx.commands.run(
        "for i in 1 2 3; do echo line$i; echo e$i >&2; sleep 0.2; done; printf '\\342\\202\\254'",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert r.exit_code == 0
    assert "".join(out) == "line1\nline2\nline3\n\u20ac" == r.stdout
    assert "".join(err) == "e1\ne2\ne3\n"
    assert len(out) > 1


def test_background_commands_wait_signal_and_kill(sbx: Sandbox) -> None:
    h = sbx.commands.run("echo started; exec sleep 600", background=True)
    assert any(p.id == h.id and p.running for p in sbx.commands.list())
    with pytest.raises(TimeoutError):
        h.wait(timeout=0.3)
    h.send_signal(15)
    ended = h.wait()
    assert (ended.running, ended.signal, ended.exit_code) == (False, 15, 143)
    assert ended.stdout == "started\n"

    # By name, to the process alone; a name that is no signal is refused.
    h = sbx.commands.run(["sleep", "600"], background=True)
    with pytest.raises(BadRequestError):
        h.send_signal("SIGNOTHING")
    h.send_signal("SIGINT", group=False)
    ended = h.wait()
    assert (ended.running, ended.signal) == (False, 2), ended

    h = sbx.commands.run(["sleep", "600"], background=True)
    assert sbx.commands.connect(h.id).pid == h.pid
    assert not h.kill().running
    with pytest.raises(NotFoundError):
        h.info()


def test_background_stdin_is_written_then_closed(sbx: Sandbox) -> None:
    h = sbx.commands.run("cat; echo eof", background=True, stdin=True)
    assert h.info().stdin_open
    h.send_stdin("a\n")
    # Bytes that are not UTF-8, and more than one request carries.
    big = b"\xff" * 700_000 + b"\n"
    h.send_stdin(big)
    assert not h.close_stdin().stdin_open
    ended = h.wait(timeout=60)
    assert ended.exit_code == 0
    assert ended.stdout_bytes == b"a\n" + big + b"eof\n"
    with pytest.raises(ConflictError, match="closed"):
        h.send_stdin("late")

    # Data given at the start is written, then stdin is closed.
    h = sbx.commands.run(["sha256sum"], background=True, stdin=b"\x00\x01")
    done = h.wait(timeout=60)
    assert done.stdout.split()[0] == hashlib.sha256(b"\x00\x01").hexdigest()
    # Without stdin=True there is none to write.
    h = sbx.commands.run("sleep 600", background=True)
    with pytest.raises(ConflictError, match="stdin"):
        h.send_stdin("x")
    # Bad bodies are refused by the daemon with what is wrong.
    path = f"/v1/sandboxes/{sbx.id}/processes/{h.id}/stdin"
    with pytest.raises(BadRequestError, match="not both"):
        sbx._conn.request("POST", path, {"data": "a", "data_b64": "YQ=="})
    with pytest.raises(BadRequestError, match="not base64"):
        sbx._conn.request("POST", path, {"data_b64": "%%%"})
    h.kill()


def test_bad_commands_are_refused(sbx: Sandbox) -> None:
    with pytest.raises(BadRequestError):
        sbx.commands.run("true", cwd="relative")
    with pytest.raises(ValueError):
        sbx.commands.run("cat", stdin=True)
