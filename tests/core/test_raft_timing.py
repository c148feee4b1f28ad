"""A controller's Raft thread sleeps until its next deadline (controller/raft_timing.py, issue 36:
idle costs nothing): the pure rule, the heartbeat period derived from the election timeout, and
the rule wired into the production node (one real GuardedSyncObj, its own journal, no partners)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from pysyncobj.monotonic import monotonic as raft_clock

from controller.raft_journal import GuardedSyncObj, make_guarded_node
from controller.raft_node import raft_conf
from controller.raft_timing import APPENDS_PER_ELECTION, append_period, tick_wait


def wait(now: float, **kw: float | bool) -> float:
    args: dict = dict(
        leader=False,
        next_append=0.0,
        period=0.075,
        election_deadline=0.0,
        election_min=0.3,
        longest=0.3,
    )
    args.update(kw)
    return tick_wait(now, **args)


def test_a_leader_sleeps_until_its_next_append() -> None:
    assert wait(10.0, leader=True, next_append=10.05) == pytest.approx(0.05)
    # due now: this tick sends it, the next is one period later (not a second tick at once)
    assert wait(10.0, leader=True, next_append=9.99) == pytest.approx(0.075)
    assert wait(10.0, leader=True, next_append=0.0) == pytest.approx(0.075)


def test_a_follower_sleeps_until_its_election_deadline_at_most_longest() -> None:
    assert wait(10.0, election_deadline=10.2) == pytest.approx(0.2)
    assert wait(10.0, election_deadline=12.0) == pytest.approx(0.3), "longest bounds the sleep"
    assert wait(10.0, election_deadline=12.0, longest=1.0) == pytest.approx(1.0)
    # due now: this tick starts the election, whose deadline is at least election_min later
    assert wait(10.0, election_deadline=9.0) == pytest.approx(0.3)
    assert wait(10.0, election_deadline=9.0, longest=0.1) == pytest.approx(0.1)


def test_a_manual_tick_without_a_wait_never_waits() -> None:
    assert wait(10.0, leader=True, next_append=11.0, longest=0.0) == 0.0
    assert wait(10.0, election_deadline=11.0, longest=0.0) == 0.0


def test_the_heartbeat_period_is_derived_from_the_shortest_election_timeout(
    tmp_path: Path,
) -> None:
    assert append_period(0.3) == pytest.approx(0.3 / APPENDS_PER_ELECTION)
    with pytest.raises(ValueError, match="election_min"):
        append_period(0.0)
    files = {"journal_file": str(tmp_path / "j"), "dump_file": str(tmp_path / "d")}
    conf = raft_conf(password="pw", **files)
    assert conf.appendEntriesPeriod == pytest.approx(conf.raftMinTimeout / 4)
    assert conf.autoTickPeriod >= conf.appendEntriesPeriod, "the tick waits for its deadlines"
    conf = raft_conf(password="pw", raftMinTimeout=0.8, raftMaxTimeout=1.6, **files)
    assert conf.appendEntriesPeriod == pytest.approx(0.2), "a longer election timeout: fewer"
    conf = raft_conf(password="pw", appendEntriesPeriod=0.05, **files)
    assert conf.appendEntriesPeriod == 0.05, "an explicit period is kept"


def test_the_default_election_timeout_and_heartbeats(tmp_path: Path) -> None:
    """A controller's default election timeout is 0.6-1.4 s, its leader's heartbeats every
    150 ms (issue 36: 0.3-0.9 s and 75 ms were most of an idle cluster's CPU); the tests'
    clusters keep the short one beside their short leases. An election_max beyond pysyncobj's
    connection timeout (1.5 s) is accepted: its conf asserted ``connectionTimeout >=
    raftMaxTimeout`` and the controller died at start."""
    from adamps.up.cluster import FAST_CONTROLLER_OPTS
    from controller.config import ControllerConfig

    fields = ControllerConfig.__dataclass_fields__
    lo, hi = fields["election_min"].default, fields["election_max"].default
    assert (lo, hi) == (0.6, 1.4)
    files = {"journal_file": str(tmp_path / "j"), "dump_file": str(tmp_path / "d")}
    conf = raft_conf(password="pw", raftMinTimeout=lo, raftMaxTimeout=hi, **files)
    conf.validate()
    assert conf.appendEntriesPeriod == pytest.approx(0.15)
    assert conf.leaderFallbackTimeout >= 4 * conf.appendEntriesPeriod
    assert (FAST_CONTROLLER_OPTS["election-min"], FAST_CONTROLLER_OPTS["election-max"]) == (
        0.3,
        0.9,
    )
    conf = raft_conf(password="pw", raftMinTimeout=1.0, raftMaxTimeout=3.0, **files)
    conf.validate()
    assert conf.connectionTimeout >= 3.0


def test_the_production_node_waits_for_its_deadline_not_a_fixed_period(tmp_path: Path) -> None:
    """A one-member group leads at once; its tick thread then waits for its next append (at
    most one period), and a follower's for its election deadline, not autoTickPeriod."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = raft_conf(
        password="pw",
        journal_file=str(tmp_path / "j"),
        dump_file=str(tmp_path / "d"),
        autoTick=False,
    )
    node = make_guarded_node(f"127.0.0.1:{port}", [], conf=conf)
    try:
        assert isinstance(node, GuardedSyncObj)
        deadline = time.monotonic() + 10
        while not node._isLeader() and time.monotonic() < deadline:
            node.doTick(0.01)
        assert node._isLeader()
        node.doTick(0.0)  # an append was due: sent in that tick
        w = node._tick_wait(conf.autoTickPeriod)
        assert 0.0 < w <= conf.appendEntriesPeriod + 1e-6, w
        # As a follower: until the election deadline
        node._SyncObj__raftState = 0
        # (pysyncobj's own clock: not time.monotonic's)
        node._SyncObj__raftElectionDeadline = raft_clock() + 0.2
        w = node._tick_wait(conf.autoTickPeriod)
        assert 0.15 < w <= 0.2, w
    finally:
        node.destroy()
