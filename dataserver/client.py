"""The trainer's side of the data servers: a prefetching batch iterator with failover.

    client = DataClient(["http://127.0.0.1:7300", "http://127.0.0.1:7301"], token)
    with client.epoch(replica=0, n_replicas=2, epoch=3, batch_size=128) as batches:
        for b in batches:          # b.x uint8 [b,28,28], b.y int64 [b], b.index int64 [b]
            ...

A background thread reads batches ahead into a bounded queue (Project Adam 3.1: trainers request
images in advance so the training threads never wait). When the dataset is split into slices,
the thread interleaves the slices' streams batch by batch. When a data server dies (connection
refused or reset, stream cut before its end frame, read timeout, 5xx), the stream is reopened on
another server of the same slice at the position the client reached: no image of the epoch is
repeated or skipped. Not thread-safe: one iterator is consumed by one thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from adamps.client import retry
from adamps.client.retry import RetryPolicy
from adamps.client.rpc import RpcError, Stream, SyncRpc, get_json, rpc_request
from adamps.wire.protocol import ProtocolError
from dataserver.framing import Batch, read_frame

log = logging.getLogger(__name__)

__all__ = ["Batch", "BatchIterator", "DataClient", "DataServerError"]

#: a server lost: refused, reset, silent (adamps.client.rpc raises ConnectionError, TimeoutError), a
#: stream cut before its end (EOFError)
_RETRYABLE = (OSError, EOFError)


class DataServerError(Exception):
    """A stream cannot be served: bad request, inconsistent servers, or no server answered in time."""


@dataclass
class ServerInfo:
    url: str
    slice_index: int
    n_slices: int
    fingerprint: str


@dataclass
class _Progress:
    failovers: int = 0
    servers: list[str] = field(default_factory=list)  #: url of each stream opened, in order


class DataClient:
    """Knows the data servers; opens epoch iterators over them."""

    def __init__(
        self,
        urls: Sequence[str],
        token: str,
        *,
        timeout: float = 10.0,
        failover_timeout: float = 30.0,
    ) -> None:
        if not urls:
            raise ValueError("at least one data server url is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self.token = token
        self.timeout = timeout  #: socket timeout: a server silent this long is treated as dead
        #: give up after this long without any server of a slice
        self.failover_timeout = failover_timeout
        self._groups: dict[int, list[ServerInfo]] | None = (
            None  #: last discovery, reused across epochs
        )
        self._lock = threading.Lock()

    def groups(self, refresh: bool = False) -> dict[int, list[ServerInfo]]:
        """The servers of each slice, discovered once and reused (refresh=True asks them again)."""
        with self._lock:
            if refresh or self._groups is None:
                self._groups = self.discover()
            return self._groups

    def discover(self) -> dict[int, list[ServerInfo]]:
        """Asks every server for its slice; returns slice index -> servers. Unreachable ones are left out."""
        groups: dict[int, list[ServerInfo]] = {}
        n_slices: set[int] = set()
        errors = []
        for url in self.urls:
            try:
                st = get_json(url, "/status", self.timeout)
                info = ServerInfo(
                    url, int(st["slice"][0]), int(st["slice"][1]), str(st["fingerprint"])
                )
            except (*_RETRYABLE, ValueError, KeyError, TypeError) as exc:
                errors.append(f"{url}: {exc}")
                continue
            groups.setdefault(info.slice_index, []).append(info)
            n_slices.add(info.n_slices)
        if not groups:
            raise DataServerError("no data server answered: " + "; ".join(errors))
        if len(n_slices) > 1:
            raise DataServerError(f"data servers disagree on n_slices: {sorted(n_slices)}")
        return groups

    def epoch(
        self,
        replica: int,
        n_replicas: int,
        epoch: int,
        *,
        batch_size: int = 128,
        split: str = "train",
        prefetch: int = 8,
    ) -> BatchIterator:
        """An iterator over replica `replica`'s batches of `epoch` (all slices), read ahead in a thread."""
        return BatchIterator(self, replica, n_replicas, epoch, batch_size, split, prefetch)

    def span(self, epoch: int, start: int, stop: int, *, batch_size: int) -> Iterator[Batch]:
        """The training batches of positions ``start:stop`` of ``epoch``'s whole order (replica 0
        of 1): an elastic replica's leased slice (dataserver/slices.py). Read in the calling
        thread, failing over like an epoch's stream; needs a single data-server slice."""
        groups = self.groups()
        if len(groups) != 1 or 0 not in groups:
            raise DataServerError(
                f"elastic replicas need the dataset on one data-server slice, got {sorted(groups)}"
            )
        req = {"replica": 0, "n_replicas": 1, "epoch": epoch, "batch_size": batch_size,
               "split": "train", "start": start, "stop": stop}  # fmt: skip
        stream = _SliceStream(self, 0, [s.url for s in groups[0]], req, _Progress())
        try:
            while (b := stream.next_batch()) is not None:
                yield b
        finally:
            stream.close()


class _SliceStream:
    """One slice's stream of an epoch; resumes at `position` on another server of the slice."""

    def __init__(
        self,
        client: DataClient,
        slice_index: int,
        urls: list[str],
        req: dict[str, Any],
        progress: _Progress,
    ):
        self.client = client
        self.slice_index = slice_index
        self.req = req
        self.progress = progress
        # Start on a different server for each replica: the servers of a slice share the load.
        shift = req["replica"] % len(urls)
        self.urls = urls[shift:] + urls[:shift]
        self.position = int(req.get("start", 0))  #: a bounded stream (a slice) starts inside
        self.total: int | None = None
        self.fingerprint: str | None = None
        self._rpc: SyncRpc | None = None
        self._resp: Stream | None = None
        self._current = 0  #: index in self.urls of the server in use
        self._stalled = 0  #: streams lost since the last batch arrived

    def close(self) -> None:
        if self._rpc is not None:
            self._rpc.close()
        self._rpc = self._resp = None

    def next_batch(self) -> Batch | None:
        """The next batch, or None at the end of the stream."""
        while True:
            if self._resp is None:
                self._open()
            assert self._resp is not None
            try:
                msg = read_frame(self._resp.read)
            except (*_RETRYABLE, ProtocolError) as exc:
                self._lost(exc)
                continue
            kind = msg.get("type")
            if kind == "batch":
                return self._accept(msg)
            if kind == "end":
                if msg.get("position") != self.total or self.position != self.total:
                    raise DataServerError(
                        f"stream ended at {msg.get('position')}, client at {self.position} of {self.total}"
                    )
                self.close()
                return None
            if kind == "wait":  # the server is still augmenting this epoch: alive
                continue
            if kind == "error":
                self._lost(DataServerError(f"server error in stream: {msg.get('message')}"))
                continue
            log.debug("ignoring frame of unknown type %r", kind)  # forward compatibility

    def _accept(self, msg: dict[str, Any]) -> Batch:
        x, y, index, pos = msg.get("x"), msg.get("y"), msg.get("index"), msg.get("position")
        ids = msg.get("ids")  # click logs' categorical ids
        if pos != self.position:
            raise DataServerError(
                f"batch at position {pos}, expected {self.position}: server out of step"
            )
        if (
            not all(hasattr(a, "shape") for a in (x, y, index))
            or not len(x) == len(y) == len(index) > 0
        ):
            raise DataServerError("batch frame lacks x/y/index arrays of one length")
        if ids is not None and (getattr(ids, "ndim", 0) != 2 or len(ids) != len(y)):
            raise DataServerError("batch frame's ids are not [batch, fields]")
        self.position += len(y)
        self._stalled = 0
        return Batch(pos, x, y, index, ids)

    def _lost(self, exc: BaseException) -> None:
        url = self.urls[self._current]
        log.warning(
            "data server %s lost at position %d (%s); failing over", url, self.position, exc
        )
        self.close()
        self.progress.failovers += 1
        self._stalled += 1
        if self._stalled > max(3, 2 * len(self.urls)):
            # Servers answer but every stream breaks before a batch: a bug, not a dead server.
            raise DataServerError(
                f"stream of slice {self.slice_index} lost {self._stalled} times at position "
                f"{self.position} without progress; last error: {exc}"
            )
        self._current = (self._current + 1) % len(self.urls)

    def _open(self) -> None:
        """Opens the stream at self.position on the first server of the slice that answers,
        in rounds over the slice's servers (adamps.client.retry's policy within failover_timeout)."""
        try:
            retry.call(
                RetryPolicy(self.client.failover_timeout),
                lambda _n: self._open_round(),
                lambda exc: isinstance(exc, _NoServer),
                on_retry=lambda _exc, _n: self._refresh_urls(),
            )
        except _NoServer as exc:
            raise DataServerError(
                f"no data server of slice {self.slice_index} served the stream for "
                f"{self.client.failover_timeout} s; last error: {exc}"
            ) from None

    def _open_round(self) -> None:
        last: BaseException | None = None
        for _ in range(len(self.urls)):
            url = self.urls[self._current]
            try:
                self._open_on(url)
                self.progress.servers.append(url)
                return
            except _Skip as exc:
                last = exc
                self.close()
                log.info("data server %s unusable: %s", url, exc)
                self._current = (self._current + 1) % len(self.urls)
        raise _NoServer(str(last))

    def _refresh_urls(self) -> None:
        """After a round in which no server answered: ask every known server again (some may be back)."""
        try:
            urls = [s.url for s in self.client.groups(refresh=True).get(self.slice_index, [])]
        except DataServerError:
            return
        if urls:
            self.urls, self._current = urls, 0

    def _open_on(self, url: str) -> None:
        self._rpc = SyncRpc(url, self.client.token, self.client.timeout)
        fields = dict(self.req, start=self.position)
        if self.fingerprint is not None:
            fields["fingerprint"] = self.fingerprint
        try:
            resp = self._rpc.open_stream(rpc_request("stream", "/stream", **fields))
        except _RETRYABLE as exc:
            raise _Skip(f"{type(exc).__name__}: {exc}") from exc
        except RpcError as err:
            status = err.http_status or 500
            if status >= 500 or err.code == "conflict":
                raise _Skip(f"HTTP {status} {err.code}: {err.message}") from err
            raise DataServerError(
                f"{url} refused the stream: HTTP {status} {err.code}: {err.message}"
            ) from err
        try:
            head = read_frame(resp.read)
        except (*_RETRYABLE, ProtocolError) as exc:
            raise _Skip(f"no stream header: {exc}") from exc
        if head.get("type") != "header":
            raise _Skip(f"first frame is {head.get('type')!r}, not a header")
        slice_ = head.get("slice")
        if slice_ is None or slice_[0] != self.slice_index:
            raise _Skip(f"server holds slice {slice_}, not {self.slice_index}")
        if self.fingerprint is None:
            self.fingerprint, self.total = head["fingerprint"], head["total"]
        elif head["fingerprint"] != self.fingerprint or head["total"] != self.total:
            raise _Skip("server holds a different dataset")
        self._resp = resp


class _Skip(Exception):
    """This server cannot serve the stream now; try the next one."""


class _NoServer(Exception):
    """No server of the slice served the stream in this round (the message: the last error)."""


_END = object()


class BatchIterator(Iterator[Batch]):
    """Batches of one (replica, epoch), read ahead by a background thread into a bounded queue."""

    def __init__(
        self,
        client: DataClient,
        replica: int,
        n_replicas: int,
        epoch: int,
        batch_size: int,
        split: str,
        prefetch: int,
    ) -> None:
        self.req = {
            "replica": replica,
            "n_replicas": n_replicas,
            "epoch": epoch,
            "batch_size": batch_size,
            "split": split,
        }
        self.progress = _Progress()
        self._client = client
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=self._run, name=f"prefetch-e{epoch}-r{replica}", daemon=True
        )
        self._thread.start()

    @property
    def failovers(self) -> int:
        """How many times a stream moved to another server."""
        return self.progress.failovers

    def _run(self) -> None:
        streams: list[_SliceStream] = []
        try:
            groups = self._discover()
            n_slices = next(iter(groups.values()))[0].n_slices
            streams = [
                _SliceStream(self._client, k, [s.url for s in groups[k]], self.req, self.progress)
                for k in range(n_slices)
            ]
            active = list(streams)
            while active and not self._stop.is_set():
                for s in list(active):  # interleave the slices batch by batch
                    b = s.next_batch()
                    if b is None:
                        active.remove(s)
                    elif not self._put(b):
                        return
            self._put(_END)
        except BaseException as exc:  # handed to the consumer thread
            self._put(exc)
        finally:
            for s in streams:
                s.close()

    def _discover(self) -> dict[int, list[ServerInfo]]:
        """Every slice with at least one live server; retried (servers may be restarting) until
        failover_timeout, asking every server again each time."""
        return retry.call(
            RetryPolicy(self._client.failover_timeout),
            lambda n: self._every_slice(refresh=n > 1),
            lambda exc: isinstance(exc, DataServerError),
            give_up=self._stop.is_set,
        )

    def _every_slice(self, refresh: bool) -> dict[int, list[ServerInfo]]:
        groups = self._client.groups(refresh)
        n_slices = next(iter(groups.values()))[0].n_slices
        missing = sorted(set(range(n_slices)) - set(groups))
        if missing:
            raise DataServerError(f"no live data server holds slice(s) {missing}")
        return groups

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Batch:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._done = True
            self._thread.join()
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def close(self) -> None:
        """Stops the reader thread (the iterator then ends)."""
        self._stop.set()
        self._done = True
        self._thread.join(timeout=5)

    def __enter__(self) -> BatchIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
