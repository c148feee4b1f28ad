"""Replication of a parameter server's buckets: the asyncio shell around adamps.core.replication.

Project Adam 3.3.3, end to end. The pure core (``BucketReplica``) decides; this module does the IO:

- registers with the controllers and heartbeats them; the replies renew this server's primary
  leases (timed on its monotonic clock from when it asked, ``HolderLeases``) and tell it its roles
  per bucket (primary, secondary, joining), which become ``Assignment``s of the core;
- as primary of a bucket: gathers client pushes into rounds (one in flight per bucket, many pushes
  per round), sends PREPARE to every member of the recorded replica set, applies the batch once all
  hold it, sends COMMIT, and acknowledges the pushes once all committed. A member that does not
  answer within ``member_timeout`` is reported to the controller (``drop-secondary``); the round
  goes on without it only under the new assignment the controller committed;
- pings the secondaries of its buckets; as a secondary, proposes a role change to the controller
  when the primary stays silent (``failover_after``);
- as a joining copy, fetches a snapshot of the bucket from its primary (values, accumulators,
  versions, position and deduplication table) and installs it; taking the snapshot made it a
  learner of the primary, whose rounds wait for it from then on. The primary reports it
  ``caught-up`` to the controller once it holds every committed batch;
- keeps its copies across registrations: a server that registers again (after a pause, a
  partition, or a restart that reloaded its copies from LMDB) offers them with their (epoch,
  seq), and keeps them as `standby` until the controller gives them a role or lets them go.

Updates travel in their compact form (dense delta of one shard, or activation and error vectors),
never as an expanded M x N delta, and every replica applies each batch as one group per shard on
the shard's owner thread, so replicas end bit-identical (``digest`` checks it).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from adamps import metrics
from adamps.controller_client import AsyncControllerClient
from adamps.core.lease import HolderLeases, LeaseTerms
from adamps.core.replication import Apply, Assignment, Batch, BucketReplica, Reject
from adamps.layout import TensorSpec
from adamps.protocol import ProtocolError, require
from adamps.rpc import AsyncRpc, RpcError
from adamps.server import vecops
from adamps.server.compressed import signs_of_wire
from adamps.server.optim import Dense, Optimizer
from adamps.server.persist import DEDUP_PER_FLUSH, Position
from adamps.server.store import ShardState, StoreError, fc_parts, owner_future

if TYPE_CHECKING:
    from adamps.server.app import ParameterServer

log = logging.getLogger(__name__)

#: replication ops served on /rpc (peer traffic: cluster token required like every mutating call)
REPL_OPS = ("repl_prepare", "repl_commit", "repl_ping", "repl_multi", "repl_snapshot", "digest")
#: the ops that may travel inside a repl_multi message
MULTI_OPS = ("repl_prepare", "repl_commit", "repl_ping")


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


class ReplMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.round_seconds = Histogram(
            "adamps_ps_replication_round_seconds",
            "two-phase-commit round as primary: first prepare to the last commit ack",
            buckets=metrics.LATENCY_BUCKETS,
            registry=registry,
        )
        self.round_pushes = Histogram(
            "adamps_ps_replication_round_pushes",
            "client pushes carried by one round",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024),
            registry=registry,
        )
        self.lag = Gauge(
            "adamps_ps_replication_lag_batches",
            "batches committed here that the slowest secondary has not committed, per bucket",
            ["bucket"],
            registry=registry,
        )
        self.failovers = Counter(
            "adamps_ps_failovers",
            "buckets this server became primary of after another server held them",
            registry=registry,
        )
        self.under_replicated = Gauge(
            "adamps_ps_under_replicated_buckets",
            "buckets this server is primary of with fewer than 2 secondaries",
            registry=registry,
        )
        self.stale = Counter(
            "adamps_ps_stale_epoch_rejected",
            "replication messages refused for an old lease epoch",
            registry=registry,
        )
        self.dedup = Counter(
            "adamps_ps_deduplicated_pushes",
            "pushes recognised as retries and not applied again",
            registry=registry,
        )
        self.dropped = Counter(
            "adamps_ps_secondaries_dropped",
            "secondaries reported to the controller as unresponsive",
            registry=registry,
        )
        self.snapshots = Counter(
            "adamps_ps_state_transfers",
            "state transfers by direction (sent, received)",
            ["direction"],
            registry=registry,
        )
        for direction in ("sent", "received"):
            self.snapshots.labels(direction)  # both series exist from the start (dashboards)
        self.primary_buckets = Gauge(
            "adamps_ps_primary_buckets", "buckets this server is primary of", registry=registry
        )
        self.lease_epoch = Gauge(
            "adamps_ps_lease_epoch_max",
            "highest lease epoch among the buckets this server is primary of",
            registry=registry,
        )


def _not_primary(
    rep: BucketReplica | None,
    bucket: int,
    addresses: dict[str, str],
    why: str,
    code: str = "not_primary",
) -> ProtocolError:
    a = rep.assignment if rep is not None else Assignment(0, None)
    return ProtocolError(
        code,
        f"bucket {bucket}: {why}",
        bucket=bucket,
        epoch=a.epoch,
        primary=addresses.get(a.primary or "", None),
    )


# -- updates on the wire ---------------------------------------------------------------------------


def dense_update(sid: str, delta: np.ndarray) -> dict[str, Any]:
    return {"k": "d", "s": sid, "d": delta}


def fc_update(tensor: str, sids: Sequence[str], a: np.ndarray, e: np.ndarray) -> dict[str, Any]:
    return {"k": "f", "t": tensor, "s": list(sids), "a": a, "e": e}


def sign_update(sid: str, tau: float, encoded: dict[str, Any]) -> dict[str, Any]:
    """A compressed update of one shard (Strom), replicated in its compressed form: ``encoded``
    is ``{"w": uint32 words}`` or ``{"r": Golomb-Rice bytes, "n": count, "b": Rice k}``."""
    return {"k": "c", "s": sid, "t": tau, **encoded}


def _batch_to_wire(b: Batch) -> dict[str, Any]:
    return {
        "seq": b.seq,
        "epoch": b.epoch,
        "updates": list(b.updates),
        "clients": [None if c is None else [c[0], c[1]] for c in b.clients],
    }


def _batch_from_wire(d: dict[str, Any]) -> Batch:
    seq = require(d, "seq", int)
    epoch = require(d, "epoch", int)
    updates = require(d, "updates", list)
    clients = require(d, "clients", list)
    if len(clients) != len(updates):
        raise ProtocolError("bad_request", "batch clients and updates differ in length")
    keys = tuple(None if c is None else (str(c[0]), int(c[1])) for c in clients)
    return Batch(seq, epoch, tuple(tuple(u) if isinstance(u, list) else u for u in updates), keys)


class Replicator:
    """The replication state and tasks of one parameter server. Lives on the PS's event loop."""

    def __init__(self, ps: ParameterServer, registry: CollectorRegistry) -> None:
        cfg = ps.cfg
        self.ps = ps
        self.store = ps.store
        self.server_id = cfg.server_id
        self.address = cfg.advertise or f"{cfg.host}:{cfg.port}"
        self.m = ReplMetrics(registry)
        self.member_timeout = cfg.member_timeout
        self.ping_interval = cfg.ping_interval
        self.failover_after = cfg.failover_after
        #: bucket -> replication state (buckets this server holds a copy of, or is joining)
        self.buckets: dict[int, BucketReplica] = {}
        #: bucket -> "primary" | "secondary" | "joining" | "standby"
        self.roles: dict[int, str] = {}
        #: buckets the controllers report unavailable (no live copy to serve them)
        self.unavailable: frozenset[int] = frozenset()
        #: bucket -> seq of the last cut taken for the flush (absent: a new or reinstalled copy)
        self._persisted: dict[int, int] = {}
        #: bucket -> the controllers' id of this copy's current join (named in the snapshot ask)
        self._join_ids: dict[int, int] = {}
        #: server id -> "host:port" (from the controllers' roles)
        self.addresses: dict[str, str] = {}
        self.leases = HolderLeases(LeaseTerms())
        self.table_version: int | None = None
        self.heartbeat_interval = 1.0
        #: bucket -> monotonic time the primary was last heard (secondary side)
        self.last_heard: dict[int, float] = {}
        self._round_tasks: dict[int, asyncio.Task] = {}
        self._join_tasks: dict[int, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None
        self._peers: dict[str, AsyncRpc] = {}
        self._channels: dict[str, PeerChannel] = {}
        self._controller: Any = None
        self._heartbeat_now = asyncio.Event()
        self._role_change_after: dict[int, float] = {}
        self.registered = asyncio.Event()
        self._closing = False
        #: buckets with a replication-lag series (removed when the bucket goes)
        self._lag_buckets: set[int] = set()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._controller = AsyncControllerClient(
            self.ps.cfg.controllers, self.ps.cfg.token, self._session, timeout=5.0, retry_for=5.0
        )
        self._tasks = [
            asyncio.create_task(self._control_loop(), name="ps-control"),
            asyncio.create_task(self._ping_loop(), name="ps-ping"),
        ]

    async def stop(self) -> None:
        self._closing = True
        tasks = [*self._tasks, *self._round_tasks.values(), *self._join_tasks.values()]
        for t in tasks:
            t.cancel()
        for ch in self._channels.values():
            ch.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Give the primary leases back, so the next primaries need not wait for them to expire:
        # all at once and within one second in total (best effort: unreleased leases run out).
        releases = [
            self._controller.release(b, self.server_id, self.buckets[b].assignment.epoch)
            for b, role in self.roles.items()
            if role == "primary" and b in self.buckets
        ]
        if releases:
            try:
                await asyncio.wait_for(asyncio.gather(*releases, return_exceptions=True), 1.0)
            except TimeoutError:
                pass
        if self._session is not None:
            await self._session.close()

    def _channel(self, server: str) -> PeerChannel:
        """The aggregating channel to a peer (prepare, commit and ping messages)."""
        rpc = self._peer(server)
        ch = self._channels.get(rpc.base_url)
        if ch is None:
            ch = self._channels[rpc.base_url] = PeerChannel(rpc)
        return ch

    def _peer(self, server: str) -> AsyncRpc:
        addr = self.addresses.get(server)
        if addr is None:
            raise ConnectionError(f"no address known for server {server!r}")
        rpc = self._peers.get(addr)
        if rpc is None:
            rpc = self._peers[addr] = AsyncRpc(
                addr, self.ps.cfg.token, self._session, self.member_timeout
            )
        return rpc

    # -- control loop: register, heartbeat, learn roles ---------------------------------------------

    async def _control_loop(self) -> None:
        while not self._closing:
            try:
                await self._register()
                while not self._closing:
                    if not await self._heartbeat():
                        break  # declared dead: register again as a fresh incarnation
                    try:
                        await asyncio.wait_for(self._heartbeat_now.wait(), self.heartbeat_interval)
                    except TimeoutError:
                        pass
                    self._heartbeat_now.clear()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("controller unreachable: %s; retrying", exc)
                await asyncio.sleep(0.5)

    def copies(self) -> dict[int, list[int]]:
        """The copies this server holds whole, with their position [committed epoch, seq]: what
        it offers the controllers (a joining copy that has no snapshot yet holds nothing)."""
        return {
            b: [rep.committed_epoch, rep.committed]
            for b, rep in self.buckets.items()
            if self.roles.get(b) != "joining" or rep.learning
        }

    def restore(self, positions: dict[int, Position]) -> None:
        """Copies reloaded from LMDB at start: held as standby until the controllers decide."""
        for b, pos in positions.items():
            rep = self.buckets[b] = BucketReplica(
                self.server_id, b, log_limit=self.ps.cfg.replication_log
            )
            rep.restore(pos.seq, pos.epoch, pos.dedup)
            self.roles[b] = "standby"
            self._persisted[b] = pos.seq
        log.info("reloaded %d copies: %s", len(positions), self.copies())

    def positions(self) -> dict[int, Position]:
        """Per held copy, its position and the exactly-once pairs recorded since the last cut.
        Called on the event loop in the same step as the flush's copies are queued: they
        describe exactly the values the flush writes."""
        out = {}
        for b, rep in self.buckets.items():
            if self.roles.get(b) == "joining" and not rep.learning:
                continue
            last = self._persisted.get(b)
            if last is None:
                dedup, fresh = rep.dedup.to_list(), True
            else:
                dedup, fresh = rep.dedup.entries_after(last, DEDUP_PER_FLUSH), False
            out[b] = Position(rep.committed_epoch, rep.committed, dedup, fresh)
            self._persisted[b] = rep.committed
        return out

    async def _register(self) -> None:
        copies = self.copies()
        reply = await self._controller.register(self.server_id, self.address, copies)
        if int(reply.get("n_buckets", self.ps.cfg.n_buckets)) != self.ps.cfg.n_buckets:
            raise RuntimeError(
                f"the controllers use n_buckets={reply['n_buckets']}, this server {self.ps.cfg.n_buckets}"
            )
        terms = reply.get("lease") or {}
        self.leases = HolderLeases(LeaseTerms(**{k: float(v) for k, v in terms.items()}))
        self.heartbeat_interval = float(reply.get("heartbeat_interval", 1.0))
        # A new incarnation: no role and no lease is trusted any more, but the copies stay (the
        # controllers may need them: they were offered) until the roles say what to do.
        for b, rep in self.buckets.items():
            self._fail_waiters(rep.on_assignment(Assignment(rep.assignment.epoch, None)), b)
            if self.roles.get(b) != "joining" or rep.learning:
                self.roles[b] = "standby"
        self.table_version = None
        self.registered.set()
        log.info(
            "registered as %s at %s, offering %d copies (lease %s)",
            self.server_id,
            self.address,
            len(copies),
            terms,
        )

    def request_heartbeat(self) -> None:
        self._heartbeat_now.set()

    async def _heartbeat(self) -> bool:
        reports = {b: [rep.assignment.epoch, rep.prepared_seq] for b, rep in self.buckets.items()}
        try:
            reply, asked_at = await self._controller.heartbeat(
                self.server_id, self.table_version, reports
            )
        except RpcError as exc:
            if exc.code == "conflict" or exc.code == "not_found":
                log.warning("controller says %s: registering again", exc.message)
                return False
            raise
        self.unavailable = frozenset(int(b) for b in reply.get("unavailable", []))
        if "roles" in reply:
            self._apply_roles(reply["roles"], int(reply["version"]))
        for b, epoch in reply.get("renewed", []):
            self.leases.on_granted(int(b), int(epoch), asked_at)
            if int(b) in self.buckets:
                self._kick(int(b))
        self._update_gauges()
        return True

    def _apply_roles(self, roles: Iterable[dict[str, Any]], version: int) -> None:
        seen = set()
        for r in roles:
            b = int(r["bucket"])
            seen.add(b)
            if r.get("address") and r.get("primary"):
                self.addresses[r["primary"]] = r["address"]
            for sid, addr in (r.get("secondary_addresses") or {}).items():
                if addr:
                    self.addresses[sid] = addr
            # `secondaries` excludes the primary; membership changes keep the lease epoch.
            assignment = Assignment(
                int(r["epoch"]),
                r.get("primary"),
                tuple(r.get("secondaries", [])),
                tuple(r.get("joining", [])),
            )
            role = r.get("role") or (
                "primary"
                if assignment.primary == self.server_id
                else "secondary"
                if self.server_id in assignment.secondaries
                else "joining"
            )
            if role == "standby" and b not in self.buckets:
                continue  # a copy this server no longer has: never an initial-valued stand-in
            self.store.hold_bucket(b)  # shards exist only for the buckets this server holds
            rep = self.buckets.get(b)
            if rep is None:
                rep = self.buckets[b] = BucketReplica(
                    self.server_id, b, log_limit=self.ps.cfg.replication_log
                )
            was = self.roles.get(b)
            if role == "standby":
                # No member: keep the copy (and its position) untouched, serve nothing.
                self.roles[b] = "standby"
                self.leases.drop(b)
                continue
            if role == "joining":
                # Not a member yet: keep the assignment to know the primary, start the transfer.
                # (A primary handed off ends its rounds and answers its waiters here; another
                # primary or epoch means another history: transfer again.)
                self._fail_waiters(rep.on_assignment(assignment), b)
                self._join_ids[b] = int(r.get("join", 0))
                self.roles[b] = "joining"
                if b not in self._join_tasks or self._join_tasks[b].done():
                    self._join_tasks[b] = asyncio.create_task(self._join(b), name=f"join-{b}")
                continue
            if was == "joining" and role != "joining":
                task = self._join_tasks.pop(b, None)
                if task is not None and not task.done():
                    task.cancel()
            self._fail_waiters(rep.on_assignment(assignment), b)
            self.roles[b] = role
            if role == "primary":
                if was != "primary" and was is not None:
                    self.m.failovers.inc()
                    log.info("bucket %d: promoted to primary at epoch %d", b, assignment.epoch)
                self._kick(b)
            else:
                self.leases.drop(b)
                self.last_heard.setdefault(b, time.monotonic())
        for b in [b for b in self.buckets if b not in seen]:
            self._forget(b)
        self.table_version = version

    def _forget(self, b: int) -> None:
        rep = self.buckets.pop(b, None)
        self._persisted.pop(b, None)
        self.roles.pop(b, None)
        self.store.release_bucket(b)
        self.leases.drop(b)
        self.last_heard.pop(b, None)
        task = self._join_tasks.pop(b, None)
        if task is not None:
            task.cancel()
        if rep is not None:
            self._fail_waiters(rep.on_assignment(Assignment(rep.assignment.epoch + 1, None)), b)
        if b in self._lag_buckets:
            self._lag_buckets.discard(b)
            self.m.lag.remove(str(b))

    def _fail_waiters(self, waiters: Iterable[Any], b: int) -> None:
        rep = self.buckets.get(b)
        for fut in waiters:
            if isinstance(fut, asyncio.Future) and not fut.done():
                # Queued in a round that may still commit elsewhere: unknown, not "not applied".
                fut.set_exception(
                    _not_primary(
                        rep,
                        b,
                        self.addresses,
                        "this server is no longer the primary; the push's outcome is unknown",
                        code="primary_changed",
                    )
                )

    def _update_gauges(self) -> None:
        prim = [b for b, r in self.roles.items() if r == "primary"]
        self.m.primary_buckets.set(len(prim))
        self.m.under_replicated.set(
            sum(1 for b in prim if len(self.buckets[b].assignment.secondaries) < 2)
        )
        self.m.lease_epoch.set(max((self.buckets[b].assignment.epoch for b in prim), default=0))
        for b in prim:
            rep = self.buckets[b]
            low = min((rep.acked_commit.get(m, -1) for m in rep.replicas), default=rep.committed)
            self.m.lag.labels(str(b)).set(max(0, rep.committed - max(low, 0)))
            self._lag_buckets.add(b)

    # -- primary: pushes and rounds -----------------------------------------------------------------

    def check_primary(self, b: int) -> BucketReplica:
        """The bucket's state if this server may serve it as primary now, else not_primary."""
        rep = self.buckets.get(b)
        if b in self.unavailable:
            self.request_heartbeat()
            raise ProtocolError(
                "bucket_unavailable",
                f"bucket {b}: no live copy can serve it (waiting for a copy to come back, or "
                "for an operator to declare it lost)",
                bucket=b,
            )
        if rep is None or self.roles.get(b) != "primary":
            raise _not_primary(rep, b, self.addresses, "this server is not its primary")
        if not self.leases.can_write(b, rep.assignment.epoch, time.monotonic()):
            self.request_heartbeat()
            raise _not_primary(
                rep, b, self.addresses, "the primary lease is not (or no longer) held"
            )
        return rep

    async def push(
        self, by_bucket: dict[int, list[dict[str, Any]]], client: tuple[str, int] | None
    ) -> None:
        """Replicates one client push (its updates grouped by bucket); returns once every member
        of every bucket's replica set committed it."""
        loop = asyncio.get_running_loop()
        reps = {b: self.check_primary(b) for b in by_bucket}  # all or nothing: check first
        futs = []
        for b, updates in by_bucket.items():
            fut = loop.create_future()
            verdict = reps[b].submit(tuple(updates), client, fut)
            if isinstance(verdict, Reject):
                raise ProtocolError(verdict.code, verdict.message, bucket=b, epoch=verdict.epoch)
            if verdict == "duplicate-committed":
                self.m.dedup.inc()
                fut.set_result(None)
            elif verdict == "duplicate-inflight":
                self.m.dedup.inc()
            self._kick(b)
            futs.append(fut)
        try:
            await asyncio.wait_for(asyncio.gather(*futs), self.ps.cfg.push_timeout)
        except TimeoutError:
            raise ProtocolError(
                "timeout",
                f"replication did not complete within {self.ps.cfg.push_timeout}s; outcome unknown",
            ) from None

    def _kick(self, b: int) -> None:
        task = self._round_tasks.get(b)
        if task is None or task.done():
            self._round_tasks[b] = asyncio.create_task(self._rounds(b), name=f"rounds-{b}")

    async def _rounds(self, b: int) -> None:
        """Runs rounds of bucket b while this server is its primary and work waits.

        Rounds are pipelined two deep: the PREPARE of round k+1 overlaps the COMMIT of round k
        (pushes of round k are still acknowledged only once every member committed it; members
        apply batches in seq order whatever order the messages arrive in)."""
        commit_task: asyncio.Task | None = None
        try:
            while not self._closing:
                rep = self.buckets.get(b)
                if rep is None or self.roles.get(b) != "primary":
                    return
                if rep.needs_recovery:
                    rep.recover()
                if rep.inflight is None:
                    if not self.leases.can_write(b, rep.assignment.epoch, time.monotonic()):
                        return  # the next heartbeat's renewal kicks us again
                    if rep.next_round() is None:
                        if commit_task is not None:
                            await commit_task
                            commit_task = None
                            continue  # pushes may have arrived meanwhile
                        # Idle: bring members that joined (or missed a commit) up to date, so a
                        # quiet bucket's copies are identical and a failover finds nothing missing.
                        for m in rep.lagging():
                            await self._sync_member(b, rep, m)
                        self._report_learners(b, rep)
                        return
                t0 = time.perf_counter()
                n_pushes = len(rep.inflight[1]) if rep.inflight else 0
                try:
                    if not await self._prepare_all(b, rep):
                        continue  # the assignment changed: loop re-reads the role
                    seq = rep.inflight[0].seq
                    # Applied here in seq order: enqueued to the owner threads before anything
                    # else runs on the loop, so reads and snapshots see whole batches.
                    self._apply(rep.commit_round())
                    if commit_task is not None:
                        await commit_task  # at most one commit phase in flight
                    commit_task = asyncio.create_task(
                        self._commit_all(b, rep, seq, t0, n_pushes), name=f"commit-{b}-{seq}"
                    )
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("bucket %d: round failed", b)
                    await asyncio.sleep(0.1)
        finally:
            if commit_task is not None and not commit_task.done():
                commit_task.cancel()

    async def _prepare_all(self, b: int, rep: BucketReplica) -> bool:
        """Until every member holds the round's batch. False when the assignment changed."""
        epoch = rep.assignment.epoch
        started = time.monotonic()
        while not rep.round_prepared():
            if (
                rep.assignment.epoch != epoch
                or self.roles.get(b) != "primary"
                or rep.inflight is None
            ):
                return False
            todo = [m for m in rep.replicas if rep.acked_prepare.get(m, -1) < rep.inflight[0].seq]
            results = await asyncio.gather(
                *(self._prepare_one(b, rep, m) for m in todo), return_exceptions=True
            )
            failed = [m for m, r in zip(todo, results, strict=True) if r is not True]
            if not failed:
                continue
            if time.monotonic() - started > self.member_timeout:
                for m in failed:
                    await self._unresponsive(b, rep, m)
                started = time.monotonic()
            else:
                await asyncio.sleep(0.02)
        return True

    async def _prepare_one(self, b: int, rep: BucketReplica, member: str) -> bool:
        for _ in range(3):
            if rep.inflight is None:
                return False
            entries = rep.prepare_for(member)
            if entries is None:
                # Too far behind for the log: it must transfer state again; the controller puts
                # it back as joining once we drop it.
                return False
            try:
                reply = await self._channel(member).call(
                    "repl_prepare",
                    bucket=b,
                    epoch=rep.assignment.epoch,
                    sender=self.server_id,
                    entries=[_batch_to_wire(e) for e in entries],
                )
            except RpcError as exc:
                if exc.code == "stale_epoch":
                    self.m.stale.inc()
                    self.request_heartbeat()
                return False
            except (ConnectionError, TimeoutError, OSError):
                return False
            if reply["status"] == "gap":
                rep.on_member_position(member, int(reply["seq"]))
                continue
            rep.on_prepare_ack(member, int(reply["seq"]))
            return True
        return False

    async def _commit_all(
        self, b: int, rep: BucketReplica, seq: int, t0: float, n_pushes: int
    ) -> None:
        """COMMIT to every member; acknowledges pushes as members confirm. A member that does not
        confirm within member_timeout is dropped (its pushes are released once it is removed)."""
        epoch = rep.assignment.epoch
        started = time.monotonic()
        while True:
            waiting = [m for m in rep.replicas if rep.acked_commit.get(m, -1) < seq]
            if not waiting or rep.assignment.epoch != epoch or self.roles.get(b) != "primary":
                break
            results = await asyncio.gather(
                *(self._commit_one(b, rep, m, seq) for m in waiting), return_exceptions=True
            )
            failed = [m for m, r in zip(waiting, results, strict=True) if r is not True]
            if failed and time.monotonic() - started > self.member_timeout:
                for m in failed:
                    await self._unresponsive(b, rep, m)
                started = time.monotonic()
            elif failed:
                await asyncio.sleep(0.02)
        self._release(b, rep, rep.release_acknowledged())
        self._report_learners(b, rep)
        self.m.round_seconds.observe(time.perf_counter() - t0)
        self.m.round_pushes.observe(n_pushes)

    async def _sync_member(
        self, b: int, rep: BucketReplica, member: str, upto: int | None = None
    ) -> bool:
        """COMMIT up to `upto` (default: our position); a member that lacks batches says where
        it stands and gets them from the log (PREPARE of committed batches), then the COMMIT
        again."""
        for _ in range(3):
            try:
                reply = await self._channel(member).call(
                    "repl_commit",
                    bucket=b,
                    epoch=rep.assignment.epoch,
                    sender=self.server_id,
                    seq=rep.committed if upto is None else min(upto, rep.committed),
                )
                if reply["status"] == "ok":
                    self._release(b, rep, rep.on_commit_ack(member, int(reply["seq"])))
                    return True
                position = int(reply["seq"])
                rep.on_member_position(member, position)
                entries = rep.log_after(position)
                if entries is None:
                    return False  # beyond the log: dropping it makes it transfer state again
                await self._channel(member).call(
                    "repl_prepare",
                    bucket=b,
                    epoch=rep.assignment.epoch,
                    sender=self.server_id,
                    entries=[_batch_to_wire(e) for e in entries],
                )
            except (RpcError, ConnectionError, TimeoutError, OSError):
                return False
        return False

    async def _commit_one(self, b: int, rep: BucketReplica, member: str, seq: int) -> bool:
        try:
            reply = await self._channel(member).call(
                "repl_commit", bucket=b, epoch=rep.assignment.epoch, sender=self.server_id, seq=seq
            )
        except RpcError as exc:
            if exc.code == "stale_epoch":
                self.m.stale.inc()
                self.request_heartbeat()
            return False
        except (ConnectionError, TimeoutError, OSError):
            return False
        if reply["status"] == "gap":
            # It lacks batches (a learner whose prepare raced its snapshot, or a restart): bring
            # it up from the log, then commit again.
            rep.on_member_position(member, int(reply["seq"]))
            return await self._sync_member(b, rep, member, seq)
        self._release(b, rep, rep.on_commit_ack(member, int(reply["seq"])))
        return True

    def _release(self, b: int, rep: BucketReplica, waiters: Iterable[Any]) -> None:
        """Acknowledges the pushes of batches every replica committed, but only while this
        server's lease of the bucket holds: past it another copy may already be acknowledging
        under the next epoch. Then their outcome is unknown to the client (`primary_changed`);
        its retry is answered by the next primary, which has the batch (exactly once)."""
        waiters = [f for f in waiters if isinstance(f, asyncio.Future) and not f.done()]
        if not waiters:
            return
        if self.leases.can_write(b, rep.assignment.epoch, time.monotonic()):
            for fut in waiters:
                fut.set_result(None)
            return
        why = "the lease ended before the acknowledgement; the push's outcome is unknown"
        for fut in waiters:
            fut.set_exception(_not_primary(rep, b, self.addresses, why, code="primary_changed"))

    async def _unresponsive(self, b: int, rep: BucketReplica, member: str) -> None:
        """A replica did not answer within member_timeout. A learner not yet reported caught up
        is no member: forget it (it transfers again). One whose report awaits the controller's
        answer is waited for. A member, or a learner the controller accepted, leaves only by a
        committed controller entry."""
        state = rep.learners.get(member)
        if state == "syncing":
            log.info("bucket %d: learner %s unresponsive; forgotten", b, member)
            rep.drop_learner(member)
            return
        if state == "reporting":
            return
        if await self._drop_secondary(b, rep, member) and member in rep.learners:
            rep.drop_learner(member)

    def _report_learners(self, b: int, rep: BucketReplica) -> None:
        """Learners that hold every committed batch: report them caught up (once)."""
        for m in rep.learners_caught_up():
            rep.report_sent(m)
            asyncio.create_task(self._report_caught_up(b, rep, m, rep.assignment.epoch))

    async def _report_caught_up(self, b: int, rep: BucketReplica, member: str, epoch: int) -> None:
        """Reports a learner caught up, in its join. An answer of unknown outcome is no refusal
        (the entry may have committed): ask again (a repeated report of one join is accepted)
        until the controllers answer, or the record moves on without this primary."""
        join = rep.learner_joins.get(member, 0)
        while not self._closing:
            accepted: bool | None
            try:
                await self._controller.caught_up(b, self.server_id, epoch, member, join)
                log.info(
                    "bucket %d: %s caught up at seq %d (epoch %d)", b, member, rep.committed, epoch
                )
                accepted = True
            except RpcError as exc:
                if exc.code in ("no_quorum", "timeout", "unavailable", "internal"):
                    accepted = None
                else:
                    log.info("bucket %d: caught-up of %s refused: %s", b, member, exc)
                    accepted = False
            except (ConnectionError, TimeoutError, OSError):
                accepted = None
            if (
                rep.assignment.epoch != epoch
                or not rep.is_primary
                or rep.learners.get(member) != "reporting"
            ):
                break  # the record moved on (on_assignment settles the learner)
            if accepted is not None:
                rep.report_done(member, accepted)
                break
            await asyncio.sleep(0.2)
        self.request_heartbeat()

    async def _drop_secondary(self, b: int, rep: BucketReplica, member: str) -> bool:
        """Reports an unresponsive member; waits for the controller's new assignment. True when
        the controller removed it."""
        log.warning(
            "bucket %d: secondary %s unresponsive; asking the controller to drop it", b, member
        )
        self.m.dropped.inc()
        epoch = rep.assignment.epoch
        try:
            await self._controller.drop_secondary(b, self.server_id, epoch, member)
        except (RpcError, ConnectionError, TimeoutError) as exc:
            log.warning("bucket %d: drop-secondary %s refused or failed: %s", b, member, exc)
            self.request_heartbeat()
            return False
        # Learn the new replica set (a committed controller entry) before going on without it.
        deadline = time.monotonic() + self.member_timeout
        while (
            member in rep.assignment.secondaries
            and rep.assignment.epoch == epoch
            and time.monotonic() < deadline
            and not self._closing
        ):
            self.request_heartbeat()
            await asyncio.sleep(0.05)
        return True

    # -- applying batches -----------------------------------------------------------------------------

    def _parts(self, updates: Iterable[Any]) -> list[tuple[ShardState, Any]]:
        parts: list[tuple[ShardState, Any]] = []
        for push in updates:
            for u in push:
                kind = u["k"]
                if kind == "d":
                    parts.append((self.store.shard(u["s"]), Dense(u["d"])))
                elif kind == "f":
                    t = self.store.tensor(u["t"])
                    parts += fc_parts(t, u["a"], u["e"], [self.store.shard(s) for s in u["s"]])
                elif kind == "c":
                    st = self.store.shard(u["s"])
                    parts.append((st, signs_of_wire(u, st.shard.size)))
                elif kind == "v":  # a vector operation (Sandblaster, vecops.py)
                    parts += vecops.parts_of(self.store, u)
                else:
                    raise ProtocolError("bad_request", f"unknown update kind {kind!r}")
        return parts

    def _apply(self, action: Apply) -> asyncio.Future:
        """Enqueues the batches, each as one group per shard, in order; a future for completion."""
        futs = []
        for batch in action.batches:
            parts = self._parts(batch.updates)
            fut = owner_future(lambda cb, parts=parts: self.store.push_group(parts, cb))
            fut.add_done_callback(_log_apply_error)
            futs.append(fut)
        return asyncio.gather(*futs)

    # -- secondary: messages from the primary ---------------------------------------------------------

    def _known(self, b: int) -> BucketReplica:
        rep = self.buckets.get(b)
        if rep is None:
            self.request_heartbeat()
            raise ProtocolError("unavailable", f"bucket {b}: no copy here (yet)", bucket=b)
        return rep

    def _reject(self, rej: Reject, b: int) -> ProtocolError:
        if rej.code == "stale_epoch":
            self.m.stale.inc()
        if rej.code == "unavailable":
            self.request_heartbeat()  # the primary knows an epoch we do not: ask the controller
        return ProtocolError(rej.code, rej.message, bucket=b, epoch=rej.epoch)

    async def op_repl_prepare(self, msg: dict[str, Any]) -> dict[str, Any]:
        b = require(msg, "bucket", int)
        rep = self._known(b)
        entries = [_batch_from_wire(e) for e in require(msg, "entries", list)]
        for e in entries:
            self._parts(e.updates)  # validates shard ids and kinds before anything is kept
        res = rep.on_prepare(require(msg, "sender", str), require(msg, "epoch", int), entries)
        if isinstance(res, Reject):
            raise self._reject(res, b)
        self.last_heard[b] = time.monotonic()
        return {"status": res[0], "seq": res[1]}

    async def op_repl_commit(self, msg: dict[str, Any]) -> dict[str, Any]:
        b = require(msg, "bucket", int)
        rep = self._known(b)
        res = rep.on_commit(
            require(msg, "sender", str), require(msg, "epoch", int), require(msg, "seq", int)
        )
        if isinstance(res, Reject):
            raise self._reject(res, b)
        self.last_heard[b] = time.monotonic()
        if isinstance(res, tuple):
            return {"status": res[0], "seq": res[1]}
        # Decided and queued to the owner threads in seq order: every later read, snapshot or
        # digest on this server queues behind it, so the ack need not wait for the application.
        self._apply(res)
        return {"status": "ok", "seq": rep.committed}

    async def op_repl_multi(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Several replication messages from one peer, handled in order; one result each."""
        results = []
        for item in require(msg, "items", list):
            if not isinstance(item, dict) or item.get("op") not in MULTI_OPS:
                op = item.get("op") if isinstance(item, dict) else None
                results.append(
                    {
                        "error": {
                            "code": "unknown_op",
                            "message": f"{op!r} not allowed in repl_multi",
                        }
                    }
                )
                continue
            try:
                results.append({"ok": await getattr(self, f"op_{item['op']}")(item)})
            except ProtocolError as exc:
                results.append({"error": exc.to_dict()})
            except StoreError as exc:  # e.g. a tensor not defined here: this message fails only
                results.append({"error": ProtocolError(exc.code, exc.message).to_dict()})
        return {"results": results}

    async def op_repl_ping(self, msg: dict[str, Any]) -> dict[str, Any]:
        sender = require(msg, "sender", str)
        now = time.monotonic()
        stale = []
        for key, epoch in require(msg, "buckets", dict).items():
            rep = self.buckets.get(int(key))
            if rep is None:
                continue
            if rep.assignment.epoch == epoch and rep.assignment.primary == sender:
                self.last_heard[int(key)] = now
            elif epoch < rep.assignment.epoch:
                stale.append(int(key))
            else:
                self.request_heartbeat()
        return {"stale": stale}

    async def _ping_loop(self) -> None:
        """Primary -> secondaries heartbeats (one message per secondary for all its buckets)."""
        while not self._closing:
            await asyncio.sleep(self.ping_interval)
            by_member: dict[str, dict[str, int]] = {}
            for b, role in self.roles.items():
                if role != "primary":
                    continue
                rep = self.buckets[b]
                for m in rep.replicas:
                    by_member.setdefault(m, {})[str(b)] = rep.assignment.epoch
            if by_member:
                await asyncio.gather(
                    *(self._ping(m, bs) for m, bs in by_member.items()), return_exceptions=True
                )
            for b, role in list(self.roles.items()):
                if role == "primary" and self.buckets[b].lagging():
                    self._kick(b)
            self._watchdog()
            self._update_gauges()

    async def _ping(self, member: str, buckets: dict[str, int]) -> None:
        reply = await self._channel(member).call(
            "repl_ping", sender=self.server_id, buckets=buckets
        )
        if reply.get("stale"):
            self.m.stale.inc(len(reply["stale"]))
            self.request_heartbeat()

    def _watchdog(self) -> None:
        """Secondary side: a primary silent for failover_after gets a role-change proposal."""
        now = time.monotonic()
        for b, role in list(self.roles.items()):
            if role != "secondary":
                continue
            heard = self.last_heard.get(b, now)
            if now - heard > self.failover_after and now >= self._role_change_after.get(b, 0):
                self._role_change_after[b] = now + self.failover_after
                asyncio.create_task(self._propose(b), name=f"role-change-{b}")

    async def _propose(self, b: int) -> None:
        rep = self.buckets.get(b)
        if rep is None:
            return
        log.warning(
            "bucket %d: primary %s silent; proposing a role change", b, rep.assignment.primary
        )
        try:
            await self._controller.role_change(
                b,
                self.server_id,
                rep.assignment.epoch,
                {self.server_id: [rep.assignment.epoch, rep.prepared_seq]},
            )
        except RpcError as exc:
            retry = exc.extra.get("retry_after")
            if retry:
                self._role_change_after[b] = time.monotonic() + float(retry)
            log.info("bucket %d: role change not accepted: %s", b, exc.message)
        except (ConnectionError, TimeoutError) as exc:
            log.info("bucket %d: role change failed: %s", b, exc)
        self.request_heartbeat()

    # -- state transfer -------------------------------------------------------------------------------

    async def op_repl_snapshot(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A consistent copy of a bucket for a joining copy: taken between rounds, no await between
        reading the position and queueing the reads, so values match `committed` exactly."""
        b = require(msg, "bucket", int)
        joiner = require(msg, "joiner", str)
        join = require(msg, "join", int, default=0)
        rep = self.check_primary(b)
        rej = rep.add_learner(joiner, join)
        if rej is not None:
            raise self._reject(rej, b)
        # From here (no await since add_learner) every round waits for the joiner: the batches
        # after `committed` reach it through the rounds, the ones up to it through this copy.
        meta = rep.snapshot_meta()
        states = [
            st for st in self.store.shards.values() if self.store.layout.bucket_of[st.id] == b
        ]
        outs = [np.empty(st.shard.shape, np.float32) for st in states]
        accs = [
            np.empty(st.shard.shape, np.float32) if st.accum is not None else None for st in states
        ]
        versions = await self.ps._wait(lambda cb: self.store.read(states, outs, cb, accums=accs))
        tensors = {st.shard.tensor for st in states}
        self.m.snapshots.labels("sent").inc()
        return {
            "bucket": b,
            "epoch": rep.assignment.epoch,
            **meta,
            "tensors": [self.ps.tensor_definition(name) for name in sorted(tensors)],
            "shards": {
                st.id: {"value": out, "accum": acc, "version": versions[st.id]}
                for st, out, acc in zip(states, outs, accs, strict=True)
            },
        }

    async def _join(self, b: int) -> None:
        """Transfers bucket b from its primary and takes its rounds as a learner until the
        controller makes it a member; transfers again if the primary changes or goes silent
        (it forgot this learner)."""
        while not self._closing and self.roles.get(b) == "joining":
            rep = self.buckets[b]
            primary, epoch = rep.assignment.primary, rep.assignment.epoch
            try:
                snap = (
                    await self._peer(primary).call(
                        "repl_snapshot",
                        bucket=b,
                        joiner=self.server_id,
                        join=self._join_ids.get(b, 0),
                    )
                    if primary
                    else None
                )
            except (RpcError, ConnectionError, TimeoutError, OSError) as exc:
                log.info("bucket %d: snapshot from %s failed: %s; retrying", b, primary, exc)
                snap = None
            if (
                snap is None
                or self.roles.get(b) != "joining"
                or (rep.assignment.epoch, rep.assignment.primary) != (epoch, primary)
                or int(snap["epoch"]) != epoch
            ):
                await asyncio.sleep(0.3)
                self.request_heartbeat()
                continue
            await self._install(b, snap)
            log.info(
                "bucket %d: snapshot at seq %d from %s installed", b, snap["committed"], primary
            )
            self.last_heard[b] = time.monotonic()
            while not self._closing and self.roles.get(b) == "joining" and rep.learning:
                if time.monotonic() - self.last_heard.get(b, 0.0) > self.failover_after:
                    log.info("bucket %d: primary %s silent while joining; again", b, primary)
                    rep.learning = False
                    break
                await asyncio.sleep(0.1)

    async def _install(self, b: int, snap: dict[str, Any]) -> None:
        for d in snap["tensors"]:
            self.ps.ensure_tensor(d)
        states, values, accums, versions = [], [], [], []
        for sid, rec in snap["shards"].items():
            st = self.store.shard(sid)
            states.append(st)
            values.append(rec["value"])
            accums.append(rec.get("accum"))
            versions.append(int(rec["version"]))
        done = owner_future(lambda cb: self.store.overwrite(states, values, accums, versions, cb))
        # The position moves in the same loop step as the values are queued: a flush cut sees
        # both or neither.
        self.buckets[b].install_snapshot(
            int(snap["committed"]), snap["dedup"], int(snap.get("committed_epoch", 0))
        )
        self._persisted.pop(b, None)
        await done
        self.m.snapshots.labels("received").inc()

    # -- digests ---------------------------------------------------------------------------------------

    async def op_digest(self, msg: dict[str, Any]) -> dict[str, Any]:
        b = require(msg, "bucket", int)
        rep = self.buckets.get(b)
        states = sorted(
            (st for st in self.store.shards.values() if self.store.layout.bucket_of[st.id] == b),
            key=lambda s: s.id,
        )
        outs = [np.empty(st.shard.shape, np.float32) for st in states]
        await self.ps._wait(lambda cb: self.store.read(states, outs, cb))
        h = hashlib.sha256()
        for st, out in zip(states, outs, strict=True):
            h.update(st.id.encode())
            h.update(out.tobytes())
        return {
            "bucket": b,
            "digest": h.hexdigest(),
            "committed": rep.committed if rep else None,
            "role": self.roles.get(b),
            "epoch": rep.assignment.epoch if rep else None,
        }

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        out = {}
        for b, rep in sorted(self.buckets.items()):
            d = self.leases.deadline(b)
            out[str(b)] = {
                "role": self.roles.get(b),
                "epoch": rep.assignment.epoch,
                "primary": rep.assignment.primary,
                "secondaries": list(rep.assignment.secondaries),
                "committed": rep.committed,
                "committed_epoch": rep.committed_epoch,
                "learners": dict(rep.learners),
                "prepared": sorted(rep.prepared),
                "pending": len(rep.pending),
                "lease_left": None if d is None else round(d - now, 3),
            }
        return {
            "server_id": self.server_id,
            "address": self.address,
            "table_version": self.table_version,
            "unavailable": sorted(self.unavailable),
            "buckets": out,
        }


def _log_apply_error(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("applying a committed batch failed: %r", fut.exception())


def tensor_from_definition(d: dict[str, Any]) -> tuple[TensorSpec, Optimizer, dict[str, Any]]:
    return TensorSpec.from_dict(d), Optimizer.from_dict(d["optimizer"]), d["init"]
