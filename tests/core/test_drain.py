"""Drains and undrains in the controllers' model, driven directly (no Raft, no sockets).

Issue 26: a primary SIGKILLed 0.1 s before another server was drained was still `live` when the
drain let go of its copies; its death then left every bucket on one copy, and `drained` was
reported. protocol-controller.md: a drain "removes no caught-up copy before its replacement has
caught up"; operations.md: "the bucket never has a copy fewer during a hand-off".
"""

from __future__ import annotations

from adamps.core.lease import LeaseTerms, check_history
from controller.state import DEAD, DRAINING, LIVE, ClusterModel

TERMS = LeaseTerms(duration=5.0, skew=0.1, margin=0.5)
HOLD = 4.5  # the service passes server_timeout + heartbeat_interval + reconcile_interval


def cluster(n: int) -> ClusterModel:
    m = ClusterModel(16, TERMS, replication=3, min_servers=n)
    for i in range(n):
        m.register(f"ps{i}", f"127.0.0.1:{9000 + i}", now=100.0)
    return m


def validate(m: ClusterModel) -> None:
    for b, bk in enumerate(m.buckets):
        for s in bk["holders"] + bk["joining"]:
            assert m.servers[s]["state"] != DEAD, f"bucket {b}: dead server {s} still a member"
    assert check_history(m.lease_records(), m.terms) == []


def run(m: ClusterModel, start: float, end: float, alive: set[str]) -> list[int]:
    """Heartbeats of `alive`, caught-up reports of every joining copy, reconciles (as the leader
    does when `grants_due` or `holds_due`), one round a second; returns, per round, the fewest
    caught-up copies any bucket has besides the draining servers."""
    fewest = []
    t = start
    while t < end:
        t += 1.0
        for s in sorted(alive):
            m.renew(s, t)
        for b, bk in enumerate(m.buckets):
            if m.holder_live(b):
                for j in list(bk["joining"]):
                    m.verified_caught_up(b, bk["lease"].holder, bk["lease"].epoch, j, t)
        if m.grants_due(t) or m.holds_due(t):
            m.reconcile(t)
        fewest.append(min(len(m.holders_of(b)) for b in range(m.n_buckets)))
    return fewest


def state_of(m: ClusterModel, sid: str) -> str:
    return m.cluster_view()["servers"][sid]["state"]


def test_a_drain_during_a_failover_is_not_drained_while_a_bucket_has_one_copy() -> None:
    """ps0 dies (still live in the model: not yet declared dead), ps2 is drained 0.1 s later:
    ps2 stays a caught-up member of every bucket until each has the two copies the drain
    planned, which needs a server back; then it is `drained`."""
    m = cluster(3)
    for s in ("ps0", "ps1", "ps2"):
        m.renew(s, 100.0)
    assert m.drain("ps2", 100.1, HOLD)["ok"]
    assert m.holds_due(100.1) == [] and m.holds_due(100.1 + HOLD) == ["ps2"]
    m.declare_dead("ps0", 103.1)  # server_timeout of silence after its last heartbeat
    fewest = run(m, 103.1, 130.0, {"ps1", "ps2"})
    assert min(fewest) >= 2, f"a bucket was left with {min(fewest)} caught-up copy: {fewest}"
    assert state_of(m, "ps2") == "draining", "drained while the buckets need its copy"
    assert all(m.primary_of(b) == "ps1" for b in range(m.n_buckets)), "primaries moved off ps2"
    assert all("ps2" in m.buckets[b]["holders"] for b in range(m.n_buckets))
    # A server comes back: the buckets get their second copy there, then ps2 lets go.
    m.register("ps0", "127.0.0.1:9000", 130.0)
    fewest = run(m, 130.0, 150.0, {"ps0", "ps1", "ps2"})
    assert min(fewest) >= 2, fewest
    assert state_of(m, "ps2") == "drained"
    assert all(sorted(m.holders_of(b)) == ["ps0", "ps1"] for b in range(m.n_buckets))
    validate(m)


def test_the_floor_of_a_drain_counts_what_it_planned_at_its_start() -> None:
    """Four servers: the drain plans three copies per bucket. A death during the drain does
    not lower that: the drain waits until the bucket is back at three (the dead server
    returns), rather than stop at two."""
    m = cluster(4)
    for s in ("ps0", "ps1", "ps2", "ps3"):
        m.renew(s, 100.0)
    m.drain("ps3", 100.1, HOLD)
    m.declare_dead("ps0", 103.1)
    fewest = run(m, 103.1, 130.0, {"ps1", "ps2", "ps3"})
    assert min(fewest) >= 2 and state_of(m, "ps3") == "draining"
    m.register("ps0", "127.0.0.1:9000", 130.0)
    run(m, 130.0, 150.0, {"ps0", "ps1", "ps2", "ps3"})
    assert state_of(m, "ps3") == "drained"
    assert all(len(m.holders_of(b)) == 3 for b in range(m.n_buckets))
    validate(m)


def test_a_drain_without_failures_completes_after_its_hold() -> None:
    """No failure: the drain lets go of its copies once the hold passed and ends at
    min(replication, servers left) copies (two of three servers here)."""
    m = cluster(3)
    m.drain("ps2", 100.0, HOLD)
    assert all("ps2" in m.buckets[b]["holders"] or m.primary_of(b) == "ps2" for b in range(16))
    fewest = run(m, 100.0, 103.0, {"ps0", "ps1", "ps2"})
    assert state_of(m, "ps2") == "draining", "let go before the hold passed"
    fewest += run(m, 103.0, 120.0, {"ps0", "ps1", "ps2"})
    assert min(fewest) >= 2 and state_of(m, "ps2") == "drained"
    assert m.holds_due(120.0) == [], "a passed hold is reconciled once"
    validate(m)


def test_a_second_drain_lowers_the_floor_of_the_first() -> None:
    """An operator who drains two of four servers asks for two copies per bucket: both
    drains complete."""
    m = cluster(4)
    m.drain("ps3", 100.0, HOLD)
    m.drain("ps2", 100.0, HOLD)
    assert m.servers["ps3"]["drain_floor"] == m.servers["ps2"]["drain_floor"] == 2
    run(m, 100.0, 120.0, {"ps0", "ps1", "ps2", "ps3"})
    assert state_of(m, "ps2") == state_of(m, "ps3") == "drained"
    validate(m)


def test_undrain_returns_a_drained_server_to_service() -> None:
    m = cluster(4)
    m.drain("ps3", 100.0, HOLD)
    run(m, 100.0, 120.0, {"ps0", "ps1", "ps2", "ps3"})
    assert state_of(m, "ps3") == "drained"
    # A drained id that registers again stays drained (its state is the operator's choice).
    m.register("ps3", "127.0.0.1:9003", 121.0)
    assert m.servers["ps3"]["state"] == DRAINING
    res = m.drain("ps3", 122.0, back=True)
    assert res == {"ok": True, "server": "ps3", "state": LIVE, "changed": True}
    assert "ps3" in m.eligible()
    run(m, 122.0, 140.0, {"ps0", "ps1", "ps2", "ps3"})
    view = m.cluster_view()
    assert view["servers"]["ps3"]["state"] == LIVE
    assert view["servers"]["ps3"]["primary"] > 0 and view["servers"]["ps3"]["secondary"] > 0
    assert view["under_replicated"] == 0
    assert m.undrain("ps3", 141.0)["changed"] is False, "undrain of a live server: a no-op"
    assert m.undrain("nobody", 141.0)["error"] == "not_found"
    m.declare_dead("ps3", 150.0)
    assert m.undrain("ps3", 151.0)["error"] == "conflict"
    validate(m)
