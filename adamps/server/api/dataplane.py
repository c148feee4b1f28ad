"""A binary streaming data plane beside the HTTP control plane: raw float32 push/pull over TCP.

Why: a 4 MB push over aiohttp reaches about a quarter of raw loopback TCP on this machine, and an
aiohttp handler that only reads and discards the body does hardly better (benchmarks/ps_apply.py):
the HTTP framework, not the PS, is the ceiling. Here a connection reads each payload with
``asyncio.BufferedProtocol`` straight into one buffer allocated at its final size (the kernel copies
into it; no chunk objects, no joins), and the numpy view of that buffer is what the owner threads
apply. On plain TCP a payload of 64 KiB or more is received by the connection's own thread
instead of the loop (adamps.server.api.dp_reader, issue 27; headers, metas and TLS stay on the
loop). Only the hot ops are offered: ``push_dense`` and ``pull`` (raw float32 payloads), of a whole
tensor or of named shards, and the message ops ``push_fc``, ``push_compressed`` and, between
replicated servers, ``repl_multi`` (the message of ``/rpc`` with its arrays out of band in the
payload, handled by the op's ``/rpc`` handler; ``repl_multi`` by the replicator, which first checks
the sender's MAC at the payload's end, adamps.security.peer_auth); the rest stays on ``POST /rpc``.
Frames and clients: ``adamps.client.dataplane`` (peers: ``adamps.server.replication.peers``).

One write path: a push here goes through ``WritePath`` like a push on /rpc (the same checks, and on
a replicated server the lease check, two-phase commit and exactly-once by (client, seq)). The
token is in the meta and is checked before any payload byte is buffered; a frame's header and
meta must arrive within ``header_timeout`` of its first byte and its payload within
``body_timeout`` (deadlines: a byte now and then does not extend them), idle connections are
closed after ``idle_timeout``, and their number is capped (the HTTP limits of the PS config; when
full, the connection longest part-way through a header is closed first, then the longest idle);
meta and payload lengths are bounded (64 KiB, ``max_body``) before anything is allocated; tensor,
length and finiteness are checked before the update is queued. An error found before the payload
was read is answered and the connection closed (the stream cannot be resynced); an error found
after (NaN, Inf) is answered and the connection stays usable.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from adamps.client.dataplane import (
    ERROR,
    HEADER,
    MAGIC,
    MAX_INFLIGHT,
    MAX_META,
    REPLY,
    REQUEST,
    VERSION,
    reply_frame,
)
from adamps.layout import Shard
from adamps.security import tls
from adamps.server.api.dp_outbox import WRITE_STEP, Outbox
from adamps.server.api.dp_reader import PayloadReader, off_loop_min
from adamps.server.api.opfields import check_frame
from adamps.server.api.tenancy import Tenancy
from adamps.server.config import PsConfig
from adamps.server.psmetrics import PsMetrics
from adamps.server.reads import Reads
from adamps.server.store.shards import StoreError
from adamps.server.updates import bounds
from adamps.server.writepath import WritePath
from adamps.wire import protocol, ride
from adamps.wire.protocol import ProtocolError

log = logging.getLogger(__name__)

#: ops whose frame carries a whole /rpc message, its arrays out of band in the payload
#: (protocol.encode_oob), handled by the op's /rpc handler
MESSAGE_OPS = ("push_fc", "push_compressed", "repl_multi", "pull_rows", "push_rows", "round",
               "put_rows", "ckpt_install", "ckpt_read")  # fmt: skip
OPS = ("push_dense", "pull", *MESSAGE_OPS)

_HEADER, _META, _PAYLOAD, _CLOSED = range(4)
#: loop time of the last "too many connections" warning (one per 10 s)
_warned = [-1e9]


class DataPlaneProtocol(asyncio.BufferedProtocol):
    """One connection: header -> meta -> payload -> queued -> next header, replies in order.

    Requests may be pipelined: the next frame is read while earlier ones are applied, up to
    MAX_INFLIGHT per connection or max_body bytes of payloads (then reading pauses). Each request is validated and queued to
    the owner threads as soon as it is complete, in arrival order, so pushes on one connection are
    applied in the order sent and a pull sees the pushes sent before it. Replies go out in order.
    """

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.cfg = plane.cfg
        self.transport: asyncio.Transport | None = None
        #: the replies' pieces not yet handed to the transport (dp_outbox)
        self.outbox: Outbox | None = None
        self.state = _HEADER
        self.buf = np.empty(HEADER.size, dtype=np.uint8)
        self.view = memoryview(self.buf)
        self.pos = 0
        self.meta: dict[str, Any] = {}
        #: a repl_multi request's meta as received (decoded again with its payload)
        self.meta_raw = b""
        self.payload_len = 0
        #: requests queued whose reply is not written yet, and their payloads' bytes
        self.inflight = 0
        self.inflight_bytes = 0
        self.paused = False
        #: writes being prepared (decoded, checked) before they are queued: reading stays paused
        self.decoding = 0
        #: resolved once the reply of the latest request is written: the next one waits for it
        self.tail: asyncio.Future | None = None
        #: loop time of the last bytes received (or of the accept): the idle timer
        self.last_activity = 0.0
        #: loop time the current frame's first byte arrived, or its payload began: the deadlines
        #: (header_timeout, body_timeout) run from here, not from the last byte (issue 28: one
        #: header byte every 4 s kept a connection open forever)
        self.frame_started = 0.0
        #: the thread that receives this connection's large payloads (adamps.server.api.dp_reader),
        #: started on the first one; None on TLS connections (the loop reads them all)
        self.reader: PayloadReader | None = None
        #: a payload is being received by `reader` (reading on the loop is paused meanwhile)
        self.off_loop = False
        #: the shards of the push_dense whose payload is being read (from its meta's checks)
        self.push_shards: list[Shard] | None = None
        #: the reader thread found the current payload within the finite bounds (bounds.within)
        self.checked = False

    # -- asyncio callbacks ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.outbox = Outbox(transport)  # type: ignore[arg-type]
        self.last_activity = asyncio.get_running_loop().time()
        self.plane.conns.add(self)
        open_ = [c for c in self.plane.conns if c.open()]
        cap = self.cfg.http_limits.effective_max_connections()
        if len(open_) > cap:
            victim = self._victim(open_)
            now = self.last_activity
            if now - _warned[0] > 10.0:  # a flood would otherwise flood the log
                _warned[0] = now
                log.warning("data plane: %d connections (limit %d): closing the oldest idle ones",
                            len(open_), cap)  # fmt: skip
            assert victim.transport is not None
            victim.transport.close()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _victim(self, open_: list[DataPlaneProtocol]) -> DataPlaneProtocol:
        """The connection to close when the server is full: the one that has been part-way
        through a frame's header or meta the longest (a slowloris holds its slot that way), else
        the longest-idle one, else this new one. A trainer between requests is idle for
        milliseconds; a flood of slow or idle connections is what gets closed."""
        others = [c for c in open_ if c is not self]
        partial = [c for c in others if c.in_header()]
        if partial:
            return min(partial, key=lambda c: c.frame_started)
        idle = [c for c in others if c.idle()]
        return min(idle, key=lambda c: c.last_activity) if idle else self

    def pause_writing(self) -> None:
        assert self.outbox is not None
        self.outbox.pause()

    def resume_writing(self) -> None:
        assert self.outbox is not None
        self.outbox.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.outbox is not None:
            self.outbox.drop()
        self.state = _CLOSED
        self.plane.conns.discard(self)
        if self.reader is not None:
            self.reader.stop()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.state == _CLOSED:  # draining after a fatal error: discard what still arrives
            return memoryview(bytearray(65536))
        return self.view[self.pos :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.state == _CLOSED:
            return
        now = asyncio.get_running_loop().time()
        self.last_activity = now
        if self.state == _HEADER and self.pos == 0:
            self.frame_started = now  # a new frame: its header deadline starts
        self.pos += nbytes
        if self.pos < self.buf.size:
            return
        self._advance()

    def _advance(self) -> None:
        """The current part (header, meta or payload) is complete: on to the next."""
        try:
            if self.state == _HEADER:
                self._on_header()
            elif self.state == _META:
                self._on_meta()
            elif self.state == _PAYLOAD:
                self._on_payload()
        except ProtocolError as exc:
            self._fatal(exc)
        except StoreError as exc:
            self._fatal(ProtocolError(exc.code, exc.message))
        except Exception:  # a bug: logged, answered, this connection closed, the server lives on
            log.exception("data plane: unexpected error")
            self._fatal(ProtocolError("internal", "unexpected server error (logged)"))

    def eof_received(self) -> bool | None:
        return None  # close our side too

    # -- timeouts ---------------------------------------------------------------------------------

    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def idle(self) -> bool:
        """Between frames with nothing queued: waiting for the client's next request."""
        idle = self.state == _HEADER and self.pos == 0 and self.inflight == 0
        return idle and (self.outbox is None or self.outbox.empty())

    def in_header(self) -> bool:
        """Part-way through a frame's header or meta (some bytes in, not all)."""
        return (self.state == _HEADER and self.pos > 0) or self.state == _META

    def expired(self, now: float) -> bool:
        """Idle past idle_timeout (since the last byte), or past a deadline: a frame's header
        and meta complete within header_timeout of its first byte, its payload within
        body_timeout of the meta (issues 12 and 28: deadlines, not timers that each byte
        restarts)."""
        if self.state == _CLOSED:
            return False
        lim = self.cfg.http_limits
        if self.idle():
            return now - self.last_activity > lim.idle_timeout
        if self.state == _PAYLOAD:
            return now - self.frame_started > lim.body_timeout
        if self.in_header():
            return now - self.frame_started > lim.header_timeout
        return False  # between frames with requests in flight: the server is answering

    # -- states -----------------------------------------------------------------------------------

    def _expect(self, state: int, n: int) -> None:
        self.state = state
        # np.empty, not bytearray(n): no zero-filling pass over a multi-MB payload that the
        # kernel is about to overwrite anyway.
        self.buf = np.empty(n, dtype=np.uint8)
        self.view = memoryview(self.buf)
        self.pos = 0

    def _on_header(self) -> None:
        magic, version, kind, _zero, meta_len, payload_len = HEADER.unpack(self.view)
        if magic != MAGIC or kind != REQUEST:
            raise ProtocolError("malformed", "not a data-plane request frame (magic ADPS, kind 1)")
        if version != VERSION:
            raise ProtocolError(
                "unsupported_version", f"frame version must be {VERSION}, got {version}"
            )
        if meta_len == 0 or meta_len > MAX_META:
            raise ProtocolError(
                "too_large" if meta_len else "malformed",
                f"meta length {meta_len} not in 1..{MAX_META}",
            )
        if payload_len > self.cfg.max_body:
            raise ProtocolError(
                "too_large",
                f"payload of {payload_len} bytes exceeds the limit of {self.cfg.max_body} bytes",
            )
        self.payload_len = payload_len
        self.meta = {}
        self._expect(_META, meta_len)

    def _on_meta(self) -> None:
        self.frame_started = asyncio.get_running_loop().time()  # the payload's deadline
        meta = protocol.decode(self.view)
        self.meta = meta
        # The token before anything else: no payload of an unauthenticated peer is ever buffered.
        who = self.plane.tenancy.authenticate_now(meta.get("token"))
        op = check_frame(meta, OPS)  # envelope, op, and no field the op does not take
        # A run's token: its namespace and push rate (adamps/server/api/tenancy.py).
        self.plane.tenancy.check(who, op, meta, self.payload_len)
        # Tensor, length and shards are checked before any payload byte is buffered.
        self.push_shards, self.checked = None, False
        if op == "push_dense":
            self.push_shards = self.plane.writes.accept_stream_push(meta, self.payload_len)
            want = self.payload_len
        elif op in MESSAGE_OPS:
            if op not in self.plane.messages and not (
                op == "repl_multi" and self.plane.peer_frame is not None
            ):
                raise ProtocolError("unknown_op", f"{op} is served by a replicated server only")
            # Decoded again once its payload (the arrays, out of band) is here.
            self.meta_raw = bytes(self.view)
            want = self.payload_len
        else:
            self.plane.reads.accept_stream_pull(meta, self.payload_len)
            want = 0
        if want:
            self._expect(_PAYLOAD, want)
            if self.plane.off_loop_min is not None and want >= self.plane.off_loop_min:
                self._read_off_loop()
        else:
            self._dispatch(None)

    def _read_off_loop(self) -> None:
        """Hands the payload's reading to the connection's thread (plain TCP only): reading on
        the loop pauses until it is complete (_payload_read)."""
        assert self.transport is not None
        if self.reader is None:
            sock = self.transport.get_extra_info("socket")
            if sock is None or self.transport.get_extra_info("sslcontext") is not None:
                return  # TLS (or no socket): the loop reads it, as before
            self.reader = PayloadReader(sock, asyncio.get_running_loop())
        self.off_loop = True
        self.transport.pause_reading()
        left = self.cfg.http_limits.body_timeout - (
            asyncio.get_running_loop().time() - self.frame_started
        )
        buf = self.buf
        check = (lambda: bounds.within(buf.view("<f4"))) if self.push_shards is not None else None
        self.reader.read(
            self.view, time.monotonic() + left, self._payload_read, self._payload_failed, check
        )

    def _payload_read(self, checked: bool) -> None:
        """On the loop: the reader thread received the whole payload (`checked`: and found a
        push's values within the finite bounds)."""
        self.off_loop = False
        if self.state == _CLOSED:
            return
        self.checked = checked
        self.last_activity = asyncio.get_running_loop().time()
        self.pos = self.buf.size
        self._advance()  # dispatched; reading resumes unless the connection is full
        # (after a fatal error too: its input is read and discarded until the peer closes)
        if not self.off_loop and (not self.paused or self.state == _CLOSED):
            assert self.transport is not None
            if not self.transport.is_closing():
                self.transport.resume_reading()

    def _payload_failed(self, why: str) -> None:
        """On the loop: the payload did not arrive (peer gone, deadline): close, as the
        sweeper does for a payload late on the loop's path."""
        self.off_loop = False
        if self.transport is not None and not self.transport.is_closing():
            log.debug("data plane: closing a connection: %s", why)
            self.transport.close()

    def _on_payload(self) -> None:
        self._dispatch(self.buf)

    def _dispatch(self, payload: np.ndarray | None) -> None:
        """Validates and queues a complete request now (arrival order); replies in order later."""
        assert self.transport is not None
        meta = self.meta
        loop = asyncio.get_running_loop()
        prev, done = self.tail, loop.create_future()
        self.tail = done
        self.inflight += 1
        size = 0 if payload is None else int(payload.nbytes)
        self.inflight_bytes += size
        try:
            started: Any = self._start(meta, payload)
        except (ProtocolError, StoreError) as exc:  # bad payload: answered, connection usable
            started = (
                exc if isinstance(exc, ProtocolError) else ProtocolError(exc.code, exc.message)
            )
        loop.create_task(self._finish(meta, started, prev, done, size))
        self._expect(_HEADER, HEADER.size)
        if self._full() and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def _start(self, meta: dict[str, Any], payload: np.ndarray | None) -> Any:
        """Queues the request (the write path or the read path); returns (future, reply builder)."""
        if meta["op"] == "push_dense":
            assert payload is not None
            self.plane.m.bytes_in.inc(payload.size)
            return self.plane.writes.start_stream_push(
                payload, meta, self.push_shards, checked=self.checked
            )
        if meta["op"] == "repl_multi" and self.plane.peer_frame is not None:
            self.plane.m.bytes_in.inc(0 if payload is None else payload.size)
            fut = asyncio.ensure_future(self.plane.peer_frame(meta, self.meta_raw, payload))
            return fut, lambda r: (r, None)
        handler = self.plane.messages.get(meta["op"])
        if handler is not None:  # the /rpc handler of the op, on the message with its arrays
            msg = protocol.decode(self.meta_raw, b"" if payload is None else payload)
            self.plane.m.bytes_in.inc(0 if payload is None else payload.size)
            staged = self.plane.staged.get(meta["op"])
            if staged is not None:  # reading pauses from now until it is queued (_dispatch)
                self.decoding += 1
                handler = lambda m: self._prepare_then_queue(*staged, m)  # noqa: E731
            return asyncio.ensure_future(handler(msg)), lambda r: (r, None)
        return self.plane.reads.start_stream_pull(meta)

    async def _prepare_then_queue(self, prepare: Any, apply: Any, msg: dict[str, Any]) -> Any:
        """A write checked and decoded (a large one on a worker thread, issues 28 and 39), then
        queued. The connection reads no further frame meanwhile (`decoding` keeps it paused):
        the requests behind it are queued after it, and a pull sees it."""
        try:
            prepared = await prepare(msg)
            # queued (its first step runs) before any later frame of this connection is read
            fut = asyncio.ensure_future(apply(prepared))
        finally:
            self.decoding -= 1
            self._resume_if_room()
        return await fut

    def _resume_if_room(self) -> None:
        if self.paused and not self._full() and self.state != _CLOSED and not self.off_loop:
            self.paused = False
            if self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()

    def _full(self) -> bool:
        """Whether reading pauses: MAX_INFLIGHT requests, or max_body bytes of payloads, wait
        for their replies. The byte bound keeps a connection's queued payloads (held until
        applied) at about max_body, however large the push the client cut into parts: memory
        sized by configuration, not by the model (issue 30)."""
        return (
            self.inflight >= MAX_INFLIGHT
            or self.inflight_bytes >= self.cfg.max_body
            or self.decoding > 0
        )

    async def _finish(
        self,
        meta: dict[str, Any],
        started: Any,
        prev: asyncio.Future | None,
        done: asyncio.Future,
        size: int = 0,
    ) -> None:
        label = f"dp_{meta['op']}"
        t0 = time.perf_counter()
        try:
            if isinstance(started, ProtocolError):
                err: ProtocolError | None = started
                reply = out = None
            else:
                fut, build = started
                try:
                    reply, out = build(await fut)
                    err = None
                except (ProtocolError, StoreError) as exc:
                    err = (
                        exc
                        if isinstance(exc, ProtocolError)
                        else ProtocolError(exc.code, exc.message)
                    )
                except Exception:
                    log.exception("data plane: unexpected error in %s", meta["op"])
                    err = ProtocolError("internal", "unexpected server error (logged)")
            if prev is not None:
                await prev  # replies leave in request order
            if err is not None:
                self.plane.m.requests.labels(label, err.code).inc()
                self._send(ERROR, {"error": err.to_dict(), "rid": meta.get("rid")}, None)
            else:
                oob = meta["op"] in self.plane.oob_replies
                self._send(REPLY, {"rid": meta.get("rid"), **reply}, out, oob)
                ok, latency = self.plane.ok_metrics(label)
                ok.inc()
                latency.observe(time.perf_counter() - t0)
        finally:
            done.set_result(None)
            self.inflight -= 1
            self.inflight_bytes -= size
            self._resume_if_room()

    # -- replies ----------------------------------------------------------------------------------

    def _send(
        self, kind: int, meta: dict[str, Any], payload: np.ndarray | None, oob: bool = False
    ) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        writes, size = reply_frame(kind, meta, payload, oob, WRITE_STEP)
        assert self.outbox is not None
        self.outbox.write(writes)
        if size:
            self.plane.m.bytes_out.inc(size)

    def _fatal(self, exc: ProtocolError) -> None:
        """An error that leaves the stream unusable: answer after the earlier replies, then close."""
        rid = self.meta.get("rid") if isinstance(self.meta, dict) else None
        self.state = _CLOSED
        prev = self.tail

        async def answer_and_close() -> None:
            if prev is not None:
                await prev
            self._send(ERROR, {"error": exc.to_dict(), "rid": rid}, None)
            if self.outbox is not None:
                self.outbox.close_when_sent()

        asyncio.get_running_loop().create_task(answer_and_close())


class DataPlane:
    """The data port of one server: its listener, its open connections and their sweeper. Pushes
    go to the write path, pulls to the read path, a peer's replication messages to the
    replicator's ``op_repl_multi``, each message op to the handler it has on /rpc, and nowhere
    else."""

    def __init__(
        self,
        cfg: PsConfig,
        writes: WritePath,
        reads: Reads,
        m: PsMetrics,
        peer: Callable[[dict[str, Any], bytes, np.ndarray | None], Awaitable[dict[str, Any]]]
        | None = None,
        *,
        tenancy: Tenancy,
    ) -> None:
        self.cfg = cfg
        #: who a frame is (its meta's token) and what a run's token may do (issue 25)
        self.tenancy = tenancy
        self.writes = writes
        self.reads = reads
        self.m = m
        #: the message ops served here: op -> its /rpc handler (repl_multi: the replicator's,
        #: on a replicated server only)
        self.messages: dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]] = {
            "push_fc": writes.op_push_fc,
            "push_compressed": writes.op_push_compressed,
        }
        #: write ops whose decoding may wait for a thread: op -> (prepare, apply), with the
        #: connection's reading paused between them (the order of one connection's requests)
        self.staged: dict[str, tuple[Any, Any]] = {}
        self.staged["push_compressed"] = (writes.prepare_compressed, writes.apply_compressed)
        #: message ops whose reply's arrays travel out of band, as its raw payload (reply_frame)
        self.oob_replies: set[str] = set()
        #: a peer's repl_multi frame (meta, meta bytes, payload): the replicator's, which checks
        #: the frame's MAC before it decodes it (on a replicated server only)
        self.peer_frame = peer
        #: open connections (closed at shutdown)
        self.conns: set[DataPlaneProtocol] = set()
        #: payloads from this size on are received on their connection's thread (None: all on
        #: the loop; ADAMPS_DP_RECV_THREAD=0)
        self.off_loop_min = off_loop_min()
        self._server: asyncio.Server | None = None
        #: op label -> its (requests ok, latency) metrics (ok_metrics)
        self._ok_metrics: dict[str, tuple[Any, Any]] = {}
        #: closes idle and stalled connections
        self._sweeper: asyncio.Task | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: DataPlaneProtocol(self),
            host,
            port,
            reuse_address=True,
            **tls.listen_kwargs(self.cfg.http_limits.header_timeout),
        )
        log.info("data plane listening on %s:%d%s", host, port, " (TLS)" if tls.enabled() else "")
        self._sweeper = asyncio.create_task(self.sweep())

    async def sweep(self, every: float = 0.5) -> None:
        """Closes expired connections (DataPlaneProtocol.expired) until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            # at most `every` apart: with another timer's wake-up when one is due (issue 36)
            await ride.sleep(every)
            now = loop.time()
            for conn in list(self.conns):
                if conn.expired(now) and conn.transport is not None:
                    conn.transport.close()

    def ok_metrics(self, label: str) -> tuple[Any, Any]:
        """The `requests` counter of (label, ok) and the `latency` histogram of `label`, looked
        up once: prometheus' labels() took a tenth of the loop's time per frame (issue 27)."""
        got = self._ok_metrics.get(label)
        if got is None:
            got = self._ok_metrics[label] = (
                self.m.requests.labels(label, "ok"),
                self.m.latency.labels(label),
            )
        return got

    def open_connections(self) -> int:
        return sum(1 for c in self.conns if c.open())

    def close(self) -> None:
        """Stops the sweeper and the listener, then closes the open connections."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()  # stops accepting; then the open connections
            for conn in list(self.conns):
                if conn.transport is not None:
                    conn.transport.close()
