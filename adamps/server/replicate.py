"""Replication of a parameter server's buckets: the asyncio shell around the replication core.

Project Adam 3.3.3, end to end. Every decision and all per-bucket state are the core's
(``adamps.core.repl_core.ReplCore``: roles, leases, rounds of two-phase commit, the watchdog,
pings, state-transfer decisions), and when to register and heartbeat is the controller link's
(``adamps.core.controller_link``); this shell only carries them out, as etcd-io/raft's users do:

- events go in through one entry, ``step`` (the core's input, the clock read, the Ready
  carried out, a refusal raised): the peers' messages (``repl_ops.PeerOps`` dispatches them),
  the answers to the core's messages and to its calls to the controllers, client pushes,
  the joining copy's snapshot, heartbeats' roles, and the clock (``tick`` every ``TICK`` s);
- ``drain`` carries out the core's ``Ready``: batches queued to the owner threads, pushes
  answered, messages and pings sent through the transport (``repl_peers.Peers.send``,
  ``ping``), calls to the controllers (``repl_control``), snapshots fetched, installed and
  persisted (the store's side is ``bucket_copy``, the disk's ``repl_persist``) or transfers
  stopped.

Updates travel in their compact form (dense delta of one shard, or activation and error vectors),
never as an expanded M x N delta, and every replica applies each batch as one group per shard on
the shard's owner thread, so replicas end bit-identical (``digest`` checks it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from prometheus_client import CollectorRegistry

from adamps.client.rpc import RpcError
from adamps.core import repl_copies
from adamps.core.repl_core import ReplCore
from adamps.core.repl_ready import Fetch
from adamps.core.replication import BucketReplica, Reject
from adamps.protocol import ProtocolError
from adamps.server import bucket_copy, repl_persist
from adamps.server.config import PsConfig
from adamps.server.peer_keys import PeerKeys
from adamps.server.repl_control import ControllerCalls
from adamps.server.repl_metrics import ReplMetrics
from adamps.server.repl_ops import PeerOps
from adamps.server.repl_peers import Peers
from adamps.server.repl_wire import refusal, settle
from adamps.server.store import Store

if TYPE_CHECKING:
    from adamps.server.catalog import TensorCatalog

log = logging.getLogger(__name__)

#: seconds between two ticks of the core (retries of failed messages, delayed COMMITs, timers)
TICK = 0.02


class Replicator:
    """The replication shell of one parameter server. Lives on the PS's event loop."""

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
        #: every replication decision and all per-bucket state (no IO, no clock)
        self.core = ReplCore(cfg.repl_settings)
        #: who this server is to its peers, and who sent what it is asked to replicate
        self.peer_keys = PeerKeys(
            cfg.server_id, cfg.own_key(), lambda: self.controller, lambda s: s in self.addresses
        )
        self.peers = Peers(cfg.token, cfg.member_timeout, self.peer_keys)
        #: server id -> "host:port" (from the controllers' roles; the peers' address book)
        self.addresses = self.peers.addresses
        #: the ops peers call (POST /rpc, the data plane's repl_multi frames)
        self.ops = PeerOps(self)
        #: bucket -> the task fetching and installing its snapshot (joining side)
        self._join_tasks: dict[int, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None
        #: the controllers' client (opened at start) and the calls the core asks of them
        self.controller: Any = None
        self.calls = ControllerCalls(self)
        #: the calls to the controllers in flight (cancelled at stop)
        self._calls: set[asyncio.Task] = set()
        #: set at stop: every loop ends
        self.closing = False
        #: what replication asks of this server's disk (set by the server: its flusher)
        self.disk = repl_persist.Disk()
        #: sees every heartbeat reply (the runs' table version, adamps/server/tenancy.py)
        self.on_heartbeat: Callable[[dict[str, Any]], None] = lambda reply: None

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.peers.session = self._session
        self.controller = self.calls.open(self._session)
        self._tasks = [asyncio.create_task(self._clock(), name="ps-clock")]

    async def stop(self) -> None:
        self.closing = True
        tasks = [*self._tasks, *self._join_tasks.values(), *self._calls]
        for t in tasks:
            t.cancel()
        self.peers.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Give the primary leases back, so the next primaries need not wait for them to expire:
        # all at once and within one second in total (best effort: unreleased leases run out).
        releases = [
            self.controller.release(b, self.server_id, self.core.buckets[b].assignment.epoch)
            for b in repl_copies.primaries(self.core)
        ]
        if releases:
            try:
                await asyncio.wait_for(asyncio.gather(*releases, return_exceptions=True), 1.0)
            except TimeoutError:
                pass
        if self._session is not None:
            await self._session.close()

    # -- carrying out the core's Ready --------------------------------------------------------------

    def drain(self) -> None:
        """Carries out what the core decided, in the order of repl_ready.py; called after every
        input in the same loop step (batches are queued before anything else runs)."""
        core = self.core
        if not core.has_ready():
            return
        rd = core.ready()
        core.advance()
        self.m.count(rd)
        for b in rd.forget:
            self.store.release_bucket(b)
        for b in rd.hold:
            self.store.hold_bucket(b)
        for _b, action in rd.applies:
            bucket_copy.apply_batches(self.store, action.batches)
        for ans in rd.answers:
            settle(ans, core.buckets.get(ans.bucket), self.addresses)
        for msg in rd.messages:  # its one answer (a reply or an error) goes back in
            self.peers.send(msg, functools.partial(self.step, -1, core.answer, msg.rid))
        for b in rd.stop_joins:
            task = self._join_tasks.pop(b, None)
            if task is not None and not task.done():
                task.cancel()
        for f in rd.fetches:
            self._join_tasks[f.bucket] = asyncio.create_task(
                self._transfer(f), name=f"join-{f.bucket}"
            )
        for req in () if self.closing else rd.requests:
            task = asyncio.create_task(self.calls.request(req), name=f"{req.kind}-{req.bucket}")
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)
        if rd.heartbeat:
            self.step(-1, core.want_record)
        if rd.pings is not None:
            for member, buckets in rd.pings.items():
                self.peers.ping(member, buckets, self._on_stale)
            self.m.observe(core)

    def step(self, b: int, event: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """The one way an event enters the core: `event` (one of ReplCore's inputs) gets the
        clock's reading after `args`; the Ready it leaves is carried out in the same loop step
        (its batches reach the owner threads before anything else runs, before a peer's reply
        goes out), and a refusal is raised as the protocol's error about bucket `b`."""
        res = event(*args, time.monotonic(), **kw)
        self.drain()
        if isinstance(res, Reject):
            raise refusal(res, self.core.buckets.get(b), b, self.addresses)
        return res

    def check_primary(self, b: int, read: bool = False) -> BucketReplica:
        """The bucket's state if this server may serve it as primary now (a `read`: with every
        acknowledged push applied), else not_primary."""
        return self.step(b, self.core.check_primary, b, read=read)

    async def _clock(self) -> None:
        """The core's clock: a tick every TICK seconds (its timers and the controller link's)."""
        while not self.closing:
            await asyncio.sleep(TICK)
            repl_persist.tell_blocked(self.core, self.disk.can_persist)
            self.step(-1, self.core.tick)

    def _on_stale(self, stale: list[Any]) -> None:
        self.core.on_ping_reply(stale)
        self.drain()

    # -- pushes -------------------------------------------------------------------------------------

    async def push(
        self, by_bucket: dict[int, list[dict[str, Any]]], client: tuple[str, int] | None
    ) -> None:
        """Replicates one client push (its updates grouped by bucket); returns once every
        bucket's round is decided (``ack = "prepared"``) or committed by every member."""
        loop = asyncio.get_running_loop()
        futs = {b: loop.create_future() for b in by_bucket}
        updates = {b: tuple(u) for b, u in by_bucket.items()}
        res = self.core.submit(updates, client, futs, time.monotonic())
        self.drain()
        if isinstance(res, tuple):
            raise refusal(res[1], self.core.buckets.get(res[0]), res[0], self.addresses)
        if res:
            self.m.dedup.inc(res)
        try:
            await asyncio.wait_for(asyncio.gather(*futs.values()), self.cfg.push_timeout)
        except TimeoutError:
            raise ProtocolError(
                "timeout",
                f"replication did not complete within {self.cfg.push_timeout}s; outcome unknown",
            ) from None

    # -- state transfer -----------------------------------------------------------------------------------

    async def _transfer(self, f: Fetch) -> None:
        """Fetches, installs and persists the snapshot the core asked for (repl_join.py)."""
        b, core = f.bucket, self.core
        snap = None
        try:
            snap = await self.peers.call(
                f.primary, "repl_snapshot", bucket=b, joiner=self.server_id, join=f.join
            )
        except (RpcError, ConnectionError, TimeoutError, OSError) as exc:
            log.info("bucket %d: snapshot from %s failed: %s; retrying", b, f.primary, exc)
        fits = self.step(b, core.snapshot_fetched, f, None if snap is None else int(snap["epoch"]))
        if not fits or snap is None:
            return
        try:
            futs = bucket_copy.install(self.store, self.catalog, b, snap, self.disk.on_corrupt)
        except ValueError as exc:  # damaged on the way: nothing installed; fetch it again
            log.error("bucket %d: CORRUPT snapshot from %s: %s; again", b, f.primary, exc)
            self.step(b, core.snapshot_corrupt, f)
            return
        # The position moves in the same loop step as the values are queued: a flush cut
        # sees both or neither.
        committed, cepoch = int(snap["committed"]), int(snap.get("committed_epoch", 0))
        self.step(b, core.installed, b, committed, snap["dedup"], cepoch)
        # Not learning until the copy and its position are on disk (the core's `installed`):
        # the flush holds it meanwhile, and the disk's persist_now writes it.
        persisted = False
        try:
            persisted = await repl_persist.persist_installed(
                futs, self.disk.persist_now, b, committed, f.primary
            )
        finally:  # False also when cancelled (the bucket moved on): the flush holds it no more
            self.step(b, core.install_persisted, b, persisted)
        if persisted:
            self.m.snapshots.labels("received").inc()
            log.info("bucket %d: snapshot at seq %d from %s installed", b, committed, f.primary)
