"""The data-plane connections of a ``PSClient``: which servers offer a data port, and one
connection per server and thread.

A server advertises its data port in ``GET /status`` (``data_port``: an int, or null when it has
none); its host is that of its HTTP address. A server without one is reached over HTTP (the
caller's fallback). Errors of the data plane become ``RpcError``s with the HTTP status of their
code, so that a caller tells them apart exactly as it does HTTP replies (retryable, or a definite
refusal); connection failures become ``ConnectionError`` (the outcome of a push is unknown).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from adamps.client.dataplane import DataPlaneClient, DataPlaneError
from adamps.client.rpc import RpcError
from adamps.wire import protocol


def as_rpc_error(exc: DataPlaneError) -> RpcError:
    """The RpcError that the same error code would have been over HTTP."""
    return RpcError(exc.code, exc.message, http_status=protocol.ERRORS[exc.code][0], **exc.extra)


class DataPlanePool:
    """Data-plane connections keyed by a server's HTTP base URL (thread-safe: each thread has
    its own connections; the ports are shared)."""

    def __init__(
        self, token: str | None, timeout: float, status_of: Callable[[str], dict[str, Any]]
    ) -> None:
        self.token = token or ""
        self.timeout = timeout
        #: base URL -> its GET /status (the client's HTTP transport)
        self.status_of = status_of
        #: base URL -> data port (0: the server has none: use HTTP)
        self._ports: dict[str, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        #: every connection of every thread, so that close() can close them all
        self._all: list[DataPlaneClient] = []

    def get(self, url: str) -> DataPlaneClient | None:
        """This thread's connection to `url`'s data port, or None when it offers none."""
        conns: dict[str, DataPlaneClient] | None = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get(url)
        if conn is not None:
            return conn
        port = self.port(url)
        if not port:
            return None
        host = urlsplit(url).hostname or "127.0.0.1"
        try:
            conn = DataPlaneClient(host, port, self.token, timeout=self.timeout)
        except OSError as exc:
            self.forget_port(url)  # a restarted server may listen elsewhere: ask again
            raise ConnectionError(f"data plane of {url} ({host}:{port}): {exc}") from exc
        conns[url] = conn
        with self._lock:
            self._all.append(conn)
        return conn

    def port(self, url: str) -> int:
        """`url`'s data port (0: none), from its GET /status (asked once, until forget_port)."""
        with self._lock:
            port = self._ports.get(url)
        if port is None:
            port = int(self.status_of(url).get("data_port") or 0)
            with self._lock:
                self._ports[url] = port
        return port

    def forget_port(self, url: str) -> None:
        with self._lock:
            self._ports.pop(url, None)

    def drop(self, url: str) -> None:
        """Closes this thread's connection to `url` (after an error: its stream may hold unread
        replies, or the server closed it); the next request opens a fresh one."""
        conns = getattr(self._local, "conns", None)
        conn = conns.pop(url, None) if conns else None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for c in conns:
            c.close()
