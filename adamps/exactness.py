"""The exactness checker of the replication tests and benchmark (after ps-lite's end-to-end test).

Clients push +1.0 to distinct elements of one tensor (plain SGD, lr = -1, so a push adds exactly;
dense deltas, or compressed updates with tau = 1),
recording for each push whether it was acknowledged, failed (a definite refusal), or of unknown
outcome (the client gave up while the push may have been applied). At the end: every acknowledged
push present exactly once, every failed push absent, unknown ones 0 or 1 times.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from adamps.client import RETRYABLE, PSClient
from adamps.layout import Layout
from adamps.rpc import RpcError


@dataclass
class Outcomes:
    acked: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    unknown: list[int] = field(default_factory=list)
    #: error code -> count, for the failed and unknown outcomes
    errors: dict[str, int] = field(default_factory=dict)
    #: (monotonic time, element) of every acknowledgement
    ack_times: list[tuple[float, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class ExactnessLoad:
    """Pusher threads, each pushing +1 to its own sequence of distinct elements."""

    def __init__(
        self,
        client: PSClient,
        layout: Layout,
        tensor: str,
        threads: int = 4,
        retry_for: float = 20.0,
        compressed: bool = False,
    ) -> None:
        self.client = client
        self.layout = layout
        self.tensor = tensor
        self.shards = layout.shards_of[tensor]
        self.size = layout.tensors[tensor].size
        self.threads = threads
        #: push each +1 as a compressed update (push_compressed, tau = 1) instead of a dense one
        self.compressed = compressed
        self.out = Outcomes()
        self._stop = threading.Event()
        self._next = iter(range(self.size))
        self._next_lock = threading.Lock()
        self._workers = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        client.retry_for = retry_for

    def _element(self) -> int | None:
        with self._next_lock:
            return next(self._next, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            i = self._element()
            if i is None:
                return
            # Elements are taken round-robin over shards, so consecutive pushes hit every bucket.
            shard = self.shards[i % len(self.shards)]
            offset = (i // len(self.shards)) % shard.size
            element = shard.start + offset
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
                    (self.out.unknown if exc.code in RETRYABLE else self.out.failed).append(element)
                    self.out.errors[exc.code] = self.out.errors.get(exc.code, 0) + 1
                continue
            except (ConnectionError, TimeoutError) as exc:
                with self.out.lock:
                    self.out.unknown.append(element)
                    name = type(exc).__name__
                    self.out.errors[name] = self.out.errors.get(name, 0) + 1
                continue
            with self.out.lock:
                self.out.acked.append(element)
                self.out.ack_times.append((time.monotonic(), element))

    def start(self) -> None:
        for w in self._workers:
            w.start()

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        for w in self._workers:
            w.join(timeout)

    def check(self, values: np.ndarray) -> dict[str, int]:
        flat = values.reshape(-1)
        o = self.out
        problems = []
        if len(set(o.acked)) != len(o.acked):
            problems.append("an element was acknowledged twice")
        bad_acked = [e for e in o.acked if flat[e] != 1.0]
        if bad_acked:
            problems.append(
                f"{len(bad_acked)} acknowledged pushes not present exactly once: {[(e, flat[e]) for e in bad_acked[:10]]}"
            )
        bad_failed = [e for e in o.failed if flat[e] != 0.0]
        if bad_failed:
            problems.append(f"{len(bad_failed)} failed pushes applied: {bad_failed[:10]}")
        bad_unknown = [e for e in o.unknown if flat[e] not in (0.0, 1.0)]
        if bad_unknown:
            problems.append(
                f"{len(bad_unknown)} unknown pushes applied more than once: {bad_unknown[:10]}"
            )
        pushed = set(o.acked) | set(o.failed) | set(o.unknown)
        strays = [int(e) for e in np.flatnonzero(flat) if int(e) not in pushed]
        if strays:
            problems.append(f"{len(strays)} elements changed that nobody pushed: {strays[:10]}")
        assert not problems, "; ".join(problems)
        return {
            "acked": len(o.acked),
            "failed": len(o.failed),
            "unknown": len(o.unknown),
            "errors": dict(o.errors),
        }
