"""The peers of a replicated server: their addresses (learnt from the controllers' roles), one
RPC client per address, and one aggregating channel per peer for the replication messages, sent
over the peer's data port when it has one (``PeerStream``), else over HTTP. ``Peers.send`` is
the replication core's transport: the simulation has an in-memory one with the same interface
(tests/core/test_replication_sim.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from adamps.client.dataplane import (
    ERROR,
    HEADER,
    MAGIC,
    MAX_META,
    REPLY,
    REQUEST,
    frame_header,
    frame_writes,
)
from adamps.client.rpc import AsyncRpc, RpcError, rpc_request
from adamps.core.replication.ready import Fetch, Send
from adamps.core.replication.settings import RATE_FLOOR
from adamps.security import peer_auth, tls
from adamps.server.replication.peer_keys import PeerKeys
from adamps.server.replication.wire import batch_to_wire
from adamps.wire import protocol

log = logging.getLogger(__name__)

#: seconds between two lookups of a peer's data port (GET /status) when it has none or is down
LOOKUP_EVERY = 2.0
#: a peer's request times out after this many member timeouts plus its size at RATE_FLOOR: only
#: a safety net, freeing the socket of a peer that never answers. Whether a peer answered in time
#: is the core's to decide, at each message's deadline (adamps/core/replication/deadlines.py,
#: issue 40), which comes first; a failure reported after it changes nothing.
SAFETY = 3
#: bytes of a frame to a peer written at a time (PeerStream._exchange)
WRITE_STEP = 1 << 20


#: bytes from which a segment's digest is kept for the other peers' frames (SegmentDigests):
#: below, hashing it again (SHA-256 at 0.5-2 GB/s: 8-30 us for 16 KiB) costs no more than the
#: cache's bookkeeping. Issue 36's profile of a click-through step at RF 3: its 128 small row
#: arrays (ids, gradients; 112 bytes to 2 KiB) thrashed a cache of 64, never reused, and the
#: bookkeeping took 3.5 times the hashing (5% of a server's event loop).
CACHE_FROM = 16 << 10


class SegmentDigests:
    """The SHA-256 of each out-of-band array of the frames to the peers (with its padding: one
    MAC segment, peer_auth.segment_digests), kept for the few frames that send the same arrays
    to the other peers. A batch's arrays are never changed once submitted (every replica must
    apply the same bytes); a cached digest holds its array, so its id is not reused meanwhile
    (the arrays of the last `size` segments of at least `cache_from` bytes: batches the
    replication log holds anyway; smaller ones are hashed for each frame)."""

    def __init__(self, size: int = 64, cache_from: int = CACHE_FROM) -> None:
        #: id(array) -> (array, segment length, digest), oldest first
        self._cache: dict[int, tuple[Any, int, bytes]] = {}
        self.size = size
        self.cache_from = cache_from
        #: digests computed and reused (tests, and the benchmark's reading of a profile)
        self.computed = self.reused = 0
        self._lock = threading.Lock()

    def of(self, parts: list[memoryview], starts: list[int]) -> list[bytes]:
        """The digests of the segments of a frame's payload: `parts` as protocol.encode_oob
        returned them, `starts` the indices of the parts where its arrays start. Empty segments
        (arrays of no bytes) have none, as on the receiving side. Thread-safe: a large frame is
        signed on a worker thread, and the frames of one batch to two peers may be signed at
        once (each may hash an array the other is hashing: the same digest)."""
        out = []
        bounds = [*starts, len(parts)]
        small = 0
        for i, j in zip(bounds, bounds[1:], strict=False):
            seg = parts[i:j]
            length = sum(len(p) for p in seg)
            if not length:
                continue
            if length < self.cache_from:
                out.append(peer_auth.segment_digest(seg))
                small += 1
                continue
            obj = seg[0].obj
            with self._lock:  # the cache only: the hashing runs outside it
                hit = self._cache.get(id(obj))
            if hit is not None and hit[0] is obj and hit[1] == length:
                out.append(hit[2])
                self.reused += 1
                continue
            d = peer_auth.segment_digest(seg)
            with self._lock:
                self.computed += 1
                self._cache[id(obj)] = (obj, length, d)
                while len(self._cache) > self.size:
                    del self._cache[next(iter(self._cache))]
            out.append(d)
        if small:
            with self._lock:
                self.computed += small
        return out


class PeerStream:
    """``repl_multi`` over one TCP connection to a peer's data port (``adamps.server.api.dataplane``).

    The batches' arrays travel out of band (``protocol.encode_oob``): written from their own
    memory after the meta, received into one buffer and applied as views of it, and no HTTP is
    parsed on either side. One request at a time: ``PeerChannel`` sends the next one once this
    one is answered. Any failure closes the connection (a half-done exchange leaves the stream out
    of step); the next call opens a new one."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        timeout: float,
        digests: SegmentDigests,
    ) -> None:
        self.host, self.port = host, port
        self.token = token
        self.timeout = timeout
        #: the segments' digests shared by every peer's stream
        self.digests = digests
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    def fits(
        self, msg: dict[str, Any], sender: str, key: bytes | None
    ) -> tuple[bytes, list[memoryview], int, str] | None:
        """The encoded request, or None when its meta exceeds a frame's (send it over HTTP).
        With a pair key, the meta names the sender and the payload ends with the MAC that the
        peer checks before it reads a field (adamps.security.peer_auth): the segmented frame MAC (each
        array hashed once for all peers)."""
        encoded = self.encode(msg, sender, key)
        return None if encoded is None else self.sign(encoded, key)

    async def fits_async(
        self, msg: dict[str, Any], sender: str, key: bytes | None
    ) -> tuple[bytes, list[memoryview], int, str] | None:
        """`fits`, with a large frame hashed on a worker thread (issue 39: the event loop held
        while a 64 MiB batch was hashed)."""
        encoded = self.encode(msg, sender, key)
        if encoded is None:
            return None
        if key is not None and encoded[2] >= peer_auth.HASH_OFF_LOOP:
            return await asyncio.to_thread(self.sign, encoded, key)
        return self.sign(encoded, key)

    def encode(
        self, msg: dict[str, Any], sender: str, key: bytes | None
    ) -> tuple[bytes, list[memoryview], int, str, list[int]] | None:
        """The request's meta and payload parts (no array copied), unsigned; None when its meta
        exceeds a frame's."""
        extra: dict[str, Any] = {}
        if key is not None:
            extra["peer"] = sender
            extra["mac"] = peer_auth.FRAME_MAC
        req = protocol.request("repl_multi", token=self.token, **extra, **msg)
        starts: list[int] = []
        meta, parts, n = protocol.encode_oob(req, starts)
        if len(meta) > MAX_META:
            return None
        return meta, parts, n, req["rid"], starts

    def sign(
        self, encoded: tuple[bytes, list[memoryview], int, str, list[int]], key: bytes | None
    ) -> tuple[bytes, list[memoryview], int, str]:
        """An encoded request with its MAC appended (with a pair key): hashes every payload
        byte not hashed before (SegmentDigests), so a large one runs on a worker thread."""
        meta, parts, n, rid, starts = encoded
        if key is not None:
            tag = peer_auth.frame_mac(key, meta, self.digests.of(parts, starts))
            parts = [*parts, memoryview(tag)]
            n += peer_auth.MAC_SIZE
        return meta, parts, n, rid

    async def call(self, encoded: tuple[bytes, list[memoryview], int, str]) -> dict[str, Any]:
        try:
            async with asyncio.timeout(self.timeout + encoded[2] / RATE_FLOOR):
                return await self._exchange(*encoded)
        except asyncio.IncompleteReadError as exc:
            self.close()
            raise ConnectionError(f"peer {self.host}:{self.port} closed the data plane") from exc
        except BaseException:
            self.close()
            raise

    async def _exchange(
        self, meta: bytes, parts: list[memoryview], n: int, rid: str
    ) -> dict[str, Any]:
        if self._conn is None:
            r, w = await asyncio.open_connection(
                self.host, self.port, **tls.connect_kwargs(self.host)
            )
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conn = (r, w)
        r, w = self._conn
        for chunk in frame_writes(frame_header(REQUEST, len(meta), n) + meta, parts):
            # large arrays straight from their memory (the kernel copies), a MiB at a time: what
            # the socket does not take at once is copied into the transport's buffer on the
            # event loop (a 64 MiB batch in one write held it, issue 39)
            view = memoryview(chunk).cast("B")
            for i in range(0, len(view), WRITE_STEP):
                w.write(view[i : i + WRITE_STEP])
                if len(view) > WRITE_STEP:
                    await w.drain()
        await w.drain()
        magic, _v, kind, _z, meta_len, payload_len = HEADER.unpack(await r.readexactly(HEADER.size))
        if magic != MAGIC or kind not in (REPLY, ERROR) or meta_len > MAX_META or payload_len:
            raise ConnectionError(f"peer {self.host}:{self.port}: not a data-plane reply")
        reply = protocol.decode(await r.readexactly(meta_len))
        if kind == ERROR:
            self.close()  # the server may close after a fatal error: start afresh
            err = dict(reply.get("error") or {})
            code = err.pop("code", "internal")
            raise RpcError(code if code in protocol.ERRORS else "internal",
                           str(err.pop("message", "")), **err)  # fmt: skip
        if reply.get("rid") != rid:
            raise ConnectionError(f"peer {self.host}:{self.port}: reply out of step")
        return reply

    def close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None


class PeerChannel:
    """Replication messages to one peer, aggregated: while one request is in flight, the next
    messages queue and travel together in the following request (op repl_multi), in order.

    One HTTP request then carries the PREPAREs and COMMITs of many buckets' rounds: on loopback
    the cost of replication is the number of requests far more than their bytes."""

    def __init__(
        self,
        rpc: AsyncRpc,
        token: str,
        timeout: float,
        keys: PeerKeys,
        member: str,
        digests: SegmentDigests | None = None,
    ) -> None:
        self.rpc = rpc
        #: the array digests shared by the channels of one server (Peers.digests)
        self.digests = digests or SegmentDigests()
        self.token = token
        self.timeout = timeout
        #: this server's peer identity (signs every message when enabled)
        self.keys = keys
        #: the peer's server id (whose pair key signs)
        self.member = member
        #: (op, fields, its future or its answer's callback) of each message queued
        self._queue: list[tuple[str, dict[str, Any], Any]] = []
        #: the answers of one reply are handed out inside one of these (Peers.batch)
        self.batch: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
        self._task: asyncio.Task | None = None
        #: the peer's data plane (None: HTTP), and when it was last looked up
        self.stream: PeerStream | None = None
        self._looked_up = -1e9

    async def _stream(self) -> PeerStream | None:
        """The peer's data plane, as its GET /status advertises it (looked up again now and then
        while it has none, or after a failure: a restarted peer may have another port)."""
        if self.stream is not None or time.monotonic() - self._looked_up < LOOKUP_EVERY:
            return self.stream
        self._looked_up = time.monotonic()
        try:
            status = await self.rpc.get_json("/status")
            port = int(status.get("data_port") or 0)
        except (RpcError, ConnectionError, TimeoutError, OSError, ValueError, AttributeError):
            return None
        if port:
            host = urlsplit(self.rpc.base_url).hostname or "127.0.0.1"
            self.stream = PeerStream(host, port, self.token, self.timeout, self.digests)
        return self.stream

    async def _http(self, msg: dict[str, Any]) -> dict[str, Any]:
        return await signed_call(self.rpc, self.keys, self.member, "repl_multi", msg)

    async def _send(self, msg: dict[str, Any]) -> dict[str, Any]:
        stream = await self._stream()
        key = await self.keys.key(self.member) if self.keys.enabled else None
        encoded = None if stream is None else await stream.fits_async(msg, self.keys.server_id, key)
        if stream is None or encoded is None:
            return await self._http(msg)
        try:
            return await stream.call(encoded)
        except (ConnectionError, OSError):
            self.stream = None  # look the port up again before the next message
            raise

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        return await self.post(op, fields)

    def post(
        self,
        op: str,
        fields: dict[str, Any],
        answer: Callable[[Any, BaseException | None], None] | None = None,
    ) -> asyncio.Future | None:
        """Queues one message now. Its reply (or the error) goes to `answer`, called from the
        channel's task, every answer of one reply inside one ``batch``; without `answer`, to
        the future returned."""
        target = answer or asyncio.get_running_loop().create_future()
        self._queue.append((op, fields, target))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="peer-channel")
        return None if answer is not None else target

    async def _run(self) -> None:
        while self._queue:
            items, self._queue = self._queue, []
            try:
                reply = await self._send({"items": [{"op": op, **f} for op, f, _ in items]})
                results = reply["results"]
                if len(results) != len(items):
                    raise ConnectionError(f"peer {self.member}: {len(results)} results")
            except Exception as exc:  # the whole request failed: so did each message
                with self.batch():
                    for _op, _f, target in items:
                        _deliver(target, None, exc)
                continue
            with self.batch():  # issue 36: one Ready carried out for a reply's answers
                for (_op, _f, target), res in zip(items, results, strict=True):
                    if "error" in res:
                        err = dict(res["error"])
                        exc = RpcError(err.pop("code"), err.pop("message"), **err)
                        _deliver(target, None, exc)
                    else:
                        _deliver(target, res["ok"], None)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.stream is not None:
            self.stream.close()


def _deliver(target: Any, result: Any, exc: BaseException | None) -> None:
    """A message's reply or error to its future, or to its answer's callback (whose failure is
    logged: the other answers of the reply are still handed out)."""
    if isinstance(target, asyncio.Future):
        if target.done():
            return
        if exc is None:
            target.set_result(result)
        else:
            target.set_exception(exc)
        return
    try:
        target(result, exc)
    except Exception:  # noqa: BLE001  (as a future's callback's failure is logged)
        log.exception("a peer's answer could not be handed to the core")


def _answered(
    msg: Send,
    done: Callable[[dict[str, Any] | None, str | None], None],
    reply: dict[str, Any] | None,
    exc: BaseException | None,
) -> None:
    """A message's reply or error (Peers.send) handed to `done`."""
    if exc is None:
        done(reply, None)
    elif isinstance(exc, RpcError):
        done(None, exc.code)
    elif isinstance(exc, ConnectionError | TimeoutError | OSError):
        done(None, "connection")
    else:  # a bug here must not leave the message in flight
        log.error("sending %s to %s failed", msg.op, msg.peer, exc_info=exc)
        done(None, "internal")


async def signed_call(
    rpc: AsyncRpc, keys: PeerKeys, member: str, op: str, fields: dict[str, Any]
) -> dict[str, Any]:
    """`op` on the peer's /rpc, with the MAC of its body when peer identity is on."""
    # Encoded on a worker thread: msgpack copies every array into the body (a batch over
    # HTTP, when the peer's data port is unknown or its meta too large, held the loop, issue 39)
    req = await asyncio.to_thread(functools.partial(rpc_request, op, **fields))
    assert req.body is not None
    hdrs = await keys.sign(member, req.body)
    return await rpc.send(dataclasses.replace(req, extra_headers=hdrs) if hdrs else req)


def snapshot_timeout(member_timeout: float) -> float:
    """Seconds a joiner waits for a snapshot: 10 member timeouts, at least 10 s."""
    return max(10.0, 10 * member_timeout)


class Peers:
    """Server id -> address, and the clients to reach them. Lives on the PS's event loop."""

    def __init__(self, token: str, timeout: float, keys: PeerKeys) -> None:
        self.token = token
        #: this server's peer identity
        self.keys = keys
        #: the member timeout: a request's safety timeout is SAFETY of them (plus its size)
        self.timeout = timeout
        #: server id -> "host:port" (from the controllers' roles)
        self.addresses: dict[str, str] = {}
        #: the HTTP session of every peer client (opened at start)
        self.session: aiohttp.ClientSession | None = None
        self._rpcs: dict[str, AsyncRpc] = {}
        #: the clients of snapshot fetches (`snapshot`): their own, longer timeout
        self._snap_rpcs: dict[str, AsyncRpc] = {}
        self._channels: dict[str, PeerChannel] = {}
        #: the answers of one reply are handed to the core inside one of these (the shell's
        #: Carrier.batch: their Ready carried out once)
        self.batch: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
        #: the arrays' digests of the data-plane frames, shared by every peer's channel: a
        #: batch sent to two secondaries is hashed once (peer_auth.frame_mac)
        self.digests = SegmentDigests()

    def channel(self, server: str) -> PeerChannel:
        """The aggregating channel to a peer (prepare, commit and ping messages)."""
        rpc = self.rpc(server)
        ch = self._channels.get(rpc.base_url)
        if ch is None:
            ch = self._channels[rpc.base_url] = PeerChannel(
                rpc, self.token, SAFETY * self.timeout, self.keys, server, self.digests
            )
        ch.member, ch.batch = server, self.batch
        return ch

    async def snapshot(self, f: Fetch) -> dict[str, Any] | None:
        """The snapshot a joining copy asks its primary for (the core's Fetch), over HTTP,
        signed; None when it failed (the core asks again)."""
        fields = {"bucket": f.bucket, "joiner": self.keys.server_id, "join": f.join}
        try:
            rpc = self.rpc(f.primary)
            # A snapshot carries the whole bucket (an embedding table's: megabytes of rows):
            # timed out at the member timeout, a loaded primary's answer came too late each
            # time, and the joiner asked for the bucket again and again (issue 38).
            snap = self._snap_rpcs.get(rpc.base_url)
            if snap is None:
                snap = self._snap_rpcs[rpc.base_url] = AsyncRpc(
                    rpc.base_url, self.token, self.session, snapshot_timeout(self.timeout)
                )
            return await signed_call(snap, self.keys, f.primary, "repl_snapshot", fields)
        except (RpcError, ConnectionError, TimeoutError, OSError) as exc:
            log.info("bucket %d: snapshot from %s failed: %s; again", f.bucket, f.primary, exc)
            return None

    def learn(self, roles: list[dict[str, Any]]) -> None:
        """The addresses of the servers a heartbeat's roles name."""
        for r in roles:
            if r.get("address") and r.get("primary"):
                self.addresses[r["primary"]] = r["address"]
            for sid, addr in (r.get("secondary_addresses") or {}).items():
                if addr:
                    self.addresses[sid] = addr

    def rpc(self, server: str) -> AsyncRpc:
        addr = self.addresses.get(server)
        if addr is None:
            raise ConnectionError(f"no address known for server {server!r}")
        rpc = self._rpcs.get(addr)
        if rpc is None:
            rpc = self._rpcs[addr] = AsyncRpc(addr, self.token, self.session, SAFETY * self.timeout)
        return rpc

    def send(self, msg: Send, done: Callable[[dict[str, Any] | None, str | None], None]) -> None:
        """The replication core's message over the peer's aggregating channel. Every message
        gets exactly one answer through `done`, always from a later loop step (never inside
        the caller's drain): the reply, or an error code ("connection": the connection failed,
        or no reply came within the safety timeout, long after the core's deadline for it).
        Queued at once, without a task per message: a click-through step at RF 3 is ~46
        messages per server (issue 36's profile)."""
        loop = asyncio.get_running_loop()
        try:
            fields = dict(msg.fields)
            if "entries" in fields:
                fields["entries"] = [batch_to_wire(e) for e in fields["entries"]]
            self.channel(msg.peer).post(msg.op, fields, functools.partial(_answered, msg, done))
        except (ConnectionError, OSError):  # e.g. no address known for the peer yet
            loop.call_soon(done, None, "connection")
        except Exception:  # noqa: BLE001  (a bug here must not leave the message in flight)
            log.exception("sending %s to %s failed", msg.op, msg.peer)
            loop.call_soon(done, None, "internal")

    def ping(self, member: str, buckets: dict[str, int], done: Callable[[list[Any]], None]) -> None:
        """The primary's ping (adamps.core.replication.pings) to one replica over its channel: `done`
        gets the buckets the replica answered stale. An unanswered ping is not reported: the
        next one follows."""
        asyncio.create_task(self._ping(member, buckets, done), name=f"ping-{member}")

    async def _ping(
        self, member: str, buckets: dict[str, int], done: Callable[[list[Any]], None]
    ) -> None:
        try:
            reply = await self.channel(member).call(
                "repl_ping", sender=self.keys.server_id, buckets=buckets
            )
        except (RpcError, ConnectionError, TimeoutError, OSError):
            return
        done(reply.get("stale") or [])

    def close(self) -> None:
        """Cancels the channels' sending tasks."""
        for ch in self._channels.values():
            ch.close()
