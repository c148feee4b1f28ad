"""The portion schedule (coordinator/portions.py): DistBelief 4.2's small portions, data
affinity, backup tasks and reassignment after a lost trainer. Pure: time is an argument."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.portions import Schedule, portion_bounds


def test_faster_trainers_do_more_and_walk_their_own_stretch() -> None:
    s = Schedule(40, backup=False)
    got: dict[str, list[int]] = {"fast": [], "slow": []}
    t = 0.0
    # fast finishes a portion every step, slow every 4th step
    pending = {"fast": s.request("fast", t), "slow": s.request("slow", t)}
    got["fast"].append(pending["fast"])
    got["slow"].append(pending["slow"])
    while not s.complete:
        t += 1
        for name, every in (("fast", 1), ("slow", 4)):
            if pending[name] is not None and int(t) % every == 0:
                assert s.report(name, pending[name], t)
                pending[name] = s.request(name, t)
                if pending[name] is not None:
                    got[name].append(pending[name])
    assert len(got["fast"]) > 2.5 * len(got["slow"])
    assert sorted(got["fast"] + got["slow"]) == list(range(40))
    # affinity: each trainer's portions are mostly consecutive
    for seq in got.values():
        steps = np.diff(seq)
        assert (steps == 1).mean() >= 0.8, seq


def test_trainers_start_apart() -> None:
    s = Schedule(100)
    assert s.request("a", 0) == 0
    assert s.request("b", 0) == 50
    assert s.request("c", 0) == 25  # the middle of the longest free run, [1, 50)
    assert s.request("a", 1) == 1


def test_backup_tasks_first_result_wins() -> None:
    s = Schedule(3, backup=True)
    a = s.request("slow", 0)
    b = s.request("fast", 0)
    c = s.request("fast2", 0)
    assert s.report("fast", b, 1) and s.report("fast2", c, 1)
    copy = s.request("fast", 2)
    assert copy == a and s.backups == 1
    assert s.request("fast2", 2) is None  # max_copies = 2 holders
    assert s.report("fast", a, 3) is True
    assert s.report("slow", a, 9) is False and s.duplicates == 1
    assert s.complete


def test_without_backup_tasks_free_trainers_wait() -> None:
    s = Schedule(2, backup=False)
    s.request("a", 0)
    s.request("b", 0)
    assert s.report("b", 1, 1)
    assert s.request("b", 1) is None


def test_a_lost_trainers_portion_is_reassigned() -> None:
    s = Schedule(2, backup=False)
    a = s.request("dead", 0)
    b = s.request("live", 0)
    assert s.report("live", b, 1)
    assert s.request("live", 1) is None
    s.heard("live", 5)
    assert s.expire(5.0, trainer_timeout=3.0) == ["dead"]
    assert s.reassigned == 1
    assert s.request("live", 5) == a
    assert s.report("live", a, 6) and s.complete
    # the dead trainer's late result (it was only slow) is a duplicate: dropped
    assert s.report("dead", a, 7) is False


@pytest.mark.parametrize("n, k", [(10, 3), (4000, 64), (5, 5)])
def test_bounds_cover_every_example_once(n, k) -> None:
    cover = [i for p in range(k) for i in range(*portion_bounds(n, k, p))]
    assert cover == list(range(n))
