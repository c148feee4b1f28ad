"""The parameter server's HTTP shell: ``POST /rpc`` (msgpack), ``POST /flush``, and the shared
``/healthz``, ``/status``, ``/metrics`` of :func:`adamps.wire.web.make_app`.

``ParameterServer`` puts the parts together and routes each op: pushes to the write path
(``writepath.py``), pulls to the read path (``reads.py``), definitions to the tensor catalog
(``adamps/server/storage/catalog.py``), replication messages to the replicator (``adamps/server/replication/shell.py``). Every request is
fully validated, on the event loop, before anything is queued to an owner thread: a bad request
changes nothing. A push returns when its update has been applied (not when it is on disk: that is
the flusher's business, Adam 3.3.2). docs/protocol-ps.md specifies every op.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable, Container
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry

from adamps import metrics
from adamps.config import ConfigError, to_dict
from adamps.layout import LayoutError
from adamps.security import peer_auth
from adamps.server.addressing import Addressing
from adamps.server.api.checkpoint_ops import CheckpointOps
from adamps.server.api.clockops import ClockOps
from adamps.server.api.dataplane import DataPlane
from adamps.server.api.opfields import RPC_FIELDS, check_fields
from adamps.server.api.roundop import RoundOp
from adamps.server.api.tableops import TableOps
from adamps.server.api.tenancy import Tenancy
from adamps.server.api.vecops import VectorOps
from adamps.server.config import PsConfig
from adamps.server.psmetrics import PsMetrics
from adamps.server.reads import Reads
from adamps.server.replication import disk as repl_persist
from adamps.server.replication import metrics as repl_metrics
from adamps.server.replication.peer_keys import PEER_OPS
from adamps.server.replication.shell import Replicator
from adamps.server.storage.catalog import TensorCatalog
from adamps.server.storage.flusher import Flusher
from adamps.server.storage.persist import Persister, Position
from adamps.server.storage.scrub import Scrubber
from adamps.server.store.shards import Snapshot, StoreError
from adamps.server.store.store import Store
from adamps.server.store.tables.rowdelta import sid_of_key
from adamps.server.updates.optim import OptimError
from adamps.server.writepath import WritePath
from adamps.wire import protocol, ride
from adamps.wire import web as aweb
from adamps.wire.protocol import ProtocolError

log = logging.getLogger(__name__)

PS_KEY = web.AppKey("ps", object)

Handler = Callable[[dict[str, Any]], Any]


class ParameterServer:
    """Store + persistence + metrics of one PS process; `make_app()` gives its HTTP app."""

    def __init__(self, cfg: PsConfig, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.registry = registry if registry is not None else metrics.new_registry()
        self.m = PsMetrics(self.registry)
        self.started = time.time()
        self.persister = Persister(
            cfg.data_dir,
            cfg.map_size,
            cfg.lmdb_sync,
            on_corrupt=lambda where: self.m.corrupt.labels(where).inc(),
        )
        #: what failed its checksum at start: those copies are not offered (issue 29)
        self.corruption = self.persister.verify(cfg.n_buckets)
        if self.corruption.everything or self.corruption.buckets:
            self._refuse_or_drop_corrupt()
        #: copies this server had when it stopped (replicated servers): it offers them again,
        #: except those that failed verification (they rejoin by state transfer)
        positions = self.persister.load_positions(skip=self.corruption) if cfg.controllers else {}
        self.store = Store(
            n_buckets=cfg.n_buckets,
            # Under controllers a server holds only the copies it had (reloaded below) and then
            # the buckets it is assigned; standalone, its static map or all.
            buckets=frozenset(positions) if cfg.controllers else (cfg.buckets or None),
            owner_threads=cfg.owner_threads,
            max_shard_elems=cfg.max_shard_elems,
            on_applied=lambda kind, n: self.m.applied.labels(kind).inc(n),
            registry=self.registry,
        )
        self.flusher = Flusher(
            self.store,
            self.persister,
            cfg.flush_interval,
            on_flush=self._on_flush,
            max_unflushed=cfg.max_unflushed or 5 * cfg.flush_interval,
            chunk_bytes=cfg.flush_chunk_bytes,
        )
        self.catalog = TensorCatalog(cfg, self.store, self.persister)
        try:
            self.catalog.load()
        except BaseException:
            self.store.close()
            self.persister.close()
            raise
        self.m.dirty.set_function(lambda: self.store.dirty_count())
        self.m.loss_window.set_function(lambda: self.flusher.loss_window())
        self.m.durable.set_function(lambda: 0 if self.flusher.not_durable() else 1)
        self.m.flush_starved.set_function(lambda: 1 if self.flusher.starved_now() else 0)
        self.m.flush_age.set_function(lambda: self.flusher.last_flush_age() or 0.0)
        self.m.flush_failures.set_function(lambda: self.flusher.failures)
        self.m.queue_depth.set_function(lambda: sum(self.store.queue_depths()))
        self.m.shards.set_function(lambda: len(self.store.shards))
        self.m.tensors.set_function(lambda: len(self.store.tensors))
        #: replication (Project Adam 3.3.3) when the server runs under controllers, else None: a
        #: standalone server on its static bucket map
        self.replicator: Replicator | None = None
        if cfg.controllers:
            self.replicator = Replicator(cfg, self.store, self.catalog, self.registry)
            repl_persist.restore(self.replicator.core, positions)
            self.replicator.disk = repl_persist.Disk(
                not_durable=self.flusher.not_durable,
                can_persist=self.flusher.can_persist,
                persist_now=self.flusher.flush_buckets,
                on_corrupt=lambda where: self.m.corrupt.labels(where).inc(),
            )
            self.flusher.cut = self._cut
        #: verifies LMDB records in the background (cfg.scrub_rate bytes/s, cfg.scrub_cpu)
        self.scrubber = Scrubber(
            self.persister,
            cfg.scrub_rate,
            on_failure=self._scrub_found,
            on_bytes=self.m.scrubbed_bytes.inc,
            cpu=cfg.scrub_cpu,
        )
        self.scrubber.start()
        #: the event loop serving this server and its thread (set at startup)
        self._loop: asyncio.AbstractEventLoop | None = None
        #: the flush's turns on the loop (a replicated server; `_flush_turns`)
        self._turns: asyncio.Task | None = None
        self._loop_thread: int | None = None
        # replicated: the loop's turn decides when a flush has something to write (_flush_turns)
        self.flusher.start(gated=self.replicator is not None)
        #: runs (issue 25): who a request is, its namespace and quotas, learnt from the controllers
        self.tenancy = Tenancy(cfg.token, self.store, self.persister, self.registry)
        if self.replicator is not None:
            rep = self.replicator  # its controller client exists once it started
            self.tenancy.fetch = lambda: rep.calls.ctl.runs_auth()
            self.tenancy.use = lambda run, name, cost: rep.calls.ctl.run_usage(run, name, cost)
            self.replicator.on_heartbeat = self.tenancy.on_heartbeat
            self.replicator.calls.on_fatal = self.stop_for
        #: why this server stopped itself (a fault no retry cures), else None
        self.fatal: str | None = None
        #: set to stop serving (`adamps ps` waits for it beside SIGTERM and SIGINT)
        self.stop_serving = asyncio.Event()
        self.addressing = Addressing(cfg, self.store, self.replicator)
        self.reads = Reads(self.store, self.addressing)
        #: the one way pushes change shards (HTTP and the data plane both use it)
        self.writes = WritePath(cfg, self.store, self.addressing, self.replicator)
        self.writes.not_durable = self.flusher.not_durable
        self.data_plane = DataPlane(
            cfg,
            self.writes,
            self.reads,
            self.m,
            peer=None if self.replicator is None else self.replicator.ops.op_repl_frame,
            tenancy=self.tenancy,
        )
        self.vectors = VectorOps(self.store, self.addressing, self.writes)
        #: embedding tables' rows (tableops.py), on /rpc and the data plane
        self.rows = TableOps(cfg, self.store, self.writes, self.replicator)
        #: a replica's whole round in one request per server (roundop.py)
        self.round = RoundOp(self.writes, self.rows)
        self.data_plane.messages.update(
            pull_rows=self.rows.op_pull_rows,
            push_rows=self.rows.op_push_rows,
            put_rows=self.rows.op_put_rows,
            round=self.round.op_round,
        )
        self.data_plane.staged.update(
            push_rows=(self.rows.prepare_push, self.rows.apply_push),
            round=(self.round.prepare, self.round.apply),
        )
        self._closed = False
        #: "METHOD /path" of every HTTP route (set by make_app)
        self._routes: set[str] = set()
        #: a checkpoint's read and restore of a bucket (checkpoint_ops.py)
        self.checkpoints = CheckpointOps(self.store, self.catalog, self.writes, self.replicator)
        # A restore's shards travel as raw payloads (the arrays out of band): no msgpack copy of
        # the values (issue 38 item 7); the operator's token only (tenancy: not a run op).
        self.data_plane.messages["ckpt_install"] = self.checkpoints.op_ckpt_install
        # A save's bucket comes back the same way: its arrays as the reply's raw payload
        self.data_plane.messages["ckpt_read"] = self.checkpoints.op_ckpt_read
        self.data_plane.oob_replies.add("ckpt_read")
        # checked (its bounds off the loop), then queued before the connection's next frame
        self.data_plane.staged["ckpt_install"] = (
            self.checkpoints.prepare_install,
            self.checkpoints.apply_install,
        )
        #: runs' step clocks and their consistency modes (issue 25, clockops.py)
        self.clocks = ClockOps(cfg.clock_lease, cfg.clock_wait, self.registry)
        #: op -> handler of POST /rpc
        self._ops: dict[str, Handler] = {
            "create": self.catalog.op_create,
            # a restore's definitions, one call per server (operator's token only: no run op)
            "create_tensors": self.catalog.op_create_tensors,
            "pull": self.reads.op_pull,
            "push_dense": self.writes.op_push_dense,
            "push_fc": self.writes.op_push_fc,
            "push_compressed": self.writes.op_push_compressed,
            "flush": self.op_flush,
            "list": self.catalog.op_list,
            "describe": self.catalog.op_describe,
            # Sandblaster's vector operations (vecops.py)
            "vec": self.vectors.op_vec,
            "vec_dot": self.vectors.op_vec_dot,
            # embedding tables (adamps/server/storage/tablecatalog.py, tableops.py)
            "create_table": self.catalog.tables.op_create_table,
            "list_tables": self.catalog.tables.op_list_tables,
            "pull_rows": self.rows.op_pull_rows,
            "push_rows": self.rows.op_push_rows,
            "put_rows": self.rows.op_put_rows,
            "round": self.round.op_round,
            "ckpt_read": self.checkpoints.op_ckpt_read,
            "ckpt_install": self.checkpoints.op_ckpt_install,
            "ckpt_hold": self.checkpoints.op_ckpt_hold,
            "ckpt_release": self.checkpoints.op_ckpt_release,
            "clock": self.clocks.op_clock,
        }
        if cfg.debug_ops:
            self._ops["debug_fail"] = self.op_debug_fail
        if self.replicator is not None:
            self._ops.update(self.replicator.ops.handlers)

    def _scrub_found(self, db: str, key: bytes, exc: Exception) -> None:
        """A record the scrub found damaged (scrub thread): counted and logged; the copy in
        memory, which replication keeps identical to the others, rewrites it at the next flush.
        A tensor definition cannot be rewritten from here: the next start then distrusts every
        copy of this server (they rejoin by state transfer)."""
        self.persister.report_corrupt("scrub", db, key, exc)
        if db in ("shards", "rowpages"):
            # a row page or a row shard's header: the row shard is rewritten whole
            sid = key.decode(errors="replace") if db == "shards" else sid_of_key(key)
            st = self.store.shards.get(sid) or self.store.tables.shards.get(sid)
            if st is not None:
                self.store.mark_dirty([st], lambda _r, _e: None)
            else:  # a leftover of a copy this server let go: nothing to rewrite it from
                self.persister.delete(db, key)
            return
        if db == "tensors":
            return
        self.persister.delete(db, key)
        b = self.persister.bucket_of_record(db, key, self.cfg.n_buckets)
        rep, loop = self.replicator, self._loop
        if rep is not None and b is not None and loop is not None:
            # The copy's next cut is written fresh: its position and whole exactly-once table.
            loop.call_soon_threadsafe(rep.core.rewrite_copy, b)

    def _refuse_or_drop_corrupt(self) -> None:
        """A standalone server has no other copy to recover from: it refuses to start. A
        replicated one starts without the corrupted copies (not offered, rejoined by state
        transfer from a good copy; the next flush deletes their records)."""
        c = self.corruption
        what = c.everything or "; ".join(f"bucket {b}: {w}" for b, w in sorted(c.buckets.items()))
        if not self.cfg.controllers:
            self.persister.close()
            raise ConfigError(
                f"{self.cfg.data_dir} holds records that fail their checksum ({what}); a "
                "standalone server has no other copy to recover them from: restore the data "
                "directory from a checkpoint or move it aside"
            )
        dropped = "every copy" if c.everything else f"buckets {sorted(c.buckets)}"
        n = self.persister.discard(c, self.cfg.n_buckets)
        log.error(
            "storage corruption in %s: %s; %s not offered (they rejoin by state transfer); "
            "%d records deleted",
            self.cfg.data_dir,
            what,
            dropped,
            n,
        )

    def _cut(
        self, buckets: Container[int] | None = None
    ) -> tuple[list[Snapshot], dict[int, Position] | None, set[int] | None]:
        """A flush chunk's cut on a replicated server: the copies of the dirty shards of
        `buckets` (None: all) are queued on the event loop, in the same step as those buckets'
        positions are read, so the values written are exactly those of the positions (updates
        are queued from the loop only). Also returns every bucket held a copy of then."""
        assert self.replicator is not None
        rep = self.replicator

        def take() -> tuple[Callable[[float], list[Snapshot]], dict[int, Position], set[int]]:
            snaps = self.store.begin_snapshot(buckets)
            return (
                snaps,
                repl_persist.positions(rep.core, buckets),
                repl_persist.held_copies(rep.core),
            )

        loop = self._loop
        if loop is None or not loop.is_running() or threading.get_ident() == self._loop_thread:
            wait, positions, held = take()  # no loop queues updates concurrently
        else:
            done: concurrent.futures.Future = concurrent.futures.Future()

            def run() -> None:
                try:
                    done.set_result(take())
                except BaseException as exc:
                    done.set_exception(exc)

            loop.call_soon_threadsafe(run)
            wait, positions, held = done.result(timeout=60)
        return wait(60), positions, held

    async def _flush_turns(self) -> None:
        """The flush's turn every flush_interval, riding the loop's other timers (Flusher.offer:
        an idle server's flush wakes no thread)."""
        rep = self.replicator
        assert rep is not None
        while True:
            await ride.sleep(self.cfg.flush_interval)
            try:
                self.flusher.offer(lambda on_disk: repl_persist.cut_unchanged(rep.core, on_disk))
            except Exception:  # never stop the turns: the next one asks again
                log.exception("the flush's turn failed")

    def _on_flush(self, shards: int, nbytes: int, seconds: float) -> None:
        self.m.flushed_shards.inc(shards)
        self.m.flushed_bytes.inc(nbytes)
        self.m.flush_seconds.observe(seconds)

    def stop_for(self, why: str) -> None:
        """Stops serving for a reason no retry can cure (issue 39, finding 18: the controllers
        use another n_buckets): logged, and `adamps ps` exits non-zero."""
        log.critical("stopping: %s", why)
        self.fatal = why
        self.stop_serving.set()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.scrubber.stop()
            self.flusher.stop(final_flush=True)
        finally:
            self.store.close()
            self.persister.close()

    # -- HTTP -------------------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = aweb.make_app(
            registry=self.registry,
            token=self.cfg.token,
            max_body=self.cfg.max_body,
            status=self.status,
            limits=self.cfg.http_limits,
            health=self.flusher.not_durable,
        )
        app[PS_KEY] = self
        app.router.add_post("/rpc", self.handle_rpc)
        app.router.add_post("/flush", self.handle_flush)
        self._routes = {
            f"{r.method} {r.resource.canonical}" for r in app.router.routes() if r.method != "HEAD"
        }

        async def start_data_plane(_app: web.Application) -> None:
            self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
            if self.cfg.data_port:
                await self.data_plane.start(self.cfg.host, self.cfg.data_port)
            if self.replicator is not None:
                await self.replicator.start()
                self._turns = asyncio.create_task(self._flush_turns(), name="flush-turns")
                # Its first registration runs in a task started above, which has not run yet:
                # the rack goes with it (issue 26).
                self.replicator.calls.ctl.rack = self.cfg.rack or None

        async def cleanup(_app: web.Application) -> None:
            if self._turns is not None:
                self._turns.cancel()
            if self.replicator is not None:
                await self.replicator.stop()
            self.data_plane.close()
            await asyncio.get_running_loop().run_in_executor(None, self.close)

        app.on_startup.append(start_data_plane)
        app.on_cleanup.append(cleanup)
        return app

    async def handle_rpc(self, request: web.Request) -> web.Response:
        # The token first: an unauthenticated body is never read.
        who = await self.tenancy.authenticate(request.headers.get("Authorization"))
        try:
            async with asyncio.timeout(self.cfg.body_timeout):
                body = await self._read_body(request)
        except TimeoutError:
            raise ProtocolError(
                "slow_request", f"the body did not arrive within {self.cfg.body_timeout} s"
            ) from None
        self.m.bytes_in.inc(len(body))
        t0 = time.perf_counter()
        op = "?"
        try:
            msg = protocol.decode(body)
            rid = msg.get("rid")
            if isinstance(rid, str | int):
                request[aweb.RID_KEY] = rid  # as sent: a reply echoes it, so does an error
            op = protocol.check_message(msg, self._ops)
            check_fields(op, msg, RPC_FIELDS)  # a misspelled field is refused, not ignored
            self.tenancy.check(who, op, msg, len(body))  # a run's namespace and quotas
            handler = self._ops[op]
            if self.replicator is not None and op in PEER_OPS:
                # Who sent it: the MAC of the body under the pair key (adamps.security.peer_auth); a
                # replication op is not served on the cluster token alone (issue 28).
                peer = await self.replicator.peer_keys.request_peer(
                    op, request.headers.get(peer_auth.PEER_HEADER), body
                )
                handler = functools.partial(self.replicator.ops.op_from_peer, op, peer=peer)
            try:
                if who.run is not None and op in ("create", "create_table"):
                    # checked whole first: the controllers count only a definition that is
                    # created once it fits (its run's size quotas, across the cluster)
                    checker = self.catalog if op == "create" else self.catalog.tables
                    checker.check(msg)
                    await self.tenancy.reserve(who, op, msg)
                reply = await handler(msg)
            except StoreError as exc:
                raise ProtocolError(exc.code, exc.message) from None
            except (LayoutError, OptimError) as exc:
                raise ProtocolError("bad_request", str(exc)) from None
        except ProtocolError as exc:
            self.m.requests.labels(op, exc.code).inc()
            raise
        except Exception:
            self.m.requests.labels(op, "internal").inc()
            raise
        reply = self.tenancy.filter_reply(who, op, reply)
        resp, size = await aweb.send_message(request, {"rid": msg.get("rid"), **reply})
        self.m.bytes_out.inc(size)
        self.m.requests.labels(op, "ok").inc()
        self.m.latency.labels(op).observe(time.perf_counter() - t0)
        return resp

    async def _read_body(self, request: web.Request) -> bytes | memoryview:
        """The body, read into one buffer of Content-Length bytes allocated up front.

        aiohttp's request.read() grows a bytearray chunk by chunk and then copies it into bytes:
        two extra copies of every multi-MB push. With a Content-Length we copy each received
        chunk once, into its place. Chunked bodies (no length) take aiohttp's bounded path.
        """
        n = request.content_length
        if n is None:
            return await aweb.read_body(request)
        if n > self.cfg.max_body:
            raise web.HTTPRequestEntityTooLarge(max_size=self.cfg.max_body, actual_size=n)
        buf = np.empty(n, dtype=np.uint8)  # not bytearray(n): no zero-filling pass
        view = memoryview(buf)
        pos = 0
        while pos < n:
            chunk = await request.content.readany()
            if not chunk:
                break
            end = pos + len(chunk)
            if end > n:  # the HTTP parser never delivers more than Content-Length; be safe
                raise ProtocolError("bad_request", "body longer than its Content-Length")
            view[pos:end] = chunk
            pos = end
        if pos != n:
            raise ProtocolError(
                "bad_request", f"body ended after {pos} of {n} bytes (Content-Length)"
            )
        return view

    async def handle_flush(self, request: web.Request) -> web.Response:
        # The operator's: a run's token is 403 forbidden (as op flush on /rpc), unknown 401.
        who = await self.tenancy.authenticate(request.headers.get("Authorization"))
        self.tenancy.check(who, "flush", {}, 0)
        await aweb.read_json(request)  # empty or a JSON object: garbage is 400, not a flush
        return aweb.json_response(await self._flush())

    async def _flush(self) -> dict[str, Any]:
        return await asyncio.get_running_loop().run_in_executor(None, self.flusher.flush)

    async def op_flush(self, msg: dict[str, Any]) -> dict[str, Any]:
        return await self._flush()

    async def op_debug_fail(self, msg: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("debug_fail: an unexpected error on purpose (debug_ops is on)")

    def status(self) -> dict[str, Any]:
        rep, now = self.replicator, time.monotonic()
        return {
            "role": "ps",
            "data_port": self.cfg.data_port or None,
            # what a peer's repl_multi frames may be signed with (adamps.security.peer_auth, issue 27)
            "peer_frame_mac": peer_auth.FRAME_MAC,
            "config": to_dict(self.cfg),
            "uptime_seconds": time.time() - self.started,
            "n_buckets": self.cfg.n_buckets,
            "buckets": sorted(self.store.buckets) if self.store.buckets is not None else "all",
            "replication": None if rep is None else repl_metrics.status(rep.core, rep.address, now),
            "tensors": {n: list(t.spec.shape) for n, t in self.store.tensors.items()},
            "shards": {
                sid: {
                    "version": st.version,
                    "bucket": self.store.layout.bucket_of[sid],
                    "owner": st.owner,
                }
                for sid, st in self.store.shards.items()
            },
            "queue_depths": self.store.queue_depths(),
            "dirty_shards": self.store.dirty_count(),
            "loss_window_seconds": self.flusher.loss_window(),
            "last_flush": {
                **self.flusher.last_flush,
                "age_seconds": self.flusher.last_flush_age(),
                "error": self.flusher.last_error,
            },
            "durable": self.flusher.not_durable() is None,
            "not_durable": self.flusher.not_durable(),
            "flush_starved": self.flusher.starved_now(),
            "applied": dict(self.store.applied),
            "clients": len(self.writes.clients),
            "runs": self.tenancy.status(),
            "clocks": self.clocks.status(),
            "served": self.served(),
        }

    def served(self) -> dict[str, list[str]]:
        """Every kind of request this server answers: /rpc ops, HTTP routes, data-plane frames
        (tests/system/test_loop_lag.py probes each; a new op cannot escape it)."""
        frames = ["push_dense", "pull", *self.data_plane.messages]
        if self.data_plane.peer_frame is not None:
            frames.append("repl_multi")
        return {
            "rpc": sorted(self._ops),
            "routes": sorted(self._routes),
            "data_plane": sorted(frames) if self.cfg.data_port else [],
        }
