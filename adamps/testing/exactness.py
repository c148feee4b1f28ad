"""The exactness checker of the replication tests and benchmark (after ps-lite's end-to-end test).

Clients push +1.0 to distinct elements of one tensor (plain SGD, lr = -1, so a push adds exactly;
dense deltas, or compressed updates with tau = 1),
recording for each push whether it was acknowledged, failed (a definite refusal), or of unknown
outcome (the client gave up while the push may have been applied). At the end: every acknowledged
push present exactly once, every failed push absent, unknown ones 0 or 1 times.

Loss windows: when every copy of the data crashed at once, the contract lets the pushes acknowledged
within the loss window (`flush_interval` plus a margin) before the crash go missing, never doubled.
`check(values, lossy=[(t0, t1), ...])` treats acknowledgements whose (monotonic) time falls in one of
those windows as "0 or 1 times"; every other acknowledgement must be present exactly once.

`read_shards` reads the tensor back shard by shard from each bucket's primary, retrying buckets
that answer "unavailable" (503) or moved until a deadline, and hands every answer to a validator
first, so that a test sees any value a server serves (e.g. init values served silently after a
restart), not only the last one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from adamps.client import RETRYABLE, PSClient
from adamps.client.rpc import RpcError, SyncRpc
from adamps.layout import Layout, Shard

#: (start, end) monotonic times; acknowledgements inside may be missing (0 or 1, never 2)
Windows = Sequence[tuple[float, float]]


@dataclass
class Outcomes:
    acked: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    unknown: list[int] = field(default_factory=list)
    #: error code -> count, for the failed and unknown outcomes
    errors: dict[str, int] = field(default_factory=dict)
    #: (monotonic time, element) of every acknowledgement
    ack_times: list[tuple[float, int]] = field(default_factory=list)
    #: the first refusals taken as definite ("code: message"), named when one was applied
    refusals: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def refused(self, exc: RpcError) -> None:
        """Counts an RpcError; keeps the first few definite ones' text (call under `lock`)."""
        self.errors[exc.code] = self.errors.get(exc.code, 0) + 1
        if definitely_not_applied(exc) and len(self.refusals) < 5:
            self.refusals.append(f"{exc.code} ({exc.http_status}): {exc}")


def definitely_not_applied(exc: RpcError) -> bool:
    """A refusal that guarantees the push was not applied: a 4xx that is not a "retry elsewhere"
    answer. Everything else (5xx, timeouts, codes the client retries) leaves the outcome open."""
    if exc.code in RETRYABLE:
        return False
    status = exc.http_status
    return status is not None and 400 <= status < 500


class ExactnessLoad:
    """Pusher threads, each pushing +1 to its own sequence of distinct elements."""

    def __init__(
        self,
        client: PSClient,
        layout: Layout,
        tensor: str,
        threads: int = 4,
        retry_for: float = 20.0,
        pause: float = 0.0,
        compressed: bool = False,
    ) -> None:
        self.client = client
        self.layout = layout
        self.tensor = tensor
        self.shards = layout.shards_of[tensor]
        self.size = layout.tensors[tensor].size
        self.threads = threads
        #: seconds each thread sleeps between pushes (0: as fast as the cluster acknowledges)
        self.pause = pause
        #: push each +1 as a compressed update (push_compressed, tau = 1) instead of a dense one
        self.compressed = compressed
        self.out = Outcomes()
        #: element -> monotonic time its acknowledged push was sent
        self.sent_at: dict[int, float] = {}
        self._stop = threading.Event()
        self._next = iter(range(self.size))
        self._next_lock = threading.Lock()
        self._workers = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        client.retry_for = retry_for

    def _element(self) -> int | None:
        with self._next_lock:
            return next(self._next, None)

    def element_of(self, i: int) -> tuple[Shard, int]:
        """The shard and offset in it of the i-th push (round-robin over shards, so consecutive
        pushes hit every bucket)."""
        shard = self.shards[i % len(self.shards)]
        return shard, (i // len(self.shards)) % shard.size

    def _run(self) -> None:
        while not self._stop.is_set():
            i = self._element()
            if i is None:
                return
            shard, offset = self.element_of(i)
            element = shard.start + offset
            sent = time.monotonic()
            try:
                if self.compressed:
                    word = np.array([offset << 1], np.uint32)  # index offset, sign +
                    self.client.push_compressed({shard.id: {"tau": 1.0, "words": word}})
                else:
                    delta = np.zeros(shard.shape, np.float32)
                    delta.reshape(-1)[offset] = 1.0
                    self.client.push_shards({shard.id: delta})
            except RpcError as exc:
                with self.out.lock:
                    (self.out.failed if definitely_not_applied(exc) else self.out.unknown).append(
                        element
                    )
                    self.out.refused(exc)
                continue
            except (ConnectionError, TimeoutError, OSError) as exc:
                with self.out.lock:
                    self.out.unknown.append(element)
                    name = type(exc).__name__
                    self.out.errors[name] = self.out.errors.get(name, 0) + 1
                continue
            with self.out.lock:
                self.out.acked.append(element)
                self.out.ack_times.append((time.monotonic(), element))
                self.sent_at[element] = sent
            if self.pause:
                self._stop.wait(self.pause)

    def start(self) -> None:
        for w in self._workers:
            w.start()

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        for w in self._workers:
            w.join(timeout)

    def acked_count(self) -> int:
        with self.out.lock:
            return len(self.out.acked)

    # -- checking --------------------------------------------------------------------------------

    def _snapshot(self) -> tuple[list[tuple[float, int]], list[int], list[int]]:
        with self.out.lock:
            return list(self.out.ack_times), list(self.out.failed), list(self.out.unknown)

    def problems(
        self,
        values: np.ndarray,
        lossy: Windows = (),
        start: int = 0,
        stop: int | None = None,
        read_at: float | None = None,
    ) -> list[str]:
        """What is wrong with `values` (the flat tensor's elements [start, stop)) given the
        outcomes so far; empty when the contract holds. `read_at`: the monotonic time the read
        was sent while pushes still run; acknowledgements after it may or may not show, and
        elements pushed but not yet recorded are not counted as strays."""
        flat = values.reshape(-1)
        stop = start + flat.size if stop is None else stop
        ack_times, failed, unknown = self._snapshot()
        if read_at is not None:
            lossy = [*lossy, (read_at, float("inf"))]

        def here(e: int) -> bool:
            return start <= e < stop

        def in_window(t: float) -> bool:
            return any(t0 <= t <= t1 for t0, t1 in lossy)

        problems = []
        acked = [e for _, e in ack_times]
        if len(set(acked)) != len(acked):
            problems.append("an element was acknowledged twice")
        must = [e for t, e in ack_times if here(e) and not in_window(t)]
        may = [e for t, e in ack_times if here(e) and in_window(t)]
        bad_acked = [e for e in must if flat[e - start] != 1.0]
        if bad_acked:
            zeros = sum(1 for e in bad_acked if flat[e - start] == 0.0)
            problems.append(
                f"{len(bad_acked)} of {len(must)} acknowledged pushes not present exactly once "
                f"({zeros} missing): {[(e, float(flat[e - start])) for e in bad_acked[:10]]}"
            )
        bad_may = [e for e in may if flat[e - start] not in (0.0, 1.0)]
        if bad_may:
            problems.append(
                f"{len(bad_may)} pushes acknowledged inside a loss window applied more than once: "
                f"{bad_may[:10]}"
            )
        bad_failed = [e for e in failed if here(e) and flat[e - start] != 0.0]
        if bad_failed:
            problems.append(
                f"{len(bad_failed)} failed pushes applied: {bad_failed[:10]} (the first "
                f"refusals: {self.out.refusals})"
            )
        bad_unknown = [e for e in unknown if here(e) and flat[e - start] not in (0.0, 1.0)]
        if bad_unknown:
            problems.append(
                f"{len(bad_unknown)} unknown pushes applied more than once: {bad_unknown[:10]}"
            )
        pushed = set(acked) | set(failed) | set(unknown)
        strays = [int(e) + start for e in np.flatnonzero(flat) if int(e) + start not in pushed]
        if read_at is not None:
            strays = [e for e in strays if flat[e - start] != 1.0]  # may be in flight
        if strays:
            problems.append(f"{len(strays)} elements changed that nobody pushed: {strays[:10]}")
        return problems

    def check(self, values: np.ndarray, lossy: Windows = ()) -> dict[str, int]:
        """Asserts the contract over the whole tensor; returns the counts of outcomes (and how
        many acknowledged pushes fell in loss windows and how many of those are missing)."""
        problems = self.problems(values, lossy)
        assert not problems, "; ".join(problems)
        flat = values.reshape(-1)
        ack_times, failed, unknown = self._snapshot()
        in_windows = [e for t, e in ack_times if any(t0 <= t <= t1 for t0, t1 in lossy)]
        o = self.out
        return {
            "acked": len(ack_times),
            "failed": len(failed),
            "unknown": len(unknown),
            "unknown_applied": sum(1 for e in unknown if flat[e] == 1.0),
            "acked_in_loss_windows": len(in_windows),
            "lost_in_loss_windows": sum(1 for e in in_windows if flat[e] == 0.0),
            "errors": dict(o.errors),
        }


def read_shards(
    client: PSClient,
    tensor: str,
    timeout: float,
    validate: Callable[[Shard, np.ndarray, float], None] | None = None,
    rpc_timeout: float = 5.0,
) -> tuple[np.ndarray, dict[str, int]]:
    """The whole tensor, read shard by shard from each bucket's primary (per the controllers'
    routing table), retrying shards whose bucket answers an error or no answer until `timeout`.
    Every successful answer goes to `validate(shard, values, sent_at)` first (it may raise;
    `sent_at` is the monotonic time the request was sent). Returns the
    values and the count of each error seen while waiting; raises TimeoutError naming the shards
    still unread and the last errors."""
    layout = client.layout
    shards = layout.shards_of[tensor]
    out = np.zeros(layout.tensors[tensor].shape, np.float32)
    flat = out.reshape(-1)
    todo = {s.id: s for s in shards}
    errors: dict[str, int] = {}
    last: dict[str, str] = {}
    rpcs: dict[str, SyncRpc] = {}
    deadline = time.monotonic() + timeout
    try:
        while todo:
            try:
                routing = client.routing(refresh=True)
            except (ConnectionError, TimeoutError, OSError, RpcError) as exc:
                errors["routing"] = errors.get("routing", 0) + 1
                last["routing"] = str(exc)
                routing = None
            groups: dict[str, list[Shard]] = {}
            for s in todo.values() if routing is not None else ():
                route = routing.routes.get(layout.bucket_of[s.id])
                if route is None:
                    errors["no_route"] = errors.get("no_route", 0) + 1
                    last[s.id] = "no primary in the routing table"
                    continue
                groups.setdefault(route.primary, []).append(s)
            for url, group in groups.items():
                rpc = rpcs.get(url)
                if rpc is None:
                    rpc = rpcs[url] = SyncRpc(url, client.token, rpc_timeout)
                for s in group:  # one shard per request: a bucket that answers is not held back
                    sent_at = time.monotonic()
                    try:
                        reply = rpc.call("pull", shards=[s.id])
                    except RpcError as exc:
                        errors[exc.code] = errors.get(exc.code, 0) + 1
                        last[s.id] = f"{exc.code} ({exc.http_status}): {exc}"
                        continue
                    except (ConnectionError, TimeoutError, OSError) as exc:
                        errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                        last[s.id] = f"{type(exc).__name__}: {exc}"
                        rpc.close()
                        rpcs.pop(url, None)
                        break
                    values = np.asarray(reply["shards"][s.id], np.float32).reshape(-1)
                    if validate is not None:
                        validate(s, values, sent_at)
                    flat[s.start : s.stop] = values
                    del todo[s.id]
            if not todo:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(todo)} shards of {tensor} unread after {timeout}s; errors {errors}; "
                    f"last: {[(k, last.get(k)) for k in list(todo)[:5]]}"
                )
            time.sleep(0.2)
    finally:
        for rpc in rpcs.values():
            rpc.close()
    return out, errors
