"""Clients of the ``POST /rpc`` endpoints (msgpack) and the admin endpoints (JSON).

``SyncRpc`` is a keep-alive ``http.client`` connection, for trainer threads and tools (one per
thread: it is not thread-safe). ``AsyncRpc`` is the aiohttp version, for servers calling peers.
Error replies are raised as ``RpcError`` carrying the server's code, message and extra fields;
a failure to reach the server at all is ``ConnectionError`` (its outcome is unknown to the caller).
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from adamps import protocol
from adamps.protocol import ProtocolError

MSGPACK = "application/msgpack"


class RpcError(ProtocolError):
    """An error reply from a server."""

    def __init__(
        self, code: str, message: str, http_status: int | None = None, **extra: Any
    ) -> None:
        super().__init__(code, message, **extra)
        self.http_status = http_status


def _raise_for(status: int, body: bytes) -> None:
    err = protocol.error_from_body(status, body)
    extra = {k: v for k, v in err.extra.items() if k != "http_status"}
    raise RpcError(err.code, err.message, http_status=status, **extra)


class SyncRpc:
    """A blocking client of one server over one keep-alive connection."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0) -> None:
        parts = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        self.base_url = f"{parts.scheme}://{parts.netloc}"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.token = token
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def _headers(self, content_type: str) -> dict[str, str]:
        h = {"Content-Type": content_type}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        return h

    def _request(
        self, method: str, path: str, body: bytes | None, content_type: str
    ) -> tuple[int, bytes]:
        # One retry on a stale keep-alive connection; a request that fails twice is the caller's.
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self._conn.request(method, path, body=body, headers=self._headers(content_type))
                resp = self._conn.getresponse()
                data = resp.read()
                if resp.getheader("Connection", "").lower() == "close":
                    self.close()
                return resp.status, data
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                self.close()
                if attempt == 1 or method != "GET":
                    raise ConnectionError(f"{self.base_url}{path}: {exc}") from exc
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if isinstance(exc, socket.timeout | TimeoutError):
                    raise TimeoutError(
                        f"{self.base_url}{path}: timed out after {self.timeout}s"
                    ) from exc
                raise ConnectionError(f"{self.base_url}{path}: {exc}") from exc
        raise AssertionError("unreachable")

    def call(self, op: str, path: str = "/rpc", **fields: Any) -> dict[str, Any]:
        """Sends request `op` with `fields`; returns the reply message or raises RpcError."""
        status, data = self._request(
            "POST", path, protocol.encode(protocol.request(op, **fields)), MSGPACK
        )
        if status != 200:
            _raise_for(status, data)
        return protocol.decode(data)

    def get_json(self, path: str) -> Any:
        status, data = self._request("GET", path, None, "application/json")
        if status != 200:
            _raise_for(status, data)
        return json.loads(data)

    def post_json(self, path: str, obj: Any = None) -> Any:
        status, data = self._request(
            "POST", path, json.dumps(obj or {}).encode(), "application/json"
        )
        if status != 200:
            _raise_for(status, data)
        return json.loads(data) if data else None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> SyncRpc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRpc:
    """An aiohttp client of one server. Pass a shared session to pool connections."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        session: aiohttp.ClientSession | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.base_url = (
            base_url.rstrip("/") if "://" in base_url else f"http://{base_url.rstrip('/')}"
        )
        self.token = token
        self._session = session
        self._own_session = session is None
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    def _headers(self, content_type: str) -> dict[str, str]:
        h = {"Content-Type": content_type}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        return h

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _request(
        self, method: str, path: str, body: bytes | None, content_type: str
    ) -> bytes:
        try:
            async with self.session.request(
                method,
                self.base_url + path,
                data=body,
                headers=self._headers(content_type),
                timeout=self.timeout,
            ) as resp:
                data = await resp.read()
                if resp.status != 200:
                    _raise_for(resp.status, data)
                return data
        except aiohttp.ClientError as exc:
            raise ConnectionError(f"{self.base_url}{path}: {exc}") from exc

    async def call(self, op: str, path: str = "/rpc", **fields: Any) -> dict[str, Any]:
        data = await self._request(
            "POST", path, protocol.encode(protocol.request(op, **fields)), MSGPACK
        )
        return protocol.decode(data)

    async def get_json(self, path: str) -> Any:
        return json.loads(await self._request("GET", path, None, "application/json"))

    async def post_json(self, path: str, obj: Any = None) -> Any:
        data = await self._request("POST", path, json.dumps(obj or {}).encode(), "application/json")
        return json.loads(data) if data else None

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None


# -- one-off JSON requests (admin endpoints, health probes, tools) --------------------------------


def base_url(addr: str) -> str:
    """'host:port' or a URL -> a URL without a trailing slash."""
    return (addr if "://" in addr else f"http://{addr}").rstrip("/")


def http_json(
    url: str, method: str = "GET", body: Any = None, token: str | None = None, timeout: float = 2.0
) -> tuple[int, Any]:
    """(status, JSON body) of one request; (0, None) when nothing answered, (status, None) when
    the body is not JSON (a health probe's text). The one helper for a single request; repeated
    calls to one server use SyncRpc/AsyncRpc instead."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None
    try:
        return status, json.loads(raw or b"null")
    except ValueError:
        return status, None


def get_json(addr: str, path: str, timeout: float = 10.0) -> Any:
    """GET `path` of `addr` ('host:port' or URL): its JSON body; ConnectionError if it did not
    answer 200."""
    status, body = http_json(base_url(addr) + path, timeout=timeout)
    if status != 200:
        raise ConnectionError(f"GET {base_url(addr)}{path}: {status or 'no answer'}")
    return body
