"""E2B's own SDKs (`e2b`, `e2b-code-interpreter` from PyPI, unmodified) against forkd's
E2B listener. Only E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY point them at it; the
template is the forkd snapshot FORKD_TEST_SNAPSHOT. Prints `ok` when every step held."""

import asyncio
import gc
import hashlib
import os
import threading
import time

from e2b import (
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxNotRunningException,
    SandboxQuery,
    SandboxState,
)
from e2b_code_interpreter import (  # type: ignore[import-untyped]
    AsyncSandbox as AsyncCodeInterpreter,
    Sandbox as CodeInterpreter,
)

template = os.environ["FORKD_TEST_SNAPSHOT"]
run = f"e2b flow {os.getpid()}"

sbx = Sandbox.create(
    template, timeout=600, metadata={"suite": run, "n": "1"}, envs={"GREETING": "hi"}
)

# Commands: streamed output, the default user, its home and the sandbox's env.
seen: list[str] = []
r = sbx.commands.run(
    "for i in 1 2 3; do echo line$i; sleep 0.2; done; echo oops >&2", on_stdout=seen.append
)
assert r.exit_code == 0 and r.stdout == "line1\nline2\nline3\n", r
assert r.stderr == "oops\n", r
assert "".join(seen) == r.stdout and len(seen) >= 2, seen
r = sbx.commands.run('echo "$GREETING $(whoami) $(pwd) $HOME"')
assert r.stdout == "hi user /home/user /home/user\n", r
assert sbx.commands.run("whoami", user="root").stdout == "root\n"
assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"

# A terminal (the PTY service): bash typed into, resized, and its exit code.
screen = bytearray()
term = sbx.pty.create(PtySize(rows=24, cols=80))
ended: list[object] = []


def drain() -> None:
    try:
        ended.append(term.wait(on_pty=screen.extend))
    except CommandExitException as e:
        ended.append(e)


reader = threading.Thread(target=drain)
reader.start()


def shows(want: str) -> None:
    for _ in range(300):
        if want in screen.decode(errors="replace"):
            return
        time.sleep(0.1)
    raise AssertionError(f"the terminal never showed {want!r}: {bytes(screen)!r}")


sbx.pty.send_stdin(term.pid, b"stty size\n")
shows("24 80")
sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
sbx.pty.send_stdin(term.pid, b"stty size; whoami\n")
shows("30 100")
shows("user")
sbx.pty.send_stdin(term.pid, b"exit 3\n")
reader.join(60)
assert len(ended) == 1 and getattr(ended[0], "exit_code", None) == 3, ended

# A failing command raises with its exit code and output.
try:
    sbx.commands.run("echo partial; exit 3")
    raise AssertionError("exit 3 did not raise")
except CommandExitException as e:
    assert e.exit_code == 3 and e.stdout == "partial\n", e

# A background command, listed, then killed.
h = sbx.commands.run("sleep 600", background=True)
assert any(p.pid == h.pid and p.args[-1] == "sleep 600" for p in sbx.commands.list())
assert h.kill()
try:
    h.wait()
    raise AssertionError("a killed command did not raise")
except CommandExitException as e:
    assert e.exit_code != 0, e
assert all(p.pid != h.pid for p in sbx.commands.list())
assert not sbx.commands.kill(h.pid)

# Reattaching to a running command: its output from then on, and its end.
h = sbx.commands.run("sleep 2; echo late", background=True)
assert sbx.commands.connect(h.pid).wait().stdout == "late\n"

# stdin of a background command.
h = sbx.commands.run("cat", background=True, stdin=True)
sbx.commands.send_stdin(h.pid, "first\n")
sbx.commands.send_stdin(h.pid, "second\n")
sbx.commands.close_stdin(h.pid)
assert h.wait().stdout == "first\nsecond\n"

# Files: text, relative to the home directory, and owned by the user.
sbx.files.write("notes/a.txt", "hello")
assert sbx.files.read("/home/user/notes/a.txt") == "hello"
owners = sbx.commands.run("stat -c %U /home/user/notes /home/user/notes/a.txt").stdout
assert owners == "user\nuser\n", owners
# What the user may not write is refused, as it would be in the guest.
try:
    sbx.files.write("/etc/hostname", "taken")
    raise AssertionError("the user overwrote a file of root's")
except SandboxException as e:
    assert "permission denied" in str(e), e
assert sbx.files.read("/etc/hostname", user="root") != "taken"
# Nor may the user read what the guest keeps from him.
sbx.commands.run("echo s3cret > /root/secret && chmod 600 /root/secret", user="root")
for path in ["/root/secret", "/etc/shadow"]:
    try:
        sbx.files.read(path)
        raise AssertionError(f"the user read {path}")
    except SandboxException as e:
        assert "permission denied" in str(e), e
assert sbx.files.read("/root/secret", user="root") == "s3cret\n"
# 10 MB of binary, byte for byte.
blob = os.urandom(10 * 1024 * 1024)
sbx.files.write("/tmp/blob.bin", blob)
got = sbx.files.read("/tmp/blob.bin", format="bytes")
assert hashlib.sha256(got).hexdigest() == hashlib.sha256(blob).hexdigest()
sha = sbx.commands.run("sha256sum /tmp/blob.bin").stdout.split()[0]
assert sha == hashlib.sha256(blob).hexdigest()
# list, exists, make_dir, rename, remove.
entries = sbx.files.list("notes")
assert [(e.name, e.type and e.type.value, e.size) for e in entries] == [("a.txt", "file", 5)]
assert sbx.files.exists("notes/a.txt") and not sbx.files.exists("notes/none")
assert sbx.files.make_dir("d1/d2") is True
assert sbx.files.make_dir("d1/d2") is False
assert getattr(sbx.files.get_info("d1/d2").type, "value", None) == "dir"
moved = sbx.files.rename("notes/a.txt", "notes/b.txt")
assert moved.name == "b.txt" and moved.path == "/home/user/notes/b.txt", moved
sbx.files.remove("notes/b.txt")
assert not sbx.files.exists("notes/b.txt")
try:
    sbx.files.read("notes/b.txt")
    raise AssertionError("reading a removed file did not raise")
except FileNotFoundException:
    pass

# Timeout, list by metadata, info.
sbx.set_timeout(900)
listed = Sandbox.list(query=SandboxQuery(metadata={"suite": run})).next_items()
assert [s.sandbox_id for s in listed] == [sbx.sandbox_id], listed
assert listed[0].metadata == {"suite": run, "n": "1"}, listed[0]
assert Sandbox.list(query=SandboxQuery(metadata={"suite": "other"})).next_items() == []
assert sbx.get_info().template_id == template

# A wrong API key is refused.
try:
    Sandbox.list(api_key="e2b_" + "0" * 40).next_items()
    raise AssertionError("a wrong API key was accepted")
except AuthenticationException:
    pass

# Fork: the sandbox is branched live and goes on; each child has its files and its
# environment as they were at that instant.
sbx.files.write("state.txt", "before the fork")
forks = sbx.fork(count=2, timeout=300)
assert len(forks) == 2, forks
sbx.files.write("state.txt", "after the fork")
for f in forks:
    assert isinstance(f, Sandbox), f
    assert f.sandbox_id != sbx.sandbox_id
    assert f.files.read("state.txt") == "before the fork"
    assert f.commands.run("echo $GREETING").stdout == "hi\n"
    f.kill()
assert sbx.files.read("state.txt") == "after the fork"

# Pause and resume: written to disk, listed paused, back as it was (files and a
# running process) through connect; a paused sandbox's next call resumes it too. (A
# command whose output a caller streams ends at the pause, as forkd's exec streams do;
# a process of the guest's own goes on.)
sbx.commands.run("sleep 600 >/dev/null 2>&1 & echo $! > /tmp/sleeper")
assert sbx.pause() is True
assert Sandbox.pause(sbx.sandbox_id) is False, "already paused"
assert sbx.get_info().state == SandboxState.PAUSED
paused = Sandbox.list(query=SandboxQuery(metadata={"suite": run}, state=[SandboxState.PAUSED]))
assert [s.sandbox_id for s in paused.next_items()] == [sbx.sandbox_id]
running = Sandbox.list(query=SandboxQuery(metadata={"suite": run}, state=[SandboxState.RUNNING]))
assert running.next_items() == []
back = Sandbox.connect(sbx.sandbox_id, timeout=900)
assert back.get_info().state == SandboxState.RUNNING
assert back.files.read("state.txt") == "after the fork"
assert back.commands.run("kill -0 $(cat /tmp/sleeper) && echo alive").stdout == "alive\n"
assert sbx.pause() is True
assert sbx.files.read("state.txt") == "after the fork", "a call resumes it"
assert sbx.get_info().state == SandboxState.RUNNING

# A timeout that pauses, and a resume through connect.
timed = Sandbox.create(
    template, timeout=2, lifecycle={"on_timeout": "pause", "auto_resume": True}
)
timed.files.write("t.txt", "kept")
for _ in range(150):
    if timed.get_info().state == SandboxState.PAUSED:
        break
    time.sleep(0.2)
assert timed.get_info().state == SandboxState.PAUSED
assert Sandbox.connect(timed.sandbox_id, timeout=60).files.read("t.txt") == "kept"
timed.kill()

# A pause that keeps the disk only (mode="filesystem"): connect boots the sandbox
# from it, with its files and without its processes; a reboot asked at connect does
# the same for a sandbox paused whole.
sbx.commands.run("sleep 600 >/dev/null 2>&1 & echo $! > $HOME/sleeper")
assert sbx.pause(mode="filesystem") is True
assert sbx.get_info().state == SandboxState.PAUSED
booted = Sandbox.connect(sbx.sandbox_id, timeout=900)
assert booted.files.read("state.txt") == "after the fork"
gone = "kill -0 $(cat $HOME/sleeper) 2>/dev/null && echo alive || echo gone"
assert booted.commands.run(gone).stdout == "gone\n"
booted.commands.run("sleep 600 >/dev/null 2>&1 & echo $! > $HOME/sleeper")
assert booted.pause() is True
rebooted = booted.connect(on_resume="reboot")
assert rebooted.files.read("state.txt") == "after the fork"
assert rebooted.commands.run(gone).stdout == "gone\n"

# Auto-resume off: a paused sandbox's calls fail as for a sandbox not running, until
# connect resumes it; at its timeout it keeps its disk only.
manual = Sandbox.create(
    template,
    timeout=3,
    lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}, "auto_resume": False},
)
assert manual.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
manual.files.write("m.txt", "kept")
for _ in range(150):
    if manual.get_info().state == SandboxState.PAUSED:
        break
    time.sleep(0.2)
assert manual.get_info().state == SandboxState.PAUSED
try:
    manual.commands.run("true")
    raise AssertionError("a paused sandbox with auto-resume off ran a command")
except SandboxNotRunningException:
    pass
assert manual.get_info().state == SandboxState.PAUSED
assert Sandbox.connect(manual.sandbox_id, timeout=60).files.read("m.txt") == "kept"
manual.kill()

sbx.kill()
assert Sandbox.kill(sbx.sandbox_id) is False

# The code interpreter: state between cells, a DataFrame, a figure, an error.
with CodeInterpreter.create(template) as ci:
    ci.run_code("x = 41")
    assert ci.run_code("x + 1").text == "42"
    ex = ci.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
    assert "<table" in (ex.results[0].html or ""), ex
    ex = ci.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
    assert any(r.png for r in ex.results), ex
    out: list[str] = []
    ex = ci.run_code("print('from a cell')", on_stdout=lambda m: out.append(m.line))
    assert "".join(ex.logs.stdout) == "from a cell\n" == "".join(out), (ex, out)
    # A polled directory watch (CreateWatcher, GetWatcherEvents, RemoveWatcher).
    ci.files.make_dir("polled")
    handle = ci.files.watch_dir("polled")
    ci.commands.run("echo x > polled/p.txt; rm polled/p.txt")
    got: list[tuple[str, str]] = []
    for _ in range(100):
        got += [(e.type.value, e.name) for e in handle.get_new_events()]
        if ("remove", "p.txt") in got:
            break
        time.sleep(0.1)
    handle.stop()
    assert got == [("create", "p.txt"), ("write", "p.txt"), ("remove", "p.txt")], got
    # Variables for one run only.
    probe = "import os; os.environ.get('RUN_ONLY', 'unset')"
    assert ci.run_code(probe, envs={"RUN_ONLY": "for this run"}).text == "'for this run'"
    assert ci.run_code(probe).text == "'unset'"
    ex = ci.run_code("1 / 0")
    assert ex.error is not None and ex.error.name == "ZeroDivisionError", ex
    assert "line 1" in ex.error.traceback, ex.error.traceback
    ctx = ci.create_code_context(cwd="/tmp")
    assert ctx.cwd == "/tmp" and ci.run_code("import os; os.getcwd()", context=ctx).text == "'/tmp'"
    assert [c.cwd for c in ci.list_code_contexts() if c.id == ctx.id] == ["/tmp"]
    ci.run_code("y = 1", context=ctx)
    assert ci.run_code("'y' in dir()").text == "False"
    assert ci.run_code("y", context=ctx).text == "1"



# The asyncio API, which code interpreters serving many users tend to use.
async def on_asyncio() -> None:
    sbx = await AsyncSandbox.create(template)
    seen: list[str] = []
    r = await sbx.commands.run("echo a; sleep 0.2; echo b", on_stdout=seen.append)
    assert r.stdout == "a\nb\n" and "".join(seen) == r.stdout, r
    h = await sbx.commands.run("sleep 600", background=True)
    assert await h.kill()
    # Waited for, so that no response stream is left open when asyncio.run returns:
    # the SDK's HTTP client (pyqwest) aborts the interpreter when a body chunk of an
    # abandoned stream arrives during its finalization.
    try:
        await h.wait()
        raise AssertionError("a killed command did not raise")
    except CommandExitException as e:
        assert e.exit_code != 0, e
    await sbx.files.write("async.txt", "from asyncio")
    assert await sbx.files.read("async.txt") == "from asyncio"
    # A streamed directory watch (WatchDir).
    await sbx.files.make_dir("watched")
    streamed: list[tuple[str, str]] = []
    handle = await sbx.files.watch_dir(
        "watched", lambda e: streamed.append((e.type.value, e.name)), recursive=True
    )
    await sbx.commands.run("echo x > watched/s.txt; rm watched/s.txt")
    for _ in range(100):
        if ("remove", "s.txt") in streamed:
            break
        await asyncio.sleep(0.1)
    await handle.stop()
    assert streamed == [("create", "s.txt"), ("write", "s.txt"), ("remove", "s.txt")], streamed
    await sbx.kill()
    ci = await AsyncCodeInterpreter.create(template)
    try:
        assert (await ci.run_code("2 ** 10")).text == "1024"
    finally:
        await ci.kill()


asyncio.run(on_asyncio())
# What the asyncio SDK left for the garbage collector goes now, while the interpreter
# runs: collected during its finalization, a body stream of the SDK's HTTP client
# (pyqwest) hands its last chunk to a dying interpreter from a thread of its own, and
# CPython aborts the process.
gc.collect()
print("ok")
