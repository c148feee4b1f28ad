"""Replication of a parameter server's buckets: the asyncio shell around adamps.core.replication.

Project Adam 3.3.3, end to end. The pure core (``BucketReplica``) decides; this module does the IO:

- registers with the controllers and heartbeats them; the replies renew this server's primary
  leases (timed on its monotonic clock from when it asked, ``HolderLeases``) and tell it its roles
  per bucket (primary, secondary, joining), which become ``Assignment``s of the core;
- as primary of a bucket: gathers client pushes into rounds of two-phase commit
  (``repl_rounds.py``);
- pings the secondaries of its buckets; as a secondary, answers the primary and proposes a role
  change to the controller when the primary stays silent (``repl_follower.py``);
- as a joining copy, fetches a snapshot of the bucket from its primary and installs it; taking
  the snapshot made it a learner of the primary, whose rounds wait for it from then on
  (``repl_transfer.py``);
- keeps its copies across registrations: a server that registers again (after a pause, a
  partition, or a restart that reloaded its copies from LMDB) offers them with their (epoch,
  seq), and keeps them as `standby` until the controller gives them a role or lets them go.

Updates travel in their compact form (dense delta of one shard, or activation and error vectors),
never as an expanded M x N delta, and every replica applies each batch as one group per shard on
the shard's owner thread, so replicas end bit-identical (``digest`` checks it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Container, Iterable
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np
from prometheus_client import CollectorRegistry

from adamps import peer_auth, protocol
from adamps.client.controller import AsyncControllerClient
from adamps.client.rpc import RpcError
from adamps.core.lease import HolderLeases, LeaseTerms
from adamps.core.replication import Apply, Assignment, BucketReplica, Reject
from adamps.protocol import ProtocolError
from adamps.server.config import PsConfig
from adamps.server.peer_keys import PeerKeys, forbidden
from adamps.server.persist import DEDUP_PER_FLUSH, Position
from adamps.server.repl_follower import Follower
from adamps.server.repl_metrics import ReplMetrics
from adamps.server.repl_peers import Peers
from adamps.server.repl_rounds import PrimaryRounds
from adamps.server.repl_transfer import StateTransfer
from adamps.server.repl_wire import (
    REPL_OPS,
    batch_from_wire,
    batch_to_wire,
    not_primary,
    store_parts,
)
from adamps.server.store import Store
from adamps.server.tickets import owner_future

if TYPE_CHECKING:
    from adamps.server.catalog import TensorCatalog

log = logging.getLogger(__name__)


class Replicator(PrimaryRounds, Follower, StateTransfer):
    """The replication state and tasks of one parameter server. Lives on the PS's event loop."""

    def __init__(
        self, cfg: PsConfig, store: Store, catalog: TensorCatalog, registry: CollectorRegistry
    ) -> None:
        self.cfg = cfg
        self.store = store
        #: tensor definitions: sent with a snapshot, created from a peer's on install
        self.catalog = catalog
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
        self.persisted: dict[int, int] = {}
        #: bucket -> the controllers' id of this copy's current join (named in the snapshot ask)
        self.join_ids: dict[int, int] = {}
        #: who this server is to its peers, and who sent what it is asked to replicate
        self.peer_keys = PeerKeys(
            cfg.server_id, cfg.own_key(), lambda: self.controller, lambda s: s in self.addresses
        )
        self.peers = Peers(cfg.token, cfg.member_timeout, self.peer_keys)
        #: server id -> "host:port" (from the controllers' roles; the peers' address book)
        self.addresses = self.peers.addresses
        self.leases = HolderLeases(LeaseTerms())
        self.table_version: int | None = None
        self.heartbeat_interval = 1.0
        #: bucket -> monotonic time the primary was last heard (secondary side)
        self.last_heard: dict[int, float] = {}
        #: bucket -> the task running its rounds (primary side)
        self.round_tasks: dict[int, asyncio.Task] = {}
        self._join_tasks: dict[int, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None
        #: the controllers' client (opened at start)
        self.controller: Any = None
        self._heartbeat_now = asyncio.Event()
        #: sees every heartbeat reply (the runs' table version, adamps/server/tenancy.py)
        self.on_heartbeat: Callable[[dict[str, Any]], None] = lambda reply: None
        #: bucket -> monotonic time before which no new role change is proposed (secondary side)
        self.role_change_after: dict[int, float] = {}
        self.registered = asyncio.Event()
        #: set at stop: every loop ends
        self.closing = False
        #: why this server cannot persist now (set by the server: its flusher), or None;
        #: reported in every heartbeat so the controllers move its buckets (issue 29)
        self.not_durable: Callable[[], str | None] = lambda: None
        #: called with where ("transfer") for every received record that fails its checksum
        self.on_corrupt: Callable[[str], None] = lambda where: None
        #: writes the named buckets' copies and positions to LMDB now, blocking (set by the
        #: server: its flusher; raises if they cannot be written). A state transfer persists
        #: the installed copy with it before the copy may count as a member (issue 29).
        self.persist_now: Callable[[set[int]], object] = lambda buckets: None
        #: why a write to LMDB would not reach the disk now, or None (set by the server): no
        #: state transfer is asked for while it cannot be persisted
        self.can_persist: Callable[[], str | None] = lambda: None
        #: buckets whose installed snapshot is being persisted (held by the flush, not learning)
        self.installing: set[int] = set()
        #: buckets with a replication-lag series (removed when the bucket goes)
        self._lag_buckets: set[int] = set()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.peers.session = self._session
        self.controller = AsyncControllerClient(
            self.cfg.controllers, self.cfg.token, self._session, timeout=5.0, retry_for=5.0
        )
        own = self.peer_keys.own
        if own is not None:  # the controllers take this server's calls from this server only

            def sign(method: str, path: str, body: bytes) -> tuple[tuple[str, str], ...]:
                value = peer_auth.server_call_header(
                    own, self.server_id, int(time.time()), method, path, body
                )
                return ((peer_auth.SERVER_HEADER, value),)

            self.controller.signer = sign
        if not self.peer_keys.enabled:
            log.warning(
                "peer identity is off (no server_key or peer_token): any holder of the cluster "
                "token, every trainer, can send this server replication messages"
            )
        self._tasks = [
            asyncio.create_task(self._control_loop(), name="ps-control"),
            asyncio.create_task(self.ping_loop(), name="ps-ping"),
        ]

    async def stop(self) -> None:
        self.closing = True
        tasks = [*self._tasks, *self.round_tasks.values(), *self._join_tasks.values()]
        for t in tasks:
            t.cancel()
        self.peers.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Give the primary leases back, so the next primaries need not wait for them to expire:
        # all at once and within one second in total (best effort: unreleased leases run out).
        releases = [
            self.controller.release(b, self.server_id, self.buckets[b].assignment.epoch)
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

    # -- control loop: register, heartbeat, learn roles ---------------------------------------------

    async def _control_loop(self) -> None:
        while not self.closing:
            try:
                await self._register()
                while not self.closing:
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
        """The copies this server holds whole, with their position [epoch, seq] of the newest
        batch held applied or prepared: what it offers the controllers (a joining copy that has
        no snapshot yet holds nothing)."""
        return {
            b: list(rep.held_position)
            for b, rep in self.buckets.items()
            if self.roles.get(b) != "joining" or rep.learning
        }

    def restore(self, positions: dict[int, Position]) -> None:
        """Copies reloaded from LMDB at start: held as standby until the controllers decide."""
        for b, pos in positions.items():
            rep = self.buckets[b] = BucketReplica(
                self.server_id, b, log_limit=self.cfg.replication_log
            )
            rep.restore(pos.seq, pos.epoch, pos.dedup, map(batch_from_wire, pos.prepared))
            self.roles[b] = "standby"
            self.persisted[b] = pos.seq
        log.info("reloaded %d copies: %s", len(positions), self.copies())

    def held_copies(self) -> set[int]:
        """The buckets whose copy a flush persists (a joining copy only once it learns)."""
        return {
            b
            for b, rep in self.buckets.items()
            if not (self.roles.get(b) == "joining" and not rep.learning) or b in self.installing
        }

    def positions(self, buckets: Container[int] | None = None) -> dict[int, Position]:
        """Per held copy (of `buckets`; None: all), its position and the exactly-once pairs
        recorded since the last cut. Called on the event loop in the same step as the flush's
        copies are queued: they describe exactly the values the flush writes."""
        out = {}
        for b, rep in self.buckets.items():
            if self.roles.get(b) == "joining" and not rep.learning and b not in self.installing:
                continue
            if buckets is not None and b not in buckets:
                continue
            last = self.persisted.get(b)
            if last is None:
                dedup, fresh = rep.dedup.to_list(), True
            else:
                dedup, fresh = rep.dedup.entries_after(last, DEDUP_PER_FLUSH), False
            prepared = [batch_to_wire(x) for x in rep.held_prepared()]
            out[b] = Position(rep.committed_epoch, rep.committed, dedup, fresh, prepared)
            self.persisted[b] = rep.committed
        return out

    async def _register(self) -> None:
        copies = await self.offers()
        reply = await self.controller.register(self.server_id, self.address, copies)
        if int(reply.get("n_buckets", self.cfg.n_buckets)) != self.cfg.n_buckets:
            raise RuntimeError(
                f"the controllers use n_buckets={reply['n_buckets']}, this server {self.cfg.n_buckets}"
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
            reply, asked_at = await self.controller.heartbeat(
                self.server_id, self.table_version, reports, self.not_durable()
            )
        except RpcError as exc:
            if exc.code == "conflict" or exc.code == "not_found":
                log.warning("controller says %s: registering again", exc.message)
                return False
            raise
        self.unavailable = frozenset(int(b) for b in reply.get("unavailable", []))
        self.on_heartbeat(reply)
        if "roles" in reply:
            self._apply_roles(reply["roles"], int(reply["version"]))
        for b, epoch in reply.get("renewed", []):
            self.leases.on_granted(int(b), int(epoch), asked_at)
            if int(b) in self.buckets:
                self.kick(int(b))
        self.update_gauges()
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
                    self.server_id, b, log_limit=self.cfg.replication_log
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
                self.join_ids[b] = int(r.get("join", 0))
                self.roles[b] = "joining"
                if b not in self._join_tasks or self._join_tasks[b].done():
                    self._join_tasks[b] = asyncio.create_task(self.join(b), name=f"join-{b}")
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
                self.kick(b)
            else:
                self.leases.drop(b)
                self.last_heard.setdefault(b, time.monotonic())
        for b in [b for b in self.buckets if b not in seen]:
            self._forget(b)
        self.table_version = version

    def _forget(self, b: int) -> None:
        rep = self.buckets.pop(b, None)
        self.persisted.pop(b, None)
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
                    not_primary(
                        rep,
                        b,
                        self.addresses,
                        "this server is no longer the primary; the push's outcome is unknown",
                        code="primary_changed",
                    )
                )

    def update_gauges(self) -> None:
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
            raise not_primary(rep, b, self.addresses, "this server is not its primary")
        if not self.leases.can_write(b, rep.assignment.epoch, time.monotonic()):
            self.request_heartbeat()
            raise not_primary(
                rep, b, self.addresses, "the primary lease is not (or no longer) held"
            )
        return rep

    def apply_batches(self, action: Apply) -> asyncio.Future:
        """Enqueues the batches, each as one group per shard, in order; a future for completion."""
        futs = []
        for batch in action.batches:
            parts = store_parts(self.store, batch.updates)
            fut = owner_future(lambda cb, parts=parts: self.store.push_group(parts, cb))
            fut.add_done_callback(_log_apply_error)
            futs.append(fut)
        return asyncio.gather(*futs)

    # -- secondary: messages from the primary ---------------------------------------------------------

    async def op_from_peer(self, op: str, msg: dict[str, Any], peer: str | None) -> dict[str, Any]:
        """A replication op whose request `peer` proved it sent (None: no proof); with peer
        identity on, refused unless every sender the message names is that server."""
        if self.peer_keys.enabled:
            if peer is None:
                raise forbidden(op, "no peer credential in the request")
            self.peer_keys.check_senders(op, msg, peer)
        return await getattr(self, f"op_{op}")(msg)

    async def peer_of_request(self, op: str, header: str | None, body: Any) -> str | None:
        """The server whose MAC of `body` the PEER_HEADER value `header` carries, or None when
        there is none or identity is off; ProtocolError forbidden for a wrong one."""
        if header is None or not self.peer_keys.enabled:
            return None
        parsed = peer_auth.parse_header(header)
        if parsed is None:
            raise forbidden(op, f"malformed {peer_auth.PEER_HEADER} header")
        return await self.peer_keys.prover(op, [body], *parsed)

    async def op_repl_frame(
        self, meta: dict[str, Any], meta_raw: bytes, payload: np.ndarray | None
    ) -> dict[str, Any]:
        """A repl_multi frame of the data plane: its MAC (the payload's last MAC_SIZE bytes,
        over the meta and the rest of the payload) checked before the message is decoded."""
        peer = None
        claimed = meta.get("peer")
        if claimed is not None:
            if payload is None or payload.size < peer_auth.MAC_SIZE:
                raise forbidden("repl_multi", "the frame's MAC is missing")
            got = payload[-peer_auth.MAC_SIZE :].tobytes()
            payload = payload[: -peer_auth.MAC_SIZE]
            if self.peer_keys.enabled:
                peer = await self.peer_keys.prover(
                    "repl_multi",
                    [meta_raw, payload],
                    claimed if isinstance(claimed, str) else None,
                    got,
                )
        msg = protocol.decode(meta_raw, b"" if payload is None else payload)
        return await self.op_from_peer("repl_multi", msg, peer)

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]]:
        """The replication ops this server serves on POST /rpc (peer traffic), by name."""
        return {op: getattr(self, f"op_{op}") for op in REPL_OPS}

    def known(self, b: int) -> BucketReplica:
        rep = self.buckets.get(b)
        if rep is None:
            self.request_heartbeat()
            raise ProtocolError("unavailable", f"bucket {b}: no copy here (yet)", bucket=b)
        return rep

    def reject(self, rej: Reject, b: int) -> ProtocolError:
        if rej.code == "stale_epoch":
            self.m.stale.inc()
        if rej.code == "unavailable":
            self.request_heartbeat()  # the primary knows an epoch we do not: ask the controller
        return ProtocolError(rej.code, rej.message, bucket=b, epoch=rej.epoch)

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
