from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from forkd import (
    BadRequestError,
    ConflictError,
    Connection,
    Limits,
    NotFoundError,
    Sandbox,
    Snapshot,
    UnreachableError,
)


def test_create_list_connect_and_kill(snapshot: str, conn: Connection) -> None:
    label = uuid.uuid4().hex[:8]
    envs = {"FORKD_RUN": label}
    with Sandbox.create(snapshot=snapshot, labels={"run": label}, timeout=600, envs=envs) as s:
        # The sandbox's variables reach commands and the code contexts it inherited.
        assert s.commands.run("echo $FORKD_RUN").stdout == label + "\n"
        assert s.run_code("import os; os.environ['FORKD_RUN']").text == repr(label)
        assert [i.id for i in Sandbox.list(labels={"run": label})] == [s.id]
        again = Sandbox.connect(s.id)
        assert again.info.snapshot == snapshot and again.info.timeout_at is not None
        s.set_timeout(None)
        assert s.refresh().timeout_at is None
        assert again.commands.run("echo ok").stdout == "ok\n"
    assert not s.is_running()
    with pytest.raises(NotFoundError):
        s.kill()
    with pytest.raises(BadRequestError, match="env keys"):
        Sandbox.create(snapshot=snapshot, envs={"A=B": "x"})
    # Limits chosen at fork come back in the sandbox's info.
    with Sandbox.create(snapshot=snapshot, limits=Limits(cpu_cores=0.5, pids=64)) as s:
        limits = s.info.limits
        assert limits is not None
        assert (limits.cpu_cores, limits.pids, limits.cpu_weight) == (0.5, 64, 100)
        assert limits.memory_bytes > s.info.memory_mib << 20
    with pytest.raises(BadRequestError, match="pids"):
        Sandbox.create(snapshot=snapshot, limits=Limits(pids=1))
    with pytest.raises(NotFoundError):
        Sandbox.connect("sb-000000000000")


def test_branch_then_fork_the_branch(snapshot: str) -> None:
    tag = "sdk-" + uuid.uuid4().hex[:8]
    with Sandbox.create(snapshot=snapshot) as source:
        source.run_code("state = 'kept'")
        source.files.write("/root/note", "before")
        snap = source.branch(tag=tag)
        assert snap.tag == tag and snap.info["parent"] == snapshot
        with pytest.raises(ConflictError):
            source.branch(tag=tag)
        source.files.write("/root/note", "after")
        children = snap.fork(n=2)
        try:
            for c in children:
                assert c.run_code("state").text == "'kept'"
                assert c.files.read("/root/note") == "before"
        finally:
            for c in children:
                c.kill()
    assert tag in [s.tag for s in Snapshot.list()]
    Snapshot.get(tag).delete()
    with pytest.raises(NotFoundError):
        Snapshot.get(tag)


def test_fork_three_and_the_errors_of_a_killed_one(snapshot: str) -> None:
    kids = Sandbox.fork(snapshot, n=3)
    assert len({k.id for k in kids}) == 3
    for k in kids:
        assert k.commands.run("hostname").exit_code == 0
        k.kill()
    with pytest.raises(NotFoundError) as e:
        kids[0].commands.run("true")
    assert kids[0].id in e.value.message


def test_a_stopped_daemon_is_an_error_naming_the_url(tmp_path: Path) -> None:
    url = f"unix:{tmp_path}/forkd.sock"
    conn = Connection(url=url)
    with pytest.raises(UnreachableError) as e:
        Sandbox.list(connection=conn)
    assert url in str(e.value)
    # Streamed calls too (a file read, a command with output callbacks).
    gone = Sandbox({"id": "sb-000000000000", "snapshot": "x", "status": "running"}, conn)
    with pytest.raises(UnreachableError):
        gone.files.read("/etc/hostname")
    with pytest.raises(UnreachableError):
        gone.commands.run("true", on_stdout=print)


def test_pause_resume_and_connect(snapshot: str) -> None:
    with Sandbox.create(snapshot=snapshot, timeout=600) as s:
        s.run_code("kept = 41")
        s.pause()
        assert s.info.status == "paused"
        with pytest.raises(ConflictError, match="paused"):
            s.pause()
        # Connecting resumes it, with its memory: the code context's variable.
        again = Sandbox.connect(s.id)
        assert again.info.status == "running"
        assert again.run_code("kept + 1").text == "42"
        # Paused again, any call resumes it.
        s.pause()
        assert s.commands.run("echo back").stdout == "back\n"
        assert s.refresh().status == "running"
        s.resume()
        assert s.info.status == "running"
