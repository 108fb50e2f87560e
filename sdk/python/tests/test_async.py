"""The asyncio client: the same calls awaited, several sandboxes driven at once."""

from __future__ import annotations

import asyncio
import io
from typing import List

import pytest

from forkd import AsyncConnection, AsyncSandbox, AsyncSnapshot, NotFoundError, TimeoutError


def test_the_async_client_drives_sandboxes_concurrently(snapshot: str) -> None:
    async def main() -> None:
        conn = AsyncConnection()
        pair = await AsyncSandbox.fork(snapshot, n=2, connection=conn)
        try:
            # Both at once: each runs its own command and cell.
            results = await asyncio.gather(
                *(s.commands.run(f"echo {s.id}; exit 5") for s in pair)
            )
            assert [(r.exit_code, r.stdout) for r in results] == [
                (5, f"{s.id}\n") for s in pair
            ]
            a = pair[0]
            assert (await a.run_code("x = 2; x * 21")).text == "42"
            # A watch, its events to a coroutine.
            await a.files.make_dir("/tmp/aw")
            events: List[str] = []

            async def on_event(e: object) -> None:
                events.append(getattr(e, "type"))

            w = await a.files.watch_dir("/tmp/aw", on_event)
            await a.commands.run("echo x > /tmp/aw/f; rm /tmp/aw/f")
            for _ in range(300):
                if "remove" in events:
                    break
                await asyncio.sleep(0.1)
            await w.stop()
            assert events == ["create", "write", "remove"], events
            out: List[str] = []
            r = await a.commands.run("echo one; sleep 0.2; echo two", on_stdout=out.append)
            assert "".join(out) == "one\ntwo\n" == r.stdout

            await a.files.write("/tmp/a.bin", io.BytesIO(b"\x01" * 3_000_000))
            assert len(await a.files.read("/tmp/a.bin", format="bytes")) == 3_000_000
            assert await a.files.exists("/tmp/a.bin")
            assert [e.name for e in await a.files.list("/tmp") if e.name == "a.bin"] == ["a.bin"]

            h = await a.commands.run("sleep 600", background=True)
            with pytest.raises(TimeoutError):
                await h.wait(timeout=0.2)
            assert (await h.kill()).running is False

            ctx = await a.create_code_context()
            assert (await a.run_code("'x' in globals()", context=ctx)).text == "False"
            await a.remove_code_context(ctx)

            snap = await a.branch()
            assert snap.info["parent"] == snapshot
            (child,) = await snap.fork(n=1)
            assert (await child.run_code("x")).text == "2"
            await child.pause()
            assert child.info.status == "paused"
            again = await AsyncSandbox.connect(child.id, connection=conn)
            assert again.info.status == "running"
            assert (await again.run_code("x")).text == "2"
            await child.kill()
        finally:
            for s in pair:
                await s.kill()
        assert not await pair[0].is_running()
        # Its source ran on the branch's disk: only now may the branch go.
        await snap.delete()
        with pytest.raises(NotFoundError):
            await AsyncSnapshot.get(snap.tag, connection=conn)
        await conn.close()

    asyncio.run(main())
