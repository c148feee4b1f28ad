"""A primary's message unanswered past its deadline fails on the core's tick (issue 40: peer
timeouts are ticks of the core; the transport only reports what happened). Driven through the
core's inputs only (submit, tick, step, answer), read from its Ready and ``next_deadline``:
no transport, no clock. Reference: adamps/core/replication/deadlines.py; Project Adam 3.3.3 (a
member that does not answer is dropped by a committed controller entry)."""

from __future__ import annotations

from typing import Any

import pytest

from adamps.core.replication.rounds import RETRY_EVERY
from adamps.core.replication.settings import RATE_FLOOR
from tests.core.test_repl_core import Cluster, core, role

TIMEOUT = 1.0  # the cores' member_timeout (tests/core/test_repl_core.core)


class Quiet(Cluster):
    """Cluster's three cores (a primary of bucket 0, b and c its secondaries), whose pings are
    far apart: the primary's only deadlines are its messages'."""

    def __init__(self) -> None:
        self.cores = {s: core(s, ping_interval=1000.0) for s in "abc"}
        for c in self.cores.values():
            c.on_roles({"version": 1, "roles": [role(0, 1, "a", ["b", "c"])]}, 0.0, 0.0)
            c.tick(0.0)  # the first pings (the next in 1000 s)
        self.cores["a"].on_roles({"renewed": [[0, 1]]}, 0.0, 0.0)
        self.out: list[Any] = []
        self.answers: list[Any] = []
        self.applied: dict[str, list[Any]] = {s: [] for s in "abc"}
        self.requests: list[Any] = []
        self.collect()
        self.deliver(0.0)  # the new primary's COMMITs: each member's position

    def hold(self, peer: str) -> list[Any]:
        """Takes the messages in flight to `peer` out of the network (unanswered until the test
        delivers them)."""
        held = [m for s, m in self.out if m.peer == peer]
        self.out = [(s, m) for s, m in self.out if m.peer != peer]
        return held

    def drops(self) -> list[str]:
        return [r.member for r in self.requests if r.kind == "drop_secondary"]


class Big:
    """An update of `nbytes` bytes (updates are opaque to the core; its arrays say their size)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def test_an_unanswered_prepare_fails_at_its_deadline_on_a_tick_not_before() -> None:
    cl = Quiet()
    a = cl.cores["a"]
    assert a.submit({0: "u1"}, ("cl", 1), {0: "w1"}, 0.1) is None
    cl.collect()
    (held,) = cl.hold("c")
    assert held.op == "repl_prepare"
    cl.deliver(0.1)  # b answers; c stays silent, and no transport reports anything
    assert cl.answers == [] and cl.requests == []
    # The shell's clock sleeps until the message's deadline: sent + member_timeout (its few
    # bytes add nothing visible), not a busy tick, not never.
    assert a.next_deadline(0.2) == pytest.approx(0.1 + TIMEOUT, abs=1e-6)
    a.tick(0.1 + TIMEOUT - 0.01)
    cl.collect()
    assert cl.requests == [] and cl.out == [], "not failed before its deadline"
    a.tick(0.1 + TIMEOUT + 1e-6)
    cl.collect()
    assert cl.drops() == ["c"], "unanswered for member_timeout: the controllers drop it"
    assert cl.out == [], "tried again after RETRY_EVERY, not at once"
    assert cl.answers == [], "nothing acknowledged without c before the record drops it"
    at = 0.1 + TIMEOUT + RETRY_EVERY + 1e-6
    assert a.next_deadline(0.1 + TIMEOUT + 1e-6) <= at
    a.tick(at)
    cl.collect()
    assert [(m.peer, m.op) for _s, m in cl.out] == [("c", "repl_prepare")]


def test_a_large_message_gets_its_size_allowance() -> None:
    """A PREPARE of 64 MB has member_timeout plus its bytes at the floor rate (2 s at 32 MB/s),
    and a message queued to the same peer after it gets that time too: its bytes come after."""
    cl = Quiet()
    a = cl.cores["a"]
    size = 64_000_000
    assert a.submit({0: Big(size)}, ("cl", 1), {0: "w1"}, 0.1) is None
    cl.collect()
    cl.hold("c")
    cl.deliver(0.1)
    deadline = 0.1 + size / RATE_FLOOR + TIMEOUT
    assert a.next_deadline(0.2) == pytest.approx(deadline, abs=1e-6)
    a.tick(0.1 + TIMEOUT + 0.5)  # past member_timeout, within the allowance
    cl.collect()
    assert cl.drops() == [] and cl.out == []
    a.tick(deadline - 0.01)
    cl.collect()
    assert cl.drops() == []
    a.tick(deadline + 1e-6)
    cl.collect()
    assert cl.drops() == ["c"]


def test_a_message_queued_behind_a_large_one_to_the_same_peer_gets_its_time() -> None:
    """The messages to one peer share its link: bucket 1's small PREPARE to c, sent while
    bucket 0's 64 MB PREPARE to c is in flight, is due after that one's bytes."""
    cl = Quiet()
    a = cl.cores["a"]
    for c in cl.cores.values():  # bucket 1 joins the same replica set
        roles = [role(0, 1, "a", ["b", "c"]), role(1, 1, "a", ["b", "c"])]
        c.on_roles({"version": 2, "roles": roles}, 0.0, 0.0)
    a.on_roles({"renewed": [[1, 1]]}, 0.0, 0.0)
    cl.collect()
    cl.deliver(0.0)
    size = 64_000_000
    a.submit({0: Big(size)}, ("cl", 1), {0: "w1"}, 0.1)
    a.submit({1: "small"}, ("cl", 2), {1: "w2"}, 0.2)
    cl.collect()
    held = cl.hold("c")
    assert [m.fields["bucket"] for m in held] == [0, 1]
    cl.deliver(0.2)
    big_done = 0.1 + size / RATE_FLOOR
    a.tick(0.2 + TIMEOUT + 0.1)  # past the small one's own member_timeout
    cl.collect()
    assert cl.drops() == [], "its bytes come after the large one's"
    a.tick(big_done + TIMEOUT + 1e-3)
    cl.collect()
    assert sorted((r.bucket, r.member) for r in cl.requests if r.kind == "drop_secondary") == [
        (0, "c"),
        (1, "c"),
    ]


def test_a_reply_after_the_deadline_changes_nothing() -> None:
    cl = Quiet()
    a = cl.cores["a"]
    a.submit({0: "u1"}, ("cl", 1), {0: "w1"}, 0.1)
    cl.collect()
    (held,) = cl.hold("c")
    cl.deliver(0.1)
    a.tick(0.1 + TIMEOUT + 1e-6)
    cl.collect()
    assert cl.drops() == ["c"]
    rep = a.buckets[0]
    before = (dict(rep.acked_prepare), dict(rep.acked_commit), rep.committed, rep.inflight)
    # c answers now, late: the core failed the message at its deadline and forgot its id
    late = 0.1 + TIMEOUT + 0.005
    res = cl.cores["c"].step("a", {"op": held.op, **held.fields}, late)
    cl.collect()
    assert res == {"status": "ok", "seq": held.fields["entries"][-1].seq}
    a.step("c", {"op": "reply", "rid": held.rid, "reply": res}, late)
    a.answer(held.rid, None, "connection", late)  # and the transport's safety timeout after
    assert not a.has_ready(), "nothing decided, acknowledged, sent or asked"
    assert (dict(rep.acked_prepare), dict(rep.acked_commit), rep.committed, rep.inflight) == before
    assert cl.answers == []


class Counted:
    """An update whose size is read by the core's deadlines: counts the reads."""

    reads = 0

    @property
    def nbytes(self) -> int:
        Counted.reads += 1
        return 1_000_000


def test_a_batch_is_measured_once_for_every_replica() -> None:
    """A PREPARE's size allowance (bytes at the floor rate) is counted once per batch, not
    once per replica it goes to (issue 36: the walk at each send, 4% of a primary's event
    loop at RF 3); both replicas' deadlines still carry it."""
    cl = Quiet()
    a = cl.cores["a"]
    Counted.reads = 0
    assert a.submit({0: Counted()}, ("cl", 1), {0: "w1"}, 0.1) is None
    cl.collect()
    assert sorted(m.peer for _s, m in cl.out if m.op == "repl_prepare") == ["b", "c"]
    assert Counted.reads == 1
    deadline = 0.1 + 1_000_000 / RATE_FLOOR + TIMEOUT
    assert a.next_deadline(0.2) == pytest.approx(deadline, abs=1e-6)
