"""Writes through any controller: the leader runs them, a follower forwards them to the leader's
HTTP address (one hop; the reply is the leader's) and waits until it applied the write itself,
so that a client reading from the controller it wrote through sees its own write.

Read-your-writes through *any* controller: every write's answer carries ``applied_index``, the
leader's Raft log index once it applied the write; a client sends the highest it has seen on its
reads (``X-Adamps-Min-Applied``), and a controller answers such a read only once it applied the
log that far (it waits up to ``commit_timeout``, else ``503 unavailable``: ask another). A client
whose calls move to another controller (a timeout, a leader change) still reads its own writes."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from adamps.security import peer_auth, tls
from adamps.wire import web as aweb
from adamps.wire.protocol import MIN_APPLIED_HEADER, ProtocolError
from controller.config import ControllerConfig
from controller.ctl_metrics import ControllerMetrics
from controller.raft_node import NotLeader, RaftNode

log = logging.getLogger(__name__)

FORWARDED = "X-Adamps-Forwarded"
APPLIED = "X-Adamps-Applied"


#: the endpoints operators (not servers) call: every refusal is logged
OPERATOR_ENDPOINTS = frozenset({"declare-lost", "drain", "rebalance", "layout", "runs"})
#: the bucket operations of POST /buckets/{bucket}/{op}
BUCKET_OPS = ("role-change", "caught-up", "release", "drop-secondary", "declare-lost")
#: reads that answer whatever the log: a probe must tell a lagging controller from a dead one
ALWAYS_ANSWER = frozenset({"/healthz", "/status", "/metrics"})
#: seconds between two readings of the applied index while a read waits for it
APPLIED_POLL = 0.005


def endpoint_of(request: web.Request) -> str:
    """A bounded label for a mutating endpoint: the bucket operation, or the route's last
    fixed segment ("/servers/{id}/heartbeat" -> "heartbeat")."""
    op = request.match_info.get("op")
    if op is not None:
        return op if op in BUCKET_OPS else "unknown"
    route = request.match_info.route.resource
    canonical = route.canonical if route is not None else request.path
    return canonical.rstrip("/").rsplit("/", 1)[-1] or "/"


class Forwarder:
    """Runs a write on the leader, wherever it arrived."""

    def __init__(self, cfg: ControllerConfig, raft: RaftNode, m: ControllerMetrics) -> None:
        self.cfg = cfg
        self.raft = raft
        self.m = m
        self._session: aiohttp.ClientSession | None = None
        #: (endpoint, reason) -> monotonic time of its last log line (servers' calls only)
        self._logged: dict[tuple[str, str], float] = {}
        #: the token check of writes (controller/runs_http.py: the cluster token, or a run's
        #: where allowed); None: the cluster token only
        self.auth: Callable[[web.Request, bool], None] | None = None
        #: reads waiting for an applied index: (index, tie, future), smallest index first
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._tie = itertools.count()
        self._poller: asyncio.Task[None] | None = None

    async def write(
        self,
        request: web.Request,
        run: Callable[[], Awaitable[dict[str, Any]]],
        runs_allowed: bool = False,
    ) -> web.Response:
        """Token check, then run on the leader or forward to it. A refusal (any 4xx this node
        decides) is logged and counted by endpoint and reason (the audit of issue 28).

        `runs_allowed`: a run's token may call it too (issue 25; `run` then reads who called
        from the request, controller/runs_http.py); else it is the operator's alone."""
        try:
            if self.auth is None:
                aweb.check_token(request)
            else:
                self.auth(request, runs_allowed)
            self.raft.check_journal()
            if self.raft.is_leader():
                try:
                    answer = dict(await run())
                    applied = self.raft.last_applied
                    # Lets a forwarding follower wait until it has applied this write itself, so
                    # that a client reading from the controller it wrote through sees its own
                    # write; the client keeps the index for its reads through any controller.
                    answer["applied_index"] = applied
                    resp = aweb.json_response(answer)
                    resp.headers[APPLIED] = str(applied)
                    return resp
                except NotLeader:
                    pass
            return await self.forward(request)
        except ProtocolError as exc:
            if exc.status < 500:
                self.refused(request, exc)
            raise

    def refused(self, request: web.Request, exc: ProtocolError) -> None:
        """Logs and counts a refused mutating call: every operator command (declare-lost,
        drain, rebalance, layout) has its log line; the servers' own calls (a dead server's
        heartbeats keep coming) one line per endpoint and reason every 10 s, counted all the
        same."""
        endpoint = endpoint_of(request)
        self.m.refused.labels(endpoint, exc.code).inc()
        now = time.monotonic()
        key = (endpoint, exc.code)
        if endpoint not in OPERATOR_ENDPOINTS:
            if now - self._logged.get(key, -1e9) < 10.0:
                return
            self._logged[key] = now
        log.warning(
            "refused %s %s from %s: %s (%s)",
            request.method,
            request.path,
            request.remote,
            exc.code,
            exc.message,
        )

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
        body = await aweb.read_body(request)
        headers = {
            "Authorization": request.headers.get("Authorization", ""),
            "Content-Type": request.headers.get("Content-Type", "application/json"),
            FORWARDED: self.raft.self_raft,
        }
        server_proof = request.headers.get(peer_auth.SERVER_HEADER)
        if server_proof is not None:  # the leader checks a server's call again
            headers[peer_auth.SERVER_HEADER] = server_proof
        if self._session is None:
            self._session = aiohttp.ClientSession()
        self.m.forwarded.inc()
        try:
            async with self._session.request(
                request.method,
                tls.url(target) + request.path_qs,
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.cfg.commit_timeout + 1.0),
                ssl=tls.client_context() or True,
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
        if applied is not None and applied.isascii() and applied.isdigit():
            # Read-your-writes through this controller: wait until it applied the write too.
            await self.until_applied(int(applied))
        return web.Response(status=status, body=payload, content_type="application/json")

    async def until_applied(self, index: int) -> bool:
        """Waits (at most `commit_timeout`) until this node applied the Raft log up to `index`;
        False if it has not. A follower learns the commit index with the leader's next append
        (up to one append period after the leader applied).

        The applied index moves on pysyncobj's thread, which tells nobody, so it is read every
        `APPLIED_POLL` seconds: by one task for all waiting reads (a poll per read cost a
        controller 0.7 CPU-s with 400 of them waiting, and every other request waited behind)."""
        if self.raft.last_applied >= index:
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (index, next(self._tie), fut)
        heapq.heappush(self._waiting, entry)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll_applied())
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.cfg.commit_timeout)
            return True
        except TimeoutError:
            return self.raft.last_applied >= index
        finally:
            if not fut.done():  # timed out or cancelled: nobody waits on it any more
                fut.cancel()
                with contextlib.suppress(ValueError):  # the poller popped it meanwhile
                    self._waiting.remove(entry)
                    heapq.heapify(self._waiting)

    async def _poll_applied(self) -> None:
        """Resolves the waiting reads whose index was applied, until none waits."""
        waiting = self._waiting
        while waiting:
            applied = self.raft.last_applied
            while waiting and (waiting[0][0] <= applied or waiting[0][2].done()):
                fut = heapq.heappop(waiting)[2]
                if not fut.done():
                    fut.set_result(None)
            if waiting:
                await asyncio.sleep(APPLIED_POLL)

    def read_middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        """The check of a read's ``X-Adamps-Min-Applied``: answered once this node applied the
        log that far, else ``503 unavailable`` (the client asks another controller)."""

        @web.middleware
        async def min_applied(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            sent = request.headers.getall(MIN_APPLIED_HEADER, [])
            if sent and request.method == "GET" and request.path not in ALWAYS_ANSWER:
                # Sent twice (a proxy or a client adding its own), the first value was used and
                # the other ignored: a read could miss the very write the ignored one named.
                if len(sent) > 1:
                    raise ProtocolError(
                        "bad_request",
                        f"{MIN_APPLIED_HEADER} sent {len(sent)} times; send it once, with the "
                        "highest index",
                    )
                want = sent[0]
                if not (want.isascii() and want.isdigit() and len(want) <= 18):
                    raise ProtocolError(
                        "bad_request",
                        f"{MIN_APPLIED_HEADER} must be a Raft log index (a non-negative integer "
                        f"of at most 18 digits), got {want[:40]!r}",
                    )
                if not await self.until_applied(int(want)):
                    raise ProtocolError(
                        "unavailable",
                        f"this controller has applied the log up to {self.raft.last_applied}, "
                        f"not yet up to {int(want)} (the client's own writes); ask another "
                        "controller or retry",
                        retry_after=0.1,
                    )
            return await handler(request)

        return min_applied

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self._session is not None:
            await self._session.close()
