"""The replication core's clock (issue 36: idle costs nothing): the core is ticked when its next
deadline is due (``ReplCore.next_deadline``: the pings, the heartbeats, the watchdog, a busy
primary's retries and COMMITs, and the deadline of each message it sent, when an unanswered one
has failed: issue 40), not every few milliseconds. An idle server with the default
``ping_interval`` (0.75 s) and heartbeats (1 s) ticks about twice a second, each tick doing what
is due. An input that brings no deadline before a bound (a ping: its watchdog, failover_after
away) leaves a plan due by then as it is, without asking the core (a walk over every bucket).

Every other input goes into the core at once (``Replicator.step``) and then ``poke``s the clock:
an input may bring a deadline earlier (a push starts a round, an answer schedules a retry, a
heartbeat's answer the next heartbeat), so unless a tick is already due within ``TICK`` the
deadline is asked again (once per loop step, however many inputs it ran). Ticks stay at least
``TICK`` apart, so a busy server ticks as often as it did when the clock ticked every ``TICK`` and
no more; ``MAX_SLEEP`` bounds a sleep all the same.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from adamps.core.replication.node import ReplCore

#: seconds between two ticks at least (a busy primary's retries and delayed COMMITs)
TICK = 0.02
#: seconds a sleep lasts at most (the pings are due sooner with every ping_interval allowed)
MAX_SLEEP = 1.0


class CoreClock:
    """Owned by the Replicator; lives on its event loop. `tick` feeds the core its tick."""

    def __init__(self, core: ReplCore, tick: Callable[[], None]) -> None:
        self.core = core
        self._tick = tick
        self._handle: asyncio.TimerHandle | None = None
        #: when the planned tick runs (time.monotonic(), the core's clock)
        self._at = float("inf")
        #: when the last tick ran
        self._last = float("-inf")
        self._stopped = False
        #: a poke's deadline query is planned for this loop step (``_repoke``)
        self._poked = False
        #: the earliest deadline the step's inputs may have brought (``poke``'s `not_before`)
        self._not_before = float("inf")
        #: ticks run (for the tests and /status)
        self.ticks = 0

    def start(self) -> None:
        self._plan(time.monotonic())  # the first tick at once (the registration is due)

    def stop(self) -> None:
        self._stopped = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def poke(self, not_before: float = 0.0) -> None:
        """After an input: tick sooner if it brought the core's next deadline earlier. Asked once
        per loop step, after every input of that step: a frame of a peer's PREPAREs for 21
        buckets is 21 inputs, and each asked the core's deadline, a walk over every bucket (issue
        36's profile: a tenth of a server's event loop at RF 3). `not_before`: the input brought
        no deadline before then (a ping: its watchdog), so a tick planned by then stands
        without asking the core (every bucket) again; the step's earliest counts."""
        self._not_before = min(self._not_before, not_before)
        if self._handle is None or self._poked:
            return  # stopped, or inside the tick (it plans the next one itself), or asked soon
        self._poked = True
        asyncio.get_running_loop().call_soon(self._repoke)

    def _repoke(self) -> None:
        self._poked = False
        not_before, self._not_before = self._not_before, float("inf")
        if self._handle is None:
            return
        now = time.monotonic()
        if self._at > max(now + TICK, not_before):
            at = max(self.core.next_deadline(now), self._last + TICK)
            if at < self._at:
                self._schedule(at, now)

    def _plan(self, now: float) -> None:
        at = max(self.core.next_deadline(now), self._last + TICK)
        self._schedule(min(at, now + MAX_SLEEP), now)

    def _schedule(self, at: float, now: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._at = at
        self._handle = asyncio.get_running_loop().call_later(max(0.0, at - now), self._fire)

    def _fire(self) -> None:
        self._handle = None
        if self._stopped:
            return
        self._last = time.monotonic()
        self.ticks += 1
        try:
            self._tick()
        finally:
            if not self._stopped:
                self._plan(time.monotonic())
