"""The parameter server's HTTP shell: ``POST /rpc`` (msgpack), ``POST /flush``, and the shared
``/healthz``, ``/status``, ``/metrics`` of :func:`adamps.web.make_app`.

Every request is fully validated here, on the event loop, before anything is queued to an owner
thread: a bad request changes nothing. A push returns when its update has been applied (not when
it is on disk: that is the flusher's business, Adam 3.3.2), with the shards' new versions.
docs/protocol-ps.md specifies every op.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from adamps import limits, metrics, protocol
from adamps import web as aweb
from adamps.config import ConfigError, to_dict
from adamps.layout import LayoutError, TensorSpec, stable_bucket
from adamps.protocol import ProtocolError, require, require_array
from adamps.server import bounds, dataplane, vecops
from adamps.server.compressed import wire_form, words_of
from adamps.server.config import PsConfig
from adamps.server.optim import Dense, OptimError, Optimizer, Signs
from adamps.server.persist import Flusher, Persister, Position
from adamps.server.replicate import REPL_OPS, Replicator, dense_update, fc_update, sign_update
from adamps.server.store import (
    INIT_KINDS,
    ShardState,
    Snapshot,
    Store,
    StoreError,
    TensorState,
    fc_parts,
    normalize_init,
    owner_future,
)

log = logging.getLogger(__name__)

OPS = ("create", "pull", "push_dense", "push_fc", "push_compressed", "flush", "list", "describe")
OPS += vecops.OPS  # Sandblaster's vector operations (adamps/server/vecops.py)
DEBUG_OPS = ("debug_fail",)
#: most rows of activation/error vectors in one push_fc
MAX_FC_K = 65_536

PS_KEY = web.AppKey("ps", object)


class PsMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.applied = Counter(
            "adamps_ps_updates_applied",
            "updates applied to shards, by kind",
            ["kind"],
            registry=registry,
        )
        self.requests = Counter(
            "adamps_ps_requests",
            "requests by op (data plane: dp_*) and outcome (ok or the error code)",
            ["op", "outcome"],
            registry=registry,
        )
        self.bytes_in = Counter(
            "adamps_ps_bytes_in",
            "request bytes received (/rpc bodies, data-plane payloads)",
            registry=registry,
        )
        self.bytes_out = Counter(
            "adamps_ps_bytes_out",
            "reply bytes sent (/rpc bodies, data-plane payloads)",
            registry=registry,
        )
        self.latency = Histogram(
            "adamps_ps_request_latency_seconds",
            "time from a complete request body to its reply, by op (pushes: until applied)",
            ["op"],
            buckets=metrics.LATENCY_BUCKETS,
            registry=registry,
        )
        self.flush_seconds = Histogram(
            "adamps_ps_flush_seconds", "duration of a flush (snapshot + LMDB commit)",
            buckets=metrics.LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.flushed_shards = Counter(
            "adamps_ps_flushed_shards", "shard records written to LMDB", registry=registry
        )
        self.flushed_bytes = Counter(
            "adamps_ps_flushed_bytes", "bytes written to LMDB by flushes", registry=registry
        )
        self.dirty = Gauge(
            "adamps_ps_dirty_shards", "shards with updates not yet flushed", registry=registry
        )
        self.loss_window = Gauge(
            "adamps_ps_loss_window_seconds",
            "age of the oldest update not yet committed to LMDB (what a crash now would lose)",
            registry=registry,
        )
        self.queue_depth = Gauge(
            "adamps_ps_queue_depth", "work items queued to owner threads", registry=registry
        )
        self.shards = Gauge("adamps_ps_shards", "shards held by this server", registry=registry)
        self.tensors = Gauge(
            "adamps_ps_tensors", "tensors defined on this server", registry=registry
        )


class ParameterServer:
    """Store + persistence + metrics of one PS process; `make_app()` gives its HTTP app."""

    def __init__(self, cfg: PsConfig, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.registry = registry if registry is not None else metrics.new_registry()
        self.m = PsMetrics(self.registry)
        self.started = time.time()
        self.persister = Persister(cfg.data_dir, cfg.map_size, cfg.lmdb_sync)
        #: copies this server had when it stopped (replicated servers): it offers them again
        positions = self.persister.load_positions() if cfg.controllers else {}
        self.store = Store(
            n_buckets=cfg.n_buckets,
            # Under controllers a server holds only the copies it had (reloaded below) and then
            # the buckets it is assigned; standalone, its static map or all.
            buckets=frozenset(positions) if cfg.controllers else (cfg.buckets or None),
            owner_threads=cfg.owner_threads,
            max_shard_elems=cfg.max_shard_elems,
            on_applied=lambda kind, n: self.m.applied.labels(kind).inc(n),
        )
        self.flusher = Flusher(
            self.store, self.persister, cfg.flush_interval, on_flush=self._on_flush
        )
        #: client id -> last sequence number seen (recorded; exactly-once comes with replication)
        self.clients: dict[str, int] = {}
        self._seq = 0
        try:
            self._load()
        except BaseException:
            self.store.close()
            self.persister.close()
            raise
        self.m.dirty.set_function(lambda: self.store.dirty_count())
        self.m.loss_window.set_function(lambda: self.flusher.loss_window())
        self.m.queue_depth.set_function(lambda: sum(self.store.queue_depths()))
        self.m.shards.set_function(lambda: len(self.store.shards))
        self.m.tensors.set_function(lambda: len(self.store.tensors))
        #: replication (Project Adam 3.3.3) when the server runs under controllers, else None: a
        #: standalone server on its static bucket map
        self.replicator: Replicator | None = None
        if cfg.controllers:
            self.replicator = Replicator(self, self.registry)
            self.replicator.restore(positions)
            self.flusher.cut = self._cut
        #: the event loop serving this server and its thread (set at startup)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self.flusher.start()
        self._closed = False
        self._data_plane: asyncio.Server | None = None
        #: closes idle and stalled data-plane connections
        self._dp_sweeper: asyncio.Task | None = None
        #: open data-plane connections (closed at shutdown)
        self._dp_conns: set[Any] = set()

    def _cut(self) -> tuple[list[Snapshot], dict[int, Position] | None]:
        """The flush's cut on a replicated server: the copies of the dirty shards are queued on
        the event loop, in the same step as the positions are read, so the values written are
        exactly those of the positions (updates are queued from the loop only)."""
        assert self.replicator is not None
        rep = self.replicator

        def take() -> tuple[Callable[[float], list[Snapshot]], dict[int, Position]]:
            return self.store.begin_snapshot(), rep.positions()

        loop = self._loop
        if loop is None or not loop.is_running() or threading.get_ident() == self._loop_thread:
            wait, positions = take()  # no loop queues updates concurrently
        else:
            done: concurrent.futures.Future = concurrent.futures.Future()

            def run() -> None:
                try:
                    done.set_result(take())
                except BaseException as exc:
                    done.set_exception(exc)

            loop.call_soon_threadsafe(run)
            wait, positions = done.result(timeout=60)
        return wait(60), positions

    def _on_flush(self, shards: int, nbytes: int, seconds: float) -> None:
        self.m.flushed_shards.inc(shards)
        self.m.flushed_bytes.inc(nbytes)
        self.m.flush_seconds.observe(seconds)

    def _load(self) -> None:
        """Reloads every tensor this server saved: definitions, values, accumulators, versions."""
        n = 0
        for saved in self.persister.load():
            meta = saved.meta
            spec = TensorSpec.from_dict(meta["spec"])
            opt = Optimizer.from_dict(meta["optimizer"])
            saved_max = meta.get("max_shard_elems", self.cfg.max_shard_elems)
            if saved_max != self.cfg.max_shard_elems:
                raise ConfigError(
                    f"{self.persister.path} holds tensor {spec.name!r} cut with max_shard_elems="
                    f"{saved_max}, but this server is configured with {self.cfg.max_shard_elems}; "
                    "the shard layout must not change under existing data"
                )
            values = None
            missing = [
                sid
                for sid in self._shards_of(spec)
                if self.store.holds_id(sid) and sid not in saved.shards
            ]
            if missing:
                # A bucket newly assigned to this server and never flushed here: its shards start
                # from the tensor's init (given values: zeros) until replication brings state.
                log.warning(
                    "tensor %s: no saved state for %d held shards (%s...); they start from init",
                    spec.name,
                    len(missing),
                    missing[0],
                )
                if meta["init"]["kind"] == "values":
                    values = np.zeros(spec.shape, dtype=np.float32)
            self.store.define(spec, opt, meta["init"], values, saved.shards)
            self._seq = max(self._seq, meta["seq"] + 1)
            n += 1
        if n:
            log.info(
                "reloaded %d tensors, %d held shards from %s",
                n,
                len(self.store.shards),
                self.persister.path,
            )

    def _shards_of(self, spec: TensorSpec) -> list[str]:
        from adamps.layout import split_tensor

        return [s.id for s in split_tensor(spec, self.store.layout.max_shard_elems)]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
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
        )
        app[PS_KEY] = self
        app.router.add_post("/rpc", self.handle_rpc)
        app.router.add_post("/flush", self.handle_flush)

        async def start_data_plane(_app: web.Application) -> None:
            self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
            if self.cfg.data_port:
                self._data_plane = await dataplane.start(self, self.cfg.host, self.cfg.data_port)
                self._dp_sweeper = asyncio.create_task(dataplane.sweep(self))
            if self.replicator is not None:
                await self.replicator.start()

        async def cleanup(_app: web.Application) -> None:
            if self.replicator is not None:
                await self.replicator.stop()
            if self._dp_sweeper is not None:
                self._dp_sweeper.cancel()
            if self._data_plane is not None:
                self._data_plane.close()  # stops accepting; then the open connections
                for conn in list(self._dp_conns):
                    if conn.transport is not None:
                        conn.transport.close()
            await asyncio.get_running_loop().run_in_executor(None, self.close)

        app.on_startup.append(start_data_plane)
        app.on_cleanup.append(cleanup)
        return app

    async def handle_rpc(self, request: web.Request) -> web.Response:
        # The token first: an unauthenticated body is never read.
        aweb.check_token(request)
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
                request[aweb.RID_KEY] = str(rid)
            ops = OPS + DEBUG_OPS if self.cfg.debug_ops else OPS
            if self.replicator is not None:
                ops = ops + REPL_OPS
            op = protocol.check_message(msg, ops)
            target = self.replicator if op in REPL_OPS else self
            handler: Callable[[dict[str, Any]], Any] = getattr(target, f"op_{op}")
            try:
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
        resp = aweb.message_response({"rid": msg.get("rid"), **reply})
        self.m.bytes_out.inc(len(resp.body))  # type: ignore[arg-type]
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
        aweb.check_token(request)
        return aweb.json_response(await self._flush())

    # -- ops --------------------------------------------------------------------------------------

    async def op_create(self, msg: dict[str, Any]) -> dict[str, Any]:
        name = require(msg, "name", str)
        # Sizes by arithmetic before anything is allocated (issue 12: [2^32] with Adagrad asked
        # for 32 GiB); a create that only repeats an existing definition allocates nothing.
        shape = limits.check_shape(require(msg, "shape", list), self.cfg.max_tensor_elems)
        spec = TensorSpec(name, shape)
        init_in = require(msg, "init", dict, default={"kind": "zeros"})
        opt = Optimizer.from_dict(require(msg, "optimizer", dict, default={"kind": "sgd"}))
        bounds.check_optimizer(opt)
        init = normalize_init(init_in, spec.shape)
        bounds.check_init(init, init_in.get("values"))
        if name not in self.store.tensors:
            self._check_server_room(spec)
        created, t = self._define(spec, opt, init, init_in.get("values"))
        return {"created": created, "tensor": self._describe(t)}

    def _check_server_room(self, spec: TensorSpec) -> None:
        """The shards of `spec` this server would hold fit in max_server_elems."""
        from adamps.layout import split_tensor

        held = sum(st.shard.size for st in self.store.shards.values())
        if limits.shard_count(spec.shape, self.store.layout.max_shard_elems) > (1 << 20):
            raise ProtocolError("too_large", f"tensor {spec.name!r} would have too many shards")
        new = sum(
            s.size
            for s in split_tensor(spec, self.store.layout.max_shard_elems)
            if self.store.holds(s)
        )
        if held + new > self.cfg.max_server_elems:
            raise ProtocolError(
                "too_large",
                f"tensor {spec.name!r} would put {held + new} elements on this server; "
                f"the limit is {self.cfg.max_server_elems}",
                limit=self.cfg.max_server_elems,
            )

    def _define(
        self, spec: TensorSpec, opt: Optimizer, init: dict[str, Any], values: np.ndarray | None
    ) -> tuple[bool, TensorState]:
        """Defines a tensor unless an identical one exists (then False); a different one with the
        same name is `exists`. Persists the definition and initial state before returning."""
        name = spec.name
        existing = self.store.tensors.get(name)
        wanted = {
            "name": name,
            "shape": list(spec.shape),
            "dtype": spec.dtype,
            "optimizer": opt.to_dict(),
            "init": init,
        }
        if existing is not None:
            if existing.describe() == wanted:
                return False, existing
            raise ProtocolError(
                "exists",
                f"tensor {name!r} exists with a different definition",
                existing=existing.describe(),
            )
        t = self.store.define(spec, opt, init, values)
        meta = {
            "spec": spec.to_dict(),
            "optimizer": opt.to_dict(),
            "init": init,
            "seq": self._seq,
            "max_shard_elems": self.cfg.max_shard_elems,
        }
        self._seq += 1
        # Written before the caller yields, so no push to the new shards is queued yet and no
        # later flush can be overtaken by this version-0 write. Create is rare; the loop blocks briefly.
        self.persister.write_tensor(
            meta, [(st.id, st.version, st.value, st.accum) for st in t.shards.values()]
        )
        log.info(
            "created tensor %s %s (%d held shards, %s)",
            name,
            list(spec.shape),
            len(t.shards),
            opt.kind,
        )
        return True, t

    def tensor_definition(self, name: str) -> dict[str, Any]:
        """The definition of a tensor as plain data (what `create` compares; `list` returns)."""
        return self.store.tensor(name).describe()

    def ensure_tensor(self, d: dict[str, Any]) -> bool:
        """Defines a tensor from a peer's definition (tensor_definition) unless it exists here;
        True if it was created. A definition of kind `values` carries only the digest: such a
        tensor starts at zeros here, for the state transfer that follows to overwrite."""
        # A peer's definition passed the same limit at its create: a larger one is not ours.
        shape = limits.check_shape(require(d, "shape", list), self.cfg.max_tensor_elems)
        spec = TensorSpec(require(d, "name", str), shape)
        opt = Optimizer.from_dict(require(d, "optimizer", dict))
        init = dict(require(d, "init", dict))
        if init.get("kind") not in INIT_KINDS:
            raise ProtocolError("bad_request", f"unknown init kind {init.get('kind')!r}")
        values = np.zeros(spec.shape, np.float32) if init["kind"] == "values" else None
        return self._define(spec, opt, init, values)[0]

    def _held(self, name: str) -> list[ShardState]:
        """Every shard of tensor `name`, which must all be held here."""
        t = self.store.tensor(name)
        if not t.held_all:
            missing = [s.id for s in t.layout_shards if s.index not in t.shards]
            raise ProtocolError(
                "unknown_shard",
                f"tensor {name!r}: {len(missing)} of its shards are not on this server; address them by shard id",
                missing=missing[:20],
            )
        return [t.shards[s.index] for s in t.layout_shards]

    def _unique_names(
        self, msg: dict[str, Any], field: str, what: str, twice_ok: bool = True
    ) -> list[str]:
        """Field `field`: a list of strings, duplicates removed (issue 12: a pull naming one shard
        N times built N copies) or, unless `twice_ok`, refused; at most max_shards_per_request."""
        names = require(msg, field, list)
        if not all(isinstance(i, str) for i in names):
            raise ProtocolError("bad_request", f"field {field!r} must be a list of {what}")
        unique = list(dict.fromkeys(names))
        if not twice_ok and len(unique) != len(names):
            raise ProtocolError("bad_request", f"field {field!r} names a shard twice")
        names = unique
        if len(names) > self.cfg.max_shards_per_request:
            raise ProtocolError(
                "too_large",
                f"field {field!r} names {len(names)} {what}; the limit is "
                f"{self.cfg.max_shards_per_request}",
                limit=self.cfg.max_shards_per_request,
            )
        return names

    def _shard_ids(
        self, msg: dict[str, Any], field: str, twice_ok: bool = True
    ) -> list[ShardState]:
        ids = self._unique_names(msg, field, "shard ids (strings)", twice_ok)
        self._check_ids(ids)
        return [self.store.shard(i) for i in ids]

    def _check_ids(self, ids: Any) -> None:
        """Under replication, a shard this server is not the primary for is not_primary (even if
        the server does not know its tensor yet): the bucket follows from the id alone."""
        if self.replicator is not None:
            for b in {stable_bucket(i, self.cfg.n_buckets) for i in ids if isinstance(i, str)}:
                self.replicator.check_primary(b)

    async def _wait(
        self, submit: Callable[[Callable[[Any, BaseException | None], None]], Any]
    ) -> Any:
        return await owner_future(submit)

    def _check_serving(self, states: list[ShardState]) -> None:
        """Under replication, only the primary of a bucket with a live lease serves it."""
        if self.replicator is not None:
            for b in {self.store.layout.bucket_of[st.id] for st in states}:
                self.replicator.check_primary(b)

    async def op_pull(self, msg: dict[str, Any]) -> dict[str, Any]:
        if "tensors" in msg:
            names = self._unique_names(msg, "tensors", "tensor names")
            states: list[ShardState] = []
            outs: list[np.ndarray] = []
            whole: dict[str, np.ndarray] = {}
            for name in names:
                sts = self._held(name)
                arr = np.empty(self.store.tensors[name].spec.shape, dtype=np.float32)
                flat = arr.reshape(-1)
                whole[name] = arr
                states += sts
                outs += [flat[st.shard.start : st.shard.stop] for st in sts]
            self._check_serving(states)
            versions = await self._wait(lambda cb: self.store.read(states, outs, cb))
            return {
                "tensors": whole,
                "versions": {n: [versions[st.id] for st in self._held(n)] for n in names},
            }
        states = self._shard_ids(msg, "shards")
        self._check_serving(states)
        outs = [np.empty(st.shard.shape, dtype=np.float32) for st in states]
        versions = await self._wait(lambda cb: self.store.read(states, outs, cb))
        return {
            "shards": {st.id: out for st, out in zip(states, outs, strict=True)},
            "versions": {st.id: versions[st.id] for st in states},
        }

    def _record_client(self, msg: dict[str, Any]) -> tuple[str, int] | None:
        client = msg.get("client")
        if client is None:
            return None
        client = require(msg, "client", str)
        seq = require(msg, "seq", int)
        self.clients[client] = seq
        return client, seq

    async def _replicate(
        self, msg: dict[str, Any], updates: list[tuple[list[ShardState], Any]]
    ) -> dict[str, Any]:
        """A checked push through the replication rounds of its buckets: (shards, compact
        update) pairs, grouped by bucket, each bucket's part a single deduplicated entry."""
        assert self.replicator is not None
        by_bucket: dict[int, list[Any]] = {}
        for states, make in updates:
            per_bucket: dict[int, list[ShardState]] = {}
            for st in states:
                per_bucket.setdefault(self.store.layout.bucket_of[st.id], []).append(st)
            for b, sts in per_bucket.items():
                by_bucket.setdefault(b, []).append(make(sts))
        await self.replicator.push(by_bucket, self._record_client(msg))
        return {"versions": {}}

    async def op_push_dense(self, msg: dict[str, Any]) -> dict[str, Any]:
        parts: list[tuple[ShardState, Dense]] = []
        if "tensor" in msg:
            name = require(msg, "tensor", str)
            sts = self._held(name)
            delta = require_array(
                msg, "delta", shape=self.store.tensors[name].spec.shape, finite=False
            )
            bounds.check_dense("delta", delta)  # finite, and small enough to stay finite
            flat = delta.reshape(-1)
            parts = [(st, Dense(flat[st.shard.start : st.shard.stop])) for st in sts]
        else:
            deltas = require(msg, "shards", dict)
            if len(deltas) > self.cfg.max_shards_per_request:
                raise ProtocolError(
                    "too_large",
                    f"push_dense names {len(deltas)} shards; the limit is "
                    f"{self.cfg.max_shards_per_request}",
                )
            self._check_ids(deltas)
            for sid in deltas:
                if not isinstance(sid, str):
                    raise ProtocolError(
                        "bad_request", "field 'shards' must map shard ids to arrays"
                    )
                st = self.store.shard(sid)
                d = require_array(deltas, sid, shape=st.shard.shape, finite=False)
                bounds.check_dense(sid, d)
                parts.append((st, Dense(d)))
            if not parts:
                raise ProtocolError(
                    "bad_request", "push_dense needs 'tensor' + 'delta' or a non-empty 'shards'"
                )
        if self.replicator is not None:
            return await self._replicate(
                msg,
                [([st], lambda sts, d=upd.delta: dense_update(sts[0].id, d)) for st, upd in parts],
            )
        self._record_client(msg)
        versions = await self._wait(lambda cb: self.store.push(parts, cb))
        return {"versions": versions}

    async def op_push_fc(self, msg: dict[str, Any]) -> dict[str, Any]:
        name = require(msg, "tensor", str)
        t = self.store.tensor(name)
        if len(t.spec.shape) != 2 or not all(s.rows_aligned for s in t.layout_shards):
            raise ProtocolError(
                "bad_request",
                f"push_fc needs a 2-D tensor cut on whole rows; {name!r} has shape {list(t.spec.shape)}",
            )
        m, n = t.spec.shape
        a = require_array(msg, "a", shape=(None, n), finite=False)
        e = require_array(msg, "e", shape=(None, m), finite=False)
        k = a.shape[0]
        if not 1 <= k <= MAX_FC_K or e.shape[0] != k:
            raise ProtocolError(
                "bad_shape",
                f"a and e need the same number of rows k, 1 <= k <= {MAX_FC_K}; got {a.shape[0]} and {e.shape[0]}",
            )
        bounds.check_fc(a, e)
        if "shards" in msg:
            states = self._shard_ids(msg, "shards", twice_ok=False)
            wrong = [st.id for st in states if st.shard.tensor != name]
            if wrong:
                raise ProtocolError("bad_request", f"shards {wrong} are not shards of {name!r}")
        else:
            states = self._held(name)
        if self.replicator is not None:
            return await self._replicate(
                msg, [(states, lambda sts: fc_update(name, [st.id for st in sts], a, e))]
            )
        self._record_client(msg)
        parts = fc_parts(t, a, e, states)
        versions = await self._wait(lambda cb: self.store.push(parts, cb))
        return {"versions": versions}

    async def op_push_compressed(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Strom's threshold-quantized update: per shard a tau and the elements moved by +-tau
        (uint32 words, or Golomb-Rice coded index gaps). Validated whole before anything is
        queued; under replication it travels in the same compressed form."""
        updates = require(msg, "shards", dict)
        if not updates:
            raise ProtocolError("bad_request", "push_compressed needs a non-empty 'shards' map")
        self._check_ids(updates)
        parts: list[tuple[ShardState, Signs, dict[str, Any]]] = []
        for sid, d in updates.items():
            if not isinstance(sid, str):
                raise ProtocolError("bad_request", "field 'shards' must map shard ids to updates")
            st = self.store.shard(sid)
            words, tau = words_of(d, st.shard.size, f"shard {sid!r}")
            parts.append((st, Signs(words, tau), d))
        if self.replicator is not None:
            return await self._replicate(
                msg,
                [([st], lambda sts, u=u, d=d: sign_update(sts[0].id, u.tau, wire_form(d)))
                 for st, u, d in parts],
            )  # fmt: skip
        self._record_client(msg)
        versions = await self._wait(lambda cb: self.store.push([(st, u) for st, u, _ in parts], cb))
        return {"versions": versions}

    async def _flush(self) -> dict[str, Any]:
        return await asyncio.get_running_loop().run_in_executor(None, self.flusher.flush)

    async def op_flush(self, msg: dict[str, Any]) -> dict[str, Any]:
        return await self._flush()

    async def op_list(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"tensors": [t.describe() for t in self.store.tensors.values()]}

    async def op_describe(self, msg: dict[str, Any]) -> dict[str, Any]:
        return self._describe(self.store.tensor(require(msg, "name", str)))

    async def op_vec(self, msg: dict[str, Any]) -> dict[str, Any]:
        return await vecops.op_vec(self, msg)

    async def op_vec_dot(self, msg: dict[str, Any]) -> dict[str, Any]:
        return await vecops.op_vec_dot(self, msg)

    async def op_debug_fail(self, msg: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("debug_fail: an unexpected error on purpose (debug_ops is on)")

    def _describe(self, t: Any) -> dict[str, Any]:
        d = t.describe()
        d["shards"] = [
            {
                "id": s.id,
                "bucket": self.store.layout.bucket_of[s.id],
                "rows": [s.row_start, s.row_stop],
                "held": s.index in t.shards,
                "version": t.shards[s.index].version if s.index in t.shards else None,
            }
            for s in t.layout_shards
        ]
        return d

    def status(self) -> dict[str, Any]:
        return {
            "role": "ps",
            "data_port": self.cfg.data_port or None,
            "config": to_dict(self.cfg),
            "uptime_seconds": time.time() - self.started,
            "n_buckets": self.cfg.n_buckets,
            "buckets": sorted(self.store.buckets) if self.store.buckets is not None else "all",
            "replication": self.replicator.status() if self.replicator is not None else None,
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
            "last_flush": self.flusher.last_flush,
            "applied": dict(self.store.applied),
            "clients": len(self.clients),
        }
