"""A data-port connection's replies go to the transport a piece at a time (dp_outbox): over a
real loopback socket whose reader is slow, the transport's own buffer never holds more than one
piece (asyncio 3.11 copied the whole unsent rest of a write into it), the bytes arrive whole
and in order, and a close requested behind queued replies waits for them."""

from __future__ import annotations

import asyncio
import hashlib
import socket

import numpy as np

from adamps.server.api.dp_outbox import WRITE_STEP, Outbox


class Sender(asyncio.Protocol):
    def __init__(self) -> None:
        self.outbox: Outbox | None = None
        self.transport: asyncio.Transport | None = None
        self.most_buffered = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.outbox = Outbox(transport)  # type: ignore[arg-type]

    def pause_writing(self) -> None:
        assert self.outbox is not None
        self.outbox.pause()

    def resume_writing(self) -> None:
        assert self.outbox is not None
        self.outbox.resume()


def pieces(a: np.ndarray) -> list[memoryview]:
    m = memoryview(a).cast("B")
    return [m[i : i + WRITE_STEP] for i in range(0, m.nbytes, WRITE_STEP)]


async def slow_read(sock: socket.socket, loop: asyncio.AbstractEventLoop, proto: Sender) -> bytes:
    got = bytearray()
    while True:
        assert proto.transport is not None
        proto.most_buffered = max(proto.most_buffered, proto.transport.get_write_buffer_size())
        chunk = await loop.sock_recv(sock, 64 << 10)
        if not chunk:
            return bytes(got)
        got += chunk
        await asyncio.sleep(0)  # let the sender's loop callbacks run between reads


def test_a_large_reply_is_handed_over_piece_by_piece_whole_and_in_order() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        _t, proto = await loop.connect_accepted_socket(Sender, a)
        first = np.random.default_rng(0).random(2 << 20, dtype=np.float32)  # 8 MB
        second = np.arange(1 << 20, dtype=np.float32)  # 4 MB
        assert proto.outbox is not None
        proto.outbox.write([b"head-1", *pieces(first)])
        proto.outbox.write([b"head-2", *pieces(second)])
        assert not proto.outbox.empty()  # the slow reader has not taken 12 MB yet
        proto.outbox.close_when_sent()
        got = await asyncio.wait_for(slow_read(b, loop, proto), 60)
        want = b"head-1" + first.tobytes() + b"head-2" + second.tobytes()
        assert len(got) == len(want)
        assert hashlib.sha256(got).digest() == hashlib.sha256(want).digest()
        assert 0 < proto.most_buffered <= WRITE_STEP, proto.most_buffered
        b.close()

    asyncio.run(main())


def test_queued_pieces_are_dropped_when_the_connection_is_gone() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        _t, proto = await loop.connect_accepted_socket(Sender, a)
        assert proto.outbox is not None and proto.transport is not None
        proto.outbox.write(pieces(np.zeros(4 << 20, np.float32)))  # 16 MB: most stays queued
        assert not proto.outbox.empty()
        closed: list[bool] = []
        proto.outbox.then(lambda: closed.append(True))
        proto.transport.abort()
        proto.outbox.resume()  # what a late resume_writing would do: nothing is written
        assert proto.outbox.empty() and closed == []
        b.close()

    asyncio.run(main())
