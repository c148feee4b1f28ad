"""Writes through any controller: the leader runs them, a follower forwards them to the leader's
HTTP address (one hop; the reply is the leader's) and waits until it applied the write itself,
so that a client reading from the controller it wrote through sees its own write."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from adamps import web as aweb
from adamps.protocol import ProtocolError
from controller.config import ControllerConfig
from controller.ctl_metrics import ControllerMetrics
from controller.raft_node import NotLeader, RaftNode

FORWARDED = "X-Adamps-Forwarded"
APPLIED = "X-Adamps-Applied"


class Forwarder:
    """Runs a write on the leader, wherever it arrived."""

    def __init__(self, cfg: ControllerConfig, raft: RaftNode, m: ControllerMetrics) -> None:
        self.cfg = cfg
        self.raft = raft
        self.m = m
        self._session: aiohttp.ClientSession | None = None

    async def write(
        self, request: web.Request, run: Callable[[], Awaitable[dict[str, Any]]]
    ) -> web.Response:
        """Token check, then run on the leader or forward to it."""
        aweb.check_token(request)
        if self.raft.is_leader():
            try:
                resp = aweb.json_response(await run())
                # Lets a forwarding follower wait until it has applied this write itself, so that
                # a client reading from the controller it wrote through sees its own write.
                resp.headers[APPLIED] = str(self.raft.last_applied)
                return resp
            except NotLeader:
                pass
        return await self.forward(request)

    async def forward(self, request: web.Request) -> web.Response:
        if request.headers.get(FORWARDED):
            raise ProtocolError(
                "no_quorum", "forwarded to a controller that is not the leader; retry"
            )
        if not self.raft.has_quorum():
            raise ProtocolError(
                "no_quorum", "this controller is not connected to a majority of controllers"
            )
        leader = self.raft.leader_raft()
        if leader is None or leader == self.raft.self_raft:
            raise ProtocolError("no_quorum", "no leader elected yet; retry")
        target = self.raft.http_of[leader]
        body = await request.read()
        headers = {
            "Authorization": request.headers.get("Authorization", ""),
            "Content-Type": request.headers.get("Content-Type", "application/json"),
            FORWARDED: self.raft.self_raft,
        }
        if self._session is None:
            self._session = aiohttp.ClientSession()
        self.m.forwarded.inc()
        try:
            async with self._session.request(
                request.method,
                f"http://{target}{request.path_qs}",
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.cfg.commit_timeout + 1.0),
            ) as resp:
                payload = await resp.read()
                status = resp.status
                applied = resp.headers.get(APPLIED)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ProtocolError(
                "no_quorum",
                f"the leader {target} did not answer ({type(exc).__name__}); retry",
                leader=target,
            ) from None
        if applied is not None and applied.isdigit():
            # Read-your-writes through this controller: wait until it applied the write too.
            deadline = time.monotonic() + self.cfg.commit_timeout
            while self.raft.last_applied < int(applied) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
        return web.Response(status=status, body=payload, content_type="application/json")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
