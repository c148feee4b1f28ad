"""Racks in the controllers' model (issue 26): a server's rack is part of its registration,
placement keeps each bucket's copies on distinct racks, and a whole rack failing leaves every
bucket a live copy to serve it. The model as every Raft node applies it (`now` passed in)."""

from __future__ import annotations

import copy
import pickle

from adamps.core.lease import LeaseTerms
from controller.state import ClusterModel


def _racked(n_buckets: int = 90) -> ClusterModel:
    m = ClusterModel(n_buckets, LeaseTerms(), 3, min_servers=6)
    for i in range(6):
        m.register(f"s{i}", f"h:{i}", 0.0, {}, f"r{i % 3}")
    return m


def test_registration_records_the_rack_and_copies_land_on_distinct_racks() -> None:
    m = _racked()
    assert m.servers["s4"]["rack"] == "r1"
    for b in range(m.n_buckets):
        assert len({m.servers[s]["rack"] for s in m.holders_of(b)}) == 3
    view = m.cluster_view()
    assert view["racks"] == 3 and view["rack_shared"] == 0
    assert view["servers"]["s2"]["rack"] == "r2"


def test_a_whole_rack_dead_leaves_every_bucket_a_live_copy_and_it_is_served_again() -> None:
    m = _racked()
    m.renew("s0", 1.0)
    for sid in ("s0", "s3"):  # rack r0
        m.declare_dead(sid, 4.0)
    assert not any(m.unavailable(b) for b in range(m.n_buckets))
    assert all(len(m.holders_of(b)) >= 2 for b in range(m.n_buckets))
    m.reconcile(20.0)  # the dead primaries' leases certainly ended
    assert all(m.holder_live(b) for b in range(m.n_buckets))
    # Two racks left for three copies: the third shares a rack, and the view says how many.
    assert m.cluster_view()["racks"] == 2


def test_without_racks_a_rack_failure_may_take_every_copy() -> None:
    """The contrast: the same cluster without racks places some buckets entirely within two
    servers of one 'rack', which its failure makes unavailable (the bug racks fix)."""
    m = ClusterModel(90, LeaseTerms(), 3, min_servers=6)
    for i in range(6):
        m.register(f"s{i}", f"h:{i}", 0.0, {})
    shared = [b for b in range(90) if len({int(s[1:]) % 3 for s in m.holders_of(b)}) < 3]
    assert shared  # two copies in one of the would-be racks


def test_registering_without_a_rack_keeps_older_entries_replaying_and_dumps_loading() -> None:
    m = ClusterModel(30, LeaseTerms(), 3, min_servers=3)
    for i in range(3):
        m.register(f"s{i}", f"h:{i}", 0.0)  # an entry of the release before racks
    assert all("rack" not in rec for rec in m.servers.values())
    assert m.racks() == {}
    m.register("s0", "h:0", 1.0, {}, "r9")  # re-registering names a rack
    assert m.racks() == {"s0": "r9"}
    clone = pickle.loads(pickle.dumps(copy.deepcopy(m)))
    assert clone.racks() == {"s0": "r9"}


def test_racks_declared_late_are_honoured_by_the_next_placement() -> None:
    m = ClusterModel(60, LeaseTerms(), 3, min_servers=6)
    for i in range(6):
        m.register(f"s{i}", f"h:{i}", 0.0, {})
    for i in range(6):  # each restarts naming its rack
        m.register(f"s{i}", f"h:{i}", 1.0 + i, {}, f"r{i % 3}")
    for b in range(60):
        racks = [m.servers[s]["rack"] for s in m.buckets[b]["want"]]
        assert len(set(racks)) == 3, (b, m.buckets[b]["want"])


def test_the_servers_rack_from_flag_environment_and_its_check() -> None:
    import pytest

    from adamps.config import ConfigError, load
    from adamps.server.config import PsConfig

    env = {"ADAMPS_TOKEN": "t" * 32}
    assert load(PsConfig, "ps", {}, environ=env).rack == ""
    assert load(PsConfig, "ps", {}, environ={**env, "ADAMPS_RACK": "row2.r7"}).rack == "row2.r7"
    assert load(PsConfig, "ps", {}, environ={**env, "ADAMPS_PS_RACK": "r1"}).rack == "r1"
    assert load(PsConfig, "ps", {"rack": "r3"}, environ={**env, "ADAMPS_RACK": "r1"}).rack == "r3"
    with pytest.raises(ConfigError, match=r"rack must be 1-64 characters .*'a b'"):
        load(PsConfig, "ps", {"rack": "a b"}, environ=env)


def test_adamps_status_shows_each_servers_rack_and_the_buckets_sharing_one() -> None:
    from controller.status import render

    m = _racked(30)
    view = m.cluster_view()
    lines = render(view, [], {}, False).splitlines()
    header = next(line for line in lines if line.startswith("server"))
    assert header.split()[:4] == ["server", "address", "state", "rack"]
    assert any(line.startswith("s4") and " r1 " in line for line in lines)
    assert not any("two copies in one rack" in line for line in lines)
    view = {**view, "racks": 2, "rack_shared": 17}
    text = render(view, [], {}, False)
    assert "buckets with two copies in one rack: 17 (2 racks among the eligible servers)" in text
