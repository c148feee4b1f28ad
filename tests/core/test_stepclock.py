"""Consistency modes' step clocks (adamps/core/stepclock.py, issue 25), time as an argument."""

from __future__ import annotations

import random

import pytest

from adamps.core.stepclock import Mode, ModeConflict, RunClocks, parse_mode


def pushed(step: int) -> int:
    return 2 * step


def fetched(step: int) -> int:
    return 2 * step - 1


def test_parse_mode() -> None:
    assert parse_mode("async") == Mode("async")
    assert parse_mode("sync") == Mode("sync")
    assert parse_mode("ssp:3") == Mode("ssp", 3) and str(Mode("ssp", 3)) == "ssp:3"
    for bad in ("ssp", "ssp:-1", "ssp:x", "SYNC", "", "ssp:99999999"):
        with pytest.raises(ValueError, match="async, sync or ssp:S"):
            parse_mode(bad)


def test_sync_two_barriers_a_step() -> None:
    c = RunClocks(Mode("sync"), lease=5.0)
    c.declare(Mode("sync"), 0.0, ["0", "1"])
    c.report("0", fetched(1), 0.0)
    assert c.blocking("0", 0.0) == ["1"]  # 1 has not read step 1's parameters yet
    c.report("1", fetched(1), 0.1)
    assert c.blocking("0", 0.1) == [] and c.blocking("1", 0.1) == []
    c.report("0", pushed(1), 0.2)
    assert c.blocking("0", 0.2) == ["1"]  # 1's gradient of step 1 is not summed yet
    c.report("1", pushed(1), 0.3)
    assert c.blocking("0", 0.3) == [] and c.release("0", 0.3) == 0


def test_ssp_bound() -> None:
    c = RunClocks(Mode("ssp", 2), lease=5.0)
    c.declare(Mode("ssp", 2), 0.0, ["fast", "slow"])
    for step in (1, 2):
        c.report("fast", pushed(step), 0.0)
        assert c.blocking("fast", 0.0) == []
        assert c.release("fast", 0.0) == step
    c.report("fast", pushed(3), 0.0)
    assert c.blocking("fast", 0.0) == ["slow"]  # 3 steps ahead of the slowest: held
    c.report("slow", pushed(1), 0.1)
    assert c.blocking("fast", 0.1) == [] and c.release("fast", 0.1) == 2
    assert c.max_staleness == 2


def test_a_dead_replica_stops_blocking_after_its_lease() -> None:
    c = RunClocks(Mode("sync"), lease=5.0)
    c.declare(Mode("sync"), 0.0, ["a", "dead"])
    c.report("a", pushed(1), 1.0)
    assert c.blocking("a", 4.0) == ["dead"]
    c.report("a", pushed(1), 5.5)
    assert c.blocking("a", 5.5) == []


def test_a_new_replica_joins_at_the_slowest_live_step() -> None:
    c = RunClocks(Mode("ssp", 1), lease=5.0)
    c.report("a", pushed(7), 0.0)
    c.report("b", fetched(6), 0.0)
    assert c.join("new", 0.1) == pushed(5)  # b's last pushed step is 5
    c.report("a", pushed(9), 0.2)
    assert c.join("a", 0.3) == pushed(9)  # a restarted replica continues from its own clock


def test_a_conflicting_mode_is_refused_while_the_run_is_live() -> None:
    c = RunClocks(Mode("sync"), lease=5.0)
    c.report("a", pushed(1), 0.0)
    with pytest.raises(ModeConflict, match=r"live in mode sync; this replica asks for ssp:2"):
        c.declare(Mode("ssp", 2), 1.0)
    c.declare(Mode("ssp", 2), 10.0)  # nobody live: the run starts again in the new mode
    assert c.mode == Mode("ssp", 2)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("bound", [0, 1, 3])
def test_random_schedules_never_release_beyond_the_bound(seed: int, bound: int) -> None:
    """Replicas advance at random speeds; a released fetch is never more than S steps ahead of
    the slowest live replica, and the run always progresses (no deadlock)."""
    rng = random.Random(seed)
    c = RunClocks(Mode("ssp", bound), lease=1e9)
    names = ["r0", "r1", "r2"]
    c.declare(c.mode, 0.0, names)
    step = dict.fromkeys(names, 0)
    waiting: set[str] = set()
    for i in range(3000):
        r = rng.choice(names)
        if r not in waiting:
            step[r] += 1
            c.report(r, pushed(step[r]), float(i))
            waiting.add(r)
        if not c.blocking(r, float(i)):
            waiting.discard(r)
            assert c.release(r, float(i)) <= bound
            assert step[r] - min(step.values()) <= bound
    assert min(step.values()) > 100
    assert c.max_staleness == bound
