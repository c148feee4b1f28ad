"""Rack-aware placement (issue 26): a bucket's copies on distinct racks while the live servers
span at least as many racks as copies, so that a whole rack failing takes at most one copy of
any bucket. Pure and deterministic, driven as the controllers call it."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from controller.placement import REPLICATION, domain, moves, place, rack_shared


def rack_map(shape: dict[str, int]) -> dict[str, str]:
    """server id -> rack, `shape` giving each rack's number of servers."""
    return {f"{r}-s{i}": r for r, n in shape.items() for i in range(n)}


def distinct_racks(assign: dict[int, list[str]], racks: dict[str, str]) -> bool:
    return all(len({racks[s] for s in h}) == len(h) for h in assign.values())


def spread(assign: dict[int, list[str]], servers: list[str]) -> tuple[int, int]:
    """(replica count spread, primary count spread) over `servers`."""
    reps = Counter(s for h in assign.values() for s in h)
    prims = Counter(h[0] for h in assign.values())
    r = [reps[s] for s in servers]
    p = [prims[s] for s in servers]
    return max(r) - min(r), max(p) - min(p)


@pytest.mark.parametrize(
    "shape,n_buckets",
    [
        ({f"r{k}": 5 for k in range(20)}, 2000),
        ({"a": 2, "b": 2, "c": 2}, 300),
        ({"a": 3, "b": 3, "c": 3, "d": 3}, 500),
        ({"a": 4, "b": 3, "c": 2, "d": 1}, 400),
    ],
)
def test_copies_on_distinct_racks_balanced_and_a_fixed_point(shape, n_buckets) -> None:
    racks = rack_map(shape)
    servers = sorted(racks)
    fresh = place(n_buckets, {}, servers, racks=racks)
    assert all(len(h) == REPLICATION for h in fresh.values())
    assert distinct_racks(fresh, racks)
    assert rack_shared(fresh, racks) == 0
    if len(set(shape.values())) == 1:  # equal racks: no balance is given up
        assert spread(fresh, servers) == (pytest.approx(0, abs=1), pytest.approx(0, abs=1))
    assert place(n_buckets, fresh, servers, racks=racks) == fresh, "a fixed point"
    assert place(n_buckets, {}, list(reversed(servers)), racks=dict(racks)) == fresh, "determinism"


def test_a_rack_smaller_than_a_third_holds_a_copy_of_every_bucket_above_quota() -> None:
    # Racks a (4 servers), b (1), c (1): distinct racks need b and c in every bucket; the
    # racks outrank the balance (goal 2 before 3).
    racks = rack_map({"a": 4, "b": 1, "c": 1})
    servers = sorted(racks)
    assign = place(120, {}, servers, racks=racks)
    assert distinct_racks(assign, racks)
    held = Counter(s for h in assign.values() for s in h)
    assert held["b-s0"] == held["c-s0"] == 120


def test_a_whole_rack_failing_leaves_two_copies_of_every_bucket_and_replacement_keeps_racks() -> (
    None
):
    racks = rack_map({f"r{k}": 5 for k in range(20)})
    servers = sorted(racks)
    before = place(2000, {}, servers, racks=racks)
    dead = {s for s in servers if racks[s] == "r7"}
    survivors = [s for s in servers if s not in dead]
    for h in before.values():
        assert len([s for s in h if s not in dead]) >= REPLICATION - 1
    after = place(2000, before, survivors, racks=racks)
    assert distinct_racks(after, racks)
    assert all(len(h) == REPLICATION and not set(h) & dead for h in after.values())
    lost = sum(len(set(h) & dead) for h in before.values())
    copies, _ = moves(before, after)
    assert lost <= copies <= 1.01 * lost, "only the rack's copies are re-created (and a few)"
    assert spread(after, survivors)[0] <= 1


def test_without_racks_nothing_changes() -> None:
    rng = random.Random(3)
    servers = [f"ps{i}" for i in range(9)]
    cur = {b: rng.sample(servers, 3) for b in range(200)}
    want = place(200, cur, servers[:7])
    assert place(200, cur, servers[:7], racks={}) == want
    assert place(200, cur, servers[:7], racks={s: "" for s in servers}) == want


def test_fewer_racks_than_copies_still_uses_every_rack() -> None:
    racks = rack_map({"a": 3, "b": 3})
    servers = sorted(racks)
    assign = place(300, {}, servers, racks=racks)
    assert all(len(set(h)) == REPLICATION for h in assign.values())
    assert all({racks[s] for s in h} == {"a", "b"} for h in assign.values())
    assert rack_shared(assign, racks) == 300
    assert spread(assign, servers) == (pytest.approx(0, abs=1), pytest.approx(0, abs=1))


def test_racks_declared_late_move_only_the_copies_sharing_a_rack() -> None:
    servers = [f"ps{i}" for i in range(12)]
    before = place(600, {}, servers)
    racks = {s: f"r{i % 4}" for i, s in enumerate(servers)}
    shared = rack_shared(before, racks)
    assert shared > 0
    after = place(600, before, servers, racks=racks)
    assert distinct_racks(after, racks)
    copies, _ = moves(before, after)
    # one copy out of each bucket that had two in a rack (plus the odd rebalancing move)
    assert shared <= copies <= 1.2 * shared
    assert place(600, after, servers, racks=racks) == after


def test_random_histories_keep_racks_distinct() -> None:
    rng = random.Random(11)
    racks = rack_map({f"r{k}": 3 for k in range(5)})
    pool = sorted(racks)
    live = list(pool)
    assign = place(250, {}, live, racks=racks)
    for _ in range(25):
        if len(live) > 6 and rng.random() < 0.5:
            live.remove(rng.choice(live))
        else:
            back = [s for s in pool if s not in live]
            if back:
                live.append(rng.choice(back))
        assign = place(250, assign, live, racks=racks)
        assert all(set(h) <= set(live) and len(h) == REPLICATION for h in assign.values())
        if len({racks[s] for s in live}) >= REPLICATION:
            assert distinct_racks(assign, racks)


def test_domain_and_rack_shared() -> None:
    assert domain("x", None) == domain("x", {}) == domain("x", {"x": ""}) != domain("y", {})
    assert domain("x", {"x": "r1"}) == domain("y", {"y": "r1"})
    racks = {"a": "r1", "b": "r1", "c": "r2"}
    assign = {0: ["a", "b", "c"], 1: ["a", "c"], 2: ["a", "b"]}
    assert rack_shared(assign, racks) == 2
    assert rack_shared(assign, racks, servers=["a", "c"]) == 0


def test_unequal_racks_cap_the_large_one_and_share_the_rest_evenly() -> None:
    # 10 servers, 1,200 copies: 120 each would put 480 copies in rack a, which can hold one
    # per bucket (400); a's servers get 100 each and the other six share 800 evenly.
    racks = rack_map({"a": 4, "b": 3, "c": 2, "d": 1})
    assign = place(400, {}, sorted(racks), racks=racks)
    held = Counter(s for h in assign.values() for s in h)
    assert [held[s] for s in sorted(racks) if racks[s] == "a"] == [100] * 4
    rest = [held[s] for s in racks if racks[s] != "a"]
    assert sum(rest) == 800 and max(rest) - min(rest) <= 1
