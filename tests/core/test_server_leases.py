"""Issue 40: leases renewed per server (controller/server_leases.py). A renewal round records
one time per server; a bucket's lease follows its holder's rounds while the per-bucket renewal
would have renewed it. These tests drive the production model through random histories and
check every lease's renewal time, every round's answer and every closed lease against the
per-bucket rule it replaces, and that a round no longer reads the buckets."""

from __future__ import annotations

import pickle
import random
from typing import Any

import pytest

from controller.state import DEAD, ClusterModel, state_digest
from tests.core.test_controller_deltas import N, step
from tests.core.test_controller_state import TERMS, cluster, validate
from tests.core.test_scale_sim import CountingBuckets, _placed


def per_bucket_rule(m: ClusterModel, sid: str) -> list[list[int]]:
    """[bucket, epoch] the per-bucket renewal of before renewed for `sid` (its own code)."""
    rec = m.servers.get(sid)
    if rec is None or rec["state"] == DEAD:
        return []
    out = []
    for b in m.leased_to(sid):
        bk = m.buckets[b]
        lease = bk["lease"]
        if lease is None or lease.holder != sid or lease.released_at is not None:
            continue
        if bk["holder_inc"] != rec["incarnation"]:
            continue
        want = bk["want"]
        if want and want[0] != sid and want[0] in bk["holders"]:
            continue
        out.append([b, lease.epoch])
    return out


class Shadowed(ClusterModel):
    """The model, with every lease's renewal time also kept by the per-bucket rule."""

    def renew(self, sid: str, now: float) -> dict[str, Any]:
        expected = per_bucket_rule(self, sid)
        res = super().renew(sid, now)
        got = res.get("renewed", [])
        assert got == expected, (sid, got, expected)
        shadow = self.__dict__.setdefault("shadow", {})
        for b, epoch in got:
            key = (b, epoch)
            shadow[key] = max(shadow.get(key, self.buckets[b]["lease"].granted_at), res["at"])
        return res


def check_against_rule(m: Shadowed) -> int:
    """Every current and closed lease's renewal time is the per-bucket rule's. The count of
    leases whose time came from a round (not their grant)."""
    shadow = m.__dict__.get("shadow", {})
    renewed = 0
    for b in range(m.n_buckets):
        lease = m.lease_of(b)
        if lease is None:
            continue
        want = shadow.get((b, lease.epoch), lease.granted_at)
        assert lease.renewed_at == want, (b, lease, want)
        renewed += want > lease.granted_at
        if lease.released_at is not None:
            assert lease.released_at >= lease.renewed_at
    for r in m.history:
        want = shadow.get((r["bucket"], r["epoch"]), r["granted_at"])
        assert r["renewed_at"] == want, (r, want)
    return renewed


@pytest.mark.parametrize("seed", range(12))
def test_each_lease_is_renewed_as_the_per_bucket_rule_renewed_it(seed: int) -> None:
    """Random histories of deaths, restarts, drains, role changes, joins, drops, releases,
    write-offs and renewals (one server or a round of several), with a restore from a dump now
    and then: each round answers exactly the leases the per-bucket renewal renewed, and every
    lease's renewal time (current and closed) is the one that rule recorded."""
    rng = random.Random(seed)
    m = Shadowed(N, TERMS, min_servers=1)
    names = [f"ps{i}" for i in range(6)]
    real, renewed = 0.0, 0
    for i in range(300):
        real += rng.choice([0.1, 0.5, 1.0, 2.0, 4.0])
        if rng.random() < 0.25:
            m.renew_round(rng.sample(names, rng.randrange(1, 5)), real)
        else:
            step(m, rng, real)
        validate(m)
        renewed = max(renewed, check_against_rule(m))
        if i % 37 == 36:  # a controller restored from a dump goes on the same way
            shadow = m.__dict__.pop("shadow", {})
            digest = state_digest(m)
            m = pickle.loads(pickle.dumps(m))
            assert state_digest(m) == digest
            m.shadow = shadow
    assert renewed > 5, "rounds renewed leases past their grant"
    assert len(m.history) > 3, "leases changed hands"


def test_a_round_reads_no_bucket_record() -> None:
    """A round renews each server once: it reads no bucket (before: every lease of every
    server in it, 100,000 leases a second at 100,000 buckets), and yet every lease it renews
    runs from the round's time."""
    m = _placed(20, 4000)
    sids = sorted(m.servers)
    m.renew_round(sids, 1.0)  # the first one may build the index
    CountingBuckets.reads = 0
    res = m.renew_round(sids, 2.0)
    assert CountingBuckets.reads == 0
    assert sum(len(a["renewed"]) for a in res["servers"].values()) == 4000
    assert all(m.lease_of(b).renewed_at == 2.0 for b in range(4000))
    assert all(bk["lease"].renewed_at == 0.0 for bk in m.buckets), "no lease record written"


def test_a_hand_off_freezes_the_lease_at_its_last_round() -> None:
    """A bucket whose hand-off starts stops following its holder: later rounds do not renew
    it, the holder is not told they did, and the new primary gets it once it certainly ran
    out after the last round that renewed it."""
    m = cluster(4)
    m.renew("ps0", 101.0)
    b = next(b for b in range(64) if m.primary_of(b) == "ps0")
    target = next(s for s in m.buckets[b]["holders"])
    m._set_want(b, [target, *(s for s in m.buckets[b]["want"] if s != target)])
    m._settle(b, 101.5)
    m.renew("ps0", 102.0)  # re-decides the bucket first: hand-off pending, frozen at 101
    later = m.renew("ps0", 103.0)
    assert [b, 1] not in later["renewed"]
    assert m.lease_of(b).renewed_at == 101.0
    expiry = TERMS.certain_expiry(101.0)
    assert b not in m.grants_due(expiry - 0.01)
    m.reconcile(expiry)
    assert m.primary_of(b) == target


def test_a_state_from_before_follows_at_the_next_round() -> None:
    """A dump written before leases per server (no `renewals`, no markers) loads and renews:
    every lease is re-decided by the next entry."""
    m = cluster(3)
    m.renew("ps1", 150.0)
    for bk in m.buckets:
        bk.pop("follows", None)
    del m.renewals, m.follow_check
    old = pickle.loads(pickle.dumps(m))
    owned = {b for b in range(64) if old.primary_of(b) == "ps1"}
    r = old.renew("ps1", 160.0)
    assert {b for b, _ in r["renewed"]} == owned
    assert all(old.lease_of(b).renewed_at == 160.0 for b in owned)


def test_a_dry_run_leaves_the_pending_marks_alone() -> None:
    """The leader's dry run of a bucket operation shares every other bucket's record with the
    model: it re-decides none of the model's pending buckets (it would write their records)."""
    from controller.state import dry_run

    m = cluster(3, n_buckets=16)
    m.renew("ps0", 101.0)
    b = next(b for b in range(16) if m.primary_of(b) == "ps0")
    m.declare_dead("ps2", 102.0)  # marks ps2's buckets: re-decided by the next entry
    pending = set(m.follow_check)
    assert pending
    before = pickle.dumps(m)
    lease = m.buckets[b]["lease"]
    dry_run(m, "release", (b, "ps0", lease.epoch, 103.0))
    assert pickle.dumps(m) == before and m.follow_check == pending
