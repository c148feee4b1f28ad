"""Clients of the controller cluster (for parameter servers, trainers and tools).

Any controller answers reads and forwards writes to the Raft leader, so a client only has to find
one that answers: it tries the controller that answered last, then the others, and retries while
the cluster answers ``no_quorum`` (an election, a lost majority) until its deadline. Errors that
are answers (4xx: bad input, stale epoch, conflict) are raised at once as `RpcError`.

Written once for both styles: `ControllerOps` turns every operation into a `Call` (the request
and how to read its answer) and `ControllerRing` decides which controller to ask and which
failures to retry; `ControllerClient` (blocking) and `AsyncControllerClient` (asyncio) only send
the requests, through `adamps.client.rpc`, with `adamps.client.retry`'s policy between rounds.

Lease timing for a parameter server (see adamps/core/lease.py): `heartbeat` returns the reply
together with `asked_at`, the caller's monotonic clock taken *before* the request was sent; pass
it to `HolderLeases.on_granted` for every ``[bucket, epoch]`` in the reply's ``renewed``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from adamps.client import retry
from adamps.client.retry import RetryPolicy
from adamps.client.rpc import AsyncRpc, Request, RpcError, SyncRpc, json_request
from adamps.wire.protocol import MIN_APPLIED_HEADER

#: error codes worth retrying on another controller / a bit later
RETRY_CODES = {"no_quorum", "unavailable", "timeout"}

#: The waits between rounds stay short: a heartbeat's lease counts from before its first try,
#: so a server must reach a newly elected leader within a small part of a lease.
BACKOFF_CAP = 0.2


def _addresses(controllers: str | Sequence[str]) -> list[str]:
    if isinstance(controllers, str):
        controllers = controllers.split(",")
    out = [c.strip() for c in controllers if c.strip()]
    if not out:
        raise ValueError("no controller address given")
    return out


def retryable(exc: BaseException) -> bool:
    """A failure another controller, or the same one a bit later, may not have."""
    if isinstance(exc, RpcError):
        return exc.code in RETRY_CODES
    return isinstance(exc, ConnectionError | TimeoutError)


# -- the core: requests, answers, which controller (no IO) -----------------------------------------


def _same(reply: Any) -> Any:
    return reply


@dataclass(frozen=True)
class Call:
    """One operation: the request to send, and what the caller gets from the answer."""

    request: Request
    #: the caller's result from the decoded answer
    then: Callable[[Any], Any] = _same
    #: the result when the controllers answer `not_found` (None: raise it)
    if_not_found: Callable[[], Any] | None = None
    #: sees a refusal first, and may raise another error for it
    refused: Callable[[RpcError], None] | None = None

    def settle(self, exc: RpcError) -> Any:
        """The result of a call whose retries ended in `exc`, or `exc` raised again."""
        if self.refused is not None:
            self.refused(exc)
        if self.if_not_found is not None and exc.code == "not_found":
            return self.if_not_found()
        raise exc


class LayoutMismatch(Exception):
    """A parameter server's `n_buckets` is not the controllers': it can serve none of their
    buckets, and no retry changes that (issue 39, finding 18). Not an `RpcError`: a server
    stops on it, it does not retry."""

    def __init__(self, mine: int, theirs: Any) -> None:
        super().__init__(
            f"this server uses n_buckets={mine}, the controllers n_buckets={theirs}: every role "
            f"of a cluster must use the same number of buckets (start it with --n-buckets "
            f"{theirs}, or ADAMPS_N_BUCKETS)"
        )
        self.mine = mine
        self.theirs = theirs


def _checks_layout(
    n_buckets: int | None,
) -> tuple[Callable[[Any], Any], Callable[[RpcError], None]]:
    """(then, refused) of a registration by a server of `n_buckets`: LayoutMismatch when the
    controllers refuse it for its n_buckets, or (controllers of an earlier release, which do
    not check) answer with another one."""

    def then(reply: Any) -> Any:
        theirs = reply.get("n_buckets") if isinstance(reply, dict) else None
        if n_buckets is not None and theirs is not None and theirs != n_buckets:
            raise LayoutMismatch(n_buckets, theirs)
        return reply

    def refused(exc: RpcError) -> None:
        if n_buckets is not None and exc.extra.get("reason") == "n_buckets":
            raise LayoutMismatch(n_buckets, exc.extra.get("n_buckets")) from exc

    return then, refused


class ControllerRing:
    """Which controller to ask first: the one that answered last, or the leader an answer named.
    Shared by the calls of one client (one thread, or the coroutines of one event loop)."""

    def __init__(self, n: int) -> None:
        self.n = n
        #: the controller that answered last: asked first
        self.first = 0
        #: the leader the answer being read named (its index), asked first from the next call
        self._leader: int | None = None
        #: the highest Raft log index a write's answer named (``applied_index``): reads ask for a
        #: state at least that far, so this client reads its own writes through any controller
        self.applied = 0

    def lead_to(self, i: int | None) -> None:
        """The answer being read names controller `i` as the Raft leader (None: one this client
        does not know): the next call asks it first. A follower forwards every write to the
        leader over HTTP (issue 36: a server's heartbeat through a follower cost two
        controllers' event loops instead of one, every second)."""
        self._leader = i

    def wrote(self, reply: Any) -> None:
        """A write's answer: keep the log index it was applied at."""
        index = reply.get("applied_index") if isinstance(reply, dict) else None
        if isinstance(index, int) and not isinstance(index, bool) and index > self.applied:
            self.applied = index

    def read_headers(self) -> tuple[tuple[str, str], ...]:
        """A read's headers: the state it must come from (none before this client wrote)."""
        return ((MIN_APPLIED_HEADER, str(self.applied)),) if self.applied else ()

    def answered(self, i: int) -> None:
        """Controller `i` answered: it is asked first next time, unless its answer named the
        leader."""
        self.first = i if self._leader is None else self._leader
        self._leader = None

    def round(self) -> Round:
        return Round(self)


class Round:
    """One round of a call over every controller; it ends at the first answer."""

    def __init__(self, ring: ControllerRing) -> None:
        self.ring = ring
        #: the last retryable failure of this round
        self.last: BaseException | None = None

    def __iter__(self) -> Iterator[int]:
        """The controller that answered last, then the others."""
        first, n = self.ring.first, self.ring.n
        return iter([(first + k) % n for k in range(n)])

    @contextlib.contextmanager
    def asking(self, i: int) -> Iterator[None]:
        """Around a request to controller `i`: a retryable failure is kept and the round goes
        on; an answer (also an error answer) makes `i` the first to ask next time."""
        try:
            yield
        except Exception as exc:
            if not retryable(exc):
                self.ring.answered(i)
                raise
            self.last = exc
        else:
            self.ring.answered(i)

    def failed(self) -> BaseException:
        """The error of a round in which no controller answered: the last one."""
        assert self.last is not None
        return self.last


def _reports(reports: dict[int, Sequence[int]] | None) -> dict[str, list[int]]:
    return {str(b): list(r) for b, r in (reports or {}).items()}


class ControllerOps:
    """Every operation of the controllers' API, built once over `_run` (a value in the blocking
    client, an awaitable in the asyncio one). See docs/protocol-controller.md."""

    #: signs a POST (method, path, body) as a server (adamps.security.peer_auth.server_call_header);
    #: set by a parameter server that has its own key
    signer: Callable[[str, str, bytes], tuple[tuple[str, str], ...]] | None = None
    #: the rack a parameter server registers in (issue 26: placement keeps a bucket's copies on
    #: distinct racks); set by the server, None: no rack
    rack: str | None = None
    #: the controllers' addresses, and which to ask first (set by the drivers)
    addresses: Sequence[str] = ()
    ring: ControllerRing | None = None

    def _run(self, call: Call) -> Any:
        raise NotImplementedError

    def _post(
        self,
        path: str,
        body: Any,
        then: Callable[[Any], Any] = _same,
        refused: Callable[[RpcError], None] | None = None,
    ) -> Any:
        req = json_request("POST", path, body)
        if self.signer is not None and req.body is not None:
            req = dataclasses.replace(req, extra_headers=self.signer("POST", path, req.body))
        return self._write(req, then, refused)

    def _write(
        self,
        req: Request,
        then: Callable[[Any], Any] = _same,
        refused: Callable[[RpcError], None] | None = None,
    ) -> Any:
        """A write: its answer's ``applied_index`` is kept for this client's later reads."""
        ring = self.ring

        def wrote(reply: Any) -> Any:
            if ring is not None:
                ring.wrote(reply)
            return then(reply)

        return self._run(Call(req, wrote, refused=refused))

    def _get(self, path: str, if_not_found: Callable[[], Any] | None = None) -> Any:
        req = json_request("GET", path)
        if self.ring is not None and self.ring.applied:
            req = dataclasses.replace(req, extra_headers=self.ring.read_headers())
        return self._run(Call(req, if_not_found=if_not_found))

    # -- parameter servers ---------------------------------------------------------------------

    def register(
        self,
        server: str,
        address: str,
        copies: dict[int, Sequence[int]] | None = None,
        rack: str | None = None,
        n_buckets: int | None = None,
    ) -> Any:
        """A registration: the server's address, the copies it offers (bucket -> [epoch, seq])
        and its rack (default: the client's `rack`). With `n_buckets` (the server's), a cluster
        of another number of buckets raises `LayoutMismatch`, and registers nothing."""
        body: dict[str, Any] = {"address": address, "copies": _reports(copies)}
        rack = rack if rack is not None else self.rack
        if rack:
            body["rack"] = rack
        if n_buckets is not None:
            body["n_buckets"] = n_buckets
        then, refused = _checks_layout(n_buckets)
        return self._post(f"/servers/{server}/register", body, then, refused)

    def heartbeat(
        self,
        server: str,
        known_version: int | None = None,
        reports: dict[int, Sequence[int]] | None = None,
        not_durable: str | None = None,
        deltas: bool | None = False,
    ) -> Any:
        """(reply, asked_at): asked_at is time.monotonic() before the request was sent.
        `not_durable`: why the server cannot persist now (issue 29), or None. `deltas`: the
        caller applies an answer's roles as a delta from `known_version` (issue 40)."""
        asked_at = time.monotonic()
        body: dict[str, Any] = {"known_version": known_version}
        if deltas:
            body["deltas"] = True
        if not_durable is not None:
            body["not_durable"] = not_durable
        if reports:
            body["reports"] = _reports(reports)

        def then(reply: Any) -> tuple[Any, float]:
            # the leader names itself: the next heartbeat goes to it, not through a follower
            if self.ring is not None and isinstance(reply, dict):
                self.ring.lead_to(self._index_of(reply.get("leader")))
            return reply, asked_at

        return self._post(f"/servers/{server}/heartbeat", body, then)

    def _index_of(self, address: Any) -> int | None:
        """The index of controller `address` in this client's list (None: not one of them)."""
        if not isinstance(address, str):
            return None
        bare = address.split("://", 1)[-1]
        for i, a in enumerate(self.addresses):
            if a.split("://", 1)[-1] == bare:
                return i
        return None

    def peer_keys(self, server: str, peers: Sequence[str], when: int, proof: str) -> Any:
        """{"keys": {peer: hex K_server,peer}}: the pairwise keys of `server`, which proves its
        own key with `proof` (adamps.security.peer_auth.proof at unix time `when`)."""
        body = {"peers": list(peers), "time": when, "proof": proof}
        return self._post(f"/servers/{server}/peer-keys", body)

    def role_change(
        self,
        bucket: int,
        server: str,
        prev_epoch: int,
        reports: dict[str, Sequence[int]] | None = None,
    ) -> Any:
        body = {
            "server": server,
            "prev_epoch": prev_epoch,
            "reports": {s: list(r) for s, r in (reports or {}).items()},
        }
        return self._post(f"/buckets/{bucket}/role-change", body)

    def caught_up(
        self, bucket: int, primary: str, epoch: int, server: str, join: int | None = None
    ) -> Any:
        """The primary's report that joining copy `server` caught up (in its join number `join`)."""
        body: dict[str, Any] = {"primary": primary, "epoch": epoch, "server": server}
        if join is not None:
            body["join"] = join
        return self._post(f"/buckets/{bucket}/caught-up", body)

    def release(self, bucket: int, server: str, epoch: int) -> Any:
        return self._post(f"/buckets/{bucket}/release", {"server": server, "epoch": epoch})

    def drop_secondary(self, bucket: int, primary: str, epoch: int, server: str) -> Any:
        body = {"primary": primary, "epoch": epoch, "server": server}
        return self._post(f"/buckets/{bucket}/drop-secondary", body)

    # -- everybody -------------------------------------------------------------------------------

    def routing(self) -> Any:
        return self._get("/routing")

    def cluster(self) -> Any:
        return self._get("/cluster")

    def layout(self) -> Any:
        """{"layout_version", "layout"}, or None when no layout was set yet."""
        return self._get("/layout", if_not_found=lambda: None)

    def set_layout(self, layout: dict[str, Any], run: str | None = None) -> Any:
        """Sets the cluster's layout; with `run`, only that run's part (its namespace's
        tensors: the others' stay)."""
        body: dict[str, Any] = {"layout": layout}
        if run:
            body["run"] = run
        return self._post("/layout", body)

    def progress(self, epoch: int | None = None) -> Any:
        return self._get("/progress" if epoch is None else f"/progress?epoch={int(epoch)}")

    def report_progress(self, epoch: int, replica: str, progress: float, done: bool = False) -> Any:
        body = {"epoch": epoch, "replica": replica, "progress": progress, "done": done}
        return self._post("/progress", body)

    def drain(self, server: str) -> Any:
        return self._post(f"/servers/{server}/drain", {})

    def undrain(self, server: str) -> Any:
        return self._post(f"/servers/{server}/undrain", {})

    def rebalance(self) -> Any:
        return self._post("/rebalance", {})

    # -- runs (issue 25; controller/runs_http.py) -------------------------------------------------

    def create_run(
        self, name: str, quotas: dict[str, Any] | None = None, consistency: str | None = None
    ) -> Any:
        """{"ok", "run", "token"}: the token is shown this once."""
        body: dict[str, Any] = {"name": name, "quotas": quotas or {}}
        if consistency is not None:
            body["consistency"] = consistency
        return self._post("/runs", body)

    def runs(self) -> Any:
        return self._get("/runs")

    def run(self, name: str) -> Any:
        return self._get(f"/runs/{name}", if_not_found=lambda: None)

    def delete_run(self, name: str) -> Any:
        return self._write(json_request("DELETE", f"/runs/{name}"))

    def run_usage(self, run: str, name: str, cost: dict[str, int]) -> Any:
        """Asks the controllers to count `name` at `cost` against run `run`'s size quotas
        (a server, before it creates it; 403 quota_exceeded when past them)."""
        return self._post(f"/runs/{run}/usage", {"name": name, "cost": cost})

    def runs_auth(self) -> Any:
        """The runs' token hashes and quotas (the servers', with the cluster token)."""
        return self._get("/auth/runs")


# -- the drivers -----------------------------------------------------------------------------------


class ControllerClient(ControllerOps):
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
        self.ring = ControllerRing(len(self.rpcs))

    def _round(self, call: Call) -> Any:
        r = self.ring.round()
        for i in r:
            with r.asking(i):
                return call.then(self.rpcs[i].send(call.request))
        raise r.failed()

    def _run(self, call: Call) -> Any:
        policy = RetryPolicy(self.retry_for, cap=BACKOFF_CAP)
        try:
            return retry.call(policy, lambda _n: self._round(call), retryable)
        except RpcError as exc:
            return call.settle(exc)

    def close(self) -> None:
        for rpc in self.rpcs:
            rpc.close()


class AsyncControllerClient(ControllerOps):
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
        self.ring = ControllerRing(len(self.rpcs))

    async def _round(self, call: Call) -> Any:
        r = self.ring.round()
        for i in r:
            with r.asking(i):
                return call.then(await self.rpcs[i].send(call.request))
        raise r.failed()

    def _run(self, call: Call) -> Awaitable[Any]:
        return self._arun(call)

    async def _arun(self, call: Call) -> Any:
        policy = RetryPolicy(self.retry_for, cap=BACKOFF_CAP)
        try:
            return await retry.acall(policy, lambda _n: self._round(call), retryable)
        except RpcError as exc:
            return call.settle(exc)

    async def close(self) -> None:
        for rpc in self.rpcs:
            await rpc.close()
