"""The transports of every client: ``POST /rpc`` (msgpack), the JSON endpoints, streams.

One request builder and one reply reader serve two transports:

* ``SyncRpc``: a keep-alive ``http.client`` connection, for trainer threads and tools (one per
  thread: it is not thread-safe); it also opens the data servers' frame streams.
* ``AsyncRpc``: aiohttp, for servers calling peers and controllers.

A request is built once as a ``Request`` (method, path, encoded body, how to read the answer);
a transport only moves bytes. Error replies are raised as ``RpcError`` carrying the server's
code, message and extra fields; a failure to reach the server at all is ``ConnectionError``, a
silent server ``TimeoutError`` (in both cases the outcome is unknown to the caller). Retrying is
not done here: it is the callers' (``adamps.client.retry``), who know what is safe to repeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from adamps.security import tls
from adamps.wire import protocol
from adamps.wire.protocol import ProtocolError

MSGPACK = "application/msgpack"
JSON = "application/json"
#: reply bytes from which AsyncRpc decodes on a worker thread: msgpack copies each array's bytes,
#: and a server reading a peer's snapshot of a large bucket held its event loop (issue 39)
DECODE_OFF_LOOP = 1 << 20


class RpcError(ProtocolError):
    """An error reply from a server."""

    def __init__(
        self, code: str, message: str, http_status: int | None = None, **extra: Any
    ) -> None:
        super().__init__(code, message, **extra)
        self.http_status = http_status


# -- the request builder and the reply reader (no IO) ---------------------------------------------


def _json_or_none(data: bytes) -> Any:
    return json.loads(data) if data else None


@dataclass(frozen=True)
class Request:
    """One HTTP request, ready to send on either transport."""

    method: str
    #: path and query string
    path: str
    body: bytes | None = None
    content_type: str = JSON
    #: reads a 200 answer's body
    decode: Callable[[bytes], Any] = json.loads
    #: further headers (a peer's MAC of the body, adamps.security.peer_auth)
    extra_headers: tuple[tuple[str, str], ...] = ()


def rpc_request(op: str, path: str = "/rpc", **fields: Any) -> Request:
    """Request `op` with `fields` as msgpack (the servers' ``POST /rpc``, the data servers'
    ``POST /stream``)."""
    return Request("POST", path, protocol.encode(protocol.request(op, **fields)), MSGPACK,
                   protocol.decode)  # fmt: skip


def json_request(method: str, path: str, obj: Any = None) -> Request:
    """A JSON request: a GET, or a POST of `obj` (``{}`` when None)."""
    if method == "GET":
        return Request("GET", path)
    return Request(method, path, json.dumps(obj or {}).encode(), JSON, _json_or_none)


def headers(
    token: str | None, content_type: str, extra: tuple[tuple[str, str], ...] = ()
) -> dict[str, str]:
    h = {"Content-Type": content_type}
    if token:
        h["Authorization"] = f"Bearer {token}"
    h.update(extra)
    return h


def raise_for(status: int, body: bytes) -> None:
    """Raises the RpcError that an error reply (`status` other than 200) describes."""
    err = protocol.error_from_body(status, body)
    extra = {k: v for k, v in err.extra.items() if k != "http_status"}
    raise RpcError(err.code, err.message, http_status=status, **extra)


def read_reply(req: Request, status: int, data: bytes) -> Any:
    """The answer to `req`: its decoded body, or the RpcError of an error reply."""
    if status != 200:
        raise_for(status, data)
    return req.decode(data)


def base_url(addr: str) -> str:
    """'host:port' or a URL -> a URL without a trailing slash."""
    return tls.url(addr)


class _Verbs:
    """The request kinds every transport offers, built once over its `send` (a value for the
    blocking transport, an awaitable for the asyncio one)."""

    def send(self, req: Request) -> Any:
        raise NotImplementedError

    def call(self, op: str, path: str = "/rpc", **fields: Any) -> Any:
        """Sends request `op` with `fields`; returns the reply message or raises RpcError."""
        return self.send(rpc_request(op, path, **fields))

    def get_json(self, path: str) -> Any:
        return self.send(json_request("GET", path))

    def post_json(self, path: str, obj: Any = None) -> Any:
        return self.send(json_request("POST", path, obj))


# -- the blocking transport ------------------------------------------------------------------------

#: what a dropped keep-alive connection raises on its next request (sent again once if a GET)
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


def _transport_error(exc: BaseException, where: str, timeout: float) -> OSError:
    if isinstance(exc, socket.timeout | TimeoutError):
        return TimeoutError(f"{where}: timed out after {timeout}s")
    return ConnectionError(f"{where}: {exc}")


class Stream:
    """The body of a 200 answer, read as it arrives (a data server's frames). `read(n)` returns
    fewer bytes only at the end; a cut or silent connection raises ConnectionError/TimeoutError."""

    def __init__(self, rpc: SyncRpc, resp: http.client.HTTPResponse, where: str) -> None:
        self._rpc, self._resp, self._where = rpc, resp, where

    def read(self, n: int) -> bytes:
        try:
            return self._resp.read(n)
        except (OSError, http.client.HTTPException) as exc:
            self._rpc.close()
            raise _transport_error(exc, self._where, self._rpc.timeout) from exc


class SyncRpc(_Verbs, contextlib.AbstractContextManager["SyncRpc"]):
    """A blocking client of one server over one keep-alive connection."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0) -> None:
        parts = urlsplit(tls.url(base_url))
        self.base_url = f"{parts.scheme}://{parts.netloc}"
        self.host = parts.hostname or "127.0.0.1"
        #: the TLS context of an https server (None: plain HTTP)
        self._tls = tls.client_context() if parts.scheme == "https" else None
        if parts.scheme == "https" and self._tls is None:  # an explicit https URL, no CA set
            self._tls = ssl.create_default_context()
        self.port = parts.port or (443 if self._tls else 80)
        self.token = token
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def _response(self, req: Request) -> http.client.HTTPResponse:
        # One retry on a stale keep-alive connection; a request that fails twice is the caller's.
        where = f"{self.base_url}{req.path}"
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = self._connect()
            try:
                self._conn.request(
                    req.method,
                    req.path,
                    body=req.body,
                    headers=headers(self.token, req.content_type, req.extra_headers),
                )
                return self._conn.getresponse()
            except _STALE as exc:
                self.close()
                if attempt == 1 or req.method != "GET":
                    raise ConnectionError(f"{where}: {exc}") from exc
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                raise _transport_error(exc, where, self.timeout) from exc
        raise AssertionError("unreachable")

    def _connect(self) -> http.client.HTTPConnection:
        if self._tls is None:
            return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return http.client.HTTPSConnection(
            self.host, self.port, timeout=self.timeout, context=self._tls
        )

    def exchange(self, req: Request) -> tuple[int, bytes]:
        """(status, body) of `req`, whatever the status."""
        return self._request(req.method, req.path, req.body, req.content_type, req.extra_headers)

    def _request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        content_type: str,
        extra_headers: tuple[tuple[str, str], ...] = (),
    ) -> tuple[int, bytes]:
        # Every whole exchange passes here: a subclass may count or record them (a metered
        # client counts the bytes of each body).
        req = Request(method, path, body, content_type, extra_headers=extra_headers)
        resp = self._response(req)
        try:
            data = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            # The response may own the socket (a "Connection: close" reply): closing only the
            # connection would leave its descriptor open until the garbage collector came.
            resp.close()
            self.close()
            raise _transport_error(exc, f"{self.base_url}{path}", self.timeout) from exc
        if resp.getheader("Connection", "").lower() == "close":
            self.close()
        return resp.status, data

    def send(self, req: Request) -> Any:
        return read_reply(req, *self.exchange(req))

    def open_stream(self, req: Request) -> Stream:
        """Sends `req` and returns its 200 answer's body to read as it comes (an error reply is
        raised as RpcError). The connection serves nothing else until the stream is closed."""
        resp = self._response(req)
        if resp.status != 200:
            status, data = resp.status, resp.read()
            self.close()
            raise_for(status, data)
        return Stream(self, resp, f"{self.base_url}{req.path}")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the asyncio transport -------------------------------------------------------------------------


class AsyncRpc(_Verbs):
    """An aiohttp client of one server. Pass a shared session to pool connections."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        session: aiohttp.ClientSession | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.base_url = tls.url(base_url)
        #: the TLS context of an https server (None: aiohttp's default, plain for http)
        self._ssl = tls.client_context() if self.base_url.startswith("https://") else None
        self.token = token
        self._session = session
        self._own_session = session is None
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def exchange(self, req: Request) -> tuple[int, bytes]:
        """(status, body) of `req`, whatever the status."""
        try:
            async with self.session.request(
                req.method,
                self.base_url + req.path,
                data=req.body,
                headers=headers(self.token, req.content_type, req.extra_headers),
                timeout=self.timeout,
                ssl=self._ssl if self._ssl is not None else True,
            ) as resp:
                n = resp.content_length
                if n is None or n < DECODE_OFF_LOOP:
                    return resp.status, await resp.read()
                # A large body (a replica's snapshot) into one buffer as it arrives: read()
                # joins its chunks in one copy on the event loop (issue 39). A msgpack body's
                # buffer is numpy's np.empty: bytearray(n) zero-fills (and page-faults) its n
                # bytes on the loop first, which held it 0.2-0.3 s for a 64 MiB snapshot on a
                # loaded machine; each chunk's copy touches its own pages instead.
                msgpack_body = resp.content_type == "application/msgpack"
                body: Any = np.empty(n, np.uint8) if msgpack_body else bytearray(n)
                pos = 0
                async for chunk in resp.content.iter_any():
                    k = len(chunk)
                    if pos + k > n:
                        raise ConnectionError(f"{self.base_url}{req.path}: more than {n} bytes")
                    body[pos : pos + k] = np.frombuffer(chunk, np.uint8) if msgpack_body else chunk
                    pos += k
                if pos != n:
                    raise ConnectionError(f"{self.base_url}{req.path}: {pos} of {n} bytes")
                return resp.status, body
        except aiohttp.ClientError as exc:
            raise ConnectionError(f"{self.base_url}{req.path}: {exc}") from exc

    async def send(self, req: Request) -> Any:
        status, data = await self.exchange(req)
        if len(data) >= DECODE_OFF_LOOP:  # a replica's snapshot: its bins copied, off the loop
            return await asyncio.to_thread(read_reply, req, status, data)
        return read_reply(req, status, data)

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None


# -- one-off JSON requests (admin endpoints, health probes, tools) --------------------------------


def http_exchange(
    url: str, method: str = "GET", body: Any = None, token: str | None = None, timeout: float = 2.0
) -> tuple[int, bytes]:
    """(status, raw body) of one request with JSON `body`; (0, b"") when nothing answered."""
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    data = None if body is None else json.dumps(body).encode()
    try:
        with SyncRpc(f"{parts.scheme}://{parts.netloc}", token, timeout) as rpc:
            return rpc.exchange(Request(method, path, data))
    except (OSError, ValueError):
        return 0, b""


def http_json(
    url: str, method: str = "GET", body: Any = None, token: str | None = None, timeout: float = 2.0
) -> tuple[int, Any]:
    """(status, JSON body) of one request; (0, None) when nothing answered, (status, None) when
    the body is not JSON (a health probe's text). The one helper for a single request; repeated
    calls to one server use SyncRpc/AsyncRpc instead."""
    status, raw = http_exchange(url, method, body, token, timeout)
    try:
        return status, (json.loads(raw or b"null") if status else None)
    except ValueError:
        return status, None


def _get_ok(addr: str, path: str, timeout: float) -> bytes:
    """The body of GET `path` of `addr` when it answers 200; else ConnectionError naming the
    status, or why nothing answered (a refused connection, a TLS certificate that does not
    verify: an outside tester saw only "no answer")."""
    url = base_url(addr)
    try:
        with SyncRpc(url, None, timeout) as rpc:
            status, raw = rpc.exchange(Request("GET", path, None))
    except (OSError, ValueError) as exc:
        raise ConnectionError(f"GET {url}{path}: no answer ({exc})") from exc
    if status != 200:
        raise ConnectionError(f"GET {url}{path}: {status}")
    return raw


def get_text(addr: str, path: str, timeout: float = 10.0) -> str:
    """GET `path` of `addr` as text (a /metrics page); ConnectionError if it did not answer 200."""
    return _get_ok(addr, path, timeout).decode()


def get_json(addr: str, path: str, timeout: float = 10.0) -> Any:
    """GET `path` of `addr` ('host:port' or URL): its JSON body; ConnectionError if it did not
    answer 200 (or its body is not JSON)."""
    raw = _get_ok(addr, path, timeout)
    try:
        return json.loads(raw or b"null")
    except ValueError as exc:
        raise ConnectionError(f"GET {base_url(addr)}{path}: not JSON ({exc})") from None
