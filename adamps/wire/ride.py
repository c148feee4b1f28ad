"""Soft periodic timers that ride the event loop's other wake-ups (issue 36: idle costs nothing).

A soft timer must run again at most `period` after its last run, and may run sooner: the loop
probe (adamps/wire/looplag.py), the data plane's sweep of expired connections, the controllers'
leader loop and checkpoint schedule. Each wake-up of an idle process costs about 0.3 ms of CPU
(the kernel's switch and the loop's own pass), far more than such a timer's own work, and each
of these timers had a wake-up of its own: a parameter server's loop woke for its probe four
times a second and for its sweep twice, beside its replication clock's ticks.

`sleep` instead runs at the latest timer the loop already has scheduled within the second half
of the period, when there is one: asyncio runs every timer due at the same time in one pass of
its loop, so the two share one wake-up. When none is scheduled there yet but one is due sooner,
it waits for that one's pass and looks again (a replication clock schedules only its next tick).
Only when no timer is due before the period's end does the soft timer wake the loop itself, then.
So a soft timer still runs at least once per `period` (a probe still sees a block of B seconds as
at least B - period) and at most twice.

The scheduled timers are read from asyncio's own heap (``loop._scheduled``, CPython's
``BaseEventLoop`` since 3.4): a loop without it gets a plain sleep of `period`.
"""

from __future__ import annotations

import asyncio


def ride_at(loop: asyncio.AbstractEventLoop, earliest: float, latest: float) -> float:
    """The loop time a soft timer due by `latest` runs at next: the latest live timer the loop
    has scheduled in [`earliest`, `latest`]; else the first one before `earliest` (a hop: it looks
    again then); else `latest`."""
    best = hop = None
    for h in getattr(loop, "_scheduled", ()):
        when = h.when()
        if when > latest or h.cancelled():
            continue
        if when >= earliest:
            if best is None or when > best:
                best = when
        elif hop is None or when < hop:
            hop = when
    if best is not None:
        return best
    return latest if hop is None else hop


async def sleep(period: float) -> float:
    """Sleeps at least `period` / 2 and at most `period` seconds, until the pass of the latest
    timer due in that window (see the module's docstring); returns the loop time it was due at
    (how late it woke is ``loop.time()`` less that)."""
    loop = asyncio.get_running_loop()
    now = loop.time()
    earliest, latest = now + period / 2, now + period
    while True:
        # first let the timers of this pass plan their next (the loop runs them meanwhile and
        # goes on without sleeping): the timer to ride may be one of theirs
        await asyncio.sleep(0)
        at = ride_at(loop, earliest, latest)
        if at < now:  # a timer overdue (its pass is this one): wait for the next
            at = latest
        fut = loop.create_future()
        handle = loop.call_at(at, _wake, fut)
        try:
            await fut
        finally:
            handle.cancel()
        if at >= earliest:
            return at
        now = loop.time()


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
