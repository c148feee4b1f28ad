"""The elastic replicas' slice leases (dataserver/slices.py, issue 25), with time as an argument:
at-least-once training of every example of every epoch under joins, deaths and stalls, and the
75% rule (Project Adam 3.2.5) over the replicas alive at the time."""

from __future__ import annotations

import random

import pytest

from dataserver.slices import SliceTable


def table(**kw):
    args = {"n_examples": 100, "slice_size": 30, "lease": 5.0, "epochs": 2} | kw
    return SliceTable(**args)


def test_slices_cover_the_epoch_once_when_nobody_dies() -> None:
    t = table()
    assert t.n_slices == 4
    got = []
    while (g := t.acquire("a", 0.0)) is not None:
        got.append(g)
        assert t.complete("a", g.epoch, g.slice, 0.0)
    assert [(g.epoch, g.start, g.stop) for g in got] == [
        (1, 0, 30), (1, 30, 60), (1, 60, 90), (1, 90, 100),
        (2, 0, 30), (2, 30, 60), (2, 60, 90), (2, 90, 100),
    ]  # fmt: skip
    assert t.finished() and t.completed() == 2
    assert t.counters() == {
        e: {"served": 100, "trained": 100, "slices_done": 4, "reissued": 0} for e in (1, 2)
    }


def test_a_dead_replicas_slice_goes_to_another_after_its_lease() -> None:
    t = table()
    dead = t.acquire("dead", 0.0)
    assert dead is not None and dead.slice == 0
    a = t.acquire("a", 1.0)
    assert a is not None and a.slice == 1  # the lease still holds
    t.complete("a", a.epoch, a.slice, 1.0)
    t.heartbeat("a", 5.5)
    # 6.0: "dead" was last heard at 0.0, lease 5 s: its slice is the oldest free one again
    assert t.held() == {"dead": 1}
    again = t.acquire("a", 6.0)
    assert again == dead and t.held() == {"a": 1}
    assert t.live(6.0) == ["a"]
    assert t.counters()[1]["reissued"] == 1


def test_a_live_slow_replica_keeps_its_slice() -> None:
    t = table()
    slow = t.acquire("slow", 0.0)
    for now in (4.0, 8.0, 12.0):
        t.heartbeat("slow", now)
        g = t.acquire("fast", now)
        assert g is None or g.slice != slow.slice or g.epoch != slow.epoch
        if g is not None:
            t.complete("fast", g.epoch, g.slice, now)
    assert t.complete("slow", slow.epoch, slow.slice, 12.5)


def test_a_late_completion_counts_once_and_the_slice_is_not_handed_out_again() -> None:
    t = table()
    g = t.acquire("stalled", 0.0)
    g2 = t.acquire("b", 10.0)  # stalled's lease lapsed: b gets the same slice
    assert g2 == g
    assert t.complete("stalled", g.epoch, g.slice, 10.5)  # it trained it after all
    assert not t.complete("b", g.epoch, g.slice, 11.0)  # b's is a repeat: not counted twice
    assert t.counters()[1]["trained"] == 30 and t.counters()[1]["served"] == 60
    assert t.acquire("b", 11.0).slice == 1


def test_a_retried_request_gets_the_same_slice_not_an_orphan() -> None:
    t = table()
    g = t.acquire("a", 0.0, seq=1)
    assert t.acquire("a", 0.1, seq=1) == g  # the answer was lost; the replica asks again
    assert t.acquire("a", 0.2, seq=2) != g
    assert t.counters()[1]["served"] == 60


def test_the_next_epoch_opens_when_75_percent_of_the_live_replicas_ran_out() -> None:
    t = table(n_examples=120, slice_size=30, epochs=3)  # 4 slices, 4 replicas
    held = {r: t.acquire(r, 0.0) for r in "abcd"}
    assert all(g.epoch == 1 for g in held.values())
    assert t.acquire("a", 0.1) is None  # 1 of 4 ran out: wait
    assert t.acquire("b", 0.2) is None  # 2 of 4
    g = t.acquire("c", 0.3)  # 3 of 4 = 75%: epoch 2 opens while d still trains its slice
    assert g is not None and g.epoch == 2
    assert t.completed() == 0  # epoch 1 is complete only when every slice is trained
    # d dies: the next time, 3 replicas are alive and d's slice of epoch 1 comes first
    for r in "abc":
        t.heartbeat(r, 6.0)
    assert t.live(6.0) == ["a", "b", "c"]
    assert t.acquire("a", 6.0) == held["d"]


def test_a_replica_alone_never_waits_for_the_dead() -> None:
    t = table(n_examples=60, slice_size=30, epochs=2)
    t.acquire("gone", 0.0)
    t.acquire("gone", 0.0)
    assert t.acquire("a", 1.0) is None  # a's only peer is alive for now: 1 of 2 < 75%
    later = t.acquire("a", 7.0)  # "gone" is not alive any more: its slices come back first
    assert (later.epoch, later.slice) == (1, 0)


@pytest.mark.parametrize("seed", range(20))
def test_random_joins_deaths_and_stalls_train_every_example_of_every_epoch(seed: int) -> None:
    """Exhaustive-ish: random replicas join, die and stall; every epoch ends with every slice
    trained, and trained counts each example exactly once."""
    rng = random.Random(seed)
    t = table(n_examples=97, slice_size=10, epochs=4, lease=3.0)
    holding: dict[str, list] = {}
    dead: set[str] = set()
    now, names = 0.0, 0
    for _ in range(5000):
        if t.finished():
            break
        now += rng.random()
        if rng.random() < 0.05 or not holding:
            names += 1
            holding[f"r{names}"] = []
        r = rng.choice(sorted(holding))
        if r in dead:
            continue
        roll = rng.random()
        if roll < 0.02:
            dead.add(r)  # dies holding whatever it holds
        elif roll < 0.5 and holding[r]:
            g = holding[r].pop(0)
            t.complete(r, g.epoch, g.slice, now)
        else:
            g = t.acquire(r, now)
            if g is not None:
                holding[r].append(g)
        if len(dead) == len(holding):
            names += 1
            holding[f"r{names}"] = []  # someone always joins again
    assert t.finished(), t.counters()
    for c in t.counters().values():
        assert c["trained"] == 97 and c["slices_done"] == 10
        assert c["served"] >= 97


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="lease"):
        SliceTable(10, 0, 1.0, 1)
    t = table()
    with pytest.raises(ValueError, match="never handed out"):
        t.complete("a", 1, 0, 0.0)
    with pytest.raises(ValueError, match="no slice"):
        t.complete("a", 9, 0, 0.0)
