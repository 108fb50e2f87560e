"""Where the daemon is and how to talk to it: one httpx client per connection.

The daemon serves its API on a unix socket (``forkd.sock`` in its data directory) and,
when asked, on TCP with a bearer token and optional TLS. ``FORKD_URL`` picks one:
``unix:/path/to/forkd.sock``, ``http://host:port`` or ``https://host:port``;
``FORKD_TOKEN`` is the token and ``FORKD_CA`` a CA bundle for a certificate the system
does not trust.
"""

from __future__ import annotations

import json
import os
import ssl
from contextlib import asynccontextmanager, contextmanager
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlencode

import httpx

from .errors import UnreachableError, error_for

# Requests that run guest code may take as long as the code does: no read timeout.
_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=None, pool=None)


def default_socket() -> str:
    """The socket of the daemon on this host's default data directory."""
    home = os.environ.get("FORKD_HOME")
    if not home:
        xdg = os.environ.get("XDG_DATA_HOME", "")
        if os.geteuid() == 0:
            home = "/var/lib/forkd"
        elif os.path.isabs(xdg):
            home = os.path.join(xdg, "forkd")
        else:
            home = os.path.join(os.path.expanduser("~"), ".local", "share", "forkd")
    return os.path.join(home, "forkd.sock")


def _settings(
    url: Optional[str], token: Optional[str], ca: Optional[str]
) -> Tuple[str, Dict[str, Any]]:
    """The URL and the httpx client options for these arguments and the environment."""
    url = url or os.environ.get("FORKD_URL") or "unix:" + default_socket()
    token = token or os.environ.get("FORKD_TOKEN")
    ca = ca or os.environ.get("FORKD_CA")
    options: Dict[str, Any] = {
        "headers": {"Authorization": f"Bearer {token}"} if token else {},
        "timeout": _TIMEOUT,
    }
    if url.startswith("unix:"):
        options["base_url"] = "http://forkd"
        options["uds"] = url[len("unix:"):]
    elif url.startswith(("http://", "https://")):
        options["base_url"] = url.rstrip("/")
        if ca:
            options["verify"] = ssl.create_default_context(cafile=ca)
    else:
        raise ValueError(f"FORKD_URL must be unix:/path, http://HOST:PORT or https://HOST:PORT: {url!r}")
    return url, options


_DOWN = (httpx.ConnectError, httpx.RemoteProtocolError)

# Where a WebSocket goes: the unix socket (if any), the base of its URI, its headers and
# its TLS context.
_WsTarget = Tuple[Optional[str], str, Dict[str, str], Optional[ssl.SSLContext]]


def _ws_target(options: Dict[str, Any]) -> _WsTarget:
    headers = dict(options["headers"])
    if options.get("uds"):
        return options["uds"], "ws://forkd", headers, None
    base: str = options["base_url"]
    if base.startswith("https://"):
        ctx = options.get("verify")
        return None, "wss://" + base[len("https://"):], headers, ctx if isinstance(ctx, ssl.SSLContext) else ssl.create_default_context()
    return None, "ws://" + base[len("http://"):], headers, None


def _ws_uri(target: _WsTarget, path: str, query: List[Tuple[str, str]]) -> str:
    return target[1] + path + ("?" + urlencode(query) if query else "")


# The daemon's sockets need no keepalive pings (a terminal may idle for hours), and a
# message is at most a chunk of output.
_WS_OPTIONS: Dict[str, Any] = {"ping_interval": None, "max_size": 4 << 20}


def _ws_failure(e: Exception) -> Exception:
    """The daemon's error for a WebSocket it would not open."""
    response = getattr(e, "response", None)
    if response is None:
        return e
    body: Any = None
    try:
        body = json.loads(response.body or b"")
    except ValueError:
        pass
    return error_for(response.status_code, body)


def unreachable(url: str, e: Exception) -> UnreachableError:
    return UnreachableError(f"no forkd daemon answers at {url}: {e}")


@contextmanager
def _streaming(http: httpx.Client, url: str, method: str, path: str, **kw: Any) -> Iterator[httpx.Response]:
    """``http.stream`` whose failure to connect is an :class:`UnreachableError`, and whose
    error answer is raised as the daemon's error."""
    try:
        with http.stream(method, path, **kw) as r:
            if r.status_code >= 400:
                r.read()
                decode(r)
            yield r
    except _DOWN as e:
        raise unreachable(url, e) from e


@asynccontextmanager
async def _astreaming(
    http: httpx.AsyncClient, url: str, method: str, path: str, **kw: Any
) -> AsyncIterator[httpx.Response]:
    try:
        async with http.stream(method, path, **kw) as r:
            if r.status_code >= 400:
                await r.aread()
                decode(r)
            yield r
    except _DOWN as e:
        raise unreachable(url, e) from e


def decode(r: httpx.Response) -> Any:
    """The decoded JSON answer (None when empty), or the error the daemon answered with."""
    body: Any = None
    if r.content:
        try:
            body = r.json()
        except ValueError:
            body = None
    if r.status_code >= 400:
        raise error_for(r.status_code, body)
    return body


class Connection:
    """A connection to one daemon. Arguments override ``FORKD_URL``, ``FORKD_TOKEN``
    and ``FORKD_CA``; with none of them set, the local unix socket is used."""

    def __init__(
        self,
        url: Optional[str] = None,
        token: Optional[str] = None,
        ca: Optional[str] = None,
    ) -> None:
        self.url, options = _settings(url, token, ca)
        self._ws = _ws_target(options)
        uds = options.pop("uds", None)
        if uds is not None:
            options["transport"] = httpx.HTTPTransport(uds=uds)
        self._http = httpx.Client(**options)

    def websocket(self, path: str, query: List[Tuple[str, str]]) -> Any:
        """Opens the daemon's WebSocket at ``path``; the daemon's error if it will not."""
        from websockets.exceptions import InvalidStatus
        from websockets.sync.client import connect, unix_connect

        uri = _ws_uri(self._ws, path, query)
        uds, _, headers, ctx = self._ws
        try:
            if uds is not None:
                ws = unix_connect(uds, uri, additional_headers=headers, **_WS_OPTIONS)
            else:
                ws = connect(uri, additional_headers=headers, ssl=ctx, **_WS_OPTIONS)
            # Entered as its context manager would be (the way websockets asks for since
            # 17.1, and the same connection before): the terminal's handle closes it.
            return ws.__enter__()
        except InvalidStatus as e:
            raise _ws_failure(e) from None
        except OSError as e:
            raise unreachable(self.url, e) from e

    def close(self) -> None:
        self._http.close()

    def request(
        self,
        method: str,
        path: str,
        json_body: Any = None,
        params: Any = None,
        content: Any = None,
    ) -> Any:
        """Sends one request; returns the decoded JSON answer (None when empty) or raises
        the error the daemon answered with."""
        try:
            r = self._http.request(method, path, json=json_body, params=params, content=content)
        except _DOWN as e:
            raise unreachable(self.url, e) from e
        return decode(r)

    def stream_lines(self, method: str, path: str, json_body: Any) -> Iterator[Dict[str, Any]]:
        """Sends one request whose answer is NDJSON and yields its lines as they come."""
        with _streaming(self._http, self.url, method, path, json=json_body) as r:
            for line in r.iter_lines():
                if line.strip():
                    yield json.loads(line)

    def open_lines(
        self, method: str, path: str, params: Any
    ) -> Tuple[httpx.Response, Iterator[Dict[str, Any]]]:
        """Sends one request whose answer is NDJSON and returns, once its head has come,
        the response (closing it stops the stream) and its lines as they come."""
        try:
            r = self._http.send(self._http.build_request(method, path, params=params), stream=True)
        except _DOWN as e:
            raise unreachable(self.url, e) from e
        if r.status_code >= 400:
            r.read()
            r.close()
            decode(r)

        def lines() -> Iterator[Dict[str, Any]]:
            try:
                for line in r.iter_lines():
                    if line.strip():
                        yield json.loads(line)
            finally:
                r.close()

        return r, lines()

    def stream_bytes(self, method: str, path: str, params: Any) -> Iterator[bytes]:
        """Sends one request and yields the answer's body in chunks."""
        with _streaming(self._http, self.url, method, path, params=params) as r:
            yield from r.iter_bytes()


class AsyncConnection:
    """:class:`Connection` on asyncio."""

    def __init__(
        self,
        url: Optional[str] = None,
        token: Optional[str] = None,
        ca: Optional[str] = None,
    ) -> None:
        self.url, options = _settings(url, token, ca)
        self._ws = _ws_target(options)
        uds = options.pop("uds", None)
        if uds is not None:
            options["transport"] = httpx.AsyncHTTPTransport(uds=uds)
        self._http = httpx.AsyncClient(**options)

    async def websocket(self, path: str, query: List[Tuple[str, str]]) -> Any:
        """:meth:`Connection.websocket` on asyncio."""
        from websockets.asyncio.client import connect, unix_connect
        from websockets.exceptions import InvalidStatus

        uri = _ws_uri(self._ws, path, query)
        uds, _, headers, ctx = self._ws
        try:
            if uds is not None:
                return await unix_connect(uds, uri, additional_headers=headers, **_WS_OPTIONS)
            return await connect(uri, additional_headers=headers, ssl=ctx, **_WS_OPTIONS)
        except InvalidStatus as e:
            raise _ws_failure(e) from None
        except OSError as e:
            raise unreachable(self.url, e) from e

    async def close(self) -> None:
        await self._http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        json_body: Any = None,
        params: Any = None,
        content: Any = None,
    ) -> Any:
        try:
            r = await self._http.request(
                method, path, json=json_body, params=params, content=content
            )
        except _DOWN as e:
            raise unreachable(self.url, e) from e
        return decode(r)

    async def stream_lines(
        self, method: str, path: str, json_body: Any
    ) -> AsyncIterator[Dict[str, Any]]:
        async with _astreaming(self._http, self.url, method, path, json=json_body) as r:
            async for line in r.aiter_lines():
                if line.strip():
                    yield json.loads(line)

    async def open_lines(
        self, method: str, path: str, params: Any
    ) -> Tuple[httpx.Response, AsyncIterator[Dict[str, Any]]]:
        """:meth:`Connection.open_lines` on asyncio."""
        try:
            req = self._http.build_request(method, path, params=params)
            r = await self._http.send(req, stream=True)
        except _DOWN as e:
            raise unreachable(self.url, e) from e
        if r.status_code >= 400:
            await r.aread()
            await r.aclose()
            decode(r)

        async def lines() -> AsyncIterator[Dict[str, Any]]:
            try:
                async for line in r.aiter_lines():
                    if line.strip():
                        yield json.loads(line)
            finally:
                await r.aclose()

        return r, lines()

    async def stream_bytes(self, method: str, path: str, params: Any) -> AsyncIterator[bytes]:
        async with _astreaming(self._http, self.url, method, path, params=params) as r:
            async for chunk in r.aiter_bytes():
                yield chunk
