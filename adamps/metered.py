"""A PSClient that counts the bytes it sends and receives: Sandblaster's coordinator and
trainers report their network cost per iteration (issue 14)."""

from __future__ import annotations

import threading
from typing import Any

from adamps.client import PSClient
from adamps.client.rpc import SyncRpc


class MeteredRpc(SyncRpc):
    """A SyncRpc that counts the bytes of its request and reply bodies."""

    def __init__(self, *args: Any, meter: Meter, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.meter = meter

    def _request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        content_type: str,
        extra_headers: tuple[tuple[str, str], ...] = (),
    ) -> tuple[int, bytes]:
        status, data = super()._request(method, path, body, content_type, extra_headers)
        self.meter.add(len(body or b""), len(data))
        return status, data


class Meter:
    """Bytes sent and received (bodies, not HTTP headers), thread safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent = 0
        self.received = 0
        self.requests = 0

    def add(self, sent: int, received: int) -> None:
        with self._lock:
            self.sent += sent
            self.received += received
            self.requests += 1


class MeteredClient(PSClient):
    """A PSClient whose connections count their bytes into ``meter``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.meter = Meter()

    def _rpc(self, url: str) -> SyncRpc:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        rpc = conns.get(url)
        if rpc is None:
            rpc = conns[url] = MeteredRpc(url, self.token, self.timeout, meter=self.meter)
            with self._lock:
                self._all_rpcs.append(rpc)
        return rpc
