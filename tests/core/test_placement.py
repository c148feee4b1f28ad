"""Bucket placement (Project Adam 3.3.3: three copies on distinct servers, relocated evenly).

Pure and deterministic: checked over 1-10 servers and 64-1024 buckets, for a fresh cluster,
a server joining, a server leaving, and a drain.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from controller.placement import REPLICATION, min_moves, moves, place, under_replicated

SERVERS = [f"ps{i}" for i in range(10)]


def check_balanced(assign: dict[int, list[str]], servers: list[str], n_buckets: int) -> None:
    width = min(REPLICATION, len(servers))
    assert sorted(assign) == list(range(n_buckets))
    replicas: Counter[str] = Counter()
    primaries: Counter[str] = Counter()
    for holders in assign.values():
        assert len(holders) == width, holders
        assert len(set(holders)) == width, f"replicas not on distinct servers: {holders}"
        assert set(holders) <= set(servers)
        replicas.update(holders)
        primaries[holders[0]] += 1
    counts = [replicas[s] for s in servers]
    assert max(counts) - min(counts) <= 1, counts
    pcounts = [primaries[s] for s in servers]
    assert max(pcounts) - min(pcounts) <= 1, pcounts


def within(actual: int, minimum: int) -> bool:
    return actual <= 1.2 * minimum


@pytest.mark.parametrize("n_buckets", [64, 100, 257, 1024])
@pytest.mark.parametrize("n_servers", range(1, 11))
def test_fresh_join_leave(n_servers: int, n_buckets: int) -> None:
    servers = SERVERS[:n_servers]
    fresh = place(n_buckets, {}, servers)
    check_balanced(fresh, servers, n_buckets)
    assert under_replicated(fresh) == (n_buckets if n_servers < REPLICATION else 0)
    assert place(n_buckets, fresh, servers) == fresh, "a balanced placement must be a fixed point"
    assert place(n_buckets, {}, list(reversed(servers))) == fresh, "deterministic"

    if n_servers < 10:
        joined = servers + [SERVERS[n_servers]]
        after = place(n_buckets, fresh, joined)
        check_balanced(after, joined, n_buckets)
        copies, changes = moves(fresh, after)
        need_copies, need_changes = min_moves(n_buckets, fresh, joined)
        assert within(copies, need_copies), (copies, need_copies)
        assert within(changes, need_changes), (changes, need_changes)

    if n_servers > 1:
        gone = servers[n_servers // 2]
        left = [s for s in servers if s != gone]
        after = place(n_buckets, fresh, left)
        check_balanced(after, left, n_buckets)
        copies, changes = moves(fresh, after)
        need_copies, need_changes = min_moves(n_buckets, fresh, left)
        assert within(copies, need_copies), (copies, need_copies)
        assert within(changes, need_changes), (changes, need_changes)
        # A server leaving must move at least what it held, and nothing stays on it.
        assert all(gone not in h for h in after.values())


def test_random_histories_stay_balanced_and_cheap() -> None:
    rng = random.Random(7)
    for _ in range(15):
        n_buckets = rng.choice([64, 128, 500, 1024])
        live = sorted(rng.sample(SERVERS, rng.randint(1, 10)))
        assign = place(n_buckets, {}, live)
        for _ in range(6):
            if len(live) > 1 and rng.random() < 0.5:
                live.remove(rng.choice(live))
            else:
                spare = [s for s in SERVERS if s not in live]
                if spare:
                    live.append(rng.choice(spare))
            live.sort()
            after = place(n_buckets, assign, live)
            check_balanced(after, live, n_buckets)
            copies, changes = moves(assign, after)
            need_copies, need_changes = min_moves(n_buckets, assign, live)
            assert within(copies, need_copies), (copies, need_copies, live)
            assert within(changes, need_changes), (changes, need_changes, live)
            assign = after


def test_no_servers_and_partial_current() -> None:
    assert place(8, {}, []) == {b: [] for b in range(8)}
    # Holders that are not eligible (dead) are dropped; survivors keep their roles when they can.
    cur = {0: ["a", "b", "c"], 1: ["b", "c", "x"], 2: ["x"], 3: []}
    after = place(4, cur, ["a", "b", "c"])
    check_balanced(after, ["a", "b", "c"], 4)
    assert after[0][0] == "a" and after[1][0] == "b"


def test_moves_counts() -> None:
    assert moves({0: ["a", "b"]}, {0: ["b", "c"]}) == (1, 1)
    assert moves({}, {0: ["a", "b", "c"]}) == (3, 1)
