"""Issue 40: a heartbeat's answer carries only the roles changed since the version the server
names, and the leader's grant check reads only the buckets some time may grant. Both are
indexes beside the replicated state; these tests drive the production model through random
histories and compare each against the full computation it replaces."""

from __future__ import annotations

import random
from typing import Any

import pytest

from adamps.core.replication.node import ReplCore
from adamps.core.replication.ready import ControllerAnswer
from adamps.core.replication.settings import ReplSettings
from controller.state import ClusterModel
from tests.core.test_controller_state import TERMS, validate

N = 32
NAMES = [f"ps{i}" for i in range(6)]
#: what a server acts on in a role (the rest of a view is informational)
KEYS = ("role", "primary", "epoch", "secondaries", "joining", "join")


def essentials(views: list[dict[str, Any]]) -> dict[int, tuple]:
    return {v["bucket"]: tuple(str(v.get(k)) for k in KEYS) for v in views}


class DeltaServer:
    """What a server holds after applying answers, as adamps.core.replication.node applies them."""

    def __init__(self) -> None:
        self.known: int | None = None
        self.roles: dict[int, tuple] = {}
        self.deltas = 0

    def answer(self, m: ClusterModel, sid: str) -> dict[str, Any]:
        return m.heartbeat_view(sid, self.known, deltas=True)

    def apply(self, view: dict[str, Any]) -> None:
        if view["roles"] is None:
            return
        if "roles_since" in view:
            assert view["roles_since"] == self.known
            self.deltas += 1
            for b in view["removed"]:
                self.roles.pop(b, None)
            self.roles.update(essentials(view["roles"]))
        else:
            self.roles = essentials(view["roles"])
        self.known = view["version"]


def step(m: ClusterModel, rng: random.Random, now: float) -> str | None:
    """One random entry (as test_random_histories_keep_leases_safe draws them); the server
    that registered again, if any (its next answer starts from no version)."""
    op, s = rng.random(), rng.choice(NAMES)
    if op < 0.12:
        kept = {} if rng.random() < 0.2 else {b: [1, rng.randrange(5)] for b in range(N)}
        m.register(s, f"h:{s}", now, copies=kept)
        return s
    if op < 0.4:
        m.renew(s, now)
    elif op < 0.45:
        m.declare_dead(s, now)
    elif op < 0.54:
        m.drain(s, now)
    elif op < 0.64:
        b = rng.randrange(N)
        bk = m.buckets[b]
        if bk["holders"]:
            epoch = bk["lease"].epoch if bk["lease"] else 0
            reports = {h: [epoch, rng.randrange(5)] for h in bk["holders"]}
            m.role_change(b, rng.choice(bk["holders"]), epoch, reports, now)
    elif op < 0.76:
        for b, bk in enumerate(m.buckets):
            for j in list(bk["joining"]):
                if rng.random() < 0.5 and bk["lease"]:
                    m.verified_caught_up(b, bk["lease"].holder, bk["lease"].epoch, j, now)
    elif op < 0.8:
        b = rng.randrange(N)
        lease, holders = m.buckets[b]["lease"], m.buckets[b]["holders"]
        if lease and holders:
            m.drop_secondary(b, lease.holder, lease.epoch, rng.choice(holders), now)
    elif op < 0.84:
        b = rng.randrange(N)
        lease = m.buckets[b]["lease"]
        if lease:
            m.release(b, lease.holder, lease.epoch, now)
    elif op < 0.87:
        m.rebalance(now)
    elif op < 0.9:
        m.write_off(rng.randrange(N), now)
    else:
        m.reconcile(now)
    return None


@pytest.mark.parametrize("seed", range(10))
def test_deltas_applied_equal_the_full_roles(seed: int) -> None:
    """Every server applies the deltas it is answered (some answers lost on the way, some
    servers registering again); what it then holds equals the full roles list, after every
    entry of a random history of deaths, restarts, drains, role changes, joins, drops,
    releases and write-offs."""
    rng = random.Random(seed)
    m = ClusterModel(N, TERMS, min_servers=1)
    servers = {s: DeltaServer() for s in NAMES}
    real = 0.0
    for _ in range(300):
        real += rng.choice([0.1, 0.5, 1.0, 2.0, 4.0])
        again = step(m, rng, real)
        if again is not None:
            servers[again] = DeltaServer()  # a new incarnation knows no version
        validate(m)
        for sid, srv in servers.items():
            if sid not in m.servers or m.servers[sid]["state"] == "dead":
                continue
            view = srv.answer(m, sid)
            if rng.random() < 0.2:
                continue  # the answer is lost: the server asks again from what it knows
            srv.apply(view)
            assert srv.roles == essentials(m.roles_of(sid)), (sid, srv.known, m.version)
    assert sum(s.deltas for s in servers.values()) > 20, "deltas were answered"


def test_a_delta_names_only_the_buckets_that_changed() -> None:
    m = ClusterModel(64, TERMS, min_servers=3)
    for i in range(4):
        m.register(f"ps{i}", f"h:{i}", now=100.0)
    full = m.heartbeat_view("ps1", None, deltas=True)
    assert "roles_since" not in full and len(full["roles"]) > 40
    known = full["version"]
    assert m.heartbeat_view("ps1", known, deltas=True)["roles"] is None, "nothing changed"
    b = next(v["bucket"] for v in full["roles"] if v["role"] == "secondary")
    primary = m.primary_of(b)
    m.drop_secondary(b, primary, m.buckets[b]["lease"].epoch, "ps1", 101.0)
    delta = m.heartbeat_view("ps1", known, deltas=True)
    assert delta["roles_since"] == known
    assert [v["bucket"] for v in delta["roles"]] == [b] and delta["removed"] == []
    assert delta["roles"][0]["role"] == "joining", "dropped, then joining again"
    # A server that applies no deltas (sends no flag) still gets the full list.
    assert len(m.heartbeat_view("ps1", known)["roles"]) == len(full["roles"])
    # A version older than what this controller tracks, or unknown: the full list.
    for k in (None, known - 1, m.version + 5, "x"):
        view = m.heartbeat_view("ps1", k, deltas=True)
        assert "roles_since" not in view and len(view["roles"]) == len(full["roles"])


@pytest.mark.parametrize("seed", range(6))
def test_grants_due_reads_only_unsettled_buckets_and_misses_none(seed: int) -> None:
    """The leader's `grants_due` (and `reconcile`) read an index of the buckets some time may
    grant: at every instant of a random history they name exactly the buckets a scan of every
    bucket names."""
    rng = random.Random(seed)
    m = ClusterModel(N, TERMS, min_servers=1)
    real, checked, smallest = 0.0, 0, N
    for _ in range(300):
        real += rng.choice([0.1, 0.5, 1.0, 2.0, 4.0])
        step(m, rng, real)
        smallest = min(smallest, len(m.unsettled()))
        for later in (0.0, 3.0, 7.0, 60.0):
            scan = [b for b in range(N) if m._grant_target(b, real + later) is not None]
            assert m.grants_due(real + later) == scan
            checked += bool(scan)
    assert checked > 10
    assert smallest < N // 2, "settled buckets leave the index"


def test_the_core_applies_a_delta_and_refuses_one_from_another_version() -> None:
    """The server side (adamps.core): a delta changes the roles it names, drops the removed
    buckets, keeps the others; a delta from a version the server does not hold is not applied
    and the next heartbeat asks for the full list (no version)."""
    c = ReplCore(ReplSettings("a", member_timeout=1.0, failover_after=3.0, lease=TERMS))
    c.tick(0.0)
    (reg,) = c.ready().requests
    c.advance()
    c.controller_answer(reg, ControllerAnswer({"lease": TERMS.to_dict()}), 0.0)
    c.tick(0.0)
    (hb,) = c.ready().requests
    c.advance()
    assert hb.body["deltas"] is True and hb.body["known"] is None

    def view(b: int, primary: str, secondaries: list[str]) -> dict[str, Any]:
        return {"bucket": b, "epoch": 1, "primary": primary, "secondaries": secondaries}

    full = {"version": 5, "roles": [view(0, "b", ["a"]), view(1, "b", ["a"]), view(2, "a", [])]}
    c.controller_answer(hb, ControllerAnswer(full, asked_at=0.0), 0.1)
    assert c.roles == {0: "secondary", 1: "secondary", 2: "primary"}
    c.want_record(0.2)
    (hb,) = c.ready().requests
    c.advance()
    assert hb.body["known"] == 5
    delta = {"version": 7, "roles_since": 5, "roles": [view(1, "a", ["b"])], "removed": [0]}
    c.controller_answer(hb, ControllerAnswer(delta, asked_at=0.2), 0.3)
    assert c.roles == {1: "primary", 2: "primary"} and c.table_version == 7
    assert 0 in c.ready().forget
    c.advance()
    c.want_record(0.4)
    (hb,) = c.ready().requests
    c.advance()
    stale = {"version": 9, "roles_since": 6, "roles": [], "removed": [1, 2]}
    c.controller_answer(hb, ControllerAnswer(stale, asked_at=0.4), 0.5)
    assert c.roles == {1: "primary", 2: "primary"}, "a delta from another version: not applied"
    c.want_record(0.6)
    (hb,) = c.ready().requests
    assert hb.body["known"] is None, "the full list is asked for"
