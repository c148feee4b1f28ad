"""The replication core's clock (adamps.server.replication.clock, issue 36: idle costs nothing): an idle
core is ticked at its deadlines only, and an input that brings a deadline earlier is seen at once,
not after the sleep. The production ReplCore and CoreClock on a real event loop; the inputs are
fed the way Replicator.step feeds them (the input, then a poke)."""

from __future__ import annotations

import asyncio
import time

from adamps.core.lease import LeaseTerms
from adamps.core.replication.node import ReplCore
from adamps.core.replication.ready import ControllerAnswer, ControllerRequest
from adamps.core.replication.settings import ReplSettings
from adamps.server.replication.clock import MAX_SLEEP, TICK, CoreClock


async def test_an_idle_core_sleeps_and_an_input_wakes_its_clock_at_once() -> None:
    core = ReplCore(ReplSettings("s", ping_interval=100.0, lease=LeaseTerms()))
    requests: list[tuple[float, str]] = []

    def tick() -> None:
        core.tick(time.monotonic())
        requests.extend((time.monotonic(), r.kind) for r in core.ready().requests)
        core.advance()

    clock = CoreClock(core, tick)
    clock.start()
    await asyncio.sleep(0.05)
    assert [k for _t, k in requests] == ["register"], "the first tick at once registers"
    (reg_at, _) = requests[0]
    # The registration is in flight and the pings are 100 s away: the clock sleeps (MAX_SLEEP).
    await asyncio.sleep(0.3)
    assert clock.ticks == 1, f"an idle core is not ticked every {TICK} s"
    # The controllers answer (an input): the first heartbeat is due now, and goes at once.
    reg = ControllerRequest("register", -1, 0, body={})
    answer = {"lease": LeaseTerms().to_dict(), "heartbeat_interval": 1.0}
    t0 = time.monotonic()
    core.controller_answer(reg, ControllerAnswer(answer), t0)
    clock.poke()
    await asyncio.sleep(0.1)
    assert [k for _t, k in requests] == ["register", "heartbeat"]
    assert requests[1][0] - t0 < 0.1 < MAX_SLEEP, "woken by the input, not after the sleep"
    assert requests[1][0] - reg_at >= TICK
    ticks = clock.ticks
    await asyncio.sleep(0.3)  # the heartbeat in flight: nothing is due
    assert clock.ticks == ticks
    clock.stop()
    await asyncio.sleep(MAX_SLEEP + 0.1)
    assert clock.ticks == ticks, "stopped"


async def test_an_input_that_brings_no_deadline_sooner_does_not_ask_every_bucket() -> None:
    """A ping only moves its buckets' watchdog later (failover_after from now): poked with that
    bound, a clock already planned to tick by then keeps its plan without asking the core's
    next deadline (a walk over every bucket) again; any other input still asks."""
    core = ReplCore(ReplSettings("s", ping_interval=100.0, lease=LeaseTerms()))
    asked: list[float] = []
    next_deadline = core.next_deadline

    def counted(now: float) -> float:
        asked.append(now)
        return next_deadline(now)

    core.next_deadline = counted  # type: ignore[method-assign]
    clock = CoreClock(core, lambda: None)
    now = time.monotonic()
    clock._schedule(now + MAX_SLEEP, now)  # a tick planned within the second, as an idle clock's
    try:
        clock.poke(time.monotonic() + 3.0)  # a ping: its watchdog is due 3 s from now at least
        await asyncio.sleep(0.01)  # (a loop step's pokes are asked once, after it)
        assert asked == [], "a tick is planned before anything the ping brought"
        clock.poke(float("inf"))  # a ping's answer: no deadline at all
        await asyncio.sleep(0.01)
        assert asked == []
        clock.poke(time.monotonic() + 0.5 * MAX_SLEEP)  # a deadline may precede the plan: ask
        await asyncio.sleep(0.01)
        assert asked, "a deadline before the plan is asked for"
        now = time.monotonic()
        clock._schedule(now + MAX_SLEEP, now)  # (that ask found the registration due: replan)
        asked.clear()
        clock.poke(time.monotonic() + 3.0)
        clock.poke()  # a ping and another input in one loop step: the earliest bound counts
        await asyncio.sleep(0.01)
        assert asked, "any other input asks the core again"
    finally:
        clock.stop()


async def test_the_inputs_of_one_loop_step_ask_the_core_deadline_once() -> None:
    """Issue 36 (helper perf36's profile of a click-through step at RF 3): a frame of a peer's
    PREPAREs for 21 buckets is 21 inputs in one loop step, and each one's poke asked the core's
    next deadline, a walk over every bucket. The pokes of one loop step ask it once."""
    core = ReplCore(ReplSettings("s", ping_interval=100.0, lease=LeaseTerms()))

    def tick() -> None:
        core.tick(time.monotonic())
        core.ready()
        core.advance()

    clock = CoreClock(core, tick)
    clock.start()
    await asyncio.sleep(0.05)  # registered; the clock sleeps (nothing due for MAX_SLEEP)
    asked: list[float] = []
    real = core.next_deadline
    core.next_deadline = lambda now: (asked.append(now), real(now))[1]  # type: ignore[method-assign]
    for _ in range(21):
        clock.poke()
    await asyncio.sleep(0.01)
    assert len(asked) == 1, f"{len(asked)} deadline queries for the pokes of one loop step"
    for _ in range(3):  # a later loop step asks again
        clock.poke()
    await asyncio.sleep(0.01)
    assert len(asked) == 2
    clock.stop()


async def test_the_clock_wakes_the_core_at_an_unanswered_message_deadline() -> None:
    """Issue 40: peer timeouts are ticks of the core. An idle primary whose COMMIT to b is never
    answered (and which no transport reports failed) is ticked at the message's deadline,
    member_timeout after it was sent, and asks the controllers to drop b then: no busy tick
    before, no waiting for a transport's timeout."""
    core = ReplCore(ReplSettings("a", member_timeout=0.3, ping_interval=100.0, lease=LeaseTerms()))
    drops: list[float] = []

    def tick() -> None:
        core.tick(time.monotonic())
        drops.extend(time.monotonic() for r in core.ready().requests if r.kind == "drop_secondary")
        core.advance()

    clock = CoreClock(core, tick)
    core.tick(time.monotonic())  # registered, its first heartbeat in flight
    (reg,) = core.ready().requests
    answer = {"lease": LeaseTerms().to_dict(), "heartbeat_interval": 100.0}
    core.controller_answer(reg, ControllerAnswer(answer), time.monotonic())
    core.tick(time.monotonic())
    assert [r.kind for r in core.ready().requests] == ["register", "heartbeat"]
    core.advance()
    sent = time.monotonic()
    rec = {"bucket": 0, "epoch": 1, "primary": "a", "secondaries": ["b"], "joining": []}
    core.on_roles({"version": 1, "roles": [rec], "renewed": [[0, 1]]}, sent, sent)
    assert [m.op for m in core.ready().messages] == ["repl_commit"]  # b's position
    core.advance()  # sent; never answered
    clock.start()  # nothing is due before the message's deadline: it sleeps until then
    await asyncio.sleep(0.2)
    assert clock.ticks == 0 and drops == []
    await asyncio.sleep(0.25)
    clock.stop()
    assert len(drops) == 1 and 0.3 <= drops[0] - sent < 0.3 + 0.1, drops
