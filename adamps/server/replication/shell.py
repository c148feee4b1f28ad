"""Replication of a parameter server's buckets: the asyncio shell around the replication core.

Project Adam 3.3.3, end to end. Every decision and all per-bucket state are the core's
(``adamps.core.replication.node.ReplCore``: roles, leases, rounds of two-phase commit, the watchdog,
pings, state transfers, when to call the controllers); this shell only carries them out, as
etcd-io/raft's users do. Every event goes in through one entry, ``step``, and the ``Ready`` is
carried out by ``carry.Carrier``, the shell without its IO, which the randomized simulation runs
too; this class is its ports on a server: batches to the owner threads, pushes answered,
messages and pings through ``peers.Peers``, calls to the controllers (``control``), snapshots
fetched, installed (``bucket_copy``) and persisted (``disk``), the clock (``clock``). Events:
peers' messages (``ops``), answers to the core's messages and calls, client pushes, a joining
copy's snapshot, the clock's ticks. Updates travel compact (a shard's dense delta, act/err
vectors), and every replica applies each batch as one group per shard on its owner thread:
bit-identical copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from prometheus_client import CollectorRegistry

from adamps.core.replication.bucket import BucketReplica, Reject
from adamps.core.replication.node import ReplCore
from adamps.core.replication.ready import Answer, ControllerRequest, Fetch
from adamps.server.config import PsConfig
from adamps.server.replication import bucket_copy, disk
from adamps.server.replication.carry import Carrier
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
        #: every replication decision and all per-bucket state (no IO, no clock)
        self.core = ReplCore(cfg.repl_settings)
        self.m = ReplMetrics(registry, self.core)
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
        #: what replication asks of this server's disk (set by the server: its flusher)
        self.disk = disk.Disk()
        #: ticks the core at its deadlines (its timers and the controller link's)
        self.clock = CoreClock(self.core, lambda: self.carrier.tick())
        #: carries every event into the core and its Ready out, through this shell's ports
        self.carrier = Carrier(self.core, self, DEBUG_CORE)
        self.peers.batch = self.carrier.batch
        self.poke, self.send, self.ping = self.clock.poke, self.peers.send, self.peers.ping
        self.counted = self.m.count
        #: sees every heartbeat reply (the runs' table version, adamps/server/api/tenancy.py)
        self.on_heartbeat: Callable[[dict[str, Any]], None] = lambda reply: None

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.peers.session = self._session
        self.calls.open(self._session)
        self.clock.start()

    async def stop(self) -> None:
        self.carrier.closing = True
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

    # -- the ports of the sans-IO shell (carry.py): what its Ready is carried out with ----------

    def step(
        self, b: int, event: Callable[..., Any], *args: Any, ahead: float = 0.0, **kw: Any
    ) -> Any:
        """The one way an event enters the core (Carrier.step); a refusal is raised."""
        return self.carrier.step(b, event, *args, ahead=ahead, **kw)

    def refuse(self, b: int, rej: Reject) -> None:
        raise refusal(rej, self.core.buckets.get(b), b, self.addresses)

    def now(self) -> float:
        return time.monotonic()

    def release_copy(self, b: int) -> None:
        self.store.release_bucket(b)

    def hold_copy(self, b: int) -> None:
        self.store.hold_bucket(b)

    def apply_batches(self, _b: int, batches: Any) -> None:
        bucket_copy.apply_batches(self.store, batches)

    def settle(self, ans: Answer) -> None:
        settle(ans, self.core.buckets.get(ans.bucket), self.addresses)

    def stop_join(self, b: int) -> None:  # (cancelling a finished task does nothing)
        if (task := self._join_tasks.pop(b, None)) is not None:
            task.cancel()

    def start_join(self, f: Fetch) -> None:
        self._join_tasks[f.bucket] = self._spawn(self._transfer(f), f"join-{f.bucket}")

    def call(self, req: ControllerRequest) -> None:
        self._spawn(self.calls.request(req), f"{req.kind}-{req.bucket}")

    def can_persist(self) -> str | None:
        return self.disk.can_persist()

    def check_primary(self, b: int, read: bool = False) -> BucketReplica:
        """The bucket's state if this server may serve it as primary now (a `read`: with every
        acknowledged push applied), else not_primary."""
        return self.step(b, self.core.check_primary, b, read=read)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

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
        b, c = f.bucket, self.carrier
        snap = await bucket_copy.verified(await self.peers.snapshot(f), self.store, self.catalog)
        if not c.fetched(f, snap) or snap is None:
            return
        futs: list[Any] = []
        put = lambda: futs.extend(  # noqa: E731
            bucket_copy.install(self.store, self.catalog, b, snap, self.disk.on_corrupt)
        )
        if not c.install(f, snap, put):
            return
        # Not learning until the copy and its position are on disk (the core's `installed`):
        # the flush holds it meanwhile, and the disk's persist_now writes it.
        committed, persisted = int(snap["committed"]), False
        try:
            persisted = await disk.persist_installed(
                futs, self.disk.persist_now, b, committed, f.primary
            )
        finally:  # False also when cancelled (the bucket moved on): the flush holds it no more
            c.install_persisted(b, persisted)
        if persisted:
            self.m.snapshots.labels("received").inc()
            log.info("bucket %d: snapshot at seq %d from %s installed", b, committed, f.primary)
