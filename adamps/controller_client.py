"""Clients of the controller cluster (for parameter servers, trainers and tools).

Any controller answers reads and forwards writes to the Raft leader, so a client only has to find
one that answers: it tries the controller that answered last, then the others, and retries while
the cluster answers ``no_quorum`` (an election, a lost majority) until its deadline. Errors that
are answers (4xx: bad input, stale epoch, conflict) are raised at once as `RpcError`.

Lease timing for a parameter server (see adamps/core/lease.py): `heartbeat` returns the reply
together with `asked_at`, the caller's monotonic clock taken *before* the request was sent; pass
it to `HolderLeases.on_granted` for every ``[bucket, epoch]`` in the reply's ``renewed``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from adamps.rpc import AsyncRpc, RpcError, SyncRpc

#: error codes worth retrying on another controller / a bit later
RETRY_CODES = {"no_quorum", "unavailable", "timeout"}


def _addresses(controllers: str | Sequence[str]) -> list[str]:
    if isinstance(controllers, str):
        controllers = controllers.split(",")
    out = [c.strip() for c in controllers if c.strip()]
    if not out:
        raise ValueError("no controller address given")
    return out


class ControllerClient:
    """Blocking client; one per thread (it keeps one keep-alive connection per controller)."""

    def __init__(
        self,
        controllers: str | Sequence[str],
        token: str | None,
        timeout: float = 5.0,
        retry_for: float = 10.0,
    ) -> None:
        self.addresses = _addresses(controllers)
        self.rpcs = [SyncRpc(a, token, timeout) for a in self.addresses]
        self.retry_for = retry_for
        self._first = 0

    def _do(self, method: str, path: str, body: Any = None) -> Any:
        deadline = time.monotonic() + self.retry_for
        last: Exception | None = None
        while True:
            for k in range(len(self.rpcs)):
                i = (self._first + k) % len(self.rpcs)
                rpc = self.rpcs[i]
                try:
                    reply = rpc.get_json(path) if method == "GET" else rpc.post_json(path, body)
                    self._first = i
                    return reply
                except RpcError as exc:
                    if exc.code not in RETRY_CODES:
                        self._first = i
                        raise
                    last = exc
                except (ConnectionError, TimeoutError) as exc:
                    last = exc
            if time.monotonic() > deadline:
                assert last is not None
                raise last
            time.sleep(0.1)

    # -- parameter servers ---------------------------------------------------------------------

    def register(
        self, server: str, address: str, copies: dict[int, Sequence[int]] | None = None
    ) -> dict[str, Any]:
        return self._do("POST", f"/servers/{server}/register", _register_body(address, copies))

    def heartbeat(
        self,
        server: str,
        known_version: int | None = None,
        reports: dict[int, Sequence[int]] | None = None,
    ) -> tuple[dict[str, Any], float]:
        """(reply, asked_at): asked_at is time.monotonic() before the request was sent."""
        asked_at = time.monotonic()
        body: dict[str, Any] = {"known_version": known_version}
        if reports:
            body["reports"] = {str(b): list(r) for b, r in reports.items()}
        return self._do("POST", f"/servers/{server}/heartbeat", body), asked_at

    def role_change(
        self,
        bucket: int,
        server: str,
        prev_epoch: int,
        reports: dict[str, Sequence[int]] | None = None,
    ) -> dict[str, Any]:
        body = {
            "server": server,
            "prev_epoch": prev_epoch,
            "reports": {s: list(r) for s, r in (reports or {}).items()},
        }
        return self._do("POST", f"/buckets/{bucket}/role-change", body)

    def caught_up(
        self, bucket: int, primary: str, epoch: int, server: str, join: int | None = None
    ) -> dict[str, Any]:
        body = _caught_up_body(primary, epoch, server, join)
        return self._do("POST", f"/buckets/{bucket}/caught-up", body)

    def declare_lost(self, bucket: int) -> dict[str, Any]:
        return self._do("POST", f"/buckets/{bucket}/declare-lost", {})

    def release(self, bucket: int, server: str, epoch: int) -> dict[str, Any]:
        return self._do("POST", f"/buckets/{bucket}/release", {"server": server, "epoch": epoch})

    def drop_secondary(self, bucket: int, primary: str, epoch: int, server: str) -> dict[str, Any]:
        body = {"primary": primary, "epoch": epoch, "server": server}
        return self._do("POST", f"/buckets/{bucket}/drop-secondary", body)

    # -- everybody -------------------------------------------------------------------------------

    def routing(self) -> dict[str, Any]:
        return self._do("GET", "/routing")

    def cluster(self) -> dict[str, Any]:
        return self._do("GET", "/cluster")

    def layout(self) -> dict[str, Any] | None:
        """{"layout_version", "layout"}, or None when no layout was set yet."""
        try:
            return self._do("GET", "/layout")
        except RpcError as exc:
            if exc.code == "not_found":
                return None
            raise

    def set_layout(self, layout: dict[str, Any]) -> dict[str, Any]:
        return self._do("POST", "/layout", {"layout": layout})

    def progress(self, epoch: int | None = None) -> dict[str, Any]:
        return self._do("GET", "/progress" if epoch is None else f"/progress?epoch={int(epoch)}")

    def report_progress(
        self, epoch: int, replica: str, progress: float, done: bool = False
    ) -> dict[str, Any]:
        body = {"epoch": epoch, "replica": replica, "progress": progress, "done": done}
        return self._do("POST", "/progress", body)

    def drain(self, server: str) -> dict[str, Any]:
        return self._do("POST", f"/servers/{server}/drain", {})

    def rebalance(self) -> dict[str, Any]:
        return self._do("POST", "/rebalance", {})

    def close(self) -> None:
        for rpc in self.rpcs:
            rpc.close()


class AsyncControllerClient:
    """The aiohttp version (for the parameter server's event loop). Same methods, awaitable."""

    def __init__(
        self,
        controllers: str | Sequence[str],
        token: str | None,
        session: aiohttp.ClientSession | None = None,
        timeout: float = 5.0,
        retry_for: float = 10.0,
    ) -> None:
        self.addresses = _addresses(controllers)
        self.rpcs = [AsyncRpc(a, token, session, timeout) for a in self.addresses]
        self.retry_for = retry_for
        self._first = 0

    async def _do(self, method: str, path: str, body: Any = None) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_for
        last: Exception | None = None
        while True:
            for k in range(len(self.rpcs)):
                i = (self._first + k) % len(self.rpcs)
                rpc = self.rpcs[i]
                try:
                    reply = await (
                        rpc.get_json(path) if method == "GET" else rpc.post_json(path, body)
                    )
                    self._first = i
                    return reply
                except RpcError as exc:
                    if exc.code not in RETRY_CODES:
                        self._first = i
                        raise
                    last = exc
                except (ConnectionError, TimeoutError) as exc:
                    last = exc
            if loop.time() > deadline:
                assert last is not None
                raise last
            await asyncio.sleep(0.1)

    async def register(
        self, server: str, address: str, copies: dict[int, Sequence[int]] | None = None
    ) -> dict[str, Any]:
        body = _register_body(address, copies)
        return await self._do("POST", f"/servers/{server}/register", body)

    async def heartbeat(
        self,
        server: str,
        known_version: int | None = None,
        reports: dict[int, Sequence[int]] | None = None,
    ) -> tuple[dict[str, Any], float]:
        asked_at = time.monotonic()
        body: dict[str, Any] = {"known_version": known_version}
        if reports:
            body["reports"] = {str(b): list(r) for b, r in reports.items()}
        return await self._do("POST", f"/servers/{server}/heartbeat", body), asked_at

    async def role_change(
        self,
        bucket: int,
        server: str,
        prev_epoch: int,
        reports: dict[str, Sequence[int]] | None = None,
    ) -> dict[str, Any]:
        body = {
            "server": server,
            "prev_epoch": prev_epoch,
            "reports": {s: list(r) for s, r in (reports or {}).items()},
        }
        return await self._do("POST", f"/buckets/{bucket}/role-change", body)

    async def caught_up(
        self, bucket: int, primary: str, epoch: int, server: str, join: int | None = None
    ) -> dict[str, Any]:
        body = _caught_up_body(primary, epoch, server, join)
        return await self._do("POST", f"/buckets/{bucket}/caught-up", body)

    async def release(self, bucket: int, server: str, epoch: int) -> dict[str, Any]:
        return await self._do(
            "POST", f"/buckets/{bucket}/release", {"server": server, "epoch": epoch}
        )

    async def drop_secondary(
        self, bucket: int, primary: str, epoch: int, server: str
    ) -> dict[str, Any]:
        body = {"primary": primary, "epoch": epoch, "server": server}
        return await self._do("POST", f"/buckets/{bucket}/drop-secondary", body)

    async def routing(self) -> dict[str, Any]:
        return await self._do("GET", "/routing")

    async def layout(self) -> dict[str, Any] | None:
        try:
            return await self._do("GET", "/layout")
        except RpcError as exc:
            if exc.code == "not_found":
                return None
            raise

    async def set_layout(self, layout: dict[str, Any]) -> dict[str, Any]:
        return await self._do("POST", "/layout", {"layout": layout})

    async def report_progress(
        self, epoch: int, replica: str, progress: float, done: bool = False
    ) -> dict[str, Any]:
        body = {"epoch": epoch, "replica": replica, "progress": progress, "done": done}
        return await self._do("POST", "/progress", body)

    async def progress(self, epoch: int | None = None) -> dict[str, Any]:
        return await self._do(
            "GET", "/progress" if epoch is None else f"/progress?epoch={int(epoch)}"
        )


def _register_body(address: str, copies: dict[int, Sequence[int]] | None) -> dict[str, Any]:
    """A registration: the server's address and the copies it offers (bucket -> [epoch, seq])."""
    return {"address": address, "copies": {str(b): list(p) for b, p in (copies or {}).items()}}


def _caught_up_body(primary: str, epoch: int, server: str, join: int | None) -> dict[str, Any]:
    """The primary's report that joining copy `server` caught up (in its join number `join`)."""
    body: dict[str, Any] = {"primary": primary, "epoch": epoch, "server": server}
    if join is not None:
        body["join"] = join
    return body
