"""Issue 40: after a death, placement gives new targets to the dead server's buckets only,
keeps their surviving copies, balances copies and primaries by direct choices, and keeps the
model's counts of wanted copies and primaries equal to a recount."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from adamps.core.lease import LeaseTerms
from controller.placement import domain
from controller.state import ClusterModel, dry_run

TERMS = LeaseTerms()


def placed(n_servers: int, n_buckets: int, rack: int = 0) -> ClusterModel:
    m = ClusterModel(n_buckets, TERMS, 3, min_servers=n_servers)
    for i in range(n_servers):
        r = f"r{i // rack}" if rack else None
        m.register(f"ps{i:03d}", f"h:{i}", 100.0 + i * 1e-3, {}, r)
    return m


def recount(m: ClusterModel) -> tuple[Counter, Counter]:
    copies = Counter(s for bk in m.buckets for s in bk["want"])
    prims = Counter(bk["want"][0] for bk in m.buckets if bk["want"])
    return +copies, +prims


@pytest.mark.parametrize("rack", [0, 4])
def test_a_death_moves_only_the_buckets_that_lost_a_member(rack: int) -> None:
    m = placed(24, 2400, rack)
    before = {b: list(bk["want"]) for b, bk in enumerate(m.buckets)}
    now = 200.0
    for dead in ("ps003", "ps010", "ps017"):  # one after another, in different racks
        m.declare_dead(dead, now)
        now += 1.0
        after = {b: list(bk["want"]) for b, bk in enumerate(m.buckets)}
        handed = 0
        for b, want in before.items():
            if dead not in want:
                assert set(after[b]) == set(want), f"bucket {b} moved though {dead} held none"
                handed += after[b][0] != want[0]  # a direct move of its primary (balance)
            else:
                survivors = [s for s in want if s != dead]
                assert set(survivors) <= set(after[b]), f"bucket {b} lost a surviving copy"
                assert dead not in after[b] and len(after[b]) == 3
                if want[0] != dead:
                    handed += after[b][0] != want[0]
        before = after
        # Primaries moved off live servers only to balance: a few, far fewer than the buckets.
        assert handed <= 2400 // 24 // 2, handed
        copies, prims = recount(m)
        assert (+m.wanted_counts()[0], +m.wanted_counts()[1]) == (copies, prims)
        live = [s for s in m.eligible()]
        # Balance: wanted copies within a few of the mean, primaries within their share + 1.
        per = [copies[s] for s in live]
        assert max(per) - min(per) <= 2, per
        share = -(-2400 // len(live))
        assert share - 1 <= min(prims[s] for s in live) <= max(prims[s] for s in live) <= share
        if rack:
            racks = m.racks()
            for b, want in after.items():
                assert len({domain(s, racks) for s in want}) == 3, f"bucket {b}: {want}"


def test_a_primary_lost_goes_to_a_caught_up_copy_and_the_leases_stay_safe() -> None:
    """Every bucket of the dead primary is granted to a surviving caught-up copy once the old
    lease certainly ended, without a second hand-off (the target is a caught-up copy)."""
    m = placed(12, 600)
    dead = "ps005"
    for s in m.eligible():
        m.renew(s, 199.0)
    mine = [b for b in range(600) if m.primary_of(b) == dead]
    m.declare_dead(dead, 200.0)
    for b in mine:
        want = m.buckets[b]["want"]
        assert want[0] in m.buckets[b]["holders"], "the new primary is caught up"
    m.reconcile(TERMS.certain_expiry(199.0))
    for b in mine:
        assert m.holder_live(b) and m.primary_of(b) == m.buckets[b]["want"][0]


@pytest.mark.parametrize("seed", range(4))
def test_counts_follow_every_entry(seed: int) -> None:
    """The counts kept beside the state equal a recount after every entry of a random history
    (deaths, restarts, role changes, write-offs, drains, rebalances) and the leader's dry runs
    (which once shared the counts with the model), as does the index of offers by bucket."""
    from tests.core.test_controller_deltas import NAMES, step

    rng = random.Random(seed)
    m = ClusterModel(32, TERMS, min_servers=1)
    real = 0.0
    for _ in range(250):
        real += rng.choice([0.1, 0.5, 1.0, 2.0, 4.0])
        step(m, rng, real)
        # The leader's dry runs of bucket operations change neither the model nor its counts.
        b = rng.randrange(32)
        lease, holders = m.buckets[b]["lease"], m.buckets[b]["holders"]
        if holders:
            epoch = lease.epoch if lease else 0
            dry_run(m, "role_change", (b, holders[0], epoch, {}, real + 60))
        dry_run(m, "write_off", (b, real + 60))
        copies, prims = m.wanted_counts()
        assert (+copies, +prims) == recount(m)
        assert m.offering(b) == sorted(s for s, r in m.servers.items() if b in r["copies"])
    assert NAMES
