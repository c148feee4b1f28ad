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
from collections.abc import Awaitable, Callable, Container
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np
from prometheus_client import CollectorRegistry

from adamps import peer_auth, protocol
from adamps.controller_client import AsyncControllerClient
from adamps.core.lease import LeaseTerms
from adamps.core.repl_core import ReplCore
from adamps.core.repl_ready import ControllerRequest
from adamps.core.repl_settings import ReplSettings
from adamps.core.replication import Apply, BucketReplica, Reject
from adamps.protocol import ProtocolError
from adamps.rpc import RpcError
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
        #: every replication decision and all per-bucket state (no IO, no clock)
        self.core = ReplCore(
            ReplSettings(
                cfg.server_id,
                member_timeout=cfg.member_timeout,
                failover_after=cfg.failover_after,
                ack=cfg.ack,
                log_limit=cfg.replication_log,
            )
        )
        #: bucket -> the task fetching and installing its snapshot (joining side)
        self._join_tasks: dict[int, asyncio.Task] = {}
        #: who this server is to its peers, and who sent what it is asked to replicate
        self.peer_keys = PeerKeys(
            cfg.server_id, cfg.own_key(), lambda: self.controller, lambda s: s in self.addresses
        )
        self.peers = Peers(cfg.token, cfg.member_timeout, self.peer_keys)
        #: server id -> "host:port" (from the controllers' roles; the peers' address book)
        self.addresses = self.peers.addresses
        self.heartbeat_interval = 1.0
        #: bucket -> the task running its rounds (primary side)
        self.round_tasks: dict[int, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None
        #: the controllers' client (opened at start)
        self.controller: Any = None
        self._heartbeat_now = asyncio.Event()
        self.registered = asyncio.Event()
        #: set at stop: every loop ends
        self.closing = False
        #: why this server cannot persist now (set by the server: its flusher), or None;
        #: reported in every heartbeat so the controllers move its buckets (issue 29)
        self.not_durable: Callable[[], str | None] = lambda: None
        #: called with where ("transfer") for every received record that fails its checksum
        self.on_corrupt: Callable[[str], None] = lambda where: None
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
            for b in self.core.primaries()
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

    # -- the core's views (what the app and the flusher read) -----------------------------------

    @property
    def buckets(self) -> dict[int, BucketReplica]:
        return self.core.buckets

    @property
    def roles(self) -> dict[int, str]:
        return self.core.roles

    @property
    def persisted(self) -> dict[int, int]:
        return self.core.persisted

    def copies(self) -> dict[int, list[int]]:
        return self.core.copies()

    def held_copies(self) -> set[int]:
        return self.core.held_copies()

    def restore(self, positions: dict[int, Position]) -> None:
        """Copies reloaded from LMDB at start: held as standby until the controllers decide."""
        for b, pos in positions.items():
            self.core.restore(b, pos.seq, pos.epoch, pos.dedup, map(batch_from_wire, pos.prepared))
        log.info("reloaded %d copies: %s", len(positions), self.copies())

    def positions(self, buckets: Container[int] | None = None) -> dict[int, Position]:
        """Per held copy (of `buckets`; None: all), its position and the exactly-once pairs
        recorded since the last cut. Called on the event loop in the same step as the flush's
        copies are queued: they describe exactly the values the flush writes."""
        return self.core.positions(
            buckets,
            DEDUP_PER_FLUSH,
            lambda e, s, d, f, p: Position(e, s, d, f, [batch_to_wire(x) for x in p]),
        )

    # -- carrying out the core's Ready ------------------------------------------------------------

    def drain(self) -> None:
        """Carries out what the core decided, in the order repl_ready.py gives; called after
        every input, in the same loop step (applies are queued before anything else runs)."""
        core = self.core
        if not core.has_ready():
            return
        rd = core.ready()
        core.advance()
        for b in rd.forget:
            self.store.release_bucket(b)
            if b in self._lag_buckets:
                self._lag_buckets.discard(b)
                self.m.lag.remove(str(b))
        for b in rd.hold:
            self.store.hold_bucket(b)
        for _b, action in rd.applies:
            self.apply_batches(action)
        for ans in rd.answers:
            fut = ans.waiter
            if not isinstance(fut, asyncio.Future) or fut.done():
                continue
            if ans.outcome == "ok":
                fut.set_result(None)
            else:  # queued in a round that may still commit elsewhere: unknown, not "failed"
                rep = core.buckets.get(ans.bucket)
                fut.set_exception(
                    not_primary(rep, ans.bucket, self.addresses, ans.why, code="primary_changed")
                )
        for b in rd.stop_joins:
            task = self._join_tasks.pop(b, None)
            if task is not None and not task.done():
                task.cancel()
        for b in rd.start_joins:
            if b not in self._join_tasks or self._join_tasks[b].done():
                self._join_tasks[b] = asyncio.create_task(self.join(b), name=f"join-{b}")
        for req in rd.requests:
            asyncio.create_task(self._request(req), name=f"{req.kind}-{req.bucket}")
        for b in rd.kicks:
            self.kick(b)
        if rd.failovers:
            self.m.failovers.inc(rd.failovers)
        if rd.stale:
            self.m.stale.inc(rd.stale)
        if rd.heartbeat:
            self.request_heartbeat()

    async def _request(self, req: ControllerRequest) -> None:
        """One call to the controllers that the core asked for; its answer goes back in."""
        b, ctl = req.bucket, self.controller
        if req.kind == "role_change":
            log.warning("bucket %d: primary silent; proposing a role change", b)
            retry = None
            try:
                await ctl.role_change(
                    b, self.server_id, req.epoch, {self.server_id: list(req.position)}
                )
            except RpcError as exc:
                retry = exc.extra.get("retry_after")
                log.info("bucket %d: role change not accepted: %s", b, exc.message)
            except (ConnectionError, TimeoutError) as exc:
                log.info("bucket %d: role change failed: %s", b, exc)
            self.core.on_role_change_answer(b, retry, time.monotonic())
        elif req.kind == "drop_secondary":
            log.warning("bucket %d: secondary %s unresponsive; asking the controller to drop it",
                        b, req.member)  # fmt: skip
            self.m.dropped.inc()
            try:
                await ctl.drop_secondary(b, self.server_id, req.epoch, req.member)
            except (RpcError, ConnectionError, TimeoutError) as exc:
                log.warning(
                    "bucket %d: drop-secondary %s refused or failed: %s", b, req.member, exc
                )
            self.request_heartbeat()  # learn the new replica set (a committed entry)
        elif req.kind == "caught_up":
            while not self.closing:
                error: str | None = None
                try:
                    await ctl.caught_up(b, self.server_id, req.epoch, req.member, req.join)
                    log.info("bucket %d: %s caught up (epoch %d)", b, req.member, req.epoch)
                except RpcError as exc:
                    log.info("bucket %d: caught-up of %s: %s", b, req.member, exc)
                    error = exc.code
                except (ConnectionError, TimeoutError, OSError):
                    error = "connection"
                again = self.core.on_caught_up_answer(req, error)
                self.drain()
                if not again:
                    return
                await asyncio.sleep(0.2)
            return
        self.drain()

    async def _register(self) -> None:
        copies = await self.offers()
        reply = await self.controller.register(self.server_id, self.address, copies)
        if int(reply.get("n_buckets", self.cfg.n_buckets)) != self.cfg.n_buckets:
            raise RuntimeError(
                f"the controllers use n_buckets={reply['n_buckets']}, this server {self.cfg.n_buckets}"
            )
        terms = reply.get("lease") or {}
        self.heartbeat_interval = float(reply.get("heartbeat_interval", 1.0))
        self.core.registered(LeaseTerms(**{k: float(v) for k, v in terms.items()}))
        self.drain()
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
        try:
            reply, asked_at = await self.controller.heartbeat(
                self.server_id, self.core.table_version, self.core.heartbeat_reports(),
                self.not_durable(),
            )  # fmt: skip
        except RpcError as exc:
            if exc.code == "conflict" or exc.code == "not_found":
                log.warning("controller says %s: registering again", exc.message)
                return False
            raise
        for r in reply.get("roles", []):  # the peers' address book
            if r.get("address") and r.get("primary"):
                self.addresses[r["primary"]] = r["address"]
            for sid, addr in (r.get("secondary_addresses") or {}).items():
                if addr:
                    self.addresses[sid] = addr
        self.core.on_roles(reply, asked_at, time.monotonic())
        self.drain()
        self.update_gauges()
        return True

    def update_gauges(self) -> None:
        prim = self.core.primaries()
        self.m.primary_buckets.set(len(prim))
        self.m.under_replicated.set(
            sum(1 for b in prim if len(self.buckets[b].assignment.secondaries) < 2)
        )
        self.m.lease_epoch.set(max((self.buckets[b].assignment.epoch for b in prim), default=0))
        for b in prim:
            self.m.lag.labels(str(b)).set(self.core.lag(b))
            self._lag_buckets.add(b)

    # -- primary: pushes and rounds -----------------------------------------------------------------

    def refusal(self, b: int, rej: Reject) -> ProtocolError:
        """A refusal of the core as the protocol error a client or peer gets."""
        rep = self.buckets.get(b)
        if rej.code == "not_primary":
            return not_primary(rep, b, self.addresses, rej.message)
        epoch = rej.epoch or (rep.assignment.epoch if rep is not None else 0)
        return ProtocolError(rej.code, rej.message, bucket=b, epoch=epoch)

    def check_primary(self, b: int) -> BucketReplica:
        """The bucket's state if this server may serve it as primary now, else not_primary."""
        rep = self.core.check_primary(b, time.monotonic())
        self.drain()
        if isinstance(rep, Reject):
            if rep.code == "bucket_unavailable":
                raise ProtocolError(rep.code, rep.message, bucket=b)
            raise self.refusal(b, rep)
        return rep

    async def push(
        self, by_bucket: dict[int, list[dict[str, Any]]], client: tuple[str, int] | None
    ) -> None:
        """Replicates one client push (its updates grouped by bucket); returns once every
        bucket's round is decided (``ack = "prepared"``) or committed by every member."""
        loop = asyncio.get_running_loop()
        futs = {b: loop.create_future() for b in by_bucket}
        res = self.core.submit(
            {b: tuple(u) for b, u in by_bucket.items()}, client, futs, time.monotonic()
        )
        self.drain()
        if isinstance(res, tuple):
            b, rej = res
            if rej.code == "bucket_unavailable":
                raise ProtocolError(rej.code, rej.message, bucket=b)
            raise self.refusal(b, rej)
        if res:
            self.m.dedup.inc(res)
        try:
            await asyncio.wait_for(asyncio.gather(*futs.values()), self.cfg.push_timeout)
        except TimeoutError:
            raise ProtocolError(
                "timeout",
                f"replication did not complete within {self.cfg.push_timeout}s; outcome unknown",
            ) from None

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

    def status(self) -> dict[str, Any]:
        out = self.core.status(time.monotonic())
        return {
            "server_id": self.server_id,
            "address": self.address,
            "table_version": self.core.table_version,
            "unavailable": sorted(self.core.unavailable),
            "buckets": out,
        }


def _log_apply_error(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("applying a committed batch failed: %r", fut.exception())
