"""The failovers a client rode through: a bucket whose primary changed between the routing table
a call started with and the one it succeeded with. Each is logged once per client, in one line
(bucket, old and new primary, seconds the call stalled), and counted, so that a training loop
that only saw a slow step can tell why (``DownpourOptimizer.stats()``, the trainers' metrics)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("adamps.client")


@dataclass(frozen=True)
class Failover:
    bucket: int
    old: str  #: the primary the call first tried
    new: str  #: the primary it succeeded with
    stalled_s: float  #: seconds from the call's start to its success


class FailoverLog:
    """A client's failovers (thread-safe: a replica's workers share the client)."""

    def __init__(self, keep: int = 100) -> None:
        self._lock = threading.Lock()
        #: the primary of each bucket as last noted: a change is logged once, not per call
        self._noted: dict[int, str] = {}
        self.events: deque[Failover] = deque(maxlen=keep)
        self.count = 0

    def observe(
        self, before: Any, after: Any, stalled_s: float, used: set[int] | None = None
    ) -> list[Failover]:
        """Compares two routing tables (adamps.client.routing.Routing) after a call that
        retried; returns (and logs) the failovers of buckets in `used` (None: every bucket) not
        seen before."""
        new: list[Failover] = []
        with self._lock:
            for b, route in after.routes.items():
                if used is not None and b not in used:
                    continue
                old = before.routes.get(b)
                if old is None or old.primary == route.primary:
                    continue
                if self._noted.get(b) == route.primary:
                    continue  # another call of this client already reported it
                self._noted[b] = route.primary
                ev = Failover(int(b), old.primary, route.primary, stalled_s)
                self.events.append(ev)
                self.count += 1
                new.append(ev)
        for ev in new:
            log.warning(
                "failover: bucket %d primary %s -> %s, stalled %.1f s",
                ev.bucket, ev.old, ev.new, ev.stalled_s,
            )  # fmt: skip
        return new
