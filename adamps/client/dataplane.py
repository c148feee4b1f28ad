"""The client side of a parameter server's binary data plane (``adamps.server.api.dataplane``): the
frame format both sides share, and a blocking client of one server's data port.

Frame (both directions): a 20-byte header ``<4s B B H I Q`` = magic ``b"ADPS"``, version 1,
kind (1 request, 2 reply, 3 error), 0, meta length, payload length; then the meta (a msgpack map,
see docs/protocol-ps.md) and the payload (raw bytes: float32 values for ``push_dense`` and
``pull``, the out-of-band arrays of ``repl_multi``).
"""

from __future__ import annotations

import collections
import socket
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np

from adamps.security import tls
from adamps.wire import protocol
from adamps.wire.protocol import ProtocolError

MAGIC = b"ADPS"
VERSION = 1
REQUEST, REPLY, ERROR = 1, 2, 3
HEADER = struct.Struct("<4sBBHIQ")
MAX_META = 64 << 10
#: requests of one connection queued or applying before the server pauses reading (pipelining)
MAX_INFLIGHT = 8


def frame_header(kind: int, meta_len: int, payload_len: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, 0, meta_len, payload_len)


#: payload parts below this many bytes are joined with their neighbours into one write
JOIN_BELOW = 64 << 10


def frame_writes(head: bytes, parts: Iterable[Any]) -> list[bytes | memoryview]:
    """A frame's bytes (`head`: its header and meta; then the payload's `parts`, bytes-like) as
    few writes: runs of small parts joined (a copy each), large ones as they are (the kernel
    copies them from the arrays' memory). Issue 36's profile of an RF 3 push_rows run: a
    replication frame of 21 buckets' rows was ~45 writes, each a send call in which loopback
    TCP also does the receiver's work, and the sends took an eighth of a server's event loop."""
    out: list[bytes | memoryview] = []
    run: list[Any] = [head]
    for p in parts:
        if memoryview(p).nbytes >= JOIN_BELOW:
            out += [b"".join(run), p]
            run = []
        else:
            run.append(p)
    if run:
        out.append(b"".join(run))
    return out


def reply_frame(
    kind: int, meta: dict[str, Any], payload: np.ndarray | None, oob: bool, step: int = 0
) -> tuple[list[bytes | memoryview], int]:
    """A reply frame's writes (frame_writes) and its payload's length. Its meta's arrays are
    written from their own memory: inside the msgpack meta (pull_rows' rows), or with `oob`
    out of band as the payload (``ckpt_read``'s shards, protocol.encode_oob: the client
    receives them into one buffer and its arrays are views of it, issue 38 item 7). `step`:
    most bytes per payload write (TLS)."""
    if oob:
        packed, pay, size = protocol.encode_oob(meta)
        meta_parts: list[Any] = [packed]
    else:
        meta_parts, _n = protocol.encode_parts(meta)
        pay = [memoryview(b"" if payload is None else payload).cast("B")]
        size = pay[0].nbytes
    step = step or size or 1
    chunks = [p[i : i + step] for p in pay for i in range(0, p.nbytes, step)]
    meta_len = sum(memoryview(p).nbytes for p in meta_parts)
    head = frame_header(kind, meta_len, size) + bytes(meta_parts[0])
    return frame_writes(head, [*meta_parts[1:], *chunks]), size


class DataPlaneError(ProtocolError):
    """An error frame from the server."""


def error_of(reply: dict[str, Any]) -> DataPlaneError:
    """The error an error frame's meta carries (an unknown code reads as ``internal``)."""
    err = reply.get("error") or {}
    code = err.get("code", "internal")
    return DataPlaneError(
        code if code in protocol.ERRORS else "internal",
        str(err.get("message", "")),
        **{k: v for k, v in err.items() if k not in ("code", "message")},
    )


class DataPlaneClient:
    """A blocking client of one PS's data plane (one connection; one thread at a time)."""

    def __init__(self, host: str, port: int, token: str, timeout: float = 30.0) -> None:
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = tls.wrap_client(sock, host)
        self.token = token
        self._hdr = bytearray(HEADER.size)
        #: rids of the shard requests sent whose reply is not read yet, oldest first
        self._rids: collections.deque[str] = collections.deque()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> DataPlaneClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _recv_exact(self, buf: memoryview) -> None:
        got = 0
        while got < len(buf):
            n = self.sock.recv_into(buf[got:])
            if n == 0:
                raise ConnectionError("data plane: connection closed by the server")
            got += n

    def _send_request(
        self, op: str, tensor: str, payload: np.ndarray | None, **fields: Any
    ) -> None:
        meta = protocol.encode(protocol.request(op, tensor=tensor, token=self.token, **fields))
        n = 0 if payload is None else payload.nbytes
        self.sock.sendall(frame_header(REQUEST, len(meta), n) + meta)
        if payload is not None:
            try:
                self.sock.sendall(memoryview(np.ascontiguousarray(payload, dtype="<f4")).cast("B"))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server refused the request early and closed: read its error frame

    def _read_head(self) -> tuple[int, int, bytearray]:
        """The next reply frame's kind, payload length and meta bytes (the payload is next)."""
        self._recv_exact(memoryview(self._hdr))
        magic, _v, kind, _z, meta_len, payload_len = HEADER.unpack(self._hdr)
        if magic != MAGIC:
            raise ConnectionError("data plane: bad reply frame")
        mbuf = bytearray(meta_len)
        self._recv_exact(memoryview(mbuf))
        return kind, payload_len, mbuf

    def _read_reply(
        self, out: np.ndarray | None = None
    ) -> tuple[dict[str, Any], memoryview | None, DataPlaneError | None]:
        kind, payload_len, mbuf = self._read_head()
        body: memoryview | None = None
        if payload_len:
            if out is not None and kind == REPLY and out.nbytes == payload_len:
                body = memoryview(out).cast("B")  # straight into the caller's array
            else:
                body = memoryview(np.empty(payload_len, dtype=np.uint8))  # no zero-filling
            self._recv_exact(body)
        # a reply's out-of-band arrays (reply_frame) are views of its payload
        reply = protocol.decode(mbuf, body if kind == REPLY and out is None else None)
        if kind == ERROR:
            return reply, None, error_of(reply)
        return reply, body, None

    def _request(
        self,
        op: str,
        tensor: str,
        payload: np.ndarray | None,
        out: np.ndarray | None = None,
        **fields: Any,
    ) -> tuple[dict[str, Any], memoryview | None]:
        self._send_request(op, tensor, payload, **fields)
        reply, body, err = self._read_reply(out)
        if err is not None:
            raise err
        return reply, body

    def push_many(
        self, items: list[tuple[str, np.ndarray]], window: int = 4
    ) -> list[dict[str, int] | DataPlaneError]:
        """Pipelined pushes: up to `window` (<= MAX_INFLIGHT) in flight on this connection,
        applied in order. Returns, per item, its versions or the error the server answered."""
        if not 1 <= window <= MAX_INFLIGHT:
            raise ValueError(f"window must be in 1..{MAX_INFLIGHT}")
        results: list[dict[str, int] | DataPlaneError] = []
        sent = 0
        while len(results) < len(items):
            while sent < len(items) and sent - len(results) < window:
                tensor, delta = items[sent]
                if delta.dtype != np.float32:
                    raise TypeError("delta must be float32")
                self._send_request("push_dense", tensor, delta)
                sent += 1
            try:
                reply, _, err = self._read_reply()
            except ConnectionError:
                # The server closed after a fatal error answered above: the rest was not applied.
                while len(results) < len(items):
                    results.append(
                        DataPlaneError(
                            "unavailable",
                            "not applied: the server closed the connection after an earlier error",
                        )
                    )
                break
            results.append(err if err is not None else reply["versions"])
        return results

    def push_dense(self, tensor: str, delta: np.ndarray, **fields: Any) -> dict[str, int]:
        """Applies delta (the whole tensor, float32) like push_dense on /rpc; returns the versions."""
        if delta.dtype != np.float32:
            raise TypeError("delta must be float32")
        reply, _ = self._request("push_dense", tensor, delta, **fields)
        return reply["versions"]

    def pull(self, tensor: str, out: np.ndarray | None = None) -> tuple[np.ndarray, list[int]]:
        """The whole tensor and its shard versions. With `out` (a C-contiguous float32 array of
        the tensor's size) the values are received straight into it; else into a new array."""
        if out is not None and (out.dtype != np.float32 or not out.flags.c_contiguous):
            raise TypeError("out must be a C-contiguous float32 array")
        reply, body = self._request("pull", tensor, None, out=out)
        assert body is not None
        if out is not None and out.nbytes == body.nbytes:  # _read_reply received into out
            return out.reshape(reply["shape"]), reply["versions"]
        return np.frombuffer(body, dtype="<f4").reshape(reply["shape"]), reply["versions"]

    # -- shards (a replicated cluster: one request per primary) -----------------------------------

    def send_push_shards(self, ids: list[str], parts: list[np.ndarray], **fields: Any) -> None:
        """Sends a push_dense of the shards `ids` (their deltas `parts`, float32, in that order;
        `fields`: `client`, `seq`) without waiting for the reply (read_push_reply): a client
        sends to every primary first, then reads, so the servers work side by side."""
        req = protocol.request("push_dense", shards=ids, token=self.token, **fields)
        meta = protocol.encode(req)
        self._rids.append(req["rid"])
        n = sum(p.nbytes for p in parts)
        self.sock.sendall(frame_header(REQUEST, len(meta), n) + meta)
        try:
            for p in parts:
                self.sock.sendall(memoryview(np.ascontiguousarray(p, dtype="<f4")).cast("B"))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused the request early and closed: read its error frame

    def send_message(self, op: str, **fields: Any) -> bool:
        """Sends a message op (``push_fc``, ``push_compressed``): the message of ``/rpc``, its
        arrays out of band in the payload. False, and nothing sent, when the message's meta
        (everything but the arrays) exceeds a frame's: send it over HTTP. Read the reply with
        read_push_reply."""
        req = protocol.request(op, token=self.token, **fields)
        meta, parts, n = protocol.encode_oob(req)
        if len(meta) > MAX_META:
            return False
        self._rids.append(req["rid"])
        self.sock.sendall(frame_header(REQUEST, len(meta), n) + meta)
        try:
            for p in parts:
                self.sock.sendall(p)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused the request early and closed: read its error frame
        return True

    def read_push_reply(self) -> dict[str, int]:
        reply, _, err = self._read_reply()
        self._check_rid(reply)
        if err is not None:
            raise err
        return reply["versions"]

    def read_message_reply(self) -> dict[str, Any]:
        """The reply to a message op (``send_message``), whole: ``pull_rows``' rows."""
        reply, _, err = self._read_reply()
        self._check_rid(reply)
        if err is not None:
            raise err
        return reply

    def _check_rid(self, reply: dict[str, Any]) -> None:
        """The reply answers the oldest request sent (a fatal error's reply may carry no rid);
        anything else means the stream is out of step: never take it as an acknowledgement."""
        want = self._rids.popleft() if self._rids else None
        rid = reply.get("rid")
        if rid is not None and rid != want:
            raise ConnectionError(f"data plane: reply {rid!r} to request {want!r} out of step")

    def send_pull_shards(self, ids: list[str]) -> None:
        """Asks for the values of shards `ids` (read them with read_pull_reply)."""
        req = protocol.request("pull", shards=ids, token=self.token)
        meta = protocol.encode(req)
        self._rids.append(req["rid"])
        self.sock.sendall(frame_header(REQUEST, len(meta), 0) + meta)

    def read_pull_reply(self, outs: list[np.ndarray]) -> list[int]:
        """Receives a pull of shards straight into `outs` (C-contiguous float32 arrays of the
        shards' sizes, in request order); returns their versions."""
        kind, payload_len, mbuf = self._read_head()
        if kind == ERROR or payload_len != sum(o.nbytes for o in outs):
            # An error (or a reply that does not fit): read whatever follows, then report it.
            self._recv_exact(memoryview(np.empty(payload_len, dtype=np.uint8)))
            reply = protocol.decode(mbuf)
            self._check_rid(reply)
            if kind != ERROR:
                raise ConnectionError("data plane: pull reply of an unexpected length")
            raise error_of(reply)
        reply = protocol.decode(mbuf)
        self._check_rid(reply)
        for o in outs:  # scattered straight into the caller's arrays: no staging copy
            self._recv_exact(memoryview(o).cast("B"))
        return list(reply["versions"])
