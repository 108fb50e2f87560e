"""Drives `forkd mcp` with the official MCP Python client over stdio, as an MCP host
would: FORKD_MCP_CONFIG is a client configuration as docs/mcp.md shows it (the server
is started from its `mcpServers.forkd` entry, with `forkd` found on PATH), FORKD_URL the
daemon, FORKD_TEST_SNAPSHOT a snapshot of the python template on it. Then the same
server over streamable HTTP at FORKD_MCP_HTTP_URL (the daemon's /mcp on TCP), with the
bearer token FORKD_MCP_TOKEN. Prints "ok" when every check passed."""

import asyncio
import json
import os

import httpx2
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client


def text(result) -> str:
    return "".join(c.text for c in result.content if getattr(c, "type", "") == "text")


async def main() -> None:
    snap = os.environ["FORKD_TEST_SNAPSHOT"]
    server = json.loads(os.environ["FORKD_MCP_CONFIG"])["mcpServers"]["forkd"]
    params = StdioServerParameters(
        command=server["command"],
        args=server.get("args", []),
        env={**os.environ, **server.get("env", {})},
    )
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as s:
            await s.initialize()
            listed = (await s.list_tools()).tools
            # Every tool comes with a description and a JSON schema of its arguments.
            for t in listed:
                assert t.description and t.input_schema.get("type") == "object", t
            run = next(t for t in listed if t.name == "run_command")
            assert {"id", "command"} <= set(run.input_schema.get("required", [])), run
            tools = {t.name for t in listed}
            want = {
                "list_snapshots", "create_sandbox", "list_sandboxes", "kill_sandbox",
                "run_command", "run_code", "read_file", "write_file", "list_files",
                "branch_sandbox", "pause_sandbox", "resume_sandbox",
            }
            assert want <= tools, tools

            assert snap in text(await s.call_tool("list_snapshots", {}))
            r = await s.call_tool("create_sandbox", {"snapshot": snap})
            assert not r.is_error, text(r)
            sid = text(r).strip()
            assert sid.startswith("sb-"), sid
            assert sid in text(await s.call_tool("list_sandboxes", {}))

            r = await s.call_tool("run_command", {"id": sid, "command": "echo hi; echo oops >&2; exit 3"})
            out = text(r)
            assert "exit code 3" in out and "hi" in out and "oops" in out, out

            r = await s.call_tool("write_file", {"id": sid, "path": "/root/notes/a.txt", "content": "héllo"})
            assert not r.is_error, text(r)
            assert text(await s.call_tool("read_file", {"id": sid, "path": "/root/notes/a.txt"})) == "héllo"
            assert "a.txt" in text(await s.call_tool("list_files", {"id": sid, "path": "/root/notes"}))

            r = await s.call_tool("run_code", {"id": sid, "code": "x = 41\nprint('p')\nx + 1"})
            assert "42" in text(r) and "p" in text(r) and not r.is_error, text(r)
            # A figure the cell leaves open reaches the model as an image.
            r = await s.call_tool(
                "run_code",
                {"id": sid, "code": "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nNone"},
            )
            images = [c for c in r.content if getattr(c, "type", "") == "image"]
            assert not r.is_error and images and images[0].mime_type == "image/png", r
            r = await s.call_tool("run_code", {"id": sid, "code": "1 / 0"})
            assert r.is_error and "ZeroDivisionError" in text(r), text(r)

            # Branch, then fork the branch: the child has the source's Python state.
            r = await s.call_tool("branch_sandbox", {"id": sid, "tag": "mcp-branch"})
            assert text(r) == "mcp-branch", text(r)
            child = text(await s.call_tool("create_sandbox", {"snapshot": "mcp-branch"})).strip()
            assert "41" in text(await s.call_tool("run_code", {"id": child, "code": "x"}))

            # Paused, then resumed by the next call, with its Python state.
            r = await s.call_tool("pause_sandbox", {"id": child})
            assert not r.is_error and "paused" in text(r), text(r)
            assert "paused" in text(await s.call_tool("list_sandboxes", {}))
            assert "41" in text(await s.call_tool("run_code", {"id": child, "code": "x"}))
            r = await s.call_tool("resume_sandbox", {"id": child})
            assert not r.is_error, text(r)

            # Failures come back as tool errors the model can read.
            r = await s.call_tool("run_command", {"id": "sb-000000000000", "command": "true"})
            assert r.is_error and "sb-000000000000" in text(r), text(r)
            r = await s.call_tool("read_file", {"id": sid, "path": "/nope"})
            assert r.is_error, text(r)
            r = await s.call_tool("create_sandbox", {"snapshot": "../x"})
            assert r.is_error, text(r)

            for i in (child, sid):
                assert not (await s.call_tool("kill_sandbox", {"id": i})).is_error
            assert "no sandboxes" in text(await s.call_tool("list_sandboxes", {}))

    # Streamable HTTP on the daemon: refused without the token, served with it.
    url = os.environ["FORKD_MCP_HTTP_URL"]
    async with httpx2.AsyncClient() as anon:
        r = await anon.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
        assert r.status_code == 401, r.status_code
    auth = {"Authorization": "Bearer " + os.environ["FORKD_MCP_TOKEN"]}
    async with create_mcp_http_client(headers=auth) as http:
        async with streamable_http_client(url, http_client=http) as (read, write):
            async with ClientSession(read, write) as s:
                await s.initialize()
                assert "run_code" in {t.name for t in (await s.list_tools()).tools}
                r = await s.call_tool("create_sandbox", {"snapshot": snap})
                assert not r.is_error, text(r)
                sid = text(r).strip()
                r = await s.call_tool("run_code", {"id": sid, "code": "6 * 7"})
                assert "42" in text(r) and not r.is_error, text(r)
                r = await s.call_tool("kill_sandbox", {"id": "sb-000000000000"})
                assert r.is_error, text(r)
                assert not (await s.call_tool("kill_sandbox", {"id": sid})).is_error
    print("ok")


asyncio.run(main())
