"""adamps.core.replication.bucket without sockets: 2PC rounds, fencing, in-doubt rounds, exactly once.

Reference: Project Adam 3.3.3 (primary replicates to secondaries over two-phase commit; secondaries
check the lease epoch before committing; the controller promotes a secondary on a role change).
"""

from __future__ import annotations

import random

import pytest

from adamps.core.replication.bucket import Apply, Assignment, Batch, BucketReplica, Reject

SERVERS = ("a", "b", "c")


class Cluster:
    """Three replicas of one bucket, a controller record, and a network that can drop messages."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.epoch = 1
        self.assignment = Assignment(1, "a", ("b", "c"))
        self.replicas = {s: BucketReplica(s, 0) for s in SERVERS}
        for r in self.replicas.values():
            r.on_assignment(self.assignment)
            if r.is_primary:
                r.recover()
        #: server -> list of updates applied, in order (the "store")
        self.applied: dict[str, list[int]] = {s: [] for s in SERVERS}
        self.acked: list[int] = []
        self.failed: list[int] = []
        self.down: set[str] = set()

    def apply(self, server: str, action: Apply | None) -> None:
        if action is None:
            return
        for b in action.batches:
            self.applied[server].extend(b.updates)

    def reassign(self, primary: str, secondaries: tuple[str, ...]) -> None:
        self.epoch += 1
        self.assignment = Assignment(self.epoch, primary, secondaries)
        for s, r in self.replicas.items():
            if s in self.down:
                continue
            self.failed += r.on_assignment(self.assignment)
            if r.is_primary and r.needs_recovery:
                r.recover()
            if r.is_primary:
                self.acked += r.release_acknowledged()

    def round(self, drop: float = 0.0) -> None:
        """Runs one round on the current primary, delivering each message unless dropped."""
        p = self.replicas[self.assignment.primary]
        batch = p.next_round()
        if batch is None and p.inflight is None:
            return
        for m in self.assignment.secondaries:
            for _ in range(3):  # resend after a gap
                entries = p.prepare_for(m)
                if m in self.down or self.rng.random() < drop:
                    break
                reply = self.replicas[m].on_prepare(p.server, p.assignment.epoch, entries)
                if reply[0] == "gap":
                    p.on_member_position(m, reply[1])
                    continue
                assert reply[0] == "ok", reply
                p.on_prepare_ack(m, reply[1])
                break
        if not p.round_prepared():
            return
        self.apply(p.server, p.commit_round())
        for m in self.assignment.secondaries:
            if m in self.down or self.rng.random() < drop:
                continue
            res = self.replicas[m].on_commit(p.server, p.assignment.epoch, p.committed)
            if isinstance(res, tuple):
                continue
            self.apply(m, res)
            self.acked += p.on_commit_ack(m, self.replicas[m].committed)


def test_round_trip_acknowledges_after_every_member_committed() -> None:
    c = Cluster()
    p = c.replicas["a"]
    for i in range(5):
        assert p.submit(i, ("cl", i), i) == "queued"
    batch = p.next_round()
    assert batch is not None and batch.seq == 1 and batch.updates == (0, 1, 2, 3, 4)
    assert p.next_round() is None  # one round in flight per bucket
    assert p.on_prepare_ack("b", c.replicas["b"].on_prepare("a", 1, p.prepare_for("b"))[1]) is False
    assert p.on_prepare_ack("c", c.replicas["c"].on_prepare("a", 1, p.prepare_for("c"))[1]) is True
    c.apply("a", p.commit_round())
    res_b = c.replicas["b"].on_commit("a", 1, 1)
    assert p.on_commit_ack("b", 1) == []  # c has not committed yet
    res_c = c.replicas["c"].on_commit("a", 1, 1)
    assert p.on_commit_ack("c", 1) == [0, 1, 2, 3, 4]
    assert isinstance(res_b, Apply) and isinstance(res_c, Apply)
    assert res_b.batches == res_c.batches == (batch,)


def test_secondary_fences_stale_and_unknown_epochs_and_impostors() -> None:
    b = BucketReplica("b", 0)
    b.on_assignment(Assignment(5, "a", ("b", "c")))
    entry = [Batch(1, 4, ("u",), (None,))]
    rej = b.on_prepare("a", 4, entry)
    assert isinstance(rej, Reject) and rej.code == "stale_epoch" and rej.epoch == 5
    rej = b.on_prepare("a", 6, entry)
    assert isinstance(rej, Reject) and rej.code == "unavailable"  # ask the controller first
    rej = b.on_prepare("c", 5, entry)
    assert isinstance(rej, Reject) and rej.code == "stale_epoch"
    assert b.prepared == {} and b.committed == 0
    assert isinstance(b.on_commit("a", 4, 1), Reject)


def test_not_primary_and_duplicates() -> None:
    c = Cluster()
    rej = c.replicas["b"].submit(1, ("x", 1), None)
    assert isinstance(rej, Reject) and rej.code == "not_primary"
    p = c.replicas["a"]
    assert p.submit(1, ("x", 1), "w1") == "queued"
    assert p.submit(1, ("x", 1), "w1b") == "duplicate-inflight"
    c.round()
    assert c.acked == ["w1", "w1b"]  # the retry is answered with the original, applied once
    assert p.submit(1, ("x", 1), "w1c") == "duplicate-committed"
    assert c.applied["a"] == c.applied["b"] == c.applied["c"] == [1]


def test_lagging_member_catches_up_from_the_log() -> None:
    c = Cluster()
    p = c.replicas["a"]
    c.down.add("c")
    p.submit(1, None, "w1")
    c.round()
    assert c.acked == [] and p.lagging() == ["c"]
    c.down.discard("c")
    p.submit(2, None, "w2")
    c.round()  # the round of push 1 was still in flight: resent to c, committed
    assert c.applied["c"] == [1] and c.acked == ["w1"]
    c.round()
    assert c.applied["c"] == c.applied["a"] == [1, 2]
    assert sorted(c.acked) == ["w1", "w2"]


def test_removed_member_unblocks_the_primary() -> None:
    c = Cluster()
    p = c.replicas["a"]
    c.down.add("c")
    p.submit(7, ("k", 1), "w7")
    c.round()
    assert c.acked == []
    c.reassign("a", ("b",))  # the controller removed c by a committed entry, new epoch
    c.round()  # the in-flight round is resent under the new epoch
    assert c.acked == ["w7"]
    assert c.applied["a"] == c.applied["b"] == [7]


def test_in_doubt_round_committed_by_the_promoted_secondary() -> None:
    """The primary dies after every member prepared seq 1 but before any commit reached them."""
    c = Cluster()
    p = c.replicas["a"]
    p.submit(1, ("k", 1), "w1")
    p.next_round()
    for m in ("b", "c"):
        p.on_prepare_ack(m, c.replicas[m].on_prepare("a", 1, p.prepare_for(m))[1])
    c.apply("a", p.commit_round())  # applied on a, which then dies
    c.down.add("a")
    assert c.replicas["b"].prepared_seq == c.replicas["c"].prepared_seq == 1
    c.reassign("b", ("c",))
    nb = c.replicas["b"]
    assert nb.committed == 0 and 1 in nb.prepared  # replicated again before it is applied
    # The client retries its push at the new primary: recognised, waits for the in-doubt round.
    assert nb.submit(1, ("k", 1), "w1-retry") == "duplicate-inflight"
    nb.submit(2, ("k", 2), "w2")
    c.round()
    assert c.applied["b"] == c.applied["c"] == [1] and c.acked == ["w1-retry"]
    assert nb.submit(1, ("k", 1), "w1-again") == "duplicate-committed"
    c.round()
    assert c.applied["c"] == c.applied["b"] == [1, 2]
    assert c.acked == ["w1-retry", "w2"]


def test_deposed_primary_round_is_dropped_when_the_new_primary_never_had_it() -> None:
    c = Cluster()
    p = c.replicas["a"]
    p.submit(1, None, "w1")
    p.next_round()
    # only c got the prepare; b did not
    p.on_prepare_ack("c", c.replicas["c"].on_prepare("a", 1, p.prepare_for("c"))[1])
    c.down.add("a")
    # the controller picks the highest (epoch, seq): c
    assert c.replicas["c"].prepared_seq == 1 > c.replicas["b"].prepared_seq
    c.reassign("c", ("b",))
    c.replicas["c"].submit(2, None, "w2")
    c.round()  # in doubt, held by the new primary: replicated and committed first
    assert c.applied["b"] == c.applied["c"] == [1]
    c.round()
    assert c.applied["b"] == c.applied["c"] == [1, 2]


def test_a_late_prepare_of_the_same_epoch_takes_back_nothing() -> None:
    """Found by tests/core/test_replication_sim.py (seed 390 of 1000): the PREPARE of seq 1,
    delayed or duplicated by the network, reaches a secondary after that of seq 2, which it had
    acknowledged. Dropping seq 2 there as "a deposed primary's round" let the primary commit and
    acknowledge a batch that a member (later the primary, after a hand-off) did not hold."""
    c = Cluster()
    p, b = c.replicas["a"], c.replicas["b"]
    p.submit(1, ("k", 1), "w1")
    p.next_round()
    late = p.prepare_for("b")  # the first PREPARE, [seq 1], held up in the network
    for m in ("b", "c"):
        p.on_prepare_ack(m, c.replicas[m].on_prepare("a", 1, p.prepare_for(m))[1])
    c.apply("a", p.commit_round())
    p.submit(2, ("k", 2), "w2")
    p.next_round()
    for m in ("b", "c"):
        p.on_prepare_ack(m, c.replicas[m].on_prepare("a", 1, p.prepare_for(m))[1])
    assert b.prepared_seq == 2
    assert b.on_prepare("a", 1, late) == ("ok", 2), "still holds seq 2, as it acknowledged"
    assert b.prepared_seq == 2


def test_acknowledged_at_the_decision_point() -> None:
    """ack = "prepared": the pushes of a round are released once every member prepared it and the
    primary applied it, before any COMMIT reached a member."""
    c = Cluster()
    p = c.replicas["a"]
    p.submit(1, ("k", 1), "w1")
    p.next_round()
    p.on_prepare_ack("b", c.replicas["b"].on_prepare("a", 1, p.prepare_for("b"))[1])
    assert p.release_decided() == []  # c has not prepared: nothing decided
    p.on_prepare_ack("c", c.replicas["c"].on_prepare("a", 1, p.prepare_for("c"))[1])
    c.apply("a", p.commit_round())
    assert p.release_decided() == ["w1"]
    assert p.release_acknowledged() == []  # released once only
    # A member holding it prepared offers it: (epoch of the newest batch held, its seq).
    assert c.replicas["b"].held_position == (1, 1) and c.replicas["b"].committed == 0


def test_promoted_primary_sends_every_in_doubt_batch_it_holds() -> None:
    """Found by tests/core/test_replication_sim.py (seed 630, ack = "prepared"): a hand-off's new
    primary held seq 16 and 17 prepared and re-replicated them one round at a time. Its first
    PREPARE carried only 16, and a member dropped its copy of 17 as an earlier epoch's batch
    above the entries, though 17 had been acknowledged at the decision point."""
    c = Cluster()
    p = c.replicas["a"]
    for i in (1, 2):
        p.submit(i, ("k", i), f"w{i}")
        p.next_round()
        for m in ("b", "c"):
            p.on_prepare_ack(m, c.replicas[m].on_prepare("a", 1, p.prepare_for(m))[1])
        c.apply("a", p.commit_round())
    assert p.release_decided() == ["w1", "w2"]  # no COMMIT reached b or c
    c.down.add("a")
    c.reassign("b", ("c",))
    nb = c.replicas["b"]
    assert nb.next_round() is not None and nb.inflight[0].seq == 1
    entries = nb.prepare_for("c")
    assert [e.seq for e in entries] == [1, 2] and {e.epoch for e in entries} == {2}
    assert c.replicas["c"].on_prepare("b", 2, entries) == ("ok", 2)
    assert c.replicas["c"].held_position == (2, 2)
    c.round()
    c.round()
    assert c.applied["b"] == c.applied["c"] == [1, 2]


def test_a_reloaded_copy_holds_its_prepared_batches() -> None:
    """A flush writes held_prepared() with the cut; restore() gives them back, so the position
    the copy offers after a restart still counts what it had prepared."""
    c = Cluster()
    p = c.replicas["a"]
    p.submit(1, ("k", 1), "w1")
    p.next_round()
    for m in ("b", "c"):
        p.on_prepare_ack(m, c.replicas[m].on_prepare("a", 1, p.prepare_for(m))[1])
    b = c.replicas["b"]
    cut = (b.committed, b.committed_epoch, b.dedup.to_list(), b.held_prepared())
    assert [x.seq for x in cut[3]] == [1]
    again = BucketReplica("b", 0)
    again.restore(*cut)
    assert again.held_position == (1, 1) and again.prepared_seq == 1 and again.committed == 0


def test_snapshot_install() -> None:
    c = Cluster()
    p = c.replicas["a"]
    for i in range(3):
        p.submit(i, ("z", i), i)
        c.round()
    meta = p.snapshot_meta()
    fresh = BucketReplica("d", 0)
    fresh.install_snapshot(meta["committed"], meta["dedup"])
    assert fresh.committed == 3 and fresh.dedup.batch_of(("z", 2)) == 3


@pytest.mark.parametrize("seed", range(40))
def test_random_failovers_keep_every_acknowledged_push_exactly_once(seed: int) -> None:
    """Random pushes, dropped messages and primary changes; at the end, with every member up:
    acknowledged pushes applied exactly once on every replica, replicas identical."""
    c = Cluster(seed)
    rng = c.rng
    next_id = 0
    for _step in range(60):
        p = c.replicas[c.assignment.primary]
        for _ in range(rng.randint(0, 3)):
            p.submit(next_id, ("cl", next_id), next_id)
            next_id += 1
        c.round(drop=0.2)
        if rng.random() < 0.1:
            # failover: promote the secondary holding the most (as the controller does)
            old = c.assignment.primary
            cand = max(c.assignment.secondaries, key=lambda s: c.replicas[s].prepared_seq)
            others = tuple(s for s in SERVERS if s != cand)
            c.failed += c.replicas[old].on_assignment(Assignment(c.epoch + 1, cand, others))
            c.reassign(cand, others)
    for _ in range(5):
        c.round()
    p = c.replicas[c.assignment.primary]
    p.submit(-1, None, "final")
    for _ in range(3):
        c.round()
    c.acked += p.release_acknowledged()
    histories = {s: c.applied[s] for s in SERVERS}
    assert histories["a"] == histories["b"] == histories["c"]
    applied = histories["a"]
    assert len(applied) == len(set(applied))  # nothing twice
    for w in c.acked:
        if w != "final":
            assert w in applied  # nothing acknowledged lost
