"""The operator's side of a cluster for ``adamps checkpoint``: the controllers' routing, one
connection per server and thread, and the waits a save or restore makes for a failover (a bucket's
primary that crashed is replaced once the controllers declare it dead; issue 39)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from adamps.checkpoint.format import CheckpointError
from adamps.client import retry
from adamps.client.dataplane import DataPlaneError
from adamps.client.pool import DataPlanePool, as_rpc_error
from adamps.client.ps import ControllerRouting, Routing, retryable
from adamps.client.rpc import RpcError, SyncRpc

#: seconds a save or restore waits for a bucket's primary (a failover after a server crash)
WAIT = 60.0
#: definitions per create_tensors request (the servers' MAX_CREATE_TENSORS)
CREATE_BATCH = 1024


class Cluster:
    """The controllers' routing and one connection per server (the operator's side)."""

    def __init__(
        self,
        controllers: list[str],
        token: str | None,
        retry_for: float = WAIT,
        source: Any = None,
    ):
        self.controllers = controllers
        self.token = token if token is not None else os.environ.get("ADAMPS_TOKEN")
        #: where the routing table comes from (the controllers, or a client's static routing)
        self.source = source if source is not None else ControllerRouting(controllers)
        self.retry_for = retry_for
        #: one connection per server and thread (a SyncRpc is one keep-alive connection)
        self._local = threading.local()
        self._all: list[SyncRpc] = []
        self._lock = threading.Lock()
        #: one data-plane connection per server and thread (message ops: arrays out of band)
        self._dp = DataPlanePool(self.token, 60.0, lambda url: self.rpc(url).get_json("/status"))

    def rpc(self, url: str) -> SyncRpc:
        rpcs = getattr(self._local, "rpcs", None)
        if rpcs is None:
            rpcs = self._local.rpcs = {}
        if url not in rpcs:
            rpcs[url] = SyncRpc(url, self.token, 60.0)
            with self._lock:
                self._all.append(rpcs[url])
        return rpcs[url]

    def message(self, rpc: SyncRpc, op: str, **fields: Any) -> Any:
        """`op` on `rpc`'s server over its data plane, the message's arrays as raw payloads
        after it (protocol.encode_oob: no msgpack copy of the values), or over HTTP where the
        server offers no data port or the meta alone exceeds a frame's. Errors as RpcError
        (the same codes), ConnectionError when the outcome is unknown."""
        url = rpc.base_url
        conn = self._dp.get(url)
        if conn is None:
            return rpc.call(op, **fields)
        try:
            if not conn.send_message(op, **fields):
                return rpc.call(op, **fields)
            return conn.read_message_reply()
        except DataPlaneError as exc:
            self._dp.drop(url)  # its stream may hold the rest of a refused payload
            raise as_rpc_error(exc) from None
        except OSError as exc:  # the connection broke (a server crash): outcome unknown
            self._dp.drop(url)
            self._dp.forget_port(url)
            raise ConnectionError(f"data plane of {url}: {exc}") from exc

    def routing(self) -> Routing:
        return self.source.fetch(self.rpc)

    def on_primary(self, b: int, fn: Callable[[SyncRpc, int], Any]) -> Any:
        """fn(rpc of bucket b's primary, attempt number), again on a fresh routing table after
        a failover."""

        def attempt(n: int) -> Any:
            route = self.routing().routes.get(b)
            if route is None:
                raise RpcError("unavailable", f"bucket {b} has no primary")
            return fn(self.rpc(route.primary), n)

        return self._within_wait(attempt, f"bucket {b}: no live primary")

    def create_tensors(self, defs: list[dict[str, Any]], n_buckets: int) -> None:
        """Defines `defs` (create's fields each) on every server of the routing table, not only
        the buckets' replicas (copies move; a server holding the definition needs only a state
        transfer's values): one ``create_tensors`` per server and up to CREATE_BATCH
        definitions, the servers side by side (issue 38 item 7: it was one create per tensor
        and server, each a synced LMDB commit). Idempotent, so retried whole after a failure."""

        def attempt(_n: int) -> None:
            routing = self.routing()
            missing = [b for b in range(n_buckets) if b not in routing.routes]
            if missing:
                raise RpcError(
                    "unavailable", f"bucket {missing[0]} has no primary in the routing table"
                )
            servers = routing.servers()

            def on(url: str) -> None:
                for i in range(0, len(defs), CREATE_BATCH):
                    self.rpc(url).call("create_tensors", tensors=defs[i : i + CREATE_BATCH])

            with ThreadPoolExecutor(max(1, len(servers))) as pool:
                list(pool.map(on, servers))

        if defs:
            self._within_wait(attempt, "a create on every server")

    def live_servers(self) -> list[tuple[str, SyncRpc]]:
        """The servers of the routing table that answer, each with its connection. A server
        that crashed is listed until the controllers declare it dead (server_timeout); it is
        left out meanwhile (its buckets are read from the primaries the failover makes,
        on_primary waits for them). Retried within the deadline while none answers, then a
        CheckpointError naming the deadline."""

        def attempt(_n: int) -> list[tuple[str, SyncRpc]]:
            live, last = [], None
            try:
                servers = self.routing().servers()
            except (RpcError, ConnectionError, TimeoutError) as exc:
                # No controller answers (ControllerRouting tried each): a wrong --controllers
                # is a message now, not after --wait.
                raise CheckpointError(f"cluster error: {exc}") from None
            for url in servers:
                try:
                    self.rpc(url).get_json("/healthz")
                except (ConnectionError, TimeoutError) as exc:
                    last = exc
                    continue
                live.append((url, self.rpc(url)))
            if not live:
                raise last or RpcError("unavailable", "the routing table lists no server")
            return live

        return self._within_wait(attempt, "no parameter server")

    def _within_wait(self, attempt: Callable[[int], Any], what: str) -> Any:
        """attempt(n) retried while it fails retryably, up to the deadline (--wait); past it,
        one CheckpointError saying `what` answered within it."""
        try:
            return retry.call(retry.RetryPolicy(self.retry_for), attempt, retryable)
        except (RpcError, ConnectionError, TimeoutError) as exc:
            if not retryable(exc):
                raise
            raise CheckpointError(
                f"{what} answered within {self.retry_for:g} s (--wait): {exc}"
            ) from None

    def server_status(self) -> list[dict[str, Any]]:
        out = []
        for _url, rpc in self.live_servers():
            try:
                out.append(rpc.get_json("/status"))
            except (ConnectionError, TimeoutError):  # died since: as if it had not answered
                continue
        return out

    def controller_json(self, path: str) -> Any:
        for url in self.controllers:
            try:
                return self.rpc(url).get_json(path)
            except (RpcError, ConnectionError, TimeoutError, OSError):
                continue
        return None

    def close(self) -> None:
        self._dp.close()
        for r in self._all:
            r.close()
