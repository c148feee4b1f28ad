"""The exactness checker for embedding-table pushes (issue 23), after ``exactness.py``.

A table of dim 1, zeros init, SGD with lr = -1 (a push of g adds g). Push k adds +1.0 to the
rows of ids ``2k`` and ``2k + 1`` in one ``push_rows`` (two ids, usually two buckets, so the
multi-bucket client contract is exercised), and records the outcome of both ids: acknowledged
(with its time), failed or unknown. The ids' values read back with ``pull_rows`` are then checked
by ``ExactnessLoad``'s rules, id by id: acknowledged exactly once (or 0/1 inside a loss window),
failed absent, unknown 0 or 1, nothing else changed.

A push spanning two buckets is acknowledged bucket by bucket: after a partial failure the
client re-sends only the unacknowledged part, so one part may have been acknowledged (and, in a
crash of every copy, lost within the loss window) long before the push as a whole returns. The
checker therefore treats an acknowledged push as inside a loss window when any moment from its
first send to its acknowledgement is (`problems`), not only its final acknowledgement.
(With only the final acknowledgement time, a whole-cluster SIGKILL test of two-bucket pushes,
dense or rows, reports such parts as lost acknowledged pushes in about 2 runs of 5.)"""

from __future__ import annotations

import threading
import time

import numpy as np

from adamps.client import PartialPushError, PSClient
from adamps.client.rpc import RpcError
from adamps.tables import buckets_of
from adamps.testing.exactness import ExactnessLoad, Outcomes, Windows, definitely_not_applied

TABLE = "exact_rows"


class RowsExactnessLoad(ExactnessLoad):
    """Pusher threads, each push +1 to two fresh ids of the table."""

    def __init__(
        self,
        client: PSClient,
        threads: int = 4,
        retry_for: float = 20.0,
        pause: float = 0.0,
        max_pushes: int = 1_000_000,
        table: str = TABLE,
        per_push: int = 2,
    ) -> None:
        self.client = client
        self.table = table
        self.threads = threads
        self.pause = pause
        #: ids of one push: per_push consecutive ids (2: usually two buckets)
        self.per_push = per_push
        #: ids are 0 .. size - 1
        self.size = per_push * max_pushes
        self.out = Outcomes()
        #: id -> monotonic time its push was first sent
        self.sent_at: dict[int, float] = {}
        #: the loss windows of the check in progress (problems -> _snapshot)
        self._windows: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._next = iter(range(max_pushes))
        self._next_lock = threading.Lock()
        self._workers = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        client.retry_for = retry_for

    def create(self) -> None:
        self.client.create_table(
            self.table, 1, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0}
        )

    def _run(self) -> None:
        ones = np.ones((self.per_push, 1), np.float32)
        while not self._stop.is_set():
            k = self._element()
            if k is None:
                return
            ids = list(range(self.per_push * k, self.per_push * (k + 1)))
            sent = time.monotonic()
            with self.out.lock:
                self.sent_at.update(dict.fromkeys(ids, sent))
            try:
                self.push(np.array(ids, np.int64), ones)
            except PartialPushError as exc:
                self._partly(ids, exc)
                continue
            except RpcError as exc:
                with self.out.lock:
                    where = self.out.failed if definitely_not_applied(exc) else self.out.unknown
                    where += ids
                    self.out.refused(exc)
                continue
            except (ConnectionError, TimeoutError, OSError) as exc:
                with self.out.lock:
                    self.out.unknown += ids
                    name = type(exc).__name__
                    self.out.errors[name] = self.out.errors.get(name, 0) + 1
                continue
            now = time.monotonic()
            with self.out.lock:
                self.out.acked += ids
                self.out.ack_times += [(now, i) for i in ids]
            if self.pause:
                self._stop.wait(self.pause)

    def push(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """One push of the load (a subclass may send it another way: a ``round``)."""
        self.client.push_rows(self.table, ids, grads)

    def _partly(self, ids: list[int], exc: PartialPushError) -> None:
        """A push whose buckets answered apart (issue 39): the ids of the buckets that applied
        it are acknowledged, the others failed (after a 4xx) or unknown."""
        cause = exc.cause
        refused = isinstance(cause, RpcError) and definitely_not_applied(cause)
        now = time.monotonic()
        buckets = buckets_of(np.array(ids, np.int64), self.client.layout.n_buckets).tolist()
        with self.out.lock:
            for i, b in zip(ids, buckets, strict=True):
                if b in exc.applied:
                    self.out.acked.append(i)
                    self.out.ack_times.append((now, i))
                else:
                    (self.out.failed if refused else self.out.unknown).append(i)
            if isinstance(cause, RpcError):
                self.out.refused(cause)
            else:
                name = type(cause).__name__
                self.out.errors[name] = self.out.errors.get(name, 0) + 1

    def problems(
        self,
        values: np.ndarray,
        lossy: Windows = (),
        start: int = 0,
        stop: int | None = None,
        read_at: float | None = None,
    ) -> list[str]:
        self._windows = [*lossy, *([(read_at, float("inf"))] if read_at is not None else [])]
        try:
            return super().problems(values, lossy, start, stop, read_at)
        finally:
            self._windows = []

    def _snapshot(self) -> tuple[list[tuple[float, int]], list[int], list[int]]:
        """Acknowledgements with, for a push whose span [first send, acknowledgement] meets a
        loss window, a time inside that window (module docstring)."""
        acks, failed, unknown = super()._snapshot()
        windows = self._windows
        if not windows:
            return acks, failed, unknown
        out = []
        for t, e in acks:
            s = self.sent_at.get(e, t)
            hit = next((max(s, t0) for t0, t1 in windows if s <= t1 and t >= t0), None)
            out.append((t if hit is None else hit, e))
        return out, failed, unknown

    def pushed_ids(self) -> int:
        """One past the highest id any push named."""
        with self.out.lock:
            every = [*self.out.acked, *self.out.failed, *self.out.unknown]
        return max(every, default=-1) + 1

    def read(self, client: PSClient | None = None, chunk: int = 65_536) -> np.ndarray:
        """The values of ids 0 .. pushed_ids() - 1, pulled from the primaries (plus a margin of
        ids nobody pushed, which must read 0)."""
        c = client or self.client
        n = self.pushed_ids() + 64
        out = np.empty(n, np.float32)
        for s in range(0, n, chunk):
            ids = np.arange(s, min(n, s + chunk), dtype=np.int64)
            out[s : s + len(ids)] = c.pull_rows(self.table, ids)[:, 0]
        return out
