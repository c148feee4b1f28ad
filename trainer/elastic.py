"""An elastic replica (issue 25): ``adamps train --run NAME`` without ``--replica`` joins the run
at any time and trains the slices of each epoch the data server leases to it
(dataserver/slices.py), instead of a static ``replica::n_replicas`` share.

- The **feed thread** asks the data server for a slice, streams its batches into a bounded
  queue, and asks for the next one; ``wait`` (the 75% rule holds the next epoch back) and
  ``done`` (every slice of the last epoch trained) come through the queue too.
- The **main thread** trains the batches in Downpour rounds (trainer/downpour.py) an epoch at a
  time; once a slice's last batch is in a queued round it queues a marker behind it, so the
  slice is reported ``complete`` only after every push of its examples is acknowledged.
- The **board thread** heartbeats the run (so this replica's leases stay valid while it trains)
  and reads the last epoch whose every slice is trained.

Every elastic replica acts as replica 0 did: it creates the tensors if absent (identical
definitions from the same ``--seed``: the first creates, the rest find them), has no warm start,
evaluates the held-out set as epochs complete and writes ``--out``/``--history``.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from adamps.client.rpc import RpcError, SyncRpc
from dataserver.client import Batch, DataClient
from trainer.board import Board

log = logging.getLogger(__name__)


def replica_id() -> str:
    """A name for this replica unique in the run: host, pid and random bits."""
    host = re.sub(r"[^A-Za-z0-9_.\-]", "-", socket.gethostname())[:32]
    return f"{host}-{os.getpid()}-{os.urandom(3).hex()}"


class Leases:
    """The run's lease calls to one data server (the first of --dataservers). Thread-safe: one
    connection per thread. Connection failures are retried for ``retry_for`` seconds."""

    def __init__(
        self, url: str, token: str, run: str, replica: str, epochs: int, fraction: float
    ) -> None:
        self.url, self.token = url, token
        self.ident = {"run": run, "replica": replica}
        self.declare = {"epochs": epochs, "epoch_fraction": fraction}
        self.retry_for = 60.0
        self._seq = 0  #: lease requests sent (the feed thread's)
        self._local = threading.local()

    def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        rpc = getattr(self._local, "rpc", None)
        if rpc is None:
            rpc = self._local.rpc = SyncRpc(self.url, self.token, timeout=10.0)
        deadline = time.monotonic() + self.retry_for
        while True:
            try:
                return rpc.call(op, f"/{op}", **self.ident, **fields)
            except (OSError, RpcError) as exc:
                if isinstance(exc, RpcError) and (exc.http_status or 500) < 500:
                    raise
                if time.monotonic() > deadline:
                    raise
                log.warning("data server %s: %s failed (%s); retrying", self.url, op, exc)
                time.sleep(0.5)

    def lease(self) -> dict[str, Any]:
        """The next slice; a retry after a lost answer carries the same seq (the same slice)."""
        self._seq += 1
        return self._call("lease", seq=self._seq, **self.declare)

    def complete(self, epoch: int, slice_: int) -> dict[str, Any]:
        return self._call("complete", epoch=epoch, slice=slice_)

    def heartbeat(self) -> dict[str, Any]:
        return self._call("heartbeat")


class ElasticBoard(Board):
    """The run's progress as the data server keeps it: no warm start, no per-replica epochs;
    an epoch is complete once every slice of it is trained."""

    def __init__(self, leases: Leases) -> None:
        self.leases = leases
        self.live = 0  #: replicas alive in the run at the last heartbeat

    def mark_warm(self) -> None:
        pass

    def warm_done(self) -> bool:
        return True

    def report(self, epoch: int, progress: float, done: bool) -> None:
        pass

    def finished(self) -> dict[str, int]:
        return {}

    def observe(self, sched: Any) -> int:
        try:
            got = self.leases.heartbeat()
        except RpcError as exc:
            if exc.code != "not_found":
                raise
            # The data server restarted and forgot the run: the feed's next lease declares it
            # again (its leases start afresh; docs/training.md).
            return int(sched.completed)
        self.live = int(got["live"])
        sched.completed = max(sched.completed, int(got["completed"]))
        return sched.completed


@dataclass(frozen=True)
class _Item:
    kind: str  #: "batch", "end" (a slice's last batch was put), "wait", "done"
    epoch: int = 0
    slice: int = -1
    batch: Batch | None = None


class ElasticFeed:
    """The slices leased to this replica, as batches in a bounded queue filled by a thread."""

    def __init__(
        self, data: DataClient, leases: Leases, batch_size: int, prefetch: int = 16
    ) -> None:
        self.data, self.leases, self.batch_size = data, leases, batch_size
        self._q: queue.Queue[_Item | BaseException] = queue.Queue(maxsize=max(2, prefetch))
        self._head: _Item | None = None
        self._stop = threading.Event()
        self.ended: list[tuple[int, int]] = []  #: slices whose last batch was taken (main thread)
        self.slices = 0  #: slices leased so far (feed thread)
        self.thread = threading.Thread(target=self._run, name="feed", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)

    # -- the feed thread

    def _put(self, item: _Item | BaseException) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        waiting = False
        try:
            while not self._stop.is_set():
                got = self.leases.lease()
                state = got["state"]
                if state == "done":
                    self._put(_Item("done"))
                    return
                if state == "wait":
                    if not waiting and not self._put(_Item("wait")):
                        return
                    waiting = True
                    self._stop.wait(0.2)
                    continue
                waiting = False
                e, s = int(got["epoch"]), int(got["slice"])
                self.slices += 1
                log.debug("leased slice %d of epoch %d [%d:%d]", s, e, got["start"], got["stop"])
                for b in self.data.span(e, got["start"], got["stop"], batch_size=self.batch_size):
                    if not self._put(_Item("batch", e, s, b)):
                        return
                if not self._put(_Item("end", e, s)):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            self._put(exc)

    # -- the main thread

    def peek(self) -> _Item:
        """The next item (not taken), skipping slice ends (recorded) and waits."""
        while True:
            if self._head is None:
                got = self._q.get()
                if isinstance(got, BaseException):
                    raise got
                self._head = got
            if self._head.kind == "end":
                self.ended.append((self._head.epoch, self._head.slice))
            elif self._head.kind != "wait":
                return self._head
            self._head = None

    def epoch_batches(self, epoch: int) -> Iterator[Batch]:
        """Batches of ``epoch`` in a row: ends at a slice of another epoch, at the end of the run,
        or when the data server has no work now (so the round in hand is trained and pushed,
        and its slice reported, before this replica waits)."""
        while True:
            if self._head is None:
                got = self._q.get()
                if isinstance(got, BaseException):
                    raise got
                self._head = got
            item = self._head
            if item.kind == "end":
                self.ended.append((item.epoch, item.slice))
                self._head = None
                continue
            if item.kind == "wait":
                self._head = None
                return
            if item.kind != "batch" or item.epoch != epoch:
                return
            self._head = None
            assert item.batch is not None
            yield item.batch

    def take_ended(self) -> list[tuple[int, int]]:
        out, self.ended = self.ended, []
        return out


# -- the replica's side (trainer/downpour.py calls these for an elastic replica) --------------


def elastic_board(replica: Any) -> ElasticBoard:
    """Joins the run: the lease calls and the board of a Downpour Replica (trainer/downpour.py)."""
    cfg = replica.cfg
    replica.replica_id = replica_id()
    leases = Leases(
        replica.data.urls[0], cfg.token, cfg.run, replica.replica_id, cfg.epochs,
        cfg.epoch_fraction,
    )  # fmt: skip
    log.info("elastic replica %s joins run %r", replica.replica_id, cfg.run)
    return ElasticBoard(leases)


def train_slices(replica: Any, train_epoch: Any) -> None:
    """The elastic replica's main loop: trains the leased slices an epoch at a time, queues each
    finished slice's ``complete`` behind its pushes, until the data server says the run is done."""
    board: ElasticBoard = replica.board
    feed = ElasticFeed(replica.data, board.leases, replica.cfg.batch_size)
    pushq = replica.pushq

    def report_ended() -> None:
        for e, s in feed.take_ended():
            pushq.put(lambda e=e, s=s: _complete(board.leases, e, s))

    replica.round_hooks.insert(0, report_ended)  # before a step gate's wait
    feed.start()
    try:
        while True:
            head = feed.peek()
            if head.kind == "done":
                break
            train_epoch(head.epoch, feed.epoch_batches(head.epoch))
            report_ended()
        report_ended()
    finally:
        feed.stop()
    log.info("the run's last epoch is trained: %d slices leased by this replica", feed.slices)


def _complete(leases: Leases, epoch: int, slice_: int) -> None:
    """In the push thread, after every push of the slice is acknowledged. A failure is logged,
    not raised: the lease then lapses and the slice is trained again (at least once)."""
    try:
        leases.complete(epoch, slice_)
    except (OSError, RpcError) as exc:
        log.warning("could not report slice %d of epoch %d complete: %s", slice_, epoch, exc)
