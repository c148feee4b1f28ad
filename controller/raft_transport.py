"""pysyncobj's TCP transport with bounded unauthenticated input (issue 12, attack 1).

pysyncobj 0.3.x reads whatever a peer sends into one ``bytes`` buffer (``+=`` per 8 KiB recv:
quadratic copying) until the frame its 4-byte length prefix announces is complete, and only then
checks the password (Fernet HMAC). A length of 2 GiB from anybody who can reach the port costs
gigabytes and half a minute of CPU before the frame is refused (bakwc/PySyncObj#174). Its server
also binds 0.0.0.0 whatever the member's address, and an idle, never-authenticated connection is
kept forever (its timeout is only checked when data arrives).

Here, at the transport, without patching pysyncobj:

- the server binds the member's own address (or ``bindAddress``), never the wildcard;
- a connection is *authenticated* once it delivered a frame that decrypted with the password AND
  carried this connection's fresh random key (so a replayed frame does not count); before that a
  frame may announce at most ``preauth_limit`` bytes (the key exchange needs ~200), after it
  ``max_message``; a larger or negative length drops the connection at once, before buffering;
- reading stops once a whole frame is buffered (the poller is level-triggered: the rest waits in
  the kernel), so the buffer never holds more than one frame plus one recv;
- at most ``max_unauthenticated`` connections may be unauthenticated at a time (a new one closes
  the oldest), each for at most ``auth_timeout`` seconds.

The name-mangled overrides (``_TcpConnection__processRead`` ...) replace pysyncobj's private
methods of the same name: pyproject.toml pins pysyncobj below 0.4, and
tests/integration/test_controller_hardening.py checks that the methods still exist and that the
bounds hold against a real node.
"""

from __future__ import annotations

import base64
import functools
import logging
import socket
import struct
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pysyncobj.pickle as ps_pickle
from pysyncobj.dns_resolver import globalDnsResolver
from pysyncobj.monotonic import monotonic
from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.tcp_connection import TcpConnection
from pysyncobj.tcp_server import TcpServer
from pysyncobj.transport import TCPTransport

if TYPE_CHECKING:
    from cryptography.fernet import Fernet

log = logging.getLogger(__name__)

_LEN = struct.Struct("i")  # pysyncobj's frame prefix: native signed 32-bit


@dataclass(frozen=True)
class RaftLimits:
    #: largest frame (bytes) a peer may announce before it authenticated
    preauth_limit: int = 64 << 10
    #: largest frame of an authenticated peer (a Raft entry is at most a controller's max_body)
    max_message: int = 64 << 20
    #: connections allowed to be unauthenticated at the same time (a new one closes the oldest)
    max_unauthenticated: int = 16
    #: seconds a connection may stay unauthenticated
    auth_timeout: float = 5.0


def open_frame(fernet: Fernet, token: bytes) -> tuple[int, bytes]:
    """(timestamp, plaintext) of a Fernet token, its HMAC checked once (issue 36: idle costs
    nothing). pysyncobj asks ``extract_timestamp``, which checks the HMAC, then ``decrypt``,
    which checks it again: two HMACs and two base64 decodes of every Raft message, a sixth of
    an idle controller's Raft thread. ``decrypt`` alone checks the HMAC, which covers the
    timestamp; the timestamp is then read from the checked token's first 9 bytes (version
    0x80 and 8 big-endian bytes: the first 12 base64 characters). Raises on a bad token."""
    plain = fernet.decrypt(token)  # raises InvalidToken unless the HMAC holds
    head = base64.urlsafe_b64decode(token[:12])
    return int.from_bytes(head[1:9], "big"), plain


class BoundedTcpConnection(TcpConnection):
    """A TcpConnection whose reads are bounded by `RaftLimits` (see the module doc)."""

    def __init__(self, *args: Any, limits: RaftLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        #: received bytes not yet parsed (a bytearray: appending and consuming cost O(n), not O(n^2))
        self._rbuf = bytearray()
        #: a frame with this connection's random key was received (the peer knows the password)
        self.authenticated = False
        #: monotonic time the connection was accepted or opened
        self.opened_at = monotonic()

    def connect(self, host: str, port: int) -> bool:
        self._rbuf = bytearray()
        self.authenticated = False
        self.opened_at = monotonic()
        return super().connect(host, port)

    def disconnect(self) -> None:
        self._rbuf = bytearray()
        self.authenticated = False
        super().disconnect()

    def _frame_limit(self) -> int:
        return self._limits.max_message if self.authenticated else self._limits.preauth_limit

    def _frame_len(self) -> int | None:
        """The announced length of the buffered frame; None while its prefix is incomplete."""
        if len(self._rbuf) < _LEN.size:
            return None
        return _LEN.unpack_from(self._rbuf)[0]

    def _TcpConnection__processRead(self) -> bool:  # noqa: N802 - overrides a mangled name
        sock = self._TcpConnection__socket  # type: ignore[attr-defined]
        try:
            incoming = sock.recv(self._TcpConnection__recvBufferSize)  # type: ignore[attr-defined]
        except OSError as e:
            if e.errno not in (socket.errno.EAGAIN, socket.errno.EWOULDBLOCK):  # type: ignore[attr-defined]
                self.disconnect()
            return False
        if not incoming or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self.disconnect()
            return False
        self._rbuf += incoming
        n = self._frame_len()
        if n is None:
            return True
        if n < 0 or n > self._frame_limit():
            log.warning(
                "raft: dropping a %s connection announcing a frame of %d bytes (limit %d)",
                "peer" if self.authenticated else "not yet authenticated",
                n,
                self._frame_limit(),
            )
            self.disconnect()
            return False
        # A whole frame is here: stop reading and parse it; the rest waits in the kernel.
        return len(self._rbuf) - _LEN.size < n

    def _TcpConnection__processParseMessage(self) -> Any:  # noqa: N802 - overrides a mangled name
        n = self._frame_len()
        if n is None or len(self._rbuf) - _LEN.size < n:
            return None
        if n < 0 or n > self._frame_limit():
            self.disconnect()
            return None
        data = bytes(self._rbuf[_LEN.size : _LEN.size + n])
        keyed = self.recvRandKey is not None
        try:
            if self.encryptor is None:
                raise ValueError("a password is required")  # raft_conf always sets one
            stamp, plain = open_frame(self.encryptor, data)
            if stamp < self.recvLastTimestamp:
                raise ValueError("timestamp went back")
            self.recvLastTimestamp = stamp
            message = ps_pickle.loads(zlib.decompress(plain))
            if keyed:
                rand_key, message = message
                if rand_key != self.recvRandKey:
                    raise ValueError("wrong connection key")
        except Exception:
            self.disconnect()
            return None
        del self._rbuf[: _LEN.size + n]
        if keyed:
            self.authenticated = True
        return message


class BoundedTcpServer(TcpServer):
    """A TcpServer that accepts `BoundedTcpConnection`s."""

    def __init__(self, *args: Any, limits: RaftLimits, on_accept_check: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._may_accept = on_accept_check

    def _TcpServer__onNewConnection(self, descr: int, event: int) -> None:  # noqa: N802
        if event & POLL_EVENT_TYPE.READ:
            try:
                sock, _addr = self._TcpServer__socket.accept()  # type: ignore[attr-defined]
            except OSError as e:
                if e.errno not in (socket.errno.EAGAIN, socket.errno.EWOULDBLOCK):  # type: ignore[attr-defined]
                    self.unbind()
                return
            if not self._may_accept():
                sock.close()
                return
            sndbuf = self._TcpServer__sendBufferSize  # type: ignore[attr-defined]
            rcvbuf = self._TcpServer__recvBufferSize  # type: ignore[attr-defined]
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            conn = BoundedTcpConnection(
                poller=self._TcpServer__poller,  # type: ignore[attr-defined]
                socket=sock,
                timeout=self._TcpServer__connectionTimeout,  # type: ignore[attr-defined]
                sendBufferSize=sndbuf,
                recvBufferSize=rcvbuf,
                keepalive=self._TcpServer__keepalive,  # type: ignore[attr-defined]
                limits=self._limits,
            )
            self._TcpServer__onNewConnectionCallback(conn)  # type: ignore[attr-defined]
        if event & POLL_EVENT_TYPE.ERROR:
            self.unbind()


class BoundedTCPTransport(TCPTransport):
    """TCPTransport on the member's own address with bounded unauthenticated input."""

    limits = RaftLimits()

    def _createServer(self) -> None:  # noqa: N802 - pysyncobj's name
        conf = self._syncObj.conf
        addr = conf.bindAddress or getattr(self._selfNode, "address", None)
        if not addr:
            raise RuntimeError("unable to determine the Raft bind address")
        host, port = addr.rsplit(":", 1)
        host = globalDnsResolver().resolve(host.strip("[]"))
        if host is None:
            raise RuntimeError(f"cannot resolve the Raft bind address {addr!r}")
        self._server = BoundedTcpServer(
            self._syncObj._poller,
            host,
            port,
            onNewConnection=self._onNewIncomingConnection,
            sendBufferSize=conf.sendBufferSize,
            recvBufferSize=conf.recvBufferSize,
            connectionTimeout=conf.connectionTimeout,
            limits=self.limits,
            on_accept_check=self._may_accept,
        )

    def _may_accept(self) -> bool:
        """Makes room for one more unauthenticated connection by closing the oldest ones: a
        real peer authenticates within a round trip, so a flood of connections that never do
        cannot keep it out for long (refusing the newest would)."""
        self._expire_unauthenticated()
        unknown = sorted(self._unknownConnections, key=lambda c: getattr(c, "opened_at", 0.0))
        excess = len(unknown) - self.limits.max_unauthenticated + 1
        if excess > 0:
            log.warning(
                "raft: %d connections not yet authenticated (limit %d); closing the oldest",
                len(unknown),
                self.limits.max_unauthenticated,
            )
            for conn in unknown[:excess]:
                conn.disconnect()
                self._unknownConnections.discard(conn)
        return True

    def _expire_unauthenticated(self) -> None:
        now = monotonic()
        for conn in list(self._unknownConnections):
            if now - getattr(conn, "opened_at", now) > self.limits.auth_timeout:
                conn.disconnect()
                self._unknownConnections.discard(conn)

    def _onTick(self) -> None:  # noqa: N802 - pysyncobj's name
        self._expire_unauthenticated()
        super()._onTick()

    def addNode(self, node: Any) -> None:  # noqa: N802 - pysyncobj's name
        super().addNode(node)
        old = self._connections.get(node)
        if old is None or isinstance(old, BoundedTcpConnection):
            return
        conf = self._syncObj.conf
        conn = BoundedTcpConnection(
            poller=self._syncObj._poller,
            timeout=conf.connectionTimeout,
            sendBufferSize=conf.sendBufferSize,
            recvBufferSize=conf.recvBufferSize,
            keepalive=conf.tcp_keepalive,
            limits=self.limits,
        )
        conn.encryptor = self._syncObj.encryptor
        conn.setOnConnectedCallback(functools.partial(self._onOutgoingConnected, conn))
        conn.setOnMessageReceivedCallback(functools.partial(self._onMessageReceived, node))
        conn.setOnDisconnectedCallback(functools.partial(self._onDisconnected, conn))
        self._connections[node] = conn


def transport_class(limits: RaftLimits) -> type[BoundedTCPTransport]:
    """A BoundedTCPTransport subclass carrying `limits` (SyncObj instantiates the class itself)."""
    return type("ConfiguredTCPTransport", (BoundedTCPTransport,), {"limits": limits})
