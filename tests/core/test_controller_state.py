"""The controller's replicated state machine, driven directly (no Raft, no sockets).

Reference: Project Adam 3.3.3 (leases, role changes, relocation of a failed server's buckets).
Every test ends with `validate`, which checks the structural invariants and lease safety of the
committed record.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from adamps.core.lease import LeaseTerms, check_history
from controller.state import DEAD, ClusterModel

TERMS = LeaseTerms(duration=5.0, skew=0.1, margin=0.5)
WAIT = TERMS.duration * (1 + TERMS.skew) + TERMS.margin  # 6.0 s: a lease certainly over


def validate(m: ClusterModel) -> None:
    for b, bk in enumerate(m.buckets):
        lease = bk["lease"]
        # A lease of an earlier incarnation (restarted server) makes no member: it just runs out.
        members = ([lease.holder] if m.holder_live(b) else []) + bk["holders"] + bk["joining"]
        assert len(members) == len(set(members)), f"bucket {b}: duplicate member {members}"
        assert len(bk["want"]) == len(set(bk["want"]))
        for s in bk["holders"] + bk["joining"]:
            assert m.servers[s]["state"] != DEAD, f"bucket {b}: dead server {s} still a member"
    assert check_history(m.lease_records(), m.terms) == []


def cluster(n_servers: int = 3, n_buckets: int = 64, min_servers: int = 3) -> ClusterModel:
    m = ClusterModel(n_buckets, TERMS, min_servers=min_servers)
    for i in range(n_servers):
        m.register(f"ps{i}", f"127.0.0.1:{9000 + i}", now=100.0)
    return m


def test_start_places_evenly_once_enough_servers() -> None:
    m = ClusterModel(64, TERMS, min_servers=3)
    m.register("ps0", "a:1", 1.0)
    m.register("ps1", "a:2", 1.0)
    assert all(bk["lease"] is None for bk in m.buckets), "waits for min_servers"
    m.register("ps2", "a:3", 2.0)
    prim = Counter(m.primary_of(b) for b in range(64))
    assert sorted(prim.values()) == [21, 21, 22]
    assert all(len(m.holders_of(b)) == 3 for b in range(64))
    assert m.under_replicated() == 0
    assert all(bk["lease"].epoch == 1 and bk["lease"].granted_at == 2.0 for bk in m.buckets)
    validate(m)


def test_dead_primary_is_replaced_only_after_its_lease_certainly_expired() -> None:
    m = cluster(4)
    m.renew("ps0", 101.0)
    owned = [b for b in range(64) if m.primary_of(b) == "ps0"]
    assert owned
    m.declare_dead("ps0", 102.0)
    assert [m.primary_of(b) for b in owned] == ["ps0"] * len(owned), "no grant before expiry"
    assert m.grants_due(101.0 + WAIT - 0.01) == []
    assert m.grants_due(101.0 + WAIT) == owned
    m.reconcile(101.0 + WAIT)
    for b in owned:
        bk = m.buckets[b]
        assert bk["lease"].holder != "ps0" and bk["lease"].epoch == 2
    # The dead server's copies are re-created on the spare (joining until caught up).
    assert all("ps0" not in m.buckets[b]["holders"] for b in range(64))
    assert any("ps3" in m.buckets[b]["joining"] for b in range(64))
    # Renewals from the dead server are refused; it must register again (and then holds nothing).
    assert m.renew("ps0", 200.0)["error"] == "conflict"
    validate(m)


def test_role_change_rules() -> None:
    m = cluster(3)
    b = next(b for b in range(64) if m.primary_of(b) == "ps0")
    secs = list(m.buckets[b]["holders"])
    m.renew("ps0", 103.0)
    r = m.role_change(b, secs[0], 7, {}, 104.0)
    assert r["error"] == "stale_epoch" and r["epoch"] == 1
    r = m.role_change(b, secs[0], 1, {}, 104.0)
    assert r["error"] == "conflict" and r["reason"] == "lease_active" and r["retry_after"] > 0
    assert m.role_change(b, "ps0", 1, {}, 200.0)["error"] == "conflict", "only a secondary proposes"
    # After expiry the most up-to-date secondary wins, not necessarily the proposer.
    reports = {secs[0]: [1, 10], secs[1]: [1, 12]}
    r = m.role_change(b, secs[0], 1, reports, 103.0 + WAIT)
    assert r["ok"] and r["primary"] == secs[1] and r["epoch"] == 2
    assert m.role_change(b, secs[0], 1, {}, 300.0)["error"] == "stale_epoch"
    validate(m)


def test_renewal_is_per_server_and_never_shortens() -> None:
    m = cluster(3)
    r = m.renew("ps1", 150.0)
    owned = {b for b in range(64) if m.primary_of(b) == "ps1"}
    assert {b for b, _ in r["renewed"]} == owned
    m.renew("ps1", 120.0)  # a leader with a slower clock: the replicated clock never goes back
    assert all(m.lease_of(b).renewed_at == 150.0 for b in owned)
    assert m.renew("nobody", 1.0)["error"] == "not_found"


def test_drain_hands_over_then_server_is_empty() -> None:
    m = cluster(4)
    m.drain("ps0", 110.0)
    owned = [b for b in range(64) if m.primary_of(b) == "ps0"]
    # Targets that were already secondaries are caught up: ps0 stops renewing those.
    t = 110.0
    for _ in range(20):
        t += 1.0
        for s in ("ps0", "ps1", "ps2", "ps3"):
            m.renew(s, t)
        for b, bk in enumerate(m.buckets):
            for j in list(bk["joining"]):
                m.verified_caught_up(b, bk["lease"].holder, bk["lease"].epoch, j, t)
        m.reconcile(t)
    assert all(m.primary_of(b) != "ps0" for b in owned)
    view = m.cluster_view()
    assert view["servers"]["ps0"]["state"] == "drained", view["servers"]["ps0"]
    assert view["under_replicated"] == 0
    validate(m)


def test_release_hands_over_at_once() -> None:
    m = cluster(4)
    m.renew("ps0", 109.0)
    m.drain("ps0", 110.0)
    for b, bk in enumerate(m.buckets):
        for j in list(bk["joining"]):
            m.verified_caught_up(b, bk["lease"].holder, bk["lease"].epoch, j, 110.0)
    b = next(
        b
        for b in range(64)
        if m.primary_of(b) == "ps0" and m.buckets[b]["want"][0] in m.buckets[b]["holders"]
    )
    target = m.buckets[b]["want"][0]
    assert m.release(b, "ps0", 1, 111.0)["ok"]
    assert m.primary_of(b) == target and m.buckets[b]["lease"].granted_at == 111.0
    assert m.release(b, "ps0", 1, 112.0)["error"] == "stale_epoch"
    validate(m)


def test_restarted_server_loses_its_leases() -> None:
    m = cluster(3)
    owned = [b for b in range(64) if m.primary_of(b) == "ps2"]
    m.register("ps2", "127.0.0.1:9999", 101.0)  # a restart: new incarnation, holds nothing
    assert m.renew("ps2", 102.0)["renewed"] == []
    m.reconcile(100.0 + WAIT)
    assert all(m.primary_of(b) != "ps2" for b in owned)
    assert all(m.buckets[b]["lease"].epoch == 2 for b in owned)
    assert sum("ps2" in bk["joining"] for bk in m.buckets) > 0, "it comes back as a copy"
    validate(m)


def members(m: ClusterModel, b: int) -> list[str]:
    return m.live_members(b)


def test_every_server_paused_past_its_timeout_keeps_the_buckets_data() -> None:
    """Issue 11, failure 1: every server silent (SIGSTOP) long enough to be declared dead. Every
    member that left in that wave keeps its copy as a candidate; the bucket is unavailable (never
    served from init) until the candidates are back, and the most up-to-date one gets the lease."""
    m = cluster(3)
    for s in ("ps0", "ps1", "ps2"):
        m.declare_dead(s, 101.0)
    view = m.cluster_view()
    assert view["unavailable"] == list(range(64))
    assert all(r["state"] == "unavailable" for r in m.routing()["buckets"])
    assert all(sorted(m.buckets[b]["candidates"]) == ["ps0", "ps1", "ps2"] for b in range(64))
    # They come back (a new incarnation each), offering what they hold in memory: the first to
    # be declared dead holds the most (its flush ran last).
    for i, (s, seq) in enumerate((("ps0", 9), ("ps1", 7), ("ps2", 8))):
        m.register(s, f"127.0.0.1:{9000 + i}", 102.0, copies={b: [1, seq] for b in range(64)})
    assert m.grants_due(100.0 + WAIT - 0.01) == [], "the old leases may still be in use"
    m.reconcile(100.0 + WAIT)
    for b in range(64):
        bk = m.buckets[b]
        assert bk["lease"].holder == "ps0" and bk["lease"].epoch == 2, b
        assert not bk["lost"] and bk["candidates"] == []
        assert sorted(bk["joining"]) == ["ps1", "ps2"], "the others copy from the candidate"
    assert m.cluster_view()["unavailable"] == []
    validate(m)


def test_a_bucket_waits_for_every_candidate_of_the_wave() -> None:
    """Seed 408 of the nemesis: both members of a bucket SIGKILLed at once. The one that comes
    back first left first (a new incarnation), while the other still counted as live; the copy
    it offers is the newest. Nothing is granted until the other is back too, and then the
    newest copy wins, although it was not the last to leave."""
    m = cluster(3)
    b = next(b for b in range(64) if m.primary_of(b) == "ps0")
    m.declare_dead("ps2", 100.5)  # gone earlier: re-replication had not finished
    other = m.buckets[b]["holders"][0]
    m.register("ps0", "127.0.0.1:9000", 101.0, copies={b: [1, 752]})
    assert not m.unavailable(b), f"{other} still counts as live"
    assert [r["role"] for r in m.roles_of("ps0") if r["bucket"] == b] in (["standby"], ["joining"])
    m.declare_dead(other, 103.0)
    assert m.unavailable(b)
    assert sorted(m.buckets[b]["candidates"]) == sorted({"ps0", other, "ps2"})
    assert [r["role"] for r in m.roles_of("ps0") if r["bucket"] == b] == ["standby"]
    m.reconcile(100.0 + 2 * WAIT)
    assert m.primary_of(b) == "ps0" and m.buckets[b]["lease"].epoch == 1, "waits for the others"
    m.register(other, "127.0.0.1:9009", 113.0, copies={b: [1, 748]})
    m.register("ps2", "127.0.0.1:9002", 113.0)  # wiped: no candidate any more
    m.reconcile(114.0)
    assert m.primary_of(b) == "ps0" and m.buckets[b]["lease"].epoch == 2
    assert m.buckets[b]["candidates"] == []
    validate(m)


def test_a_member_that_left_long_before_the_last_is_no_candidate() -> None:
    m = cluster(3)
    b = next(b for b in range(64) if m.primary_of(b) == "ps0")
    m.declare_dead("ps1", 101.0)
    m.declare_dead("ps2", 101.0 + TERMS.duration + 1.0)
    m.declare_dead("ps0", 101.0 + TERMS.duration + 1.5)
    cands = sorted(m.buckets[b]["candidates"])
    assert "ps1" not in cands and "ps0" in cands, cands
    validate(m)


def test_a_candidate_back_without_its_copy_is_no_candidate_and_nothing_is_recreated() -> None:
    m = cluster(3)
    for s in ("ps0", "ps1", "ps2"):
        m.declare_dead(s, 101.0)
    for i, s in enumerate(("ps0", "ps1", "ps2")):
        m.register(s, f"127.0.0.1:{9000 + i}", 102.0)  # wiped: offers nothing
    m.reconcile(100.0 + 2 * WAIT)
    assert all(m.buckets[b]["lease"].epoch == 1 for b in range(64)), "no grant without a copy"
    assert m.cluster_view()["unavailable"] == list(range(64))
    assert all(r["role"] != "primary" for s in ("ps0", "ps1") for r in m.roles_of(s))
    validate(m)


def test_restart_of_the_last_member_offers_its_reloaded_copy() -> None:
    """Issue 11, failure 2: the whole cluster SIGKILLed and restarted before any was declared
    dead. Each restart is a new incarnation; every copy of the wave is a candidate, and the most
    up-to-date one (not the last to leave) gets the lease."""
    m = cluster(3)
    b = next(b for b in range(64) if m.primary_of(b) == "ps0")
    m.register("ps1", "127.0.0.1:9001", 101.0, copies={b: [1, 40]})
    m.register("ps2", "127.0.0.1:9002", 101.0, copies={b: [1, 38]})
    assert members(m, b) == ["ps0"]
    m.register("ps0", "127.0.0.1:9000", 101.5, copies={b: [1, 35]})
    assert sorted(m.buckets[b]["candidates"]) == ["ps0", "ps1", "ps2"], "one wave"
    assert m.unavailable(b)
    assert [r["role"] for r in m.roles_of("ps0") if r["bucket"] == b] == ["standby"]
    m.reconcile(100.0 + WAIT)
    assert m.primary_of(b) == "ps1" and m.buckets[b]["lease"].epoch == 2, "the newest copy"
    validate(m)


def test_the_most_up_to_date_candidate_wins() -> None:
    m = cluster(3)
    b = 5
    # The members leave together (one entry): every one of them is the last, all candidates.
    bk = m.buckets[b]
    cands = [m.primary_of(b), *bk["holders"]]
    m.servers["ps0"]["state"] = m.servers["ps1"]["state"] = DEAD
    m.declare_dead("ps2", 101.0)
    m.servers["ps0"]["state"] = m.servers["ps1"]["state"] = "live"
    bk["candidates"] = list(cands)
    for s, pos in zip(cands, ([2, 10], [3, 4], [2, 99]), strict=True):
        m.register(s, "127.0.0.1:1", 102.0, copies={b: pos})
    m.reconcile(100.0 + WAIT)
    assert m.primary_of(b) == cands[1], "highest (epoch, seq): epoch first"


def test_declare_lost_is_explicit_logged_and_counted() -> None:
    m = cluster(3)
    assert m.write_off(3, 101.0)["error"] == "conflict", "served buckets are never lost"
    for s in ("ps0", "ps1", "ps2"):
        m.declare_dead(s, 101.0)
    m.register("ps0", "127.0.0.1:9000", 102.0, copies={3: [1, 5]})  # not a candidate
    m.register("ps1", "127.0.0.1:9001", 102.0)
    assert m.write_off(3, 102.0)["reason"] == "lease_active"
    res = m.write_off(3, 100.0 + WAIT)
    assert res["ok"] and res["primary"] == "ps0" and res["from"] == "copy"
    res = m.write_off(4, 100.0 + WAIT)
    assert res["ok"] and res["from"] == "initial values"
    view = m.cluster_view()
    assert view["lost"] == [3, 4] and view["declared_lost"] == 2
    assert 3 not in view["unavailable"] and 4 not in view["unavailable"]
    validate(m)


def test_caught_up_is_reported_by_the_current_primary_only() -> None:
    m = cluster(4)
    m.drain("ps0", 101.0)
    b, bk = next((b, bk) for b, bk in enumerate(m.buckets) if bk["joining"])
    j, lease = bk["joining"][0], bk["lease"]
    assert m.verified_caught_up(b, j, lease.epoch, j, 102.0)["error"] == "stale_epoch"
    assert (
        m.verified_caught_up(b, lease.holder, lease.epoch + 1, j, 102.0)["error"] == "stale_epoch"
    )
    assert m.verified_caught_up(b, lease.holder, lease.epoch, j, 102.0)["ok"]
    assert j in bk["holders"]
    validate(m)


def test_layout_and_progress() -> None:
    m = cluster(1, min_servers=1)
    assert m.set_layout({"n_buckets": 32, "tensors": []}, 1.0)["error"] == "conflict"
    assert m.set_layout({"n_buckets": 64, "tensors": []}, 1.0)["layout_version"] == 1
    assert m.set_layout({"n_buckets": 64, "tensors": []}, 1.0)["layout_version"] == 1
    for e in range(40):
        m.report_progress(e, "r0", 0.5, False, 2.0)
    assert len(m.progress) == 32 and "39" in m.progress and "0" not in m.progress


def test_one_server_then_more_restores_replication() -> None:
    m = cluster(1, min_servers=1)
    assert m.under_replicated() == 64
    m.register("ps1", "b", 101.0)
    m.register("ps2", "c", 101.0)
    for b, bk in enumerate(m.buckets):
        for j in list(bk["joining"]):
            m.verified_caught_up(b, bk["lease"].holder, bk["lease"].epoch, j, 102.0)
    assert m.under_replicated() == 0
    validate(m)


@pytest.mark.parametrize("seed", range(8))
def test_random_histories_keep_leases_safe(seed: int) -> None:
    """Random failures, restarts, drains, role changes, caught-up reports and leader clocks
    that disagree by up to margin/2: the committed record never shows two overlapping leases."""
    rng = random.Random(seed)
    m = ClusterModel(32, TERMS, min_servers=1)
    names = [f"ps{i}" for i in range(6)]
    real = 0.0
    for _ in range(400):
        real += rng.choice([0.1, 0.5, 1.0, 2.0, 4.0])
        now = real + rng.uniform(-TERMS.margin / 2, TERMS.margin / 2)  # this leader's clock
        op = rng.random()
        s = rng.choice(names)
        if op < 0.15:
            # A restart offers the copies it kept (mostly: sometimes its disk is gone).
            kept = {} if rng.random() < 0.2 else {b: [1, rng.randrange(5)] for b in range(32)}
            m.register(s, f"h:{s}", now, copies=kept)
        elif op < 0.45:
            m.renew(s, now)
        elif op < 0.55:
            m.declare_dead(s, now)
        elif op < 0.6:
            m.drain(s, now)
        elif op < 0.7:
            b = rng.randrange(32)
            bk = m.buckets[b]
            if bk["holders"]:
                epoch = bk["lease"].epoch if bk["lease"] else 0
                reports = {h: [epoch, rng.randrange(5)] for h in bk["holders"]}
                m.role_change(b, rng.choice(bk["holders"]), epoch, reports, now)
        elif op < 0.8:
            for b, bk in enumerate(m.buckets):
                for j in list(bk["joining"]):
                    if rng.random() < 0.5 and bk["lease"]:
                        m.verified_caught_up(b, bk["lease"].holder, bk["lease"].epoch, j, now)
        elif op < 0.85:
            b = rng.randrange(32)
            lease = m.buckets[b]["lease"]
            if lease:
                m.release(b, lease.holder, lease.epoch, now)
        elif op < 0.9:
            m.rebalance(now)
        elif op < 0.93:
            m.write_off(rng.randrange(32), now)
        else:
            m.reconcile(now)
        validate(m)
    assert len(m.lease_records()) > 32, "the history exercised re-grants"


def test_an_offer_of_a_copy_the_server_let_go_is_void() -> None:
    """A server that came back with copies of buckets others serve gets no role in some of
    them, so it drops those copies: their offers must not make it a stand-in later
    (write_off, standby)."""
    m = cluster(4)
    m.register("ps3", "127.0.0.1:9003", 101.0, copies={b: [9, 99] for b in range(64)})
    roles = {r["bucket"] for r in m.roles_of("ps3")}
    assert set(m.servers["ps3"]["copies"]) == roles
    b = next(b for b in range(64) if b not in roles)
    for s in m.holders_of(b):
        m.declare_dead(s, 102.0)
    assert m.unavailable(b)
    assert all(
        r["role"] not in ("standby", "primary") for r in m.roles_of("ps3") if r["bucket"] == b
    )
    assert m.write_off(b, 100.0 + WAIT)["from"] == "initial values"
    validate(m)


def test_a_primary_declared_dead_drops_nobody() -> None:
    """Found by the nemesis (seed 406): the primary and one secondary paused past their timeout,
    both declared dead; the third copy, live, is then the bucket's only member. The primary
    wakes up, finds that copy slow and asks to drop it: accepted, the bucket would have no live
    member and no candidate (every copy's server left while another member was live)."""
    m = cluster(3)
    b = next(b for b in range(64) if m.primary_of(b) == "ps1")
    epoch = m.buckets[b]["lease"].epoch
    survivor = next(s for s in m.holders_of(b) if s != "ps1")
    m.declare_dead("ps1", 101.0)
    for s in m.holders_of(b):
        if s != survivor:
            m.declare_dead(s, 101.0)
    assert m.live_members(b) == [survivor]
    assert m.drop_secondary(b, "ps1", epoch, survivor, 101.5)["error"] == "stale_epoch"
    assert m.live_members(b) == [survivor] and not m.unavailable(b)
    validate(m)


def test_a_primary_handed_off_stays_in_the_replica_set() -> None:
    """Nemesis seed 451: a rebalance hands bucket b from its primary to a caught-up secondary.
    The old primary holds every acknowledged batch, so it stays a member (a secondary); had it
    to re-join by state transfer, a crash of the new primary and the other secondary would leave
    no member, and the controllers would serve an older copy from disk over its full one."""
    m = cluster(4)
    b = next(b for b in range(64) if m.primary_of(b) == "ps0")
    old = m.buckets[b]["holders"][0]
    m.buckets[b]["want"] = [old, "ps0", *[s for s in m.buckets[b]["holders"] if s != old]]
    assert m.release(b, "ps0", 1, 101.0)["ok"]
    assert m.primary_of(b) == old
    assert "ps0" in m.buckets[b]["holders"] and "ps0" not in m.buckets[b]["joining"]
    others = [s for s in m.live_members(b) if s != "ps0"]
    for s in others:
        m.declare_dead(s, 102.0)
    assert not m.unavailable(b), "the old primary is still a live member"
    validate(m)


def _tied_wave(digests: dict[str, str]) -> tuple[ClusterModel, int]:
    """Every server of bucket b killed and back at the same (epoch, seq), each offering the
    digest given for it (issue 29)."""
    m = cluster(3)
    for s in ("ps0", "ps1", "ps2"):
        m.declare_dead(s, 101.0)
    for i, s in enumerate(("ps0", "ps1", "ps2")):
        copies = {b: [1, 9, 9, digests[s]] for b in range(64)}
        m.register(s, f"127.0.0.1:{9000 + i}", 102.0, copies=copies)
    return m, 0


def test_tied_candidates_whose_digests_disagree_are_settled_by_majority_and_counted() -> None:
    """Issue 29: the copy of ps0 (which would win the tie by placement) holds other values than
    the two others at the same (epoch, seq): the majority's copy serves every bucket; the
    disagreement is logged and counted, never settled silently."""
    m, _ = _tied_wave({"ps0": "bad", "ps1": "0a", "ps2": "0a"})
    m.reconcile(100.0 + WAIT)
    assert all(m.primary_of(b) in ("ps1", "ps2") for b in range(64))
    assert m.digest_conflicts == 64 and m.cluster_view()["digest_conflicts"] == 64
    assert m.cluster_view()["unavailable"] == []
    validate(m)


def test_tied_candidates_without_a_majority_digest_leave_the_bucket_unavailable() -> None:
    m, _ = _tied_wave({"ps0": "01", "ps1": "02", "ps2": "03"})
    m.reconcile(100.0 + WAIT)
    m.reconcile(100.0 + 2 * WAIT)
    assert m.cluster_view()["unavailable"] == list(range(64)), "never served by a guess"
    assert m.digest_conflicts == 64, "counted once per bucket, not once per reconcile"
    validate(m)


def test_tied_candidates_at_seq_0_without_a_majority_serve_and_the_others_rejoin() -> None:
    """Issue 29 (seen on the scale branch): copies at (epoch 0, seq 0) whose digests differ
    after an interrupted create hold no committed update: serving any of them loses nothing
    acknowledged, so the bucket is served (the placement's first candidate), the disagreement
    is counted, and the other copies rejoin by state transfer from it instead of waiting for
    an operator."""
    m = cluster(3)
    for s in ("ps0", "ps1", "ps2"):
        m.declare_dead(s, 101.0)
    for i, s in enumerate(("ps0", "ps1", "ps2")):
        copies = {b: [0, 0, 0, f"0{i}"] for b in range(64)}
        m.register(s, f"127.0.0.1:{9000 + i}", 102.0, copies=copies)
    m.reconcile(100.0 + WAIT)
    view = m.cluster_view()
    assert view["unavailable"] == [], "nothing committed: never waits for an operator"
    assert m.digest_conflicts == 64 and view["digest_conflicts"] == 64
    for b in range(64):
        bk = m.buckets[b]
        assert m.primary_of(b) == bk["want"][0]
        assert sorted(bk["joining"]) == sorted(s for s in bk["want"] if s != m.primary_of(b))
    validate(m)


def test_tied_candidates_that_agree_are_no_conflict() -> None:
    m, _ = _tied_wave({"ps0": "0a", "ps1": "0a", "ps2": "0a"})
    m.reconcile(100.0 + WAIT)
    assert m.cluster_view()["unavailable"] == [] and getattr(m, "digest_conflicts", 0) == 0


def test_a_server_that_cannot_persist_is_drained_until_it_can_again() -> None:
    """Issue 29: a server reports it cannot persist (its heartbeat's not_durable): placement
    moves its copies and primaries to the others, as from a draining server; once it can, it is
    eligible again. With no durable server left, every live one stays eligible."""
    m = cluster(4)
    assert any("ps0" in bk["want"] for bk in m.buckets)
    res = m.write_storage("ps0", "disk full: /data has 0 bytes free", 101.0)
    assert res["ok"] and m.servers["ps0"]["not_durable"].startswith("disk full")
    assert "ps0" not in m.eligible()
    assert all("ps0" not in bk["want"] for bk in m.buckets), "its copies are to move"
    m.write_storage("ps0", None, 102.0)
    assert "ps0" in m.eligible() and "not_durable" not in m.servers["ps0"]
    for s in ("ps0", "ps1", "ps2", "ps3"):
        m.write_storage(s, "disk full", 103.0)
    assert m.eligible() == ["ps0", "ps1", "ps2", "ps3"], "nowhere better to go"
    assert m.write_storage("nobody", None, 104.0)["ok"] is False
    validate(m)


def test_a_storage_fault_most_servers_share_moves_no_bucket() -> None:
    """Issue 39: every server starved of CPU reported "the disk stalls" within seconds; the
    controllers moved the buckets onto the one still durable, and a bucket stayed without a
    primary for a minute. One server of three that cannot persist is its own fault: its
    buckets move (issue 29). A second one makes it a cause most servers share: from then on
    nothing moves for it (on main every bucket went to the last durable server, alone). Every
    bucket keeps its primary and members through the reports and the reconciles after them,
    none is ever unavailable, and every bucket is whole again once they recover."""
    m = cluster(3, n_buckets=16)
    m.reconcile(100.0 + WAIT)
    stall = "a flush has been writing for 4.7 s (the disk stalls)"
    t = 101.0 + WAIT
    m.write_storage("ps1", stall, t)  # one server's own fault: it drains
    assert m.eligible() == ["ps0", "ps2"]
    assert all("ps1" not in bk["want"] for bk in m.buckets)
    for _ in range(3):
        t += WAIT
        m.reconcile(t)
    assert all(m.primary_of(b) != "ps1" and m.holder_live(b) for b in range(16))
    m.write_storage("ps2", stall, t)  # a second: most servers share the cause
    assert m.eligible() == ["ps0", "ps1", "ps2"]
    before = {b: (m.primary_of(b), sorted(m.live_members(b))) for b in range(16)}
    assert all(len(members) == 2 for _, members in before.values()), before
    m.write_storage("ps0", stall, t + 0.5)  # and the third
    for _ in range(5):
        t += WAIT
        m.reconcile(t)
        assert m.eligible() == ["ps0", "ps1", "ps2"]
        assert [b for b in range(16) if m.unavailable(b)] == []
        after = {b: (m.primary_of(b), sorted(m.live_members(b))) for b in range(16)}
        assert after == before, "no primary moved, no member left"
    for s in ("ps0", "ps1", "ps2"):
        m.write_storage(s, None, t)
    for _ in range(3):
        t += WAIT
        m.reconcile(t)
        for b in range(16):  # the copies that were asked to join catch up
            for s in list(m.buckets[b]["joining"]):
                epoch = m.buckets[b]["lease"].epoch
                m.verified_caught_up(b, m.primary_of(b), epoch, s, t, m.buckets[b]["join_ids"][s])
    assert [b for b in range(16) if m.unavailable(b)] == []
    assert all(m.holder_live(b) and len(m.live_members(b)) == 3 for b in range(16))
    validate(m)


def test_a_primary_back_within_the_server_timeout_keeps_its_secondaries_members() -> None:
    """Issue 29, every disk full, then every server SIGKILLed and restarted (CI saw it): the
    first server back was a primary and came back before the controllers declared the others
    dead. It was the only durable server, so each bucket wanted it alone, and its new
    incarnation counted as the primary "in the replica set": every caught-up secondary left,
    with no candidate kept, and its buckets stayed unavailable once the others were back.
    A restarted primary is no member (it re-joins): the secondaries stay until one is served."""
    m = cluster(3, n_buckets=8)
    led = [b for b in range(8) if m.primary_of(b) == "ps0"]
    assert led
    for s in ("ps0", "ps1", "ps2"):
        m.write_storage(s, "disk full", 101.0)  # none durable: every server still eligible
    copies = {b: [1, 0] for b in range(8)}
    before = {b: list(m.buckets[b]["holders"]) for b in led}
    assert all(before.values())  # each still has a caught-up secondary
    m.register("ps0", "127.0.0.1:9000", 102.0, copies)  # back at once; the others not yet
    for b in led:
        assert m.buckets[b]["holders"] == before[b], m.bucket_view(b)
        assert not m.unavailable(b)
    m.declare_dead("ps1", 103.0)
    m.declare_dead("ps2", 103.0)
    m.register("ps1", "127.0.0.1:9001", 104.0, copies)
    m.register("ps2", "127.0.0.1:9002", 105.0, copies)
    m.reconcile(102.0 + WAIT)
    assert [b for b in range(8) if m.unavailable(b)] == []
    assert all(m.holder_live(b) for b in range(8))
    validate(m)


def test_a_member_that_cannot_persist_stays_until_a_primary_that_failed_with_it_is_dead() -> None:
    """The replication simulation, seed 927421: a bucket had two members left (a primary and
    one secondary); the secondary's disk filled, and the controllers dropped it at once, the
    primary the one wanted copy. The primary had crashed a moment before, not yet declared dead:
    what it acknowledged after its last flush was held only by the dropped secondary's memory,
    and lost with it. A member that cannot persist leaves as a drained one does: not before
    the hold (the time a silent server needs to be declared dead), nor while fewer copies than
    can be placed remain. Here the primary's death comes within the hold: the secondary is
    still a member of every bucket, and takes it over."""
    m = cluster(3, n_buckets=16)
    m.reconcile(100.0 + WAIT)
    t = 101.0 + WAIT
    m.declare_dead("ps2", t)  # every bucket keeps two members: nowhere to place a third
    for _ in range(3):
        t += WAIT
        m.reconcile(t)
    assert all(sorted(m.live_members(b)) == ["ps0", "ps1"] for b in range(16))
    hold = 3.5
    m.write_storage("ps1", "disk full: /data has 0 bytes free", t, hold)
    assert m.eligible() == ["ps0"]
    m.reconcile(t + 0.1)
    assert all("ps1" in m.live_members(b) for b in range(16)), "dropped within its hold"
    m.declare_dead("ps0", t + 1.0)  # it failed with ps1's report, known dead within the hold
    for i in range(1, 6):
        m.reconcile(t + 1.0 + i * WAIT)
    assert all(m.live_members(b) == ["ps1"] for b in range(16)), [
        m.live_members(b) for b in range(16)
    ]
    validate(m)


def test_a_member_that_cannot_persist_leaves_after_its_hold_when_copies_are_whole() -> None:
    """Once its hold passed, a member that cannot persist leaves the buckets whose wanted copies
    are all in the replica set (as a drained server's); it can persist again: eligible again."""
    m = cluster(4, n_buckets=16)
    m.reconcile(100.0 + WAIT)
    t = 101.0 + WAIT
    mine = [b for b in range(16) if "ps1" in m.live_members(b)]
    assert mine
    m.write_storage("ps1", "a flush has failed: [Errno 5] EIO", t, 2.0)
    assert m.holds_due(t + 1.0) == [] and m.holds_due(t + 2.0) == ["ps1"]
    for i in range(1, 8):  # the copies that replace it join and catch up; the hold passes
        t2 = t + i * WAIT
        for b in range(16):
            for s in m.buckets[b]["joining"]:
                m.verified_caught_up(b, m.primary_of(b), m.lease_of(b).epoch, s, t2)
        m.reconcile(t2)
    assert all("ps1" not in m.live_members(b) for b in range(16))
    assert all(len(m.live_members(b)) == 3 for b in range(16))
    m.write_storage("ps1", None, t + 10.0)
    assert "ps1" in m.eligible() and "hold_until" not in m.servers["ps1"]
    validate(m)
