"""A data-port connection's replies on their way out, handed to the transport a piece at a time.

asyncio's socket transport (Python 3.11) sends what the socket takes at once and copies the rest
of a write into a bytearray: a 16 MB ``ckpt_read`` reply was copied whole into freshly mapped
memory (a page fault every 4 KiB), and as the kernel took it, ``del buffer[:n]`` copied the rest
again each time it fell below half of its allocation. A profile of a 1 GB save (issue 38 item 7,
``benchmarks/checkpoint_profile.py --save-only``) put a fifth to a quarter of each server's
samples in those two lines. Here a reply's pieces (views of the arrays' own memory) wait in a
queue, and the next piece goes to the transport only once its buffer is empty (write-buffer
limits of 1 and 0: ``pause_writing`` as soon as the socket did not take a whole piece,
``resume_writing`` once the transport sent the rest): the transport then tries the socket
first, and copies at most the part of one piece that the socket did not take.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable
from typing import Any

#: bytes per piece of a reply's payload. With TLS, asyncio also encrypts each write whole into a
#: memory buffer before it sends any of it: 4 MB pulls written at once measured 66-88 MB/s, in
#: 256 KiB pieces 96-158 MB/s (one loaded 2-core machine, alternating runs)
WRITE_STEP = 256 << 10


class Outbox:
    """The pieces of a connection's replies not yet handed to its transport, in order."""

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self.transport = transport
        # pause as soon as anything is left in the transport's buffer, resume once it is empty
        # (high=1: the TLS transport pauses at size >= high, the plain one at size > high, so
        # high=0 would pause TLS after every write and never resume it)
        transport.set_write_buffer_limits(high=1, low=0)
        self.pieces: collections.deque[Any] = collections.deque()
        self.paused = False
        #: called once every queued piece is handed over (see `then`)
        self.after: list[Callable[[], None]] = []

    def write(self, pieces: Iterable[Any]) -> None:
        """Queues `pieces` (bytes-like, each at most a write step) behind what is queued."""
        self.pieces.extend(pieces)
        self.pump()

    def empty(self) -> bool:
        return not self.pieces

    def then(self, fn: Callable[[], None]) -> None:
        """Calls `fn` once every piece queued so far is handed to the transport (at once if
        none is): a close or write_eof must not overtake a reply still in the queue."""
        self.after.append(fn)
        self.pump()

    def close_when_sent(self) -> None:
        """Half-closes the connection once every queued piece is handed over, and keeps
        discarding input until the peer closes (closing with unread input would send a reset,
        which can destroy the last reply, an error frame, before the peer reads it)."""
        self.then(self._half_close)

    def _half_close(self) -> None:
        t = self.transport
        if t.is_closing():
            return
        if t.can_write_eof():
            t.write_eof()
            asyncio.get_running_loop().call_later(5.0, t.close)
        else:
            t.close()

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self.pump()

    def drop(self) -> None:
        """The connection is gone: what is queued will never be sent."""
        self.pieces.clear()
        self.after.clear()

    def pump(self) -> None:
        t = self.transport
        while self.pieces and not self.paused:
            if t.is_closing():
                self.drop()
                return
            t.write(self.pieces.popleft())  # may call pause() before it returns
        if not self.pieces:
            after, self.after = self.after, []
            for fn in after:
                fn()
