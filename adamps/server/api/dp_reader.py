"""A data-plane connection's payloads received on a thread of its own, off the event loop
(issue 27).

The event loop of a server reads every connection's bytes: for a 1 MiB payload that is dozens of
`recv_into` calls, each a wake-up of the selector and a trip through asyncio's and the protocol's
Python code under the GIL, while the same loop decodes metas, validates and answers the other
connections. Here, once a frame's meta has been checked (token, op, tensor, length), the
connection stops reading on the loop (``pause_reading``) and this thread receives the payload
with blocking `recv_into` straight into the payload's buffer: the wait and the copy run without
the GIL, and the loop gets one callback per complete payload. Headers and metas stay on the loop
(they are small, and the checks before any payload byte is buffered stay where they were), as
do TLS connections (an `ssl` transport owns the socket's bytes: they keep the loop's path).

The thread reads from a duplicate of the connection's file descriptor (``os.dup``), so the
descriptor it reads can never be closed under it and reused by another connection. The socket
stays non-blocking (the loop writes replies on it meanwhile; ``O_NONBLOCK`` is shared by both
descriptors): the thread waits with a timeout (``settimeout``, a poll without the GIL), never
with ``settimeout(None)``, which would make the loop's writes blocking.

A push's finiteness and bounds check (``bounds.within``: one min and one max over the payload)
runs here too, right after the payload is received, while its bytes are still in the cache; the
loop is told whether it passed and skips ``check_dense`` only then. A payload that fails goes
through the loop's full check, which refuses it with the error naming the shard: the check still
happens before the update reaches state, and bad input gets the same answer.

Only the loop mutates the protocol: the thread reports through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping

#: ``ADAMPS_DP_RECV_THREAD=0`` keeps every payload on the loop, the path before issue 27 (a
#: way back); read when a data port starts
RECV_THREAD_ENV = "ADAMPS_DP_RECV_THREAD"
#: payloads at least this large are received on the connection's thread; smaller ones stay on
#: the loop (a hand-off to a thread and back costs tens of microseconds: more than the reading)
OFF_LOOP_MIN = 64 << 10


def off_loop_min(environ: Mapping[str, str] = os.environ) -> int | None:
    """The payload size from which a data port receives on a thread (None: never)."""
    value = environ.get(RECV_THREAD_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{RECV_THREAD_ENV} must be 0 or 1, got {value!r}")
    return OFF_LOOP_MIN if value == "1" else None


#: bytes a wait of the thread asks for at least (SO_RCVLOWAT), see _receive_lowat
LOWAT = 256 << 10
#: how long one wait of the thread lasts before it looks at its stop flag and its deadline
_POLL = 0.25


def _checked(check: Callable[[], bool] | None) -> bool:
    """The check of a payload, on this thread, while its bytes are still in the cache (issue
    27: on the loop it was a tenth of a push's time there, and held everything else up). A
    check that fails or raises is not an answer: the loop runs the full one, which names the
    problem."""
    if check is None:
        return False
    try:
        return bool(check())
    except Exception:
        return False


class PayloadReader:
    """The reader thread of one connection (started on its first large payload, stopped when
    the connection is lost). ``read`` is called by the loop only, and only while the
    connection's reading on the loop is paused."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        #: a duplicate of the connection's descriptor: ours to close
        self.sock = socket.socket(sock.family, sock.type, fileno=os.dup(sock.fileno()))
        self.sock.settimeout(_POLL)
        self.loop = loop
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adamps-dp-recv", daemon=True)
        self._thread.start()

    def read(
        self,
        view: memoryview,
        deadline: float,
        done: Callable[[bool], None],
        failed: Callable[[str], None],
        check: Callable[[], bool] | None = None,
    ) -> None:
        """Receives exactly len(view) bytes into `view`, then calls `done(ok)` on the loop, `ok`
        being `check()` run here on the bytes just received (False without a check, or if it
        raised: the loop then checks them itself); on end of stream, an error or `deadline`
        (time.monotonic) passing, `failed(why)`."""
        self._jobs.put((view, deadline, done, failed, check))

    def stop(self) -> None:
        """The connection is gone: wakes the thread (a shutdown ends its wait) and lets it go."""
        self._stopped.set()
        self._jobs.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already shut down by the peer or the loop

    def _report(self, fn: Callable[..., None], *args: object) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self._stopped.set()

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                job = self._jobs.get()
                if job is None:
                    break
                view, deadline, done, failed, check = job
                why = self._receive(view, deadline)
                if why is None:
                    self._report(done, _checked(check))
                else:
                    self._report(failed, why)
        finally:
            self.sock.close()

    def _receive(self, view: memoryview, deadline: float) -> str | None:
        try:
            return self._receive_lowat(view, deadline)
        finally:
            try:  # the loop reads the next header: readable at the first byte again
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            except OSError:
                pass

    def _receive_lowat(self, view: memoryview, deadline: float) -> str | None:
        """Each wait ends only once LOWAT bytes (or the rest) are in the socket (SO_RCVLOWAT):
        every wake-up of this thread takes the GIL again, and while the loop or an owner thread
        holds it that can take a switch interval (5 ms): few large reads, not many small ones."""
        got, n = 0, len(view)
        lowat = 0
        while got < n:
            want = min(n - got, LOWAT)
            if want != lowat:
                lowat = want
                try:
                    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
                except OSError:
                    pass
            if self._stopped.is_set():
                return "connection closed"
            if time.monotonic() > deadline:
                return "payload not received within body_timeout"
            try:
                k = self.sock.recv_into(view[got:])
            except TimeoutError:
                continue
            except OSError as exc:
                return f"receive failed: {exc}"
            if k == 0:
                return "connection closed by the client mid-payload"
            got += k
        return None
