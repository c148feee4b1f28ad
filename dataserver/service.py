"""The data server (Project Adam 3.1): a dataset slice cached in memory, augmented ahead of time in
worker processes, streamed to trainers over HTTP as length-prefixed msgpack frames.

    POST /stream   (token)  body: msgpack {"op": "stream", "v": 1, replica, n_replicas, epoch,
                            start, stop?, batch_size, split, fingerprint?}  -> chunked frames
                            (header, batch..., end); see docs/protocol-dataserver.md
    POST /lease /complete /heartbeat, GET /runs: elastic replicas' slices (dataserver/elastic.py)
    GET  /healthz /status /metrics   (from adamps.wire.web)

Only the event-loop thread touches the server's state; augmentation runs in the worker pool.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from adamps import config as adamps_config
from adamps import metrics
from adamps.client.controller import AsyncControllerClient
from adamps.security.run_tokens import RunTokens
from adamps.wire import protocol
from adamps.wire import web as adamps_web
from adamps.wire.protocol import ProtocolError
from dataserver.augment import Augmenter, AugmentParams
from dataserver.cache import EpochCache
from dataserver.config import DataServerConfig
from dataserver.elastic import ElasticRuns
from dataserver.framing import CONTENT_TYPE, Batch, frame
from dataserver.partition import MAX_EPOCH, MAX_REPLICAS, slice_members, stream_positions
from dataserver.sources import Dataset

log = logging.getLogger(__name__)

SPLITS = ("train", "test")
#: the fields of a stream request (beside the envelope's): any other is refused, not ignored
STREAM_FIELDS = frozenset(
    {"replica", "n_replicas", "epoch", "batch_size", "split", "start", "stop", "fingerprint"}
)
#: a stream's batch frames are written in runs of about this many bytes: one aiohttp write per
#: 8-image batch (25 KB) cost more than encoding it (issue 27's profile of a training cluster)
WRITE_BYTES = 128 << 10


@dataclass(frozen=True)
class StreamRequest:
    replica: int
    n_replicas: int
    epoch: int
    start: int
    batch_size: int
    split: str
    stop: int | None = None  #: end position (exclusive); None: the stream's end (an elastic slice)


class DataServerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.images_served = Counter(
            "adamps_dataserver_images_served",
            "images sent to trainers in stream batches",
            ["split"],
            registry=registry,
        )
        self.augmented = Counter(
            "adamps_dataserver_images_augmented",
            "images augmented by the worker pool",
            registry=registry,
        )
        self.backlog = Gauge(
            "adamps_dataserver_augment_backlog_images",
            "images scheduled for augmentation and not yet done",
            registry=registry,
        )
        self.cache_bytes = Gauge(
            "adamps_dataserver_cache_bytes",
            "bytes held by the image cache (decoded + augmented epochs)",
            registry=registry,
        )
        self.skipped = Counter(
            "adamps_dataserver_skipped_files",
            "unreadable image files skipped while loading the source",
            registry=registry,
        )
        self.streams_open = Gauge(
            "adamps_dataserver_streams_open", "batch streams being sent now", registry=registry
        )
        self.stream_waits = Counter(
            "adamps_dataserver_stream_waits",
            "streams that had to wait for their epoch's augmentation (it was not ready ahead)",
            registry=registry,
        )


class DataServer:
    """One data server: its slice of a dataset, the augmented-epoch cache and the stream endpoint."""

    def __init__(
        self,
        cfg: DataServerConfig,
        dataset: Dataset,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.cfg = cfg
        self.dataset = dataset
        self.registry = registry if registry is not None else metrics.new_registry()
        self.metrics = DataServerMetrics(self.registry)
        #: runs' tokens (issue 25), learnt from the controllers when some are configured
        self.run_tokens: RunTokens | None = None
        self._ctl: AsyncControllerClient | None = None
        if cfg.controllers:
            self._ctl = AsyncControllerClient(
                cfg.controllers, cfg.token, timeout=3.0, retry_for=3.0
            )
            self.run_tokens = RunTokens(self._ctl.runs_auth)
        k, n = cfg.slice_index, cfg.n_slices
        self.n_train_total = len(dataset.train_y)
        self.train_index = slice_members(len(dataset.train_y), k, n)
        self.test_index = slice_members(len(dataset.test_y), k, n)
        # Only this slice stays in memory: several servers split the dataset between them.
        self.train_x = np.ascontiguousarray(dataset.train_x[self.train_index])
        self.train_y = np.ascontiguousarray(dataset.train_y[self.train_index])
        self.test_x = np.ascontiguousarray(dataset.test_x[self.test_index])
        self.test_y = np.ascontiguousarray(dataset.test_y[self.test_index])
        #: click logs' categorical ids (int64 [n, fields]) beside their dense x; None for images
        self.train_ids = self.test_ids = None
        if dataset.train_ids is not None and dataset.test_ids is not None:
            self.train_ids = np.ascontiguousarray(dataset.train_ids[self.train_index])
            self.test_ids = np.ascontiguousarray(dataset.test_ids[self.test_index])
        #: images are augmented; click logs' rows never are
        augment = cfg.augment and self.train_ids is None
        held = (self.train_x, self.train_y, self.test_x, self.test_y, self.train_ids, self.test_ids)
        base = sum(a.nbytes for a in held if a is not None)
        self.cache = EpochCache(cfg.cache_bytes, base, self.train_x.nbytes if augment else 0)
        self.fingerprint = self._fingerprint()
        self.metrics.skipped.inc(dataset.skipped)
        self.augmenter: Augmenter | None = None
        if augment:
            self.augmenter = Augmenter(
                self.train_x,
                self.train_index,
                self.n_train_total,
                seed=cfg.seed,
                params=AugmentParams(cfg.max_shift, cfg.max_rotation, cfg.reflect),
                workers=cfg.workers,
                chunk=cfg.chunk,
                on_progress=self._on_augmented,
            )
        self._inflight: dict[int, asyncio.Task[np.ndarray]] = {}  #: epoch -> its augmentation
        self._streams_open = 0  #: /stream responses being sent
        #: "METHOD /path" of every HTTP route (set by make_app; tests/system/test_loop_lag_roles.py
        #: probes each, so a route added without a probe fails that test)
        self._routes: set[str] = set()
        #: elastic replicas' leased slices of the training set, per run
        self.elastic = ElasticRuns(
            len(self.train_y), cfg.slice_size, cfg.slice_lease, self.registry
        )
        self.elastic.caller = self._check_token
        self._update_gauges()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Starts the worker pool and computes the first epochs ahead."""
        if self.augmenter is not None:
            self.augmenter.start()
            self._want(0)

    async def close(self) -> None:
        for task in list(self._inflight.values()):
            task.cancel()
        await asyncio.gather(*self._inflight.values(), return_exceptions=True)
        self._inflight.clear()
        if self.augmenter is not None:
            self.augmenter.close()
        if self._ctl is not None:
            await self._ctl.close()

    def _fingerprint(self) -> str:
        """Identifies (dataset slice, seed): servers of one failover group must agree on it."""
        h = hashlib.sha256()
        held = (self.train_x, self.train_y, self.test_x, self.test_y, self.train_ids, self.test_ids)
        for a in (a for a in held if a is not None):
            h.update(str(a.shape).encode())
            h.update(a.tobytes())
        h.update(f"{self.cfg.seed}/{self.cfg.slice_index}/{self.cfg.n_slices}".encode())
        return h.hexdigest()[:16]

    # ------------------------------------------------------------------ augmented epochs

    def _on_augmented(self, n: int) -> None:
        self.metrics.augmented.inc(n)
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.cache_bytes.set(self.cache.nbytes)
        self.metrics.backlog.set(self.augmenter.backlog if self.augmenter else 0)

    def _want(self, epoch: int) -> None:
        """Schedules `epoch` and the next `ahead` epochs, within what the cache bound can hold."""
        room = self.cache.capacity_epochs
        for e in range(epoch, epoch + self.cfg.ahead + 1):
            if e in self._inflight or e in self.cache:
                continue
            held = sum(1 for c in [*self.cache.epochs(), *self._inflight] if c >= epoch)
            if e != epoch and held >= room:
                break  # computing further ahead would evict epochs that are still to be served
            self._inflight[e] = asyncio.get_running_loop().create_task(self._compute(e))
        self._update_gauges()

    async def _compute(self, epoch: int) -> np.ndarray:
        assert self.augmenter is not None
        try:
            images = await self.augmenter.epoch(epoch)
            evicted = self.cache.put(epoch, images)
            if evicted:
                log.debug("cache bound: evicted augmented epochs %s", evicted)
            return images
        finally:
            self._inflight.pop(epoch, None)
            self._update_gauges()

    async def epoch_images(self, split: str, epoch: int) -> np.ndarray:
        """The images a stream of (split, epoch) indexes into: augmented training images or the held-out ones."""
        if split == "test":
            return self.test_x
        if self.augmenter is None:
            return self.train_x
        self._want(epoch)
        cached = self.cache.get(epoch)
        if cached is not None:
            return cached
        self.metrics.stream_waits.inc()
        # shield: one impatient client that disconnects must not cancel the shared computation.
        return await asyncio.shield(self._inflight[epoch])

    # ------------------------------------------------------------------ streams

    def stream_length(self, req: StreamRequest) -> int:
        """The stream's end position: its length, or ``stop`` when the request bounds it."""
        n = len(self.train_y) if req.split == "train" else len(self.test_y)
        total = len(range(req.replica, n, req.n_replicas))
        return total if req.stop is None else min(total, req.stop)

    async def batches(
        self, req: StreamRequest, images: np.ndarray | None = None
    ) -> AsyncIterator[Batch]:
        """The batches of one stream from position req.start: the shared core of /stream and the benchmark."""
        train = req.split == "train"
        labels, index = (
            (self.train_y, self.train_index) if train else (self.test_y, self.test_index)
        )
        positions = stream_positions(
            len(labels), req.replica, req.n_replicas, req.epoch, self.cfg.seed, shuffle=train
        )
        if images is None:
            images = await self.epoch_images(req.split, req.epoch)
        ids = self.train_ids if train else self.test_ids
        end = self.stream_length(req)
        for pos in range(req.start, end, req.batch_size):
            sel = positions[pos : min(end, pos + req.batch_size)]
            yield Batch(
                pos, images[sel], labels[sel], index[sel], None if ids is None else ids[sel]
            )

    def parse_stream(self, msg: dict[str, Any]) -> StreamRequest:
        """Validates a stream request; every problem is a bad_request naming the field."""
        # a misspelled `strat` streamed from position 0, silently repeating what was trained
        protocol.only_fields(msg, "op 'stream'", STREAM_FIELDS | protocol.ENVELOPE, op="stream")
        n_replicas = protocol.require(msg, "n_replicas", int)
        if not 1 <= n_replicas <= MAX_REPLICAS:
            raise ProtocolError(
                "bad_request", f"n_replicas must be in [1, {MAX_REPLICAS}], got {n_replicas}"
            )
        replica = protocol.require(msg, "replica", int)
        if not 0 <= replica < n_replicas:
            raise ProtocolError(
                "bad_request", f"replica must be in [0, n_replicas={n_replicas}), got {replica}"
            )
        epoch = protocol.require(msg, "epoch", int)
        if not 0 <= epoch <= MAX_EPOCH:
            raise ProtocolError("bad_request", f"epoch must be in [0, {MAX_EPOCH}], got {epoch}")
        batch_size = protocol.require(msg, "batch_size", int)
        if not 1 <= batch_size <= self.cfg.max_batch:
            raise ProtocolError(
                "bad_request", f"batch_size must be in [1, {self.cfg.max_batch}], got {batch_size}"
            )
        split = protocol.require(msg, "split", str, "train")
        if split not in SPLITS:
            raise ProtocolError(
                "bad_request", f"split must be one of {list(SPLITS)}, got {split!r}"
            )
        start = protocol.require(msg, "start", int, 0)
        stop = protocol.require(msg, "stop", int, None)
        full = self.stream_length(StreamRequest(replica, n_replicas, epoch, 0, batch_size, split))
        if stop is not None and not 0 <= stop <= full:
            raise ProtocolError(
                "bad_request", f"stop must be in [0, {full}] for this stream, got {stop}"
            )
        req = StreamRequest(replica, n_replicas, epoch, start, batch_size, split, stop)
        total = self.stream_length(req)
        if not 0 <= start <= total:
            raise ProtocolError(
                "bad_request", f"start must be in [0, {total}] for this stream, got {start}"
            )
        fingerprint = protocol.require(msg, "fingerprint", str, self.fingerprint)
        if fingerprint != self.fingerprint:
            raise ProtocolError(
                "conflict",
                f"this server holds dataset {self.fingerprint}, the stream was begun on {fingerprint}",
                fingerprint=self.fingerprint,
            )
        return req

    def header(self, req: StreamRequest) -> dict[str, Any]:
        return {
            "type": "header",
            "v": protocol.VERSION,
            "fingerprint": self.fingerprint,
            "slice": [self.cfg.slice_index, self.cfg.n_slices],
            "split": req.split,
            "epoch": req.epoch,
            "start": req.start,
            "total": self.stream_length(req),
            "image_shape": list(self.train_x.shape[1:]),
            "augmented": bool(self.augmenter is not None and req.split == "train"),
            **self._kind(),
        }

    def _kind(self) -> dict[str, Any]:
        """What a batch holds: images, or click logs' rows (their dense and categorical widths)."""
        if self.train_ids is None:
            return {"kind": "images"}
        return {
            "kind": "ctr",
            "n_dense": self.train_x.shape[1],
            "n_fields": self.train_ids.shape[1],
        }

    async def _images_with_heartbeat(
        self, req: StreamRequest, resp: web.StreamResponse
    ) -> np.ndarray:
        """Awaits the epoch's images, sending `wait` frames meanwhile so that the client's read
        timeout tells a dead server from one still augmenting a large epoch."""
        fut = asyncio.ensure_future(self.epoch_images(req.split, req.epoch))
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=self.cfg.heartbeat)
                if done:
                    return fut.result()
                backlog = self.augmenter.backlog if self.augmenter else 0
                await resp.write(frame({"type": "wait", "backlog": backlog}))
        finally:
            fut.cancel()  # no-op when done; the shared augmentation itself is shielded

    async def _check_token(self, request: web.Request) -> str | None:
        """The cluster token (None), or (with controllers) a run's token (the run's name): data
        is read-only, and a run's elastic replicas lease only their run's slices."""
        if self.run_tokens is not None:
            _, _, given = request.headers.get("Authorization", "").partition(" ")
            if given.strip() and given.strip() != self.cfg.token:
                run = await self.run_tokens.run_of(given.strip())
                if run is not None:
                    return run
        adamps_web.check_token(request)
        return None

    async def handle_stream(self, request: web.Request) -> web.StreamResponse:
        await self._check_token(request)
        msg = await adamps_web.read_message(request, {"stream"})
        req = self.parse_stream(msg)
        resp = web.StreamResponse(status=200, headers={"Content-Type": CONTENT_TYPE})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        self.metrics.streams_open.inc()
        self._streams_open += 1
        served = self.metrics.images_served.labels(req.split)
        try:
            await resp.write(frame(self.header(req)))
            images = await self._images_with_heartbeat(req, resp)
            run: list[bytes] = []  # frames not written yet (the same bytes, fewer writes)
            size = 0
            async for b in self.batches(req, images):
                msg = {
                    "type": "batch",
                    "position": b.position,
                    "x": b.x,
                    "y": b.y,
                    "index": b.index,
                }
                if b.ids is not None:
                    msg["ids"] = b.ids
                f = frame(msg)
                run.append(f)
                size += len(f)
                served.inc(len(b.y))
                if size >= WRITE_BYTES:
                    await resp.write(b"".join(run))
                    run, size = [], 0
            run.append(frame({"type": "end", "position": self.stream_length(req)}))
            await resp.write(b"".join(run))
            await resp.write_eof()
        except ConnectionError:
            # The trainer went away (or failed over); nothing to clean up beyond the gauge.
            log.debug("stream %s cut by the client", req)
        except Exception as exc:  # after prepare() the status is sent: report in-band, then close
            log.exception("stream %s failed", req)
            try:
                await resp.write(frame({"type": "error", "code": "internal", "message": str(exc)}))
                await resp.write_eof()
            except ConnectionError:
                pass
        finally:
            self.metrics.streams_open.dec()
            self._streams_open -= 1
        return resp

    # ------------------------------------------------------------------ status / app

    def status(self) -> dict[str, Any]:
        return {
            "role": "dataserver",
            "source": self.dataset.description,
            "fingerprint": self.fingerprint,
            "slice": [self.cfg.slice_index, self.cfg.n_slices],
            "n_train": len(self.train_y),
            "n_test": len(self.test_y),
            "n_train_total": self.n_train_total,
            "image_shape": list(self.train_x.shape[1:]),
            "classes": self.dataset.classes,
            "augment": self.augmenter is not None,
            "epochs_cached": self.cache.epochs(),
            "epochs_in_flight": sorted(self._inflight),
            "augment_backlog": self.augmenter.backlog if self.augmenter else 0,
            "cache_bytes": self.cache.nbytes,
            "cache_bound": self.cache.bound,
            "skipped_files": self.dataset.skipped,  # click logs: lines that are not rows
            "source_errors": self.dataset.errors,
            **self._kind(),
            "streams_open": self._streams_open,
            "runs": self.elastic.status(),
            "served": {"routes": sorted(self._routes)},
            "config": adamps_config.to_dict(self.cfg),
        }

    def make_app(self) -> web.Application:
        app = adamps_web.make_app(
            registry=self.registry,
            token=self.cfg.token,
            max_body=self.cfg.max_body,
            status=self.status,
            limits=self.cfg.http_limits,
        )
        app.router.add_post("/stream", self.handle_stream)
        self.elastic.add_routes(app)
        self._routes = {
            f"{r.method} {r.resource.canonical}" for r in app.router.routes() if r.method != "HEAD"
        }
        return app
