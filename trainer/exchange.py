"""How the partitions of one model replica exchange activations and errors (DistBelief 3).

A replica cut into K partitions (trainer/partition.py) needs, before each layer with
parameters, the whole of the previous layer's output, of which partition k holds a slice of
the last axis (its feature maps, its units): an **all-gather**. Backward, each partition holds
a partial error of that whole input (the part its own filters or units contribute) and needs
the sum of the K partials over its own slice: a **reduce-scatter**. Each crossing value goes
once to each partition that needs it, never more (DistBelief 3: "its state is only sent to the
machine on the other side of that boundary once").

Two transports behind one ``Link`` interface (point to point, both directions, in order):

- ``tcp``: length-prefixed frames on a TCP connection, sent by a thread per link so that two
  partitions sending each other large frames at once cannot deadlock on full socket buffers;
- ``shm``: within a machine, the bytes go through ``multiprocessing.shared_memory`` (one
  segment per direction, one message in flight: the sender waits for the receiver's ack before
  it overwrites the segment); the TCP connection only carries one-byte "data"/"ack" signals,
  which never fill a socket buffer.

The mesh is set up per Hogwild worker: worker w of partition k pairs with worker w of every
other partition (they train the same minibatches). Partition k listens on its address's port
+ w and connects to the lower partitions; the handshake carries a digest of the cluster token
and, for ``shm``, the segment names. Both segments are unlinked as soon as both sides mapped
them, so a SIGKILLed partition leaks no shared memory.

A peer that dies closes its sockets: the next exchange raises ``PeerLost`` (an EOF), and the
worker fails, which fails the partition (trainer/partitioned.py stops the replica).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

TRANSPORTS = ("shm", "tcp")
_MAGIC = b"APX1"
_HELLO = struct.Struct("!4sII32sB")  # magic, partition, worker, token digest, transport
_FRAME = struct.Struct("!Q")
_SIGNAL_DATA, _SIGNAL_ACK = b"D", b"A"


class PeerLost(ConnectionError):
    """A peer partition closed its connection (it died or stopped)."""


def token_digest(token: str) -> bytes:
    return hashlib.sha256(b"adamps-partition-exchange\0" + token.encode()).digest()


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise PeerLost("peer partition closed the connection")
        got += n


class Link:
    """One peer: ``send`` (may return before the peer has the bytes; the array must not change
    until ``flush``), ``recv_into`` (exactly ``out.nbytes``), counters for the metrics."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.bytes_sent = 0
        self.wait_seconds = 0.0  #: time blocked waiting for the peer

    def send(self, arr: np.ndarray) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def recv_into(self, out: np.ndarray) -> None:
        raise NotImplementedError

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class TcpLink(Link):
    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self._q: queue.Queue[memoryview | None] = queue.Queue()
        self._pending = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._sender, name="exchange-send", daemon=True)
        self._thread.start()

    def _sender(self) -> None:
        while True:
            view = self._q.get()
            if view is None:
                return
            try:
                self.sock.sendall(_FRAME.pack(len(view)))
                self.sock.sendall(view)
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                self._error = exc
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def send(self, arr: np.ndarray) -> None:
        if self._error is not None:
            raise PeerLost(f"sending to the peer partition failed: {self._error!r}")
        view = memoryview(np.ascontiguousarray(arr)).cast("B")
        with self._cond:
            self._pending += 1
        self.bytes_sent += len(view)
        self._q.put(view)

    def flush(self) -> None:
        t0 = time.perf_counter()
        with self._cond:
            while self._pending:
                self._cond.wait(1.0)
        self.wait_seconds += time.perf_counter() - t0
        if self._error is not None:
            raise PeerLost(f"sending to the peer partition failed: {self._error!r}")

    def recv_into(self, out: np.ndarray) -> None:
        t0 = time.perf_counter()
        head = bytearray(_FRAME.size)
        _recv_exact(self.sock, memoryview(head))
        (n,) = _FRAME.unpack(head)
        if n != out.nbytes:
            raise ValueError(f"frame of {n} bytes from the peer partition, expected {out.nbytes}")
        _recv_exact(self.sock, memoryview(out).cast("B"))
        self.wait_seconds += time.perf_counter() - t0

    def close(self) -> None:
        self._q.put(None)
        super().close()
        self._thread.join(2)


class ShmLink(Link):
    """Payload through shared memory; the counters that order it live there too.

    Each side writes only its own segment: the message (length, bytes), ``seq`` (messages it
    wrote) and ``ack`` (the peer's messages it consumed). A waiting side first spins on the
    peer's counters for up to ``SPIN_S`` (yielding the core between looks: partitions reach an
    exchange at about the same time, and a wake-up through the kernel costs more than the
    copy), then sleeps on the socket, where every write and every consumption also sends one
    signal byte. The counters are the truth; the bytes only wake a sleeper, and are drained
    whenever a side sleeps (and every ``_DRAIN`` messages, so they never fill the socket).
    """

    _HEAD = 64  # one cache line: [0] length, [1] seq, [2] ack (uint64 each), then the bytes
    #: ADAMPS_EXCHANGE_SPIN_US: how long to spin before sleeping (0: sleep at once, for
    #: machines with fewer cores than partitions)
    SPIN_S = float(os.environ.get("ADAMPS_EXCHANGE_SPIN_US", "500")) / 1e6
    _DRAIN = 128

    def __init__(
        self,
        sock: socket.socket,
        mine: shared_memory.SharedMemory,
        theirs: shared_memory.SharedMemory,
    ) -> None:
        super().__init__(sock)
        self._mine, self._theirs = mine, theirs
        self.capacity = mine.size - self._HEAD
        self._out = np.ndarray((mine.size,), np.uint8, buffer=mine.buf)
        self._in = np.ndarray((theirs.size,), np.uint8, buffer=theirs.buf)
        self._my = self._out[: self._HEAD].view(np.uint64)  # written here only
        self._peer = self._in[: self._HEAD].view(np.uint64)  # written by the peer only
        self._sent = 0  #: messages written (my seq)
        self._taken = 0  #: the peer's messages consumed (my ack)
        self._ops = 0

    def _sleep_until(self, ready: Any) -> None:
        t0 = time.perf_counter()
        deadline = t0 + self.SPIN_S
        while not ready():
            if time.perf_counter() < deadline:
                time.sleep(0)  # sched_yield: a neighbour on this core may run
                continue
            try:
                got = self.sock.recv(4096)
            except OSError as exc:
                raise PeerLost(f"peer partition gone: {exc!r}") from exc
            if not got:
                raise PeerLost("peer partition closed the connection")
        self.wait_seconds += time.perf_counter() - t0

    def _signal(self, byte: bytes) -> None:
        """Wakes the peer if it sleeps. Best effort: the counters already say everything, and
        a peer that finished may have closed its end; a dead peer is noticed where we wait."""
        self._ops += 1
        try:
            if self._ops % self._DRAIN == 0:
                self.sock.setblocking(False)
                try:
                    while self.sock.recv(65536):
                        pass
                except BlockingIOError:
                    pass
                finally:
                    self.sock.setblocking(True)
            self.sock.sendall(byte)
        except OSError:
            pass

    def send(self, arr: np.ndarray) -> None:
        n = arr.nbytes
        if n > self.capacity:
            raise ValueError(f"message of {n} bytes exceeds the shared segment ({self.capacity})")
        peer = self._peer
        self._sleep_until(lambda: int(peer[2]) >= self._sent)  # the previous one was read
        self._my[0] = n
        np.copyto(self._out[self._HEAD : self._HEAD + n].view(arr.dtype).reshape(arr.shape), arr)
        self._sent += 1
        self._my[1] = self._sent  # after the bytes: the peer reads them once it sees this
        self.bytes_sent += n
        self._signal(_SIGNAL_DATA)

    def recv_into(self, out: np.ndarray) -> None:
        peer = self._peer
        self._sleep_until(lambda: int(peer[1]) > self._taken)
        n = int(peer[0])
        if n != out.nbytes:
            raise ValueError(f"message of {n} bytes from the peer partition, expected {out.nbytes}")
        np.copyto(out, self._in[self._HEAD : self._HEAD + n].view(out.dtype).reshape(out.shape))
        self._taken += 1
        self._my[2] = self._taken
        self._signal(_SIGNAL_ACK)

    def flush(self) -> None:
        # the segment is free again once the peer consumed the last message: wait here so
        # that the wait is counted where it happens
        peer = self._peer
        self._sleep_until(lambda: int(peer[2]) >= self._sent)

    def close(self) -> None:
        super().close()
        del self._out, self._in, self._my, self._peer
        for shm in (self._mine, self._theirs):
            try:
                shm.close()
            except BufferError:
                pass


# Python 3.11 registers every segment, created or attached, with the resource tracker, which
# unlinks what is still registered when its process exits. The exchange unlinks both segments
# itself as soon as both sides mapped them, so neither side leaves them registered: the creator
# unregisters before it tells the peer the name (processes spawned by one parent share one
# tracker, and that order keeps its register/unregister pairs from interleaving), the peer
# right after attaching, and the unlink goes around the tracker.


def _create(size: int) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(create=True, size=size)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def _attach(name: str) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def _unlink(shm: shared_memory.SharedMemory) -> None:
    shared_memory._posixshmem.shm_unlink(shm._name)  # type: ignore[attr-defined]


def _handshake(sock: socket.socket, transport: str, capacity: int, connecting: bool) -> Link:
    if transport == "tcp":
        return TcpLink(sock)
    mine = _create(capacity + ShmLink._HEAD)
    try:
        name = mine.name.encode()
        sock.sendall(struct.pack("!H", len(name)) + name)
        head = bytearray(2)
        _recv_exact(sock, memoryview(head))
        (n,) = struct.unpack("!H", head)
        raw = bytearray(n)
        _recv_exact(sock, memoryview(raw))
        theirs = _attach(raw.decode())
        sock.sendall(b"M")  # mapped: the peer may unlink its segment
        _recv_exact(sock, memoryview(bytearray(1)))
        _unlink(mine)  # both sides mapped both segments: nothing left to leak after a SIGKILL
    except BaseException:
        _unlink(mine)  # the handshake failed: the segment must not outlive us
        mine.close()
        raise
    return ShmLink(sock, mine, theirs)


def parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"partition address {addr!r}: expected host:port")
    return host, int(port)


def connect_mesh(
    k: int,
    addrs: Sequence[str],
    worker: int,
    transport: str,
    token: str,
    capacity: int,
    timeout: float = 60.0,
    listener: socket.socket | None = None,
    bind: str | None = None,
) -> dict[int, Link]:
    """The links of worker ``worker`` of partition ``k`` to the same worker of every other
    partition. ``addrs[j]`` is partition j's host:port; worker w listens on port + w (on
    ``bind`` if given, e.g. 0.0.0.0 in a container, else on its own address's host)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r}: expected one of {TRANSPORTS}")
    n = len(addrs)
    digest = token_digest(token)
    deadline = time.monotonic() + timeout
    links: dict[int, Link] = {}
    own = listener
    if own is None and k < n - 1:
        host, port = parse_addr(addrs[k])
        own = socket.create_server((bind or host, port + worker))
    try:
        for j in range(k):  # connect to the lower partitions
            host, port = parse_addr(addrs[j])
            while True:
                try:
                    sock = socket.create_connection((host, port + worker), timeout=5)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"partition {j} ({host}:{port + worker}) did not answer"
                        ) from None
                    time.sleep(0.1)
            try:
                sock.settimeout(max(1.0, deadline - time.monotonic()))
                sock.sendall(_HELLO.pack(_MAGIC, k, worker, digest, TRANSPORTS.index(transport)))
                ok = bytearray(1)
                _recv_exact(sock, memoryview(ok))
                if ok != b"Y":
                    raise PermissionError(f"partition {j} refused the connection (token?)")
                links[j] = _handshake(sock, transport, capacity, connecting=True)
            except BaseException:
                sock.close()
                raise
        while len(links) < n - 1:  # accept the higher ones
            assert own is not None
            own.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                sock, _ = own.accept()
            except TimeoutError:
                raise TimeoutError(f"partition {k}: peers did not connect in time") from None
            sock.settimeout(5.0)  # a silent stranger must not hold up the real peers
            raw = bytearray(_HELLO.size)
            try:
                _recv_exact(sock, memoryview(raw))
            except (OSError, PeerLost):
                sock.close()
                continue
            magic, j, w, got, tr = _HELLO.unpack(raw)
            good = (
                magic == _MAGIC
                and hmac.compare_digest(got, digest)
                and w == worker
                and k < j < n
                and j not in links
                and tr == TRANSPORTS.index(transport)
            )
            if not good:
                try:
                    sock.sendall(b"N")
                except OSError:
                    pass  # a stranger that left already: refused all the same
                finally:
                    sock.close()
                continue
            try:
                sock.sendall(b"Y")
                links[j] = _handshake(sock, transport, capacity, connecting=False)
            except (OSError, PeerLost, ValueError, struct.error) as exc:
                # A token holder's garbage after a good hello (or a peer that died mid-way):
                # refuse this connection and keep accepting (issue 28); the real peer retries
                # or the mesh times out as before.
                log.warning("partition %d: peer %d's handshake failed: %s", k, j, exc)
                sock.close()
                continue
            except BaseException:
                sock.close()
                raise
    except BaseException:
        for link in links.values():
            link.close()
        raise
    finally:
        if own is not None and listener is None:
            own.close()
    for link in links.values():
        link.sock.settimeout(None)  # a dead peer shows as EOF; a slow one is waited for
        link.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return links


class Exchange:
    """The collectives of one worker of partition ``k`` over its links to the others."""

    def __init__(self, k: int, n: int, links: dict[int, Link]) -> None:
        self.k, self.n = k, n
        self.links = links
        self._tmp: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}

    def _buf(self, key: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        buf = self._tmp.get((key, shape))
        if buf is None or buf.dtype != dtype:
            buf = self._tmp[(key, shape)] = np.empty(shape, dtype)
        return buf

    @property
    def bytes_sent(self) -> int:
        return sum(link.bytes_sent for link in self.links.values())

    @property
    def wait_seconds(self) -> float:
        return sum(link.wait_seconds for link in self.links.values())

    def all_gather(
        self, local: np.ndarray, out: np.ndarray, ranges: Sequence[tuple[int, int]]
    ) -> None:
        """out[..., ranges[j]] = partition j's ``local`` for every j (this one's included)."""
        lo, hi = ranges[self.k]
        src = np.ascontiguousarray(local)
        for link in self.links.values():
            link.send(src)
        out[..., lo:hi] = local
        for j, link in self.links.items():
            a, b = ranges[j]
            buf = self._buf(j, (*out.shape[:-1], b - a), out.dtype)
            link.recv_into(buf)
            out[..., a:b] = buf
        for link in self.links.values():
            link.flush()

    def reduce_scatter(
        self, partial: np.ndarray, out: np.ndarray, ranges: Sequence[tuple[int, int]]
    ) -> None:
        """out = the sum over partitions of their ``partial[..., ranges[k]]``."""
        sends = []
        for j, link in self.links.items():
            a, b = ranges[j]
            piece = self._buf(-1 - j, (*partial.shape[:-1], b - a), partial.dtype)
            np.copyto(piece, partial[..., a:b])
            link.send(piece)
            sends.append(piece)
        lo, hi = ranges[self.k]
        out[...] = partial[..., lo:hi]
        buf = self._buf(self.n + self.k, out.shape, out.dtype)
        for link in self.links.values():
            link.recv_into(buf)
            out += buf
        for link in self.links.values():
            link.flush()

    def close(self) -> None:
        for link in self.links.values():
            link.close()
