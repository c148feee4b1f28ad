"""The primary's rounds of one bucket as messages: what to send each replica now, and what a
reply or a failure means (Project Adam 3.3.3; the per-bucket 2PC state is ``BucketReplica``).

At most one message per replica is in flight for a bucket. Each replica gets, in this order:

- the PREPARE of the round in flight, with every batch it lacks before it (from the log), and the
  primary's committed seq riding along (Raft's leaderCommit: the replica applies what was decided
  without a separate COMMIT, and says so in its reply);
- else, when it has not confirmed everything committed: the batches it lacks from the log with the
  committed seq riding along (a replica that answered "gap"), or COMMIT(committed). With
  ``ack = "prepared"`` a COMMIT waits first for the next round's PREPARE to carry it (one message
  per replica per round instead of two): ``COMMIT_DELAY``, or, when the bucket's rounds come at a
  steady pace (a trainer's steps), ``COMMIT_GAPS`` times the time between its last two rounds, at
  most ``COMMIT_WAIT_MAX`` (issue 36, session 13: at a fixed 2 ms, ~20 ms with the clock's
  ``TICK``, every training step sent each bucket's COMMIT alone, a second frame to each peer
  per step). The acknowledgement never waits for it; only a secondary's applying of a bucket's
  last batch before a pause does.

A message fails when the transport reports it failed (the connection, or the replica refused
it), or when the core's tick finds it unanswered past its deadline (``overdue``): sent plus
``member_timeout`` plus its size allowance (deadlines.py; issue 40: the transport no longer
decides a peer's liveness). A failed message is retried after ``RETRY_EVERY``; a replica that
has failed since a message sent ``member_timeout`` or more ago is unresponsive
(``ReplCore.unresponsive`` decides what follows). A reply to a message failed at its deadline,
or to one of an older epoch, changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from adamps.core.replication.bucket import BucketReplica

#: seconds a decided round's COMMIT waits (ack = "prepared") for the next PREPARE to carry it
COMMIT_DELAY = 0.002
#: the bucket's last gaps between two rounds a COMMIT waits for the next PREPARE to carry it
COMMIT_GAPS = 1.5
#: seconds a COMMIT waits at most (well inside ``failover_after``: a promoted secondary's
#: in-doubt rounds stay few)
COMMIT_WAIT_MAX = 1.0
#: seconds between two tries of a message to a replica that failed
RETRY_EVERY = 0.02
#: "gap" answers in a row after which a replica counts as failing (its position keeps moving)
MAX_GAPS = 3


@dataclass
class Outstanding:
    """A message to a replica, in flight."""

    rid: int
    op: str
    epoch: int
    sent: float
    #: failed if unanswered by then (deadlines.PeerLinks)
    deadline: float = float("inf")


@dataclass
class Rounds:
    """The primary's bookkeeping of one bucket's messages. Mutated only by ReplCore."""

    #: replica -> its message in flight
    out: dict[str, Outstanding] = field(default_factory=dict)
    #: replica -> when the first message it failed since its last answer was sent
    fail_since: dict[str, float] = field(default_factory=dict)
    #: replica -> no new try before this time
    retry_at: dict[str, float] = field(default_factory=dict)
    #: replica -> "gap" answers in a row
    gaps: dict[str, int] = field(default_factory=dict)
    #: no COMMIT before this time (ack = "prepared": the next PREPARE may carry it)
    commit_after: float = 0.0
    #: when the round in flight started, and how many pushes it carries (for the metrics)
    began: float = 0.0
    pushes: int = 0
    #: seconds between the starts of the last two rounds (how long a COMMIT waits, COMMIT_GAPS)
    gap: float = 0.0

    def started(self, now: float, pushes: int) -> None:
        """A round starts now, carrying `pushes` pushes."""
        if self.began:
            self.gap = now - self.began
        self.began, self.pushes = now, pushes

    def decided(self, now: float) -> None:
        """The round in flight is decided (ack = "prepared"): its COMMIT waits for the next
        round's PREPARE as long as the rounds' pace says one is coming."""
        self.commit_after = now + min(COMMIT_WAIT_MAX, max(COMMIT_DELAY, COMMIT_GAPS * self.gap))

    def due(self, rep: BucketReplica, now: float) -> float:
        """When a pump of this bucket next has something to do: `now` or earlier (at once), a
        time, or inf (nothing until an input: an answer, a push, a role change, each of which
        pumps the bucket at once). Due at once: a recovery, or a round to start (pushes wait and
        none is in flight; the lease gates it inside the pump). Else the earliest message
        ``to_send`` would build: to a replica with no message in flight, its PREPARE once its
        retry time passed, its COMMIT once the delayed COMMIT's time passed too; and a message
        in flight at its deadline (it has failed then: ``overdue``). Between those, a bucket
        whose replicas all answered or have a message in flight waits for nothing but answers:
        issue 36 (helper ctr36's profile of a click-through step at RF 3) found the clock
        ticking every TICK while any message was in flight, and each tick pumping every bucket
        one of whose replicas had answered while another had not, for nothing."""
        if rep.needs_recovery or (rep.inflight is None and rep.pending):
            return now
        seq = rep.inflight[0].seq if rep.inflight is not None else None
        at = float("inf")
        for o in self.out.values():
            at = o.deadline if o.deadline < at else at
        for m in rep.replicas:
            if m in self.out:
                continue
            retry = self.retry_at.get(m, 0.0)
            if seq is not None and rep.acked_prepare.get(m, -1) < seq:
                at = min(at, retry)
            elif rep.acked_commit.get(m, -1) < rep.committed:
                at = min(at, max(retry, self.commit_after))
        return at

    def forget_gone(self, replicas: tuple[str, ...]) -> None:
        """Replicas that left the set: nothing more is retried or timed for them, and the answer
        to a message still in flight to one of them is ignored (it may come back as a learner)."""
        for m in {*self.out, *self.fail_since, *self.retry_at, *self.gaps} - set(replicas):
            self.forget(m)

    def forget(self, m: str) -> None:
        """Everything known of `m`'s messages: its answers from now on are to new messages."""
        for d in (self.out, self.fail_since, self.retry_at, self.gaps):
            d.pop(m, None)

    def to_send(self, rep: BucketReplica, now: float) -> list[tuple[str, str, dict[str, Any]]]:
        """(replica, op, fields) of the messages to send now; a replica whose gap reaches past
        the log gets ("", ...) as op: it needs a state transfer (the caller counts a failure)."""
        out = []
        for m in rep.replicas:
            if m in self.out or now < self.retry_at.get(m, 0.0):
                continue
            have = rep.acked_prepare.get(m, -1)
            if rep.inflight is not None and have < rep.inflight[0].seq:
                entries = rep.prepare_for(m)
                if entries is None:
                    out.append((m, "", {}))
                    continue
                out.append((m, "repl_prepare", {"entries": entries, "commit": rep.committed}))
            elif rep.acked_commit.get(m, -1) < rep.committed and now >= self.commit_after:
                if 0 <= have < rep.committed:  # it said where it stands: send what it lacks
                    entries = rep.log_after(have)
                    if entries is None:
                        out.append((m, "", {}))
                        continue
                    out.append((m, "repl_prepare", {"entries": entries, "commit": rep.committed}))
                else:
                    out.append((m, "repl_commit", {"seq": rep.committed}))
        return out

    def sent(self, m: str, rid: int, op: str, epoch: int, now: float, deadline: float) -> None:
        self.out[m] = Outstanding(rid, op, epoch, now, deadline)

    def overdue(self, now: float) -> list[tuple[str, Outstanding]]:
        """The messages unanswered at their deadline, no longer in flight: they have failed
        (the caller forgets their ids, so a late reply changes nothing)."""
        late = [(m, o) for m, o in self.out.items() if now >= o.deadline]
        for m, _o in late:
            del self.out[m]
        return late

    def answered(self, rep: BucketReplica, m: str, op: str, reply: dict[str, Any]) -> int | None:
        """A replica's reply to its message: updates what the primary knows of it. Returns the
        seq it says it committed, if it says so (the caller releases what that acknowledges)."""
        status, seq = reply.get("status"), int(reply.get("seq", -1))
        if status == "gap":
            rep.on_member_position(m, seq)
            self.gaps[m] = self.gaps.get(m, 0) + 1
            return None
        self.gaps.pop(m, None)
        self.fail_since.pop(m, None)
        self.retry_at.pop(m, None)
        if op == "repl_prepare":
            rep.on_prepare_ack(m, seq)
            return int(reply["committed"]) if "committed" in reply else None
        return seq

    def failed(self, m: str, sent: float, now: float, timeout: float) -> bool:
        """A message to `m` failed (or could not be built). True when `m` has failed for
        `timeout` or longer: it is unresponsive now (timed again from now)."""
        since = self.fail_since.setdefault(m, sent)
        self.retry_at[m] = now + RETRY_EVERY
        if now - since >= timeout:
            self.fail_since[m] = now
            return True
        return False
