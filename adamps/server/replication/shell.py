"""Replication of a parameter server's buckets: the asyncio shell around the replication core.

Project Adam 3.3.3, end to end. Every decision and all per-bucket state are the core's
(``adamps.core.replication.node.ReplCore``: roles, leases, rounds of two-phase commit, the watchdog,
pings, state transfers, when to call the controllers); this shell only carries them out, as
etcd-io/raft's users do. Every event goes in through one entry, ``step`` (the core's input with
the clock's reading, its ``Ready`` carried out in the same loop step, a refusal raised): peers'
messages (``ops``), answers to the core's messages and calls, client pushes, a joining copy's
snapshot, the clock (``clock``). ``drain`` carries out the ``Ready``: batches to the owner
threads, pushes answered, messages and pings through ``peers.Peers``, calls to the controllers
(``control``), snapshots fetched, installed (``bucket_copy``) and persisted (``disk``). Updates
travel compact (a shard's dense delta, act/err vectors), and every replica applies each batch as
one group per shard on its owner thread: bit-identical copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from prometheus_client import CollectorRegistry

from adamps.core.replication.bucket import BucketReplica, Reject
from adamps.core.replication.node import ReplCore
from adamps.core.replication.ready import Fetch
from adamps.server.config import PsConfig
from adamps.server.replication import bucket_copy, disk
from adamps.server.replication.clock import CoreClock
from adamps.server.replication.control import ControllerCalls
from adamps.server.replication.metrics import ReplMetrics
from adamps.server.replication.ops import PeerOps
from adamps.server.replication.peer_keys import PeerKeys
from adamps.server.replication.peers import Peers
from adamps.server.replication.wire import refusal, settle
from adamps.server.store.store import Store
from adamps.wire.protocol import ProtocolError

if TYPE_CHECKING:
    from adamps.server.storage.catalog import TensorCatalog

log = logging.getLogger(__name__)
DEBUG_CORE = os.environ.get("ADAMPS_DEBUG_CORE") == "1"  # tests: invariants after each input


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
            cfg.server_id, cfg.own_key(), lambda: self.calls.ctl, lambda s: s in self.addresses
        )
        self.peers = Peers(cfg.token, cfg.member_timeout, self.peer_keys)
        #: server id -> "host:port" (from the controllers' roles; the peers' address book)
        self.addresses = self.peers.addresses
        #: the ops peers call (POST /rpc, the data plane's repl_multi frames)
        self.ops = PeerOps(self)
        #: every task of this shell (cancelled at stop): the clock, the calls to the controllers
        #: and, by bucket, the state transfers (fetch, install, persist) of joining copies
        self._tasks: set[asyncio.Task] = set()
        self._join_tasks: dict[int, asyncio.Task] = {}
        self._session: aiohttp.ClientSession | None = None
        #: the calls the core asks of the controllers (their client is opened at start)
        self.calls = ControllerCalls(self)
        #: set at stop: every loop ends
        self.closing = False
        #: what replication asks of this server's disk (set by the server: its flusher)
        self.disk = disk.Disk()
        #: ticks the core at its deadlines (its timers and the controller link's)
        self.clock = CoreClock(self.core, self._tick)
        #: sees every heartbeat reply (the runs' table version, adamps/server/api/tenancy.py)
        self.on_heartbeat: Callable[[dict[str, Any]], None] = lambda reply: None

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.peers.session = self._session
        self.calls.open(self._session)
        self.clock.start()

    async def stop(self) -> None:
        self.closing = True
        self.clock.stop()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        self.peers.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        # The primary leases given back, so the next primaries need not wait for them to expire:
        # all at once and within one second in total (best effort: unreleased leases run out).
        releases = [self.calls.request(req) for req in self.core.stopping()]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*releases), 1.0)
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
        for b in rd.stop_joins:  # (cancelling a finished task does nothing)
            if (task := self._join_tasks.pop(b, None)) is not None:
                task.cancel()
        for f in rd.fetches:
            self._join_tasks[f.bucket] = self._spawn(self._transfer(f), f"join-{f.bucket}")
        for req in () if self.closing else rd.requests:
            self._spawn(self.calls.request(req), f"{req.kind}-{req.bucket}")
        if rd.heartbeat:
            self.step(-1, core.want_record)
        if rd.pings is not None:
            stale = functools.partial(self.step, -1, core.on_ping_reply, ahead=float("inf"))
            for member, buckets in rd.pings.items():
                self.peers.ping(member, buckets, stale)
            self.m.observe(core)

    def step(
        self, b: int, event: Callable[..., Any], *args: Any, ahead: float = 0.0, **kw: Any
    ) -> Any:
        """The one way an event enters the core: `event` (one of ReplCore's inputs) gets the
        clock's reading after `args`; the Ready it leaves is carried out in the same loop step
        (its batches reach the owner threads before anything else runs, before a peer's reply
        goes out), and a refusal is raised as the protocol's error about bucket `b` (or the one
        it names). `ahead`: it brings no deadline sooner (a ping: failover_after; an answer: none)."""
        now = time.monotonic()
        res = event(*args, now, **kw)
        self.drain()
        if DEBUG_CORE:
            self.core.validate()  # raised where the input came from (logged there)
        self.clock.poke(now + ahead)
        if isinstance(res, Reject):
            b = b if res.bucket is None else res.bucket
            raise refusal(res, self.core.buckets.get(b), b, self.addresses)
        return res

    def check_primary(self, b: int, read: bool = False) -> BucketReplica:
        """The bucket's state if this server may serve it as primary now (a `read`: with every
        acknowledged push applied), else not_primary."""
        return self.step(b, self.core.check_primary, b, read=read)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _tick(self) -> None:
        disk.tell_blocked(self.core, self.disk.can_persist)
        self.step(-1, self.core.tick)

    # -- pushes -------------------------------------------------------------------------------------

    async def push(
        self, by_bucket: dict[int, list[dict[str, Any]]], client: tuple[str, int] | None
    ) -> None:
        """Replicates one client push (its updates grouped by bucket); returns once every
        bucket's round is decided (``ack = "prepared"``) or committed by every member."""
        futs = {b: asyncio.get_running_loop().create_future() for b in by_bucket}
        updates = {b: tuple(u) for b, u in by_bucket.items()}
        self.step(-1, self.core.submit, updates, client, futs)
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
        snap = await bucket_copy.verified(await self.peers.snapshot(f), self.store, self.catalog)
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
            persisted = await disk.persist_installed(
                futs, self.disk.persist_now, b, committed, f.primary
            )
        finally:  # False also when cancelled (the bucket moved on): the flush holds it no more
            self.step(b, core.install_persisted, b, persisted)
        if persisted:
            self.m.snapshots.labels("received").inc()
            log.info("bucket %d: snapshot at seq %d from %s installed", b, committed, f.primary)
