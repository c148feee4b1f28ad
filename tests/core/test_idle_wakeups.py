"""An idle process's soft timers ride its other wake-ups (issue 36, item 4: idle costs nothing;
adamps/wire/ride.py): the loop probe, the data plane's sweep and a controller's leader loop each
had a timer of their own, so a server's loop woke for them beside its replication clock's ticks.

Each test runs the real timers on an event loop beside one "protocol" timer (a stand-in for a
server's replication clock, which must keep its own deadlines), counts how often the loop slept
and woke (its selector's blocking waits), and checks that the soft timers added no wake-ups of
their own while still running at least once per period. It counts wake-ups, not time: a loaded
machine delays them, it does not add any.
"""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from adamps.server.api.dataplane import DataPlane
from adamps.wire import looplag
from controller.leader import LeaderDuties

#: the stand-in protocol timer's period (seconds): 0.2 s, shorter than the probe's 0.25 s
HARD = 0.2
#: seconds each test watches
WINDOW = 3.0


class _Counting:
    """The loop's selector, counting the waits that could block (a timeout other than 0)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.sleeps = 0

    def select(self, timeout: float | None = None) -> Any:
        if timeout is None or timeout > 0:
            self.sleeps += 1
        return self._inner.select(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def _hard(fired: list[float]) -> None:
    """A timer that keeps its own period (as the replication clock keeps its deadlines)."""
    loop = asyncio.get_running_loop()
    due = loop.time() + HARD
    while True:
        loop.call_at(due, lambda: None)  # scheduled ahead, as CoreClock plans its next tick
        await asyncio.sleep(max(0.0, due - loop.time()))
        fired.append(loop.time())
        due += HARD


def _watch(*soft: Any) -> tuple[int, int]:
    """Runs the hard timer and the `soft` coroutines' tasks for WINDOW seconds; returns the
    loop's wake-ups and the hard timer's firings."""
    loop = asyncio.new_event_loop()
    counting = _Counting(loop._selector)  # type: ignore[attr-defined]
    loop._selector = counting  # type: ignore[attr-defined]
    fired: list[float] = []

    async def main() -> None:
        tasks = [asyncio.create_task(_hard(fired))] + [asyncio.create_task(c) for c in soft]
        await asyncio.sleep(0.05)  # every task started
        counting.sleeps = 0
        n0 = len(fired)
        await asyncio.sleep(WINDOW)
        fired[:] = fired[n0:]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return counting.sleeps, len(fired)


def test_the_loop_probe_adds_no_wakeup_beside_a_protocol_timer(monkeypatch) -> None:
    monkeypatch.setattr(looplag, "PERIOD", 0.25)
    probe = looplag.LoopLag(CollectorRegistry())
    checks: list[float] = []
    record = probe.record
    monkeypatch.setattr(probe, "record", lambda late, blocked: (checks.append(late),
                                                                record(late, blocked)))  # fmt: skip
    sleeps, hard = _watch(probe._run())
    # the probe still ran at least once per period (it rides the hard timer's wake-ups)
    assert len(checks) >= WINDOW / 0.25 - 2, checks
    # before: 12 more wake-ups (the probe's own timer, 4 a second)
    assert sleeps <= hard + 2, (sleeps, hard)


def test_the_data_planes_sweep_adds_no_wakeup(monkeypatch) -> None:
    swept: list[int] = []

    class Conns(set):
        def __iter__(self):  # the sweep lists the open connections once per pass
            swept.append(1)
            return super().__iter__()

    plane = types.SimpleNamespace(conns=Conns())
    sleeps, hard = _watch(DataPlane.sweep(plane, 0.5))  # type: ignore[arg-type]
    assert len(swept) >= WINDOW / 0.5 - 1, swept
    assert sleeps <= hard + 2, (sleeps, hard)  # before: 6 more (twice a second)


def test_a_followers_leader_loop_and_probe_add_no_wakeup(monkeypatch) -> None:
    """A follower's leader loop passes every reconcile_interval (0.25 s) for nothing but to see
    whether it leads now; with the probe, they woke the loop four times a second together."""
    monkeypatch.setattr(looplag, "PERIOD", 0.25)
    probe = looplag.LoopLag(CollectorRegistry())
    raft = types.SimpleNamespace(
        is_leader=lambda: False, is_ready=lambda: True, term=1, commit_index=0,
        journal=lambda: None,
    )  # fmt: skip
    metrics = types.SimpleNamespace(update=lambda *a: None)
    cfg = types.SimpleNamespace(reconcile_interval=0.25, server_timeout=3.0)
    duties = LeaderDuties(cfg, None, raft, metrics)  # type: ignore[arg-type]
    steps: list[float] = []
    step = duties.step

    async def counted_step() -> None:
        steps.append(1)
        await step()

    duties.step = counted_step  # type: ignore[method-assign]
    sleeps, hard = _watch(duties.run(), probe._run())
    assert len(steps) >= WINDOW / 0.25 - 2, steps
    assert sleeps <= hard + 2, (sleeps, hard)  # before: 12 more


@pytest.mark.parametrize("period", [0.25, 1.0])
def test_ride_sleeps_at_most_its_period_and_at_least_half(period: float) -> None:
    from adamps.wire import ride

    async def main() -> tuple[float, float, float, float]:
        loop = asyncio.get_running_loop()
        loop.call_at(loop.time() + period * 0.3, lambda: None)  # before the window: not ridden
        inside = loop.call_at(loop.time() + period * 0.7, lambda: None)  # in it: ridden
        due = await ride.sleep(period)
        t0 = loop.time()
        alone = await ride.sleep(period)  # nothing scheduled: the period's end
        return due, inside.when(), alone - t0, loop.time() - t0

    due, inside, alone, slept = asyncio.run(main())
    assert due == inside
    # (computed from the loop's clock read just after t0: later by a preemption at most)
    assert period <= alone < period + 0.1
    assert slept >= period - 0.001  # (asyncio runs a timer within its clock resolution)


def test_ride_at_rides_the_latest_live_timer_in_its_window() -> None:
    from adamps.wire import ride

    loop = asyncio.new_event_loop()
    try:
        h = loop.call_at(10.5, lambda: None)
        loop.call_at(10.2, lambda: None)
        assert ride.ride_at(loop, 10.0, 11.0) == 10.5
        h.cancel()
        assert ride.ride_at(loop, 10.0, 11.0) == 10.2
        assert ride.ride_at(loop, 10.6, 11.0) == 10.2  # a hop: it looks again then
        assert ride.ride_at(loop, 10.0, 10.1) == 10.1  # nothing due by then: its own
    finally:
        loop.close()


def test_the_probe_opens_its_schedstat_once(monkeypatch) -> None:
    """Each probe wake-up reads the loop thread's run-queue wait twice: from a file opened once
    (pread), not opened and read each time (20 us each, a tenth of an idle loop's time)."""
    import builtins
    import os

    opened: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def counting_open(path, *a, **k):  # type: ignore[no-untyped-def]
        if "schedstat" in str(path):
            opened.append(str(path))
        return real_open(path, *a, **k)

    def counting_os_open(path, *a, **k):  # type: ignore[no-untyped-def]
        if "schedstat" in str(path):
            opened.append(str(path))
        return real_os_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(os, "open", counting_os_open)
    monkeypatch.setattr(looplag, "PERIOD", 0.02)
    probe = looplag.LoopLag(CollectorRegistry())

    async def main() -> None:
        probe.start()
        await asyncio.sleep(0.5)
        await probe.stop()

    asyncio.run(main())
    count = next(x.value for x in probe.lag.collect()[0].samples if x.name.endswith("_count"))
    assert count >= 10  # the probe ran
    assert len(opened) <= 1, opened
