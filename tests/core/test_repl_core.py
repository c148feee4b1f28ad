"""adamps.core.replication.node without sockets or clock: the per-server replication core's decisions,
each driven through its inputs (on_roles, tick, step, submit, answer, controller_answer) and
read from its Ready, as the shell and the simulation drive it. Three cores are wired by hand
(an in-memory network of state machines, etcd-io/raft's test shape)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from adamps.core.lease import LeaseTerms
from adamps.core.replication import copies as repl_copies
from adamps.core.replication.node import ReplCore
from adamps.core.replication.ready import ControllerAnswer, ControllerRequest, Ready
from adamps.core.replication.rounds import (
    COMMIT_DELAY,
    COMMIT_GAPS,
    COMMIT_WAIT_MAX,
    RETRY_EVERY,
)
from adamps.core.replication.settings import ReplSettings
from adamps.core.replication.values import Reject

TERMS = LeaseTerms(duration=2.0, skew=0.1, margin=0.1)


def role(b: int, epoch: int, primary: str, secondaries: list[str], joining: list[str] = (), **kw: Any) -> dict[str, Any]:  # fmt: skip
    return {"bucket": b, "epoch": epoch, "primary": primary, "secondaries": list(secondaries),
            "joining": list(joining), **kw}  # fmt: skip


def core(sid: str, **kw: Any) -> ReplCore:
    """A core registered as a server's is (its link's request, the controllers' answer), its
    first heartbeat left in flight: the tests feed it roles themselves (on_roles), so its link
    asks for nothing more."""
    c = ReplCore(ReplSettings(sid, member_timeout=1.0, failover_after=3.0, lease=TERMS, **kw))
    before = -100.0  # long before the tests' times: no timer of theirs has run yet
    c.tick(before)
    (reg,) = take(c).requests
    answer = {"lease": TERMS.to_dict(), "heartbeat_interval": 1.0}
    c.controller_answer(reg, ControllerAnswer(answer), before)
    c.tick(before)
    assert [r.kind for r in take(c).requests] == ["heartbeat"]
    return c


def take(c: ReplCore) -> Ready:
    rd = c.ready()
    c.advance()
    return rd


class Cluster:
    """Three cores a (primary), b, c of bucket 0 at epoch 1, messages delivered by hand."""

    def __init__(self, ack: str = "prepared") -> None:
        self.cores = {s: core(s, ack=ack) for s in "abc"}
        for c in self.cores.values():
            c.on_roles({"version": 1, "roles": [role(0, 1, "a", ["b", "c"])]}, 0.0, 0.0)
        self.cores["a"].on_roles({"renewed": [[0, 1]]}, 0.0, 0.0)
        self.out: list[Any] = []  # (sender, Send) not yet delivered
        self.answers: list[Any] = []
        self.applied: dict[str, list[Any]] = {s: [] for s in "abc"}
        self.requests: list[Any] = []
        self.collect()
        # A new primary learns each member's position first (a COMMIT of what it holds).
        assert {m.op for _s, m in self.out} == {"repl_commit"}
        self.deliver(0.0)

    def collect(self) -> None:
        for s, c in self.cores.items():
            rd = take(c)
            self.out += [(s, m) for m in rd.messages]
            self.answers += rd.answers
            self.requests += rd.requests
            for _b, action in rd.applies:
                self.applied[s] += [u for batch in action.batches for u in batch.updates]

    def deliver(self, now: float, drop: set[str] = frozenset(), hops: int = 1000) -> int:
        """Delivers every message in flight and the replies, and what they cause (`hops` times
        at most); those to `drop` fail."""
        n = 0
        while self.out and hops > 0:
            hops -= 1
            out, self.out = self.out, []
            for src, m in out:
                n += 1
                if m.peer in drop:
                    self.cores[src].report_unreachable(m.rid, now)
                    continue
                res = self.cores[m.peer].step(src, {"op": m.op, **m.fields}, now)
                assert not isinstance(res, Reject), res
                self.cores[src].step(m.peer, {"op": "reply", "rid": m.rid, "reply": res}, now)
            self.collect()
        return n


def test_a_push_is_acknowledged_at_the_decision_point_and_applied_everywhere() -> None:
    """Reference: docs/protocol-ps.md, replication: PREPARE to every member, apply and acknowledge
    once all hold the batch; the COMMIT rides on the next PREPARE or follows alone."""
    cl = Cluster()
    a = cl.cores["a"]
    assert a.submit({0: "u1"}, ("cl", 1), {0: "w1"}, 0.1) is None
    cl.collect()
    assert [m.op for _s, m in cl.out] == ["repl_prepare", "repl_prepare"]
    cl.deliver(0.1)
    assert [(x.waiter, x.outcome) for x in cl.answers] == [("w1", "ok")]
    assert cl.applied["a"] == ["u1"] and cl.applied["b"] == []  # b, c: prepared, not committed
    a.tick(0.2)  # past COMMIT_DELAY: COMMIT goes alone (no next round carried it)
    cl.collect()
    assert [m.op for _s, m in cl.out] == ["repl_commit", "repl_commit"]
    cl.deliver(0.2)
    assert cl.applied == {"a": ["u1"], "b": ["u1"], "c": ["u1"]}


def test_the_commit_rides_on_the_next_prepare() -> None:
    cl = Cluster()
    a = cl.cores["a"]
    a.submit({0: "u1"}, ("cl", 1), {0: "w1"}, 0.1)
    cl.collect()
    cl.deliver(0.1)
    a.submit({0: "u2"}, ("cl", 2), {0: "w2"}, 0.1)  # before COMMIT_DELAY passed
    cl.collect()
    (_, m), _ = cl.out
    assert m.op == "repl_prepare" and m.fields["commit"] == 1
    cl.deliver(0.1)
    assert cl.applied["b"] == ["u1"], "b applied batch 1 from the commit riding on PREPARE 2"
    assert cl.cores["a"].buckets[0].acked_commit["b"] == 1


def test_at_a_steady_pace_of_rounds_every_commit_rides_on_the_next_prepare() -> None:
    """Issue 36, session 13: a trainer pushes a bucket once per step, a step being far longer
    than COMMIT_DELAY; each round's COMMIT went alone, a second message to every replica per
    step. The COMMIT now waits COMMIT_GAPS times the rounds' pace: no COMMIT goes alone while the
    pushes keep coming, the clock sleeps until it is due, and once they stop it goes alone by
    COMMIT_WAIT_MAX."""
    cl = Cluster()
    a = cl.cores["a"]
    step = 0.3
    for i in range(1, 6):
        t = i * step
        a.tick(t)
        cl.collect()
        alone = [m.op for _s, m in cl.out]
        # The first round sets no pace: its COMMIT went alone after COMMIT_DELAY.
        assert alone == (["repl_commit", "repl_commit"] if i == 2 else []), f"step {i}: {alone}"
        cl.deliver(t)
        a.submit({0: f"u{i}"}, ("cl", i), {0: f"w{i}"}, t)
        cl.collect()
        ops = [m.op for _s, m in cl.out]
        assert ops == ["repl_prepare", "repl_prepare"], f"step {i}: {ops}"
        cl.deliver(t)
        assert [x.waiter for x in cl.answers][-1] == f"w{i}", "acknowledged at the decision point"
        if i > 1:
            assert a.next_deadline(t) > t, "a delayed COMMIT only: the clock sleeps"
            mid = t + step * 0.9
            a.tick(mid)
            cl.collect()
            assert cl.out == [], f"step {i}: the COMMIT waits for the next step's PREPARE"
            assert cl.applied["b"] == [f"u{j}" for j in range(1, i)], "it rode on each PREPARE"
    last = 5 * step
    wait = min(COMMIT_WAIT_MAX, COMMIT_GAPS * step)
    a.tick(last + wait - 0.01)
    cl.collect()
    assert [m.op for _s, m in cl.out if m.op == "repl_commit"] == [], "not before its time"
    cl.out.clear()
    a.tick(last + wait + 0.001)
    cl.collect()
    assert [m.op for _s, m in cl.out] == ["repl_commit", "repl_commit"], "the pushes stopped"
    cl.deliver(last + wait + 0.001)
    assert cl.applied["b"] == cl.applied["c"] == [f"u{j}" for j in range(1, 6)]


def test_a_tick_pumps_no_bucket_whose_delayed_commit_is_all_it_waits_for() -> None:
    """Issue 36 (helper perf36's profile of a click-through step at RF 3): between two steps
    every bucket the trainer pushed waits for its delayed COMMIT or for its PREPARE's answers,
    and every tick of the clock (every TICK while messages are in flight) pumped each of them
    for nothing: about a tenth of a server's event loop. A tick pumps such a bucket only once
    its COMMIT is due; an answer pumps it at once; what is sent, and when, is unchanged."""
    cl = Cluster()
    a = cl.cores["a"]
    pumped: list[int] = []
    real = a.pump
    a.pump = lambda b, now: (pumped.append(b), real(b, now))[1]  # type: ignore[method-assign]
    step = 0.3
    for i in range(1, 4):
        t = i * step
        a.tick(t)
        cl.collect()
        cl.deliver(t)
        a.submit({0: f"u{i}"}, ("cl", i), {0: f"w{i}"}, t)
        cl.collect()
        pumped.clear()
        a.tick(t + 0.01)
        assert pumped == [], f"step {i}: its PREPAREs await their answers: nothing to pump"
        cl.deliver(t)
    pumped.clear()
    a.tick(t + step / 2)
    cl.collect()
    assert pumped == [] and cl.out == [], "nothing due: not pumped, nothing sent"
    wait = min(COMMIT_WAIT_MAX, COMMIT_GAPS * step)
    a.tick(t + wait + 0.001)
    cl.collect()
    assert pumped == [0], "pumped once its COMMIT is due"
    assert [m.op for _s, m in cl.out] == ["repl_commit", "repl_commit"]
    cl.deliver(t + wait + 0.001)
    assert cl.applied["b"] == cl.applied["c"] == ["u1", "u2", "u3"]


def test_a_new_primary_serves_no_read_before_it_applied_its_in_doubt_rounds() -> None:
    """Found by tests/system/test_racks.py (1 run in 5): a's push was acknowledged once b and c
    held it prepared; a died before any COMMIT. The promoted b held it prepared, not applied,
    and served a pull without it. docs/protocol-ps.md: a pull sees every push acknowledged
    before it was sent. Reads are refused (not_primary, retryable) until the first rounds of
    the new epoch applied the in-doubt batches; writes go on, sequenced after them."""
    cl = Cluster()
    a, b = cl.cores["a"], cl.cores["b"]
    a.submit({0: "u1"}, ("cl", 1), {0: "w1"}, 0.1)
    cl.collect()
    cl.deliver(0.1)
    assert [(x.waiter, x.outcome) for x in cl.answers] == [("w1", "ok")]
    assert cl.applied["b"] == []  # prepared only: a's COMMIT never left
    for c in (b, cl.cores["c"]):
        c.on_roles({"version": 2, "roles": [role(0, 2, "b", ["c"])]}, 3.0, 3.0)
    b.on_roles({"renewed": [[0, 2]]}, 3.0, 3.0)
    assert b.buckets[0].in_doubt
    rej = b.check_primary(0, 3.0, read=True)
    assert isinstance(rej, Reject) and rej.code == "not_primary" and "in-doubt" in rej.message
    assert not isinstance(b.check_primary(0, 3.0), Reject), "writes are not refused"
    assert b.submit({0: "u2"}, ("cl", 2), {0: "w2"}, 3.0) is None
    cl.cores.pop("a")  # dead: its messages are gone with it
    cl.out = [(s, m) for s, m in cl.out if s != "a"]
    cl.collect()
    cl.deliver(3.0)
    assert cl.applied["b"][:1] == ["u1"], "the in-doubt batch is applied first"
    assert not b.buckets[0].in_doubt
    assert not isinstance(b.check_primary(0, 3.0, read=True), Reject)


def test_no_acknowledgement_after_the_lease_ended() -> None:
    """A round decided after the primary's lease ran out: its pushes are answered "unknown"
    (another copy may already acknowledge under the next epoch), never "ok"."""
    cl = Cluster()
    a = cl.cores["a"]
    a.submit({0: "u1"}, ("cl", 1), {0: "w1"}, 0.1)
    cl.collect()
    deadline = a.leases.deadline(0)
    assert deadline is not None
    cl.deliver(deadline + 0.01)
    assert [(x.waiter, x.outcome) for x in cl.answers] == [("w1", "unknown")]


def test_committed_mode_acknowledges_once_every_member_committed() -> None:
    cl = Cluster(ack="committed")
    a = cl.cores["a"]
    a.submit({0: "u1"}, ("cl", 1), {0: "w1"}, 0.1)
    cl.collect()
    cl.deliver(0.1, hops=1)  # the PREPAREs and their replies
    assert cl.applied["a"] == ["u1"] and cl.answers == []  # decided, not committed by b and c
    assert [m.op for _s, m in cl.out] == ["repl_commit", "repl_commit"]  # no COMMIT_DELAY
    cl.deliver(0.1)
    assert [(x.waiter, x.outcome) for x in cl.answers] == [("w1", "ok")]
    assert cl.applied == {"a": ["u1"], "b": ["u1"], "c": ["u1"]}


def test_a_push_is_refused_without_the_lease_or_the_role() -> None:
    cl = Cluster()
    b = cl.cores["b"]
    res = b.submit({0: "u"}, ("cl", 1), {0: "w"}, 0.1)
    assert isinstance(res, Reject) and (res.code, res.bucket) == ("not_primary", 0)
    a = cl.cores["a"]
    late = a.leases.deadline(0) + 1.0  # type: ignore[operator]
    res = a.submit({0: "u"}, ("cl", 1), {0: "w"}, late)
    assert isinstance(res, Reject) and (res.code, res.bucket) == ("not_primary", 0)
    assert take(a).heartbeat, "a lapsed lease asks the controllers at once"


def test_the_role_and_lease_of_every_bucket_of_a_request_are_checked_in_one_input() -> None:
    """Issue 36: a push_rows names most buckets; the shell stepped the core (and drained its
    Ready) once per bucket. check_primaries checks them all in one input and names the first
    refused bucket, as check_primary does for one."""
    cl = Cluster()
    a, b = cl.cores["a"], cl.cores["b"]
    assert a.check_primaries([0], 0.1) is None
    assert a.check_primaries([0], 0.1, read=True) is None
    res = a.check_primaries([0, 7], 0.1)  # bucket 7 is no copy of a's
    assert isinstance(res, Reject) and (res.code, res.bucket) == ("not_primary", 7)
    res = b.check_primaries(iter([0]), 0.1, read=True)
    assert isinstance(res, Reject) and (res.code, res.bucket) == ("not_primary", 0)
    take(a)
    late = a.leases.deadline(0) + 1.0  # type: ignore[operator]
    res = a.check_primaries({0}, late)
    assert isinstance(res, Reject) and (res.code, res.bucket) == ("not_primary", 0)
    assert take(a).heartbeat, "a lapsed lease asks the controllers at once"


def test_an_unresponsive_member_is_reported_only_after_member_timeout() -> None:
    """Reference: Project Adam 3.3.3; a member that does not answer is dropped by a committed
    controller entry, never by the primary alone: the round waits for the new record."""
    cl = Cluster()
    a = cl.cores["a"]
    a.submit({0: "u1"}, ("cl", 1), {0: "w1"}, 0.1)
    cl.collect()
    cl.deliver(0.5, drop={"c"})
    assert cl.answers == [] and cl.requests == []
    for t in (0.6, 0.9, 1.0):
        a.tick(t)
        cl.collect()
        cl.deliver(t, drop={"c"})
    assert cl.requests == [], "not before member_timeout"
    a.tick(1.2)
    cl.collect()
    cl.deliver(1.2, drop={"c"})
    kinds = [(r.kind, r.member) for r in cl.requests]
    assert kinds == [("drop_secondary", "c")]
    assert cl.answers == [], "nothing acknowledged without c before the record drops it"
    # The controllers' entry removes c (same epoch: a membership change keeps it).
    a.on_roles({"version": 2, "roles": [role(0, 1, "a", ["b"])]}, 1.3, 1.3)
    cl.collect()
    assert [(x.waiter, x.outcome) for x in cl.answers] == [("w1", "ok")]


def test_the_core_calls_the_controllers_when_its_link_says_and_takes_every_answer() -> None:
    """Registration and heartbeats are requests in the Ready (repl_controllers.py): a register
    offers the copies after the core stopped acting on its roles; an unreachable controller
    group means registering again after link_retry, a heartbeat refused as dead at once; a
    record wanted while registered is a heartbeat at once, but never two in flight."""
    c = ReplCore(ReplSettings("a", lease=TERMS, link_retry=0.5))
    c.tick(10.0)
    (reg,) = take(c).requests
    assert (reg.kind, dict(reg.body)) == ("register", {"copies": {}, "committed": {}})
    c.controller_answer(reg, ControllerAnswer(error="connection"), 10.1)
    c.tick(10.5)
    assert take(c).requests == [], "not again before link_retry"
    c.tick(10.7)
    (reg,) = take(c).requests
    answer = {"lease": {"duration": 3.0, "skew": 0.1, "margin": 0.1}, "heartbeat_interval": 2.0}
    c.controller_answer(reg, ControllerAnswer(answer), 10.8)
    assert c.leases.terms.duration == 3.0, "the lease terms announced at registration"
    c.tick(10.8)
    (hb,) = take(c).requests
    assert (hb.kind, dict(hb.body)) == (
        "heartbeat",
        {"known": None, "reports": {}, "deltas": True},
    )
    c.want_record(10.9)
    assert take(c).requests == [], "one heartbeat in flight at a time"
    roles = {"version": 4, "roles": [role(0, 1, "a", ["b"])], "renewed": [[0, 1]]}
    c.controller_answer(hb, ControllerAnswer(roles, asked_at=10.8), 11.0)
    assert c.roles == {0: "primary"} and c.leases.deadline(0) is not None
    (msg,) = take(c).messages  # b answers (unanswered, it would be dropped at its deadline)
    c.answer(msg.rid, {"status": "ok", "seq": msg.fields["seq"]}, None, 11.0)
    take(c)
    c.tick(11.0)
    (hb,) = take(c).requests  # the record wanted meanwhile, once the answer came
    c.controller_answer(hb, ControllerAnswer({"version": 4}, asked_at=11.0), 11.0)
    c.tick(12.9)
    assert take(c).requests == [], "the next heartbeat after the interval"
    c.want_record(12.95)
    (hb,) = take(c).requests
    assert hb.body["known"] == 4 and hb.body["reports"] == {0: [1, 0]}
    c.controller_answer(hb, ControllerAnswer(error="conflict"), 13.0)  # declared dead
    c.tick(13.0)
    (reg,) = take(c).requests
    assert reg.kind == "register" and c.roles == {0: "standby"}, "no role acted on meanwhile"
    assert reg.body["copies"] == {0: [0, 0]}, "its copy offered: no batch held yet"


def test_the_watchdog_proposes_a_role_change_once_per_failover_after() -> None:
    c = core("b")
    c.on_roles({"version": 1, "roles": [role(0, 1, "a", ["b", "c"])]}, 0.0, 0.0)
    take(c)
    c.step("a", {"op": "repl_ping", "sender": "a", "buckets": {0: 1}}, 1.0)
    c.tick(3.9)
    assert take(c).requests == []
    c.tick(4.1)
    (req,) = take(c).requests
    assert (req.kind, req.bucket, req.position) == ("role_change", 0, (1, 0))
    c.tick(4.2)
    assert take(c).requests == [], "not again before failover_after"
    c.controller_answer(req, ControllerAnswer(error="conflict", retry_after=10.0), 4.3)
    c.tick(8.0)
    assert take(c).requests == [], "retry_after is respected"
    c.tick(14.4)
    assert [r.kind for r in take(c).requests] == ["role_change"]


def test_the_next_deadline_is_the_watchdogs_the_pings_and_the_heartbeats() -> None:
    """Issue 36 (idle costs nothing): the shell sleeps until ``next_deadline``, so a tick before
    it must change nothing, and every timer (the watchdog, the pings, the heartbeat) must be
    in it: a secondary's deadline is when its primary has been silent failover_after."""
    b = core("b", ping_interval=0.3)
    b.on_roles({"version": 1, "roles": [role(0, 1, "a", ["b", "c"])]}, 0.0, 0.0)
    b.tick(0.0)  # the first pings (to nobody: a secondary)
    take(b)
    assert b.next_deadline(0.0) == pytest.approx(0.3), "the next pings"
    b.step("a", {"op": "repl_ping", "sender": "a", "buckets": {0: 1}}, 1.0)
    for t in (0.3, 0.6, 0.9, 1.2, 1.5, 1.8, 2.1, 2.4, 2.7, 3.0, 3.3, 3.6, 3.9):
        assert b.next_deadline(t) == pytest.approx(t), "pings due at once"
        b.tick(t)
        assert take(b).requests == []
    assert b.next_deadline(3.95) == pytest.approx(4.0), "the watchdog's: heard at 1.0, fa 3.0"
    b.tick(4.0 + 1e-9)
    (req,) = take(b).requests
    assert req.kind == "role_change"
    # No pings due for long (a huge interval): the watchdog's next proposal is the deadline.
    c = core("c", ping_interval=1e9)
    c.tick(0.0)
    take(c)
    c.on_roles({"version": 1, "roles": [role(0, 1, "a", ["c"])]}, 0.5, 0.5)
    take(c)
    assert c.next_deadline(0.6) == pytest.approx(3.5), "last heard at the roles (0.5) + fa"
    c.tick(3.4)
    assert take(c).requests == [], "nothing before the deadline"
    c.tick(3.6)
    assert [r.kind for r in take(c).requests] == ["role_change"]
    assert c.next_deadline(3.7) == pytest.approx(6.6), "proposed again only fa later"
    # The heartbeat in flight is answered: the next one is the deadline, interval after.
    hb = core("h", ping_interval=1e9)
    hb.tick(0.0)
    take(hb)
    assert hb.next_deadline(0.0) == 1e9, "a heartbeat in flight: only the (far) pings"
    req = ControllerRequest("heartbeat", -1, 0, body={})  # what core() left in flight
    hb.controller_answer(req, ControllerAnswer({"version": 1, "roles": []}), 5.0)
    assert hb.next_deadline(5.0) == pytest.approx(6.0), "heartbeat_interval (1.0) later"
    hb.tick(5.99)
    assert take(hb).requests == []
    hb.tick(6.0)
    assert [r.kind for r in take(hb).requests] == ["heartbeat"]


def test_a_busy_primary_is_due_at_once_and_an_idle_one_not() -> None:
    """A primary's bucket with a push waiting is due at once; one whose delayed COMMIT is all it
    waits for at the COMMIT's time, a failed message at its retry's. Once every replica holds
    everything, only the pings remain."""
    cl = Cluster()
    a = cl.cores["a"]
    a.tick(0.0)
    take(a)
    a.submit({0: "u1"}, ("cl", 1), {0: "w1"}, 0.1)
    cl.collect()
    cl.deliver(0.1)
    assert a.next_deadline(0.1) == pytest.approx(0.1 + COMMIT_DELAY), "the COMMIT's time"
    assert a.next_deadline(0.2) == 0.2, "the COMMIT is due"
    a.tick(0.2)
    cl.collect()
    cl.deliver(0.2)
    idle = a.next_deadline(0.2)
    assert idle == pytest.approx(a.settings.ping_interval), "idle: only the next pings"
    cl.cores["a"].submit({0: "u2"}, ("cl", 2), {0: "w2"}, 0.25)
    cl.collect()
    cl.deliver(0.25, drop={"c"})  # c fails: retried every RETRY_EVERY until member_timeout
    assert a.next_deadline(0.26) == pytest.approx(0.25 + RETRY_EVERY), "c's retry"
    assert a.next_deadline(0.28) == 0.28


def test_a_primary_waiting_only_for_answers_is_due_at_no_time_and_not_pumped() -> None:
    """Issue 36 (helper ctr36's profile of a click-through step at RF 3): while any message was
    in flight the core was due at once, so the clock ticked every TICK through a training step,
    and each tick pumped every bucket one of whose replicas had answered its PREPARE while the
    other had not: a tenth of a server's event loop, for nothing (the answer pumps the bucket
    itself). Such a bucket is due at no time: only the pings' deadline remains."""
    cl = Cluster()
    a = cl.cores["a"]
    a.tick(0.0)
    take(a)
    pumped: list[int] = []
    real = a.pump
    a.pump = lambda b, now: (pumped.append(b), real(b, now))[1]  # type: ignore[method-assign]
    a.submit({0: "u1"}, ("cl", 1), {0: "w1"}, 0.1)
    cl.collect()
    to_b = [(src, m) for src, m in cl.out if m.peer == "b"]
    cl.out = [(src, m) for src, m in cl.out if m.peer != "b"]  # c's PREPARE stays in flight
    for src, m in to_b:
        res = cl.cores["b"].step(src, {"op": m.op, **m.fields}, 0.1)
        a.step("b", {"op": "reply", "rid": m.rid, "reply": res}, 0.1)
    cl.collect()
    assert cl.answers == [], "c has not answered: the round is not decided"
    pings = a.next_deadline(0.1)
    assert pings == pytest.approx(a.settings.ping_interval), "due at the pings only"
    pumped.clear()
    a.tick(0.11)
    cl.collect()
    assert pumped == [] and [m.peer for _s, m in cl.out] == ["c"], "nothing pumped or sent"
    cl.deliver(0.12)  # c's answer pumps the bucket: decided
    assert [(x.waiter, x.outcome) for x in cl.answers] == [("w1", "ok")]


def test_a_primary_pings_each_replica_once_per_ping_interval() -> None:
    """Reference: Project Adam 3.3.3 (the primary heartbeats its secondaries): one ping per
    replica for all the buckets it is primary of, every ping_interval; none from a secondary."""
    a = core("a", ping_interval=0.3)
    a.on_roles({"version": 1, "roles": [role(0, 1, "a", ["b", "c"]), role(1, 2, "a", ["b"]),
                                        role(2, 1, "b", ["a"])]}, 0.0, 0.0)  # fmt: skip
    take(a)
    a.tick(0.0)
    assert take(a).pings == {"b": {"0": 1, "1": 2}, "c": {"0": 1}}
    a.tick(0.29)
    assert take(a).pings is None, "not before ping_interval"
    a.tick(0.3)
    assert take(a).pings == {"b": {"0": 1, "1": 2}, "c": {"0": 1}}
    b = core("b", ping_interval=0.3)
    b.on_roles({"version": 1, "roles": [role(0, 1, "a", ["b"])]}, 0.0, 0.0)
    take(b)
    b.tick(0.0)
    assert take(b).pings == {}, "the time came, but a secondary pings nobody"
    assert b.step("a", {"op": "repl_ping", "sender": "a", "buckets": {0: 0}}, 0.1) == {
        "stale": [0]
    }, "a ping of an older epoch is answered stale"
    a.on_ping_reply([0], 1.0)
    assert take(a).heartbeat, "told its epoch is stale: the primary asks for the record"


def test_roles_standby_joining_and_forgotten_copies() -> None:
    c = core("b")
    c.on_roles({"version": 1, "roles": [role(0, 1, "a", ["c"], ["b"], join=7)]}, 0.0, 0.0)
    rd = take(c)
    assert rd.hold == [0]
    c.tick(0.0)
    assert [(f.bucket, f.primary, f.epoch, f.join) for f in take(c).fetches] == [(0, "a", 1, 7)]
    assert repl_copies_of(c) == {}, "a joining copy without its snapshot offers nothing"
    c.installed(0, 5, [["cl", 1, 5]], 1, 0.5)
    # Persisted (issue 29) before it learns or is offered; the flush holds it meanwhile.
    assert not c.learning(0) and repl_copies_of(c) == {} and repl_copies.held_copies(c) == {0}
    c.install_persisted(0, True, 0.5)
    assert c.learning(0) and repl_copies_of(c) == {0: [1, 5]}
    c.tick(4.0)  # the primary stayed silent past failover_after: transfer again
    assert not c.learning(0)
    # a standby role for a copy it does not hold is ignored; for one it holds, kept untouched
    c.on_roles({"version": 2, "roles": [role(0, 1, "a", ["c"], role="standby")]}, 4.1, 4.1)
    assert c.roles[0] == "standby" and c.buckets[0].committed == 5
    c.on_roles({"version": 3, "roles": []}, 4.2, 4.2)
    rd = take(c)
    assert rd.forget == [0] and 0 not in c.buckets


def test_an_installed_copy_learns_only_once_persisted_under_the_record_it_came_from() -> None:
    # Issue 29: a copy held only in memory is no member. While it is persisted the flush holds
    # it (held_copies, positions) but it neither learns nor is offered; a failed write, or a
    # record that moved on meanwhile, leaves it not learning (the shell asks again).
    c = core("b")
    c.on_roles({"version": 1, "roles": [role(0, 1, "a", ["c"], ["b"], join=7)]}, 0.0, 0.0)
    take(c)
    c.installed(0, 5, [], 1, 0.5)
    assert not c.learning(0)
    got = repl_copies.positions(c, None, 100, lambda e, s, d, f, p: (e, s))
    assert got == {0: (1, 5)} and repl_copies_of(c) == {}
    c.install_persisted(0, False, 0.6)  # the disk refused it
    assert not c.learning(0) and repl_copies.held_copies(c) == set()
    assert c.join_target(0) == ("a", 1, 7), "asks again"
    c.installed(0, 6, [], 1, 0.7)
    c.on_roles({"version": 2, "roles": [role(0, 2, "c", ["a"], ["b"], join=8)]}, 0.8, 0.8)
    c.install_persisted(0, True, 0.9)
    assert not c.learning(0), "fetched from an earlier record: the new primary is asked"
    assert c.join_target(0) == ("c", 2, 8)
    c.installed(0, 6, [], 2, 1.0)
    c.install_persisted(0, True, 1.1)
    assert c.learning(0) and repl_copies_of(c) == {0: [2, 6]}


def test_the_state_transfer_is_asked_again_as_the_core_decides() -> None:
    """The joining side's loop (which primary to ask, when to ask again, when a snapshot fits,
    the gate of a server that cannot persist) is the core's; the shell only fetches, installs
    and persists what the Ready names and feeds the outcome back."""
    c = core("b", join_retry=0.3, persist_retry=1.0)
    c.on_roles({"version": 1, "roles": [role(0, 1, None, [], ["b"], join=7)]}, 0.0, 0.0)
    take(c)
    c.tick(0.0)
    rd = take(c)
    assert rd.fetches == [] and rd.heartbeat, "no primary to ask: learn the record first"
    c.on_roles({"version": 2, "roles": [role(0, 1, "a", [], ["b"], join=7)]}, 0.1, 0.1)
    c.tick(0.2)
    assert take(c).fetches == [], "asked again only after join_retry"
    c.cannot_persist("flushes fail: disk full")
    c.tick(0.35)
    assert take(c).fetches == [], "no transfer is asked for while the copy cannot be persisted"
    c.cannot_persist(None)
    c.tick(1.0)
    assert take(c).fetches == [], "the gate is looked at again after persist_retry"
    c.tick(1.36)
    (f,) = take(c).fetches
    c.tick(1.4)
    assert take(c).fetches == [], "one fetch at a time"
    assert not c.snapshot_fetched(f, None, 1.5), "the fetch failed"
    rd = take(c)
    assert rd.heartbeat and rd.fetches == []
    c.tick(1.81)
    (f,) = take(c).fetches
    assert not c.snapshot_fetched(f, 2, 1.9), "sent under another epoch: does not fit"
    c.tick(2.21)
    (f,) = take(c).fetches
    assert c.snapshot_fetched(f, 1, 2.3)
    c.snapshot_corrupt(f, 2.3)  # failed its checksum: nothing installed
    c.tick(2.4)
    assert take(c).fetches == []
    c.tick(2.61)
    (f,) = take(c).fetches
    c.on_roles({"version": 3, "roles": [role(0, 2, "c", [], ["b"], join=8)]}, 2.7, 2.7)
    assert not c.snapshot_fetched(f, 1, 2.8), "the record moved on while it was fetched"
    c.tick(3.11)
    (f,) = take(c).fetches
    assert (f.primary, f.epoch, f.join) == ("c", 2, 8)
    assert c.snapshot_fetched(f, 2, 3.2)
    c.installed(0, 5, [], 2, 3.2)
    c.tick(3.6)
    assert take(c).fetches == [], "nothing is asked while the installed copy is persisted"
    c.install_persisted(0, False, 3.7)
    c.tick(4.0)
    assert take(c).fetches == [], "a copy that could not be persisted waits persist_retry"
    c.tick(4.71)
    (f,) = take(c).fetches
    assert c.snapshot_fetched(f, 2, 4.8)
    c.installed(0, 6, [], 2, 4.8)
    c.install_persisted(0, True, 4.9)
    c.tick(5.0)
    assert c.learning(0) and take(c).fetches == [], "learning: nothing to fetch"
    c.on_roles({"version": 4, "roles": [role(0, 2, "c", ["b"])]}, 5.1, 5.1)
    assert take(c).stop_joins == [0]


def repl_copies_of(c: ReplCore) -> dict[int, list[int]]:
    return repl_copies.copies(c)


def test_the_disk_is_an_input_a_reload_a_cut_and_a_damaged_copy() -> None:
    """A copy reloaded at start is standby and offered; a flush's cut writes the exactly-once
    pairs recorded after the last cut; after the scrub found its records damaged the next cut is
    written fresh, whole table and position (the core's inputs, not writes from the shell)."""
    c = core("b")
    c.reloaded(0, 5, 2, [["cl", 1, 5]], ())
    assert c.roles == {0: "standby"} and repl_copies.copies(c) == {0: [2, 5]}

    def cut(e: int, s: int, d: Any, fresh: bool, _p: Any) -> Any:
        return e, s, d, fresh

    assert repl_copies.positions(c, None, 100, cut) == {0: (2, 5, [], False)}
    c.rewrite_copy(0)
    assert repl_copies.positions(c, None, 100, cut) == {0: (2, 5, [["cl", 1, 5]], True)}
    assert repl_copies.positions(c, None, 100, cut) == {0: (2, 5, [], False)}, "cut taken"


def test_a_deposed_primary_answers_its_waiters_unknown() -> None:
    cl = Cluster()
    a = cl.cores["a"]
    a.submit({0: "u1"}, ("cl", 1), {0: "w1"}, 0.1)
    take(a)
    a.on_roles({"version": 2, "roles": [role(0, 2, "b", ["c", "a"])]}, 0.2, 0.2)
    rd = take(a)
    assert [(x.waiter, x.outcome) for x in rd.answers] == [("w1", "unknown")]


@pytest.mark.parametrize(("error", "again"), [("timeout", True), ("connection", True),
                                               ("conflict", False), (None, False)])  # fmt: skip
def test_a_caught_up_report_of_unknown_outcome_is_sent_again(
    error: str | None, again: bool
) -> None:
    cl = Cluster()
    a = cl.cores["a"]
    a.on_roles({"version": 2, "roles": [role(0, 1, "a", ["b", "c"], ["d"])]}, 0.1, 0.1)
    take(a)
    meta = a.snapshot_for(0, "d", 0, 0.1)
    assert not isinstance(meta, Reject)
    a.buckets[0].acked_commit["d"] = 0  # (d committed everything: nothing was committed yet)
    a.pump(0, 0.1)
    (req,) = take(a).requests
    assert req.kind == "caught_up" and req.member == "d"
    assert a.on_caught_up_answer(req, error, 0.2) is again
    assert a.buckets[0].learners.get("d") == (
        "reporting" if again else "reported" if error is None else None
    )
    # When to send it again is the core's: in the first tick report_retry (0.2 s) later, once
    take(a)
    a.tick(0.3)
    assert take(a).requests == []
    a.tick(0.41)
    assert take(a).requests == ([req] if again else [])
    a.tick(0.7)
    assert take(a).requests == []


def test_a_record_older_than_an_accepted_caught_up_report_keeps_the_learner_in_the_rounds() -> None:
    """Simulation seeds 3745, 8035, 9819: a heartbeat's answer computed before the controllers
    accepted a learner's caught-up report (here: while it was out of the record, between two
    joins) arrives after the acceptance. Dropping the learner on it made the primary
    acknowledge pushes without a copy the controllers already count as a member; only a record
    asked after the acceptance may remove it."""
    cl = Cluster()
    a = cl.cores["a"]
    a.on_roles({"version": 2, "roles": [role(0, 1, "a", ["b", "c"], ["d"])]}, 0.1, 0.1)
    take(a)
    assert not isinstance(a.snapshot_for(0, "d", 0, 0.1), Reject)
    a.buckets[0].acked_commit["d"] = 0  # (d committed everything: nothing was committed yet)
    a.pump(0, 0.1)
    (req,) = take(a).requests
    assert a.on_caught_up_answer(req, None, 0.2) is False  # accepted: d is a member now
    # the answer to a heartbeat asked at 0.15, from a record without d
    a.on_roles({"version": 3, "roles": [role(0, 1, "a", ["b", "c"])]}, 0.15, 0.25)
    assert a.buckets[0].learners == {"d": "reported"}
    a.submit({0: "u1"}, ("cl", 1), {0: "w1"}, 0.3)
    assert sorted(m.peer for m in take(a).messages) == ["b", "c", "d"], "d is in the round"
    # a record asked after the acceptance that lacks d: the controllers removed it since
    a.on_roles({"version": 4, "roles": [role(0, 1, "a", ["b", "c"])]}, 0.3, 0.35)
    assert a.buckets[0].learners == {}


def test_a_stale_epoch_is_refused_and_counted() -> None:
    c = core("b")
    c.on_roles({"version": 1, "roles": [role(0, 2, "a", ["b"])]}, 0.0, 0.0)
    take(c)
    res = c.step("a", {"op": "repl_commit", "bucket": 0, "sender": "a", "epoch": 1, "seq": 1}, 1)
    assert isinstance(res, Reject) and res.code == "stale_epoch"
    assert take(c).stale == 1
    res = c.step("a", {"op": "repl_commit", "bucket": 0, "sender": "a", "epoch": 3, "seq": 1}, 1)
    assert isinstance(res, Reject) and res.code == "unavailable"
    assert take(c).heartbeat, "an epoch it does not know: ask the controllers"


def test_the_core_reads_no_clock_and_does_no_io() -> None:
    """The core takes time as an argument: none of its modules imports a clock, a socket, a
    thread or an event loop (what makes the simulation's seeds deterministic)."""
    banned = {"time", "datetime", "asyncio", "socket", "threading", "random", "os", "aiohttp"}
    core_dir = Path(__file__).resolve().parents[2] / "adamps" / "core"
    for path in sorted(core_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            assert not set(names) & banned, f"{path.name} imports {set(names) & banned}"


def test_a_primarys_message_to_a_secondary_brings_no_deadline_before_failover_after() -> None:
    """What the shell relies on when a peer's PREPARE or COMMIT to a copy held as secondary
    pokes its clock with failover_after ahead (adamps/server/replication/ops.py, issue 36): the
    step, accepted or refused, brings no deadline of this core before now + failover_after,
    so a tick planned by then stands without a walk over every bucket."""
    cl = Cluster()
    a, b = cl.cores["a"], cl.cores["b"]
    fa = b.settings.failover_after
    stepped = 0
    for i in range(1, 8):
        t = 0.25 * i
        a.tick(t)
        a.submit({0: f"u{i}"}, ("cl", i), {0: f"w{i}"}, t)
        cl.collect()
        out, cl.out = cl.out, []
        for src, m in out:
            assert b.roles[0] == "secondary" or m.peer != "b"
            target = cl.cores[m.peer]
            before = target.next_deadline(t)
            res = target.step(src, {"op": m.op, **m.fields}, t)
            if m.peer == "b":
                stepped += 1
                assert target.next_deadline(t) >= min(before, t + fa), (m.op, i)
            cl.cores[src].step(m.peer, {"op": "reply", "rid": m.rid, "reply": res}, t)
        cl.collect()
        cl.deliver(t)
        # a refused one too: a PREPARE of an older epoch
        before = b.next_deadline(t)
        stale = {"op": "repl_prepare", "bucket": 0, "sender": "a", "epoch": 0, "entries": []}
        assert isinstance(b.step("a", stale, t), Reject)
        assert b.next_deadline(t) >= min(before, t + fa)
        take(b)
    assert stepped >= 7
