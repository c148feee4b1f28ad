"""Requests to several servers at once, pipelined per data-plane connection (issue 27).

A ``PSClient`` pull or push becomes requests (server URL, group): each server's in order. Over a
server's data plane up to ``window`` (at most ``MAX_INFLIGHT``, what the server queues per
connection) are in flight at a time, and each reply read makes room for the next request of that
server at once: a sliding window, not rounds of ``window`` with a barrier between them. So the
server applies one frame while the next arrives, and the client sends while the server applies.
Before, a push of 4 MB to one server went out as one frame and the client sat idle through its
apply (``benchmarks/ps_apply.py``: ``PSClient`` push 0.47 of raw TCP against 0.75 for frames in
flight on one connection).

Servers without a data port get their requests over HTTP, one after the other. Replies of one
connection come in request order (docs/protocol-ps.md), so each lane reads its oldest request's
reply. Every reply sent for is read, or its connection dropped, before the first error is raised:
no unread reply is ever taken for a later request's.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from adamps.client.dataplane import MAX_INFLIGHT, DataPlaneClient, DataPlaneError
from adamps.client.pool import DataPlanePool, as_rpc_error

#: send(conn, group) -> False when the request does not fit a frame (then it goes over HTTP)
Send = Callable[[DataPlaneClient, Any], Any]
#: read(conn, group): reads the reply of the oldest request of conn (raises its error)
Read = Callable[[DataPlaneClient, Any], None]
#: by_http(url, group): the same request over HTTP, blocking
ByHttp = Callable[[str, Any], None]


def connection_error(url: str, exc: OSError) -> ConnectionError | TimeoutError:
    """A failed data-plane exchange, as the retry policy knows it (outcome unknown)."""
    if isinstance(exc, ConnectionError | TimeoutError):
        return exc
    return ConnectionError(f"data plane of {url}: {exc}")


@dataclass
class _Lane:
    """One server's requests: those not sent yet, and those sent whose reply is unread."""

    url: str
    #: its data-plane connection, or None: over HTTP
    dp: DataPlaneClient | None
    pending: collections.deque = field(default_factory=collections.deque)
    inflight: collections.deque = field(default_factory=collections.deque)


@dataclass
class Counts:
    """Requests sent over each transport (PSClient.dp_requests, .http_requests)."""

    dp: int = 0
    http: int = 0


def exchange(
    pool: DataPlanePool | None,
    groups: Iterable[tuple[str, Any]],
    send: Send,
    read: Read,
    by_http: ByHttp,
    counts: Counts,
    window: int = MAX_INFLIGHT,
) -> None:
    """Sends every (url, group) of `groups` (over the data plane of `pool` where a server
    offers one; `pool` None: HTTP only), `window` in flight per connection, and reads every
    reply. Raises the first error once nothing is left unread."""
    if not 1 <= window <= MAX_INFLIGHT:
        raise ValueError(f"window must be in 1..{MAX_INFLIGHT}")
    by_url: dict[str, collections.deque] = {}
    for url, group in groups:
        by_url.setdefault(url, collections.deque()).append(group)
    state = _Exchange(pool, send, read, by_http, counts, window)
    for url, pending in by_url.items():
        state.open(url, pending)
    state.run()


class _Exchange:
    """The lanes of one exchange and the first error (mutated by its own methods only)."""

    def __init__(
        self,
        pool: DataPlanePool | None,
        send: Send,
        read: Read,
        by_http: ByHttp,
        counts: Counts,
        window: int,
    ) -> None:
        self.pool = pool
        self.send = send
        self.read = read
        self.by_http = by_http
        self.counts = counts
        self.window = window
        self.lanes: list[_Lane] = []
        self.error: BaseException | None = None

    def _fail(self, lane: _Lane, exc: BaseException, *, forget: bool = False) -> None:
        """The lane stops: its connection is dropped (its stream may hold unread replies, or
        the server closed it), what it did not send is not sent; the first error is kept."""
        if lane.dp is not None and self.pool is not None:
            self.pool.drop(lane.url)
            if forget:
                self.pool.forget_port(lane.url)
        lane.dp = None
        lane.pending.clear()
        lane.inflight.clear()
        self.error = self.error or exc

    def open(self, url: str, pending: collections.deque) -> None:
        lane = _Lane(url, None, pending)
        self.lanes.append(lane)
        if self.pool is None:
            return
        try:
            lane.dp = self.pool.get(url)
        except OSError as exc:  # the data connection failed: nothing sent yet, outcome known
            self._fail(lane, connection_error(url, exc))
        except Exception as exc:  # its GET /status failed
            self._fail(lane, exc)

    def _over_http(self, lane: _Lane, group: Any) -> bool:
        try:
            self.counts.http += 1
            self.by_http(lane.url, group)
        except Exception as exc:
            self._fail(lane, exc)
            return False
        return True

    def fill(self, lane: _Lane) -> None:
        """Sends the lane's next requests until its window is full (over HTTP: all of them,
        each waiting for its reply)."""
        while lane.pending and len(lane.inflight) < self.window:
            group = lane.pending.popleft()
            if lane.dp is None:
                if not self._over_http(lane, group):
                    return
                continue
            try:
                sent = self.send(lane.dp, group)
            except OSError as exc:  # the data connection failed: its outcome is unknown
                self._fail(lane, connection_error(lane.url, exc))
                return
            except Exception as exc:
                self._fail(lane, exc)  # (a frame half sent would leave its stream unusable)
                return
            if sent is False:  # too big for a frame: over HTTP, in its turn
                if not lane.inflight:
                    if not self._over_http(lane, group):
                        return
                    continue
                # Replies of earlier frames first: put it back until they are read.
                lane.pending.appendleft(group)
                return
            self.counts.dp += 1
            lane.inflight.append(group)

    def read_one(self, lane: _Lane) -> None:
        """Reads the reply of the lane's oldest request in flight."""
        assert lane.dp is not None
        group = lane.inflight[0]
        try:
            self.read(lane.dp, group)
        except DataPlaneError as exc:
            self._fail(lane, as_rpc_error(exc))
            return
        except OSError as exc:
            self._fail(lane, connection_error(lane.url, exc), forget=True)
            return
        lane.inflight.popleft()

    def run(self) -> None:
        try:
            while True:
                for lane in self.lanes:
                    self.fill(lane)
                busy = [lane for lane in self.lanes if lane.inflight]
                if not busy:
                    break
                for lane in busy:
                    self.read_one(lane)
                    self.fill(lane)  # its next frame out before the next lane's reply is read
        except BaseException:
            # Replies left unread on a connection would be taken for the next request's:
            # close every connection whose replies were not all read.
            for lane in self.lanes:
                if lane.inflight and self.pool is not None:
                    self.pool.drop(lane.url)
            raise
        if self.error is not None:
            raise self.error
