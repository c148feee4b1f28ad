"""The peers of a replicated server: their addresses (learnt from the controllers' roles), one
RPC client per address, and one aggregating channel per peer for the replication messages."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from adamps.rpc import AsyncRpc, RpcError


class PeerChannel:
    """Replication messages to one peer, aggregated: while one request is in flight, the next
    messages queue and travel together in the following request (op repl_multi), in order.

    One HTTP request then carries the PREPAREs and COMMITs of many buckets' rounds: on loopback
    the cost of replication is the number of requests far more than their bytes."""

    def __init__(self, rpc: AsyncRpc) -> None:
        self.rpc = rpc
        self._queue: list[tuple[str, dict[str, Any], asyncio.Future]] = []
        self._task: asyncio.Task | None = None

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((op, fields, fut))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="peer-channel")
        return await fut

    async def _run(self) -> None:
        while self._queue:
            items, self._queue = self._queue, []
            try:
                reply = await self.rpc.call(
                    "repl_multi", items=[{"op": op, **f} for op, f, _ in items]
                )
                results = reply["results"]
            except Exception as exc:  # the whole request failed: so did each message
                for _op, _f, fut in items:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_op, _f, fut), res in zip(items, results, strict=True):
                if fut.done():
                    continue
                if "error" in res:
                    err = dict(res["error"])
                    fut.set_exception(RpcError(err.pop("code"), err.pop("message"), **err))
                else:
                    fut.set_result(res["ok"])

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


class Peers:
    """Server id -> address, and the clients to reach them. Lives on the PS's event loop."""

    def __init__(self, token: str, timeout: float) -> None:
        self.token = token
        #: seconds a peer has to answer one request (the member timeout)
        self.timeout = timeout
        #: server id -> "host:port" (from the controllers' roles)
        self.addresses: dict[str, str] = {}
        #: the HTTP session of every peer client (opened at start)
        self.session: aiohttp.ClientSession | None = None
        self._rpcs: dict[str, AsyncRpc] = {}
        self._channels: dict[str, PeerChannel] = {}

    def channel(self, server: str) -> PeerChannel:
        """The aggregating channel to a peer (prepare, commit and ping messages)."""
        rpc = self.rpc(server)
        ch = self._channels.get(rpc.base_url)
        if ch is None:
            ch = self._channels[rpc.base_url] = PeerChannel(rpc)
        return ch

    def rpc(self, server: str) -> AsyncRpc:
        addr = self.addresses.get(server)
        if addr is None:
            raise ConnectionError(f"no address known for server {server!r}")
        rpc = self._rpcs.get(addr)
        if rpc is None:
            rpc = self._rpcs[addr] = AsyncRpc(addr, self.token, self.session, self.timeout)
        return rpc

    def close(self) -> None:
        """Cancels the channels' sending tasks."""
        for ch in self._channels.values():
            ch.close()
