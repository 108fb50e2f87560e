from __future__ import annotations

import hashlib
import io
import os

import pytest

from forkd import BadRequestError, NotFoundError, Sandbox


def test_text_bytes_and_streams_round_trip(sbx: Sandbox) -> None:
    sbx.files.write("/tmp/t.txt", "héllo\n")
    assert sbx.files.read("/tmp/t.txt") == "héllo\n"
    sbx.files.write("/tmp/b.bin", b"\x00\xff" * 10, mode=0o600)
    assert sbx.files.read("/tmp/b.bin", format="bytes") == b"\x00\xff" * 10
    assert sbx.files.stat("/tmp/b.bin").mode & 0o777 == 0o600

    # 20 MiB from a file object, sent as it is read, read back as a stream.
    big = os.urandom(20 << 20)
    info = sbx.files.write("/tmp/big", io.BytesIO(big))
    assert info.size == len(big)
    h = hashlib.sha256()
    pieces = 0
    for chunk in sbx.files.read("/tmp/big", format="stream"):
        h.update(chunk)
        pieces += 1
    assert h.hexdigest() == hashlib.sha256(big).hexdigest()
    assert sbx.commands.run("sha256sum /tmp/big").stdout.split()[0] == h.hexdigest()


def test_directories(sbx: Sandbox) -> None:
    sbx.files.make_dir("/tmp/d/e")
    sbx.files.write("/tmp/d/e/f", "x")
    assert [e.name for e in sbx.files.list("/tmp/d")] == ["e"]
    assert sbx.files.stat("/tmp/d/e").type == "dir"
    sbx.files.rename("/tmp/d/e/f", "/tmp/d/g")
    assert sbx.files.exists("/tmp/d/g") and not sbx.files.exists("/tmp/d/e/f")
    sbx.files.remove("/tmp/d", recursive=True)
    assert not sbx.files.exists("/tmp/d")


def test_missing_and_bad_paths(sbx: Sandbox) -> None:
    with pytest.raises(NotFoundError):
        sbx.files.read("/nope/nothing")
    with pytest.raises(NotFoundError):
        sbx.files.stat("/nope/nothing")
    with pytest.raises(BadRequestError):
        sbx.files.write("relative/path", "x")


def test_a_watched_directory_reports_changes_in_order(sbx: Sandbox) -> None:
    import threading
    import time

    from forkd import FilesystemEvent

    sbx.files.make_dir("/tmp/sdk-watch")
    seen: list[FilesystemEvent] = []
    done = threading.Event()

    def on_event(e: FilesystemEvent) -> None:
        seen.append(e)
        if e.type == "remove":
            done.set()

    handle = sbx.files.watch_dir("/tmp/sdk-watch", on_event, recursive=True)
    sbx.commands.run("echo x > /tmp/sdk-watch/f; rm /tmp/sdk-watch/f")
    assert done.wait(30), seen
    handle.stop()
    assert not handle.running and handle.error is None
    assert [(e.type, e.path) for e in seen] == [
        ("create", "/tmp/sdk-watch/f"),
        ("write", "/tmp/sdk-watch/f"),
        ("remove", "/tmp/sdk-watch/f"),
    ]
    # Nothing arrives after stop.
    sbx.commands.run("touch /tmp/sdk-watch/late")
    time.sleep(0.3)
    assert len(seen) == 3
    with pytest.raises(NotFoundError):
        sbx.files.watch_dir("/tmp/no-such-dir", on_event)
